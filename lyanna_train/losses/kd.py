"""Knowledge-distillation losses for a hot-vocabulary draft.

The target's next-token distribution ``p`` comes from its full-vocabulary logits. The
draft scores only the hot vocabulary, so tokens outside it are handled explicitly:

* ``mask`` (EAGLE-3's choice): positions whose target top-1 token is not hot are
  dropped; elsewhere ``p`` is renormalised over the hot ids and ``KL(p_hot ‖ q)``;
* ``other``: the draft has one extra "other" logit and ``p`` keeps its outside mass in
  that bucket: ``KL([p_hot, 1 − Σ p_hot] ‖ q)`` on every position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

OUT_OF_VOCAB_MODES = ("mask", "other")


def teacher_from_summary(hot_logits: torch.Tensor, top1_hot: torch.Tensor, lse: torch.Tensor, mode: str):
    """The teacher from the hot logits [N, V_hot], whether the top-1 is hot [N] and the
    full logsumexp [N] -> (log-probs [N, V_hot(+1)], usable [N] bool)."""
    if mode == "mask":
        return torch.log_softmax(hot_logits.float(), dim=-1), top1_hot
    if mode == "other":
        hot = hot_logits.float() - lse.float()[:, None]
        other = torch.log1p(-torch.logsumexp(hot, dim=-1, keepdim=True).exp().clamp(max=1 - 1e-6))
        return torch.cat([hot, other], dim=-1), torch.ones_like(top1_hot)
    raise ValueError(f"unknown out-of-vocabulary mode {mode!r} (expected one of {OUT_OF_VOCAB_MODES})")


def hot_mask(hot_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] bool: which target ids are hot."""
    return torch.zeros(vocab_size, dtype=torch.bool, device=hot_ids.device).index_fill_(0, hot_ids, True)


def teacher_targets(target_logits: torch.Tensor, hot_ids: torch.Tensor, mode: str):
    """The plain definition, from full logits [N, V] -> (teacher log-probs [N, V_hot(+1)],
    usable [N] bool, top-1 in hot [N] bool)."""
    logits = target_logits.float()
    top1_hot = hot_mask(hot_ids, logits.shape[-1])[logits.argmax(-1)]
    logp, usable = teacher_from_summary(logits[:, hot_ids], top1_hot, torch.logsumexp(logits, dim=-1), mode)
    return logp, usable, top1_hot


def kl_to_teacher(draft_logits: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Per-position KL(teacher ‖ draft): draft_logits, teacher_logp [N, K] -> [N]."""
    q = torch.log_softmax(draft_logits.float(), dim=-1)
    return (teacher_logp.exp() * (teacher_logp - q)).sum(-1)


def tv_to_teacher(draft_logits: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Per-position total variation ½·Σ|p − q|: draft_logits, teacher_logp [N, K] -> [N].

    Under rejection sampling a drafted token is accepted with probability Σ min(p, q) =
    1 − TV(p, q), so TV is the acceptance loss itself (KL only bounds it, via Pinsker)."""
    q = torch.softmax(draft_logits.float(), dim=-1)
    return 0.5 * (teacher_logp.exp() - q).abs().sum(-1)


def hidden_regression(draft_state: torch.Tensor, target_state: torch.Tensor) -> torch.Tensor:
    """Smooth-L1 between RMS-normalised states [N, H] -> [N]: scale-free, so the target's
    outlier dimensions (thousands in magnitude) do not dominate the loss."""
    def rms(x):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    return F.smooth_l1_loss(rms(draft_state), rms(target_state), reduction="none").mean(-1)
