"""Teacher-forced top-1 agreement between a draft head and its target.

The figure that says how good a head is, independent of decoding settings and prompt
lookup: at every answer position, does the draft's most likely token (after the unroll
steps the training-time test uses) equal the target's full-vocabulary top-1? Measured on
samples the head never trained on and, the same way, on some it did: the difference is
the over-fit gap. Positions whose target top-1 lies outside the hot vocabulary count as
misses (the head cannot propose them); ``in_hot`` is that ceiling.
"""

from __future__ import annotations

from typing import Iterable

import torch


@torch.no_grad()
def on_device(batch: dict, device: torch.device) -> dict:
    """A feature batch's tensors on ``device``: batches are built on the host (cache shards,
    the online extractor), the draft may be on a GPU (copied asynchronously there)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def top1_agreement(draft, batches: Iterable[dict], steps: int, lm_weight: torch.Tensor | None = None) -> dict:
    """batches: aux [B, T, k·H], input_ids / loss_mask / valid [B, T], and teacher_top1 [B, T]
    (or last [B, T, H] with ``lm_weight``) -> {"positions", "top1_step{j}", "in_hot"}.

    Anchor t, step j predicts x_{t+2+j}; the target's top-1 for it is ``teacher_top1[t+1+j]``.
    Positions count where x_{t+2+j} is an answer token (``loss_mask``)."""
    was_training = draft.training
    draft.eval()
    agree, count = [0] * steps, [0] * steps
    in_hot = 0
    vocab = draft.cfg.draft_vocab_size
    try:
        device = next(draft.parameters()).device
        for batch in batches:
            batch = on_device(batch, device)
            ids, loss_mask, valid = batch["input_ids"], batch["loss_mask"], batch["valid"]
            top1 = batch.get("teacher_top1")
            if top1 is None:
                top1 = (batch["last"].float() @ lm_weight.float().T).argmax(-1)
            top1 = top1.long()
            t = ids.shape[1]
            outs = draft.forward_unrolled(batch["aux"].float(), ids, steps, valid)
            for j, out in enumerate(outs):
                n = t - 2 - j
                if n <= 0:
                    break
                mask = loss_mask[:, 2 + j:2 + j + n] & valid[:, 2 + j:2 + j + n]
                drafted = draft.draft_to_target(out.logits[:, :n, :vocab].argmax(-1))
                agree[j] += int((drafted == top1[:, 1 + j:1 + j + n])[mask].sum())
                count[j] += int(mask.sum())
                if j == 0:
                    in_hot += int(draft.t2d[top1[:, 1:1 + n]][mask].sum())
    finally:
        draft.train(was_training)
    return {"positions": count[0], **{f"top1_step{j}": a / max(c, 1) for j, (a, c) in enumerate(zip(agree, count))},
            "in_hot": in_hot / max(count[0], 1)}
