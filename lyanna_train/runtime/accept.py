"""Greedy accept/reject: a pure function of token ids, so it is tested without any model."""

from __future__ import annotations

import torch


def accept_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest drafted prefix the target agrees with, and the target's token after it.

    draft_tokens [B, d]: candidates for the next d positions; target_argmax [B, d+1]: the
    target's greedy token after the last accepted token and after each drafted one (one
    more than drafted, so a fully accepted draft still yields a "bonus" token).
    Returns (accepted [B] in 0..d, bonus [B]). The bonus is exactly what plain greedy
    decoding would emit next, which is why greedy speculative decoding is lossless.
    """
    d = draft_tokens.shape[1]
    if target_argmax.shape != (draft_tokens.shape[0], d + 1):
        raise ValueError(f"target_argmax must be [B, d+1] = {(draft_tokens.shape[0], d + 1)}, "
                         f"got {tuple(target_argmax.shape)}")
    matches = draft_tokens == target_argmax[:, :d]
    accepted = matches.long().cumprod(dim=1).sum(dim=1)  # a mismatch zeroes everything after it
    bonus = target_argmax.gather(1, accepted[:, None]).squeeze(1)
    return accepted, bonus
