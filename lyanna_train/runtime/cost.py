"""How many candidates to verify: expected tokens per second of target time.

On a GPU a target forward costs about the same for 1 or 64 tokens, so every candidate is
worth verifying. On a CPU it does not: with SmolLM2 on 2 cores one token takes ~39 ms
but two already ~57 ms (the BLAS leaves its matrix-vector path), 16 ~70 ms. So the
runtime measures the target's forward time per number of tokens once, and each
iteration verifies the ``n`` most probable candidates that maximise

    (1 + Σ_{i ≤ n} p_i) / cost(n + 1)

(p_i: each candidate's estimated chance to be accepted; the 1 is the target's own next
token). n = 0 is a plain decoding step: speculation is skipped when it would not pay.
"""

from __future__ import annotations

import time
import weakref
from bisect import bisect_left
from typing import Sequence

import torch
from transformers import DynamicCache

from .target_step import target_forward

SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


class VerifyCost:
    """Seconds of one target forward over N new tokens, interpolated between measured sizes."""

    def __init__(self, sizes: Sequence[int], seconds: Sequence[float]):
        if len(sizes) != len(seconds) or not sizes or list(sizes) != sorted(sizes):
            raise ValueError("need increasing sizes, one time each")
        self.sizes, self.seconds = list(sizes), list(seconds)

    @classmethod
    def flat(cls) -> "VerifyCost":
        """Every size costs the same: verify every candidate (an accelerator's regime)."""
        return cls([1], [1.0])

    def __call__(self, n: int) -> float:
        i = bisect_left(self.sizes, n)
        if i == 0:
            return self.seconds[0]
        if i == len(self.sizes):  # past the last size: extend the last segment's slope
            if len(self.sizes) == 1:
                return self.seconds[0]
            i = len(self.sizes) - 1
        (a, b), (ta, tb) = self.sizes[i - 1:i + 1], self.seconds[i - 1:i + 1]
        return ta + (tb - ta) * (n - a) / (b - a)


def best_count(probs: Sequence[float], cost: VerifyCost) -> int:
    """probs sorted high to low -> how many to verify (0..len) for the most tokens per second."""
    best, best_rate, expected = 0, 1.0 / cost(1), 1.0
    for n, p in enumerate(probs, start=1):
        expected += p
        rate = expected / cost(n + 1)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


_measured: "weakref.WeakKeyDictionary[torch.nn.Module, VerifyCost]" = weakref.WeakKeyDictionary()


def measured_cost(target, context: int = 256, repeats: int = 3) -> VerifyCost:
    """The target's forward time per number of new tokens after ``context`` cached ones
    (best of ``repeats``: the least disturbed by other work), measured once per model."""
    if target not in _measured:
        vocab = target.config.vocab_size
        seconds = []
        with torch.inference_mode():
            cache = DynamicCache(config=target.config)
            target_forward(target, None, cache, torch.randint(0, vocab, (1, context), device=target.device), 1)
            for n in SIZES:
                ids = torch.randint(0, vocab, (1, n), device=target.device)
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    target_forward(target, None, cache, ids)
                    if target.device.type == "cuda":
                        torch.cuda.synchronize()
                    best = min(best, time.perf_counter() - start)
                    cache.crop(-n)
                seconds.append(best)
        _measured[target] = VerifyCost(SIZES, seconds)
    return _measured[target]
