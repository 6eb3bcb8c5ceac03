"""One distillation micro-step: unrolled draft forward, teacher targets, weighted losses.

Indexing (anchor *t*, unroll step *j*): the draft predicts token x_{t+2+j}; the teacher
is the target's distribution at position t+1+j (``lm_head(last[t+1+j])``); the position
counts when x_{t+2+j} is an assistant token (``loss_mask``) and, in ``mask`` mode, when
the target's top-1 there lies in the hot vocabulary.
"""

from __future__ import annotations

import torch

from ..data.features import teacher_summary
from ..evaluation.agreement import on_device
from ..losses.kd import hidden_regression, hot_mask, kl_to_teacher, teacher_from_summary, tv_to_teacher


def teacher_logprobs(last: torch.Tensor, lm_weight: torch.Tensor, hot_ids: torch.Tensor, mode: str,
                     top1: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """last [B, T, Ht] -> (teacher log-probs over the draft's outputs [B, T, K], usable [B, T]).

    ``top1`` / ``lse`` [B, T]: the full-vocabulary summary from the feature cache; without
    it (online features, older caches) it is computed here, from the full LM head."""
    b, t, h = last.shape
    flat = last.reshape(-1, h).float()
    if top1 is None or lse is None:
        top1, lse = teacher_summary(flat, lm_weight)
    hot_logits = flat @ lm_weight[hot_ids].float().T
    top1_hot = hot_mask(hot_ids, lm_weight.shape[0])[top1.reshape(-1).long()]
    logp, usable = teacher_from_summary(hot_logits, top1_hot, lse.reshape(-1), mode)
    return logp.view(b, t, -1), usable.view(b, t)


def step_autocast(model: torch.nn.Module, autocast: str | None):
    """The context a training step runs under: ``train.autocast`` (None = off) on the
    model's device; weights and optimizer stay fp32."""
    device_type = next(model.parameters()).device.type
    return torch.autocast(device_type, dtype=getattr(torch, autocast or "float32"), enabled=autocast is not None)


def noisy_features(aux: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """aux plus Gaussian noise of ``scale`` x each dimension's RMS: EAGLE's data noise, so the
    head cannot memorise exact feature vectors (the CPU recipe sees each sample ~6 times).
    First positions (attention sinks, activations far above the rest) stay out of the RMS."""
    body = aux[:, 1:][valid[:, 1:]]
    rms = body.pow(2).mean(0).sqrt() if len(body) else aux.new_ones(aux.shape[-1])
    return aux + scale * rms * torch.randn_like(aux)


def distill_loss(draft, batch: dict, lm_weight: torch.Tensor, loss_cfg) -> tuple[torch.Tensor, dict]:
    """batch: aux [B, T, 3Ht], last [B, T, Ht], input_ids / loss_mask / valid [B, T] ->
    (weighted loss, metrics as 0-d tensors; nothing is synced to the host here). The batch
    comes from the host (cache shards, the online extractor) and moves to the draft's device."""
    batch = on_device(batch, next(draft.parameters()).device)
    aux, last = batch["aux"].float(), batch["last"].float()
    ids, loss_mask, valid = batch["input_ids"], batch["loss_mask"], batch["valid"]
    if loss_cfg.positions == "all":  # user turns too: more signal from the same target forwards
        loss_mask = valid
    if loss_cfg.feature_noise > 0:
        aux = noisy_features(aux, valid, loss_cfg.feature_noise)
    t = ids.shape[1]
    steps = min(loss_cfg.ttt_steps, max(t - 2, 1))
    outs = draft.forward_unrolled(aux, ids, steps, valid)
    with torch.no_grad():
        summary = [batch[k][:, 1:] if k in batch else None for k in ("teacher_top1", "teacher_lse")]
        teacher, usable = teacher_logprobs(last[:, 1:], lm_weight, draft.hot_ids, loss_cfg.out_of_vocab, *summary)
    total = aux.new_zeros(())
    metrics: dict = {}
    for j, out in enumerate(outs):
        n = t - 2 - j
        if n <= 0:
            break
        mask = loss_mask[:, 2 + j:2 + j + n] & valid[:, 2 + j:2 + j + n] & usable[:, j:j + n]
        logits, target = out.logits[:, :n][mask], teacher[:, j:j + n][mask]
        count = mask.sum()
        kl = kl_to_teacher(logits, target).sum() / count.clamp(min=1)
        step_loss = kl
        if loss_cfg.tv_weight > 0:
            step_loss = step_loss + loss_cfg.tv_weight * tv_to_teacher(logits, target).sum() / count.clamp(min=1)
        if loss_cfg.hidden_weight > 0:
            reg = hidden_regression(out.hidden[:, :n][mask], last[:, 1 + j:1 + j + n][mask])
            step_loss = step_loss + loss_cfg.hidden_weight * reg.sum() / count.clamp(min=1)
        total = total + loss_cfg.step_weight ** j * step_loss
        with torch.no_grad():
            metrics[f"loss/step{j}"] = kl.detach()
            metrics[f"acc/step{j}"] = (logits.argmax(-1) == target.argmax(-1)).float().sum() / count.clamp(min=1)
    with torch.no_grad():
        anchors = valid[:, : max(t - 2, 1)]
        metrics["pool/hit_rate"] = outs[0].hit[:, : anchors.shape[1]][anchors].float().mean()
        hits = outs[0].hit[:, : anchors.shape[1]] & anchors
        metrics["pool/alpha_mean"] = outs[0].alpha[:, : anchors.shape[1]][hits].sum() / hits.sum().clamp(min=1)
        metrics["tokens"] = valid.sum()
    return total, metrics
