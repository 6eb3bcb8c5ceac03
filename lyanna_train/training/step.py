"""One distillation micro-step: unrolled draft forward, teacher targets, weighted losses.

Indexing (anchor *t*, unroll step *j*): the draft predicts token x_{t+2+j}; the teacher
is the target's distribution at position t+1+j (``lm_head(last[t+1+j])``); the position
counts when x_{t+2+j} is an assistant token (``loss_mask``) and, in ``mask`` mode, when
the target's top-1 there lies in the hot vocabulary.
"""

from __future__ import annotations

import torch

from ..losses.kd import hidden_regression, kl_to_teacher, teacher_targets


def teacher_logprobs(last: torch.Tensor, lm_weight: torch.Tensor, hot_ids: torch.Tensor, mode: str,
                     chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """last [B, T, Ht] -> (teacher log-probs over the draft's outputs [B, T, K], usable [B, T]).

    Full-vocabulary logits are formed in chunks of positions (the top-1 and the outside
    mass need them) and never kept whole."""
    b, t, h = last.shape
    flat = last.reshape(-1, h)
    logps, usable = [], []
    for i in range(0, len(flat), chunk):
        logits = flat[i:i + chunk].float() @ lm_weight.float().T
        lp, ok, _ = teacher_targets(logits, hot_ids, mode)
        logps.append(lp)
        usable.append(ok)
    return torch.cat(logps).view(b, t, -1), torch.cat(usable).view(b, t)


def distill_loss(draft, batch: dict, lm_weight: torch.Tensor, loss_cfg) -> tuple[torch.Tensor, dict]:
    """batch: aux [B, T, 3Ht], last [B, T, Ht], input_ids / loss_mask / valid [B, T] ->
    (weighted loss, metrics as 0-d tensors; nothing is synced to the host here)."""
    aux, last = batch["aux"].float(), batch["last"].float()
    ids, loss_mask, valid = batch["input_ids"], batch["loss_mask"], batch["valid"]
    t = ids.shape[1]
    steps = min(loss_cfg.ttt_steps, max(t - 2, 1))
    outs = draft.forward_unrolled(aux, ids, steps, valid)
    with torch.no_grad():
        teacher, usable = teacher_logprobs(last[:, 1:], lm_weight, draft.hot_ids, loss_cfg.out_of_vocab)
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
