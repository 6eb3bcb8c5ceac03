"""Attention over runs of rows, each up to its own longest row, instead of the whole batch's.

A ragged forward hands attention every row's keys up to the longest row
(:class:`.ragged_cache.RaggedCache`'s ``kv_length``), the mask hiding what a
row does not hold. On a CPU, SDPA computes the hidden columns as it does the others
(measured, torch 2.13, 2 cores: ~10-15 us per call, plus ~25 ns per query-key pair at 4
new tokens a row and ~45-75 ns at 1), so one long row makes every short row pay its
length. Regenerating 192 ShareGPT first turns at 32 rows, the rows held 0.66 of the pairs
attended; the cuts below attend 0.83-0.85 of them. Measured (Zen 4, fp32, the demo's
head): one 1,800-token row among 16 short ones, 128 new tokens each, 24.4 / 24.0 s
ungrouped against 18.9 / 20.2 s; regeneration at 64 rows 337 against 313 tok/s.

:func:`row_groups` cuts the rows into contiguous runs where a cut saves more pairs than a
call costs; :func:`grouped` routes the target's attention, for one forward, through
:func:`grouped_sdpa`, which runs transformers' own SDPA once per run over that run's keys.
Every row reads the same keys under the same mask (the hidden columns weigh exactly zero
either way), so the outputs differ from the ungrouped ones only by the rounding of a
shorter reduction, as a batched forward differs from a row alone: decoding stays lossless
(the tokens were identical in every measurement above).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ...target.support import text_config

NAME = "lyanna_grouped_sdpa"
# query-key pairs one more SDPA call must save to pay for itself: a call, its slicing and
# the concatenation (~15 us) against ~45 ns a pair (the measurement above); at 1,500 the
# regeneration bench cut too seldom to gain anything
CALL_PAIRS = 300
MAX_GROUPS = 6

_groups: list[tuple[int, int, int]] | None = None  # (first row, end row, keys) of the current forward


def grouped_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA, once per run of rows over the keys that run holds."""
    if _groups is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    for first, end, keys in _groups:
        mask = attention_mask[first:end, ..., :keys] if attention_mask is not None else None
        out, _ = sdpa_attention_forward(module, query[first:end], key[first:end, :, :keys],
                                        value[first:end, :, :keys], mask, **kwargs)
        outputs.append(out)
    return torch.cat(outputs), None


AttentionInterface.register(NAME, grouped_sdpa)


def row_groups(keys: list[int], new_tokens: int, call_pairs: int = CALL_PAIRS,
               max_groups: int = MAX_GROUPS) -> list[tuple[int, int, int]]:
    """Rows needing ``keys[i]`` key slots each, cut into contiguous runs -> ``(first, end,
    run's keys)``; one run (the whole batch) when no cut saves ``call_pairs`` pairs.

    Cuts greedily, the best single cut of the run that saves most first (each search linear
    in the rows: a per-step cost of microseconds, where an exact partition is quadratic)."""
    groups = [(0, len(keys), max(keys))]
    while len(groups) < max_groups:
        best = None
        for g, (first, end, top) in enumerate(groups):
            cut = _best_cut(keys[first:end], top)
            if cut is not None and (best is None or cut[1] > best[2]):
                best = (g, cut[0], cut[1])
        if best is None or best[2] * new_tokens < call_pairs:
            break
        g, at, _ = best
        first, end, _ = groups[g]
        groups[g:g + 1] = [(first, first + at, max(keys[first:first + at])),
                           (first + at, end, max(keys[first + at:end]))]
    return groups


def _best_cut(keys: list[int], top: int) -> tuple[int, int] | None:
    """(rows before the cut, key slots saved) of the run's best single cut, or None."""
    n = len(keys)
    if n < 2:
        return None
    suffix = keys[:]
    for i in range(n - 2, -1, -1):
        suffix[i] = max(suffix[i], suffix[i + 1])
    best, prefix = None, 0
    for at in range(1, n):
        prefix = max(prefix, keys[at - 1])
        saved = n * top - at * prefix - (n - at) * suffix[at]
        if best is None or saved > best[1]:
            best = (at, saved)
    return best if best[1] > 0 else None


@contextlib.contextmanager
def grouped(target, groups: list[tuple[int, int, int]] | None):
    """The target's attention runs per run of rows for the forwards inside (an SDPA target
    on the CPU, more than one run; anything else runs as loaded)."""
    global _groups
    config = text_config(target.config)
    if groups is None or len(groups) < 2 or getattr(config, "_attn_implementation", None) != "sdpa" \
            or target.device.type != "cpu":
        yield
        return
    _groups = groups
    config._attn_implementation_internal = NAME  # read by every attention layer at each call
    try:
        yield
    finally:
        config._attn_implementation_internal = "sdpa"
        _groups = None
