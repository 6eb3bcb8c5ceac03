"""Acceptance of a draft head on a few prompts: the figure in-loop evaluation reports."""

from __future__ import annotations

from typing import Sequence

from ..models.draft_head import DraftHead
from ..runtime.scheduling.scheduler import generate
from ..runtime.settings import DecodeSettings, LookupSettings, TreeShape


def accept_rates(accept_lengths: Sequence[int], depth: int) -> list[float]:
    """τ per verify (accepted drafted tokens + 1) -> [depth] floats: entry k-1 is the
    fraction of verifies that accepted at least k drafted tokens (non-increasing in k).
    Their sum is the mean number of drafted tokens accepted per verify."""
    n = max(len(accept_lengths), 1)
    return [sum(t - 1 >= k for t in accept_lengths) / n for k in range(1, depth + 1)]


def mean_acceptance(target, draft: DraftHead, prompts: Sequence[Sequence[int]], depth: int, max_new_tokens: int,
                    eos_ids: int | Sequence[int] | None = (), layer_ids: Sequence[int] | None = None,
                    settings: DecodeSettings | None = None) -> dict:
    """Greedy decoding of each prompt (a chain of ``depth`` drafts unless ``settings`` say
    otherwise); returns

    * ``mean_tau``: new tokens / target forwards over all prompts (prefill forwards
      included: 1.0 means no speedup in target forwards);
    * ``mean_tau_verify``: mean of τ = accepted drafts + 1 over verify iterations only;
    * ``accept_rate``: [depth] floats, entry k-1 = fraction of iterations that accepted
      at least k drafted tokens (non-increasing in k);
    * ``tokens``, ``target_forwards``, ``iterations``, ``wall_time`` (seconds).

    ``eos_ids`` defaults to none, so every prompt contributes ``max_new_tokens`` tokens
    and the figures do not depend on where the target happens to stop.
    """
    taus: list[int] = []
    tokens = forwards = 0
    wall = 0.0
    settings = settings or DecodeSettings(tree=TreeShape(depth, 1, 1, depth),  # the head's τ: its chain alone
                                          lookup=LookupSettings(max_tokens=0, pool_tokens=0), verify="all")
    for prompt in prompts:
        result = generate(target, draft, prompt, max_new_tokens, settings, eos_ids=eos_ids, layer_ids=layer_ids)
        taus += result.accept_lengths
        tokens += len(result.tokens)
        forwards += result.target_forwards
        wall += result.wall_time
    iterations = max(len(taus), 1)
    return {
        "mean_tau": tokens / max(forwards, 1),
        "mean_tau_verify": sum(taus) / iterations,
        "accept_rate": accept_rates(taus, depth),
        "tokens": tokens,
        "target_forwards": forwards,
        "iterations": len(taus),
        "wall_time": wall,
    }
