"""What speculation costs: the target's verify time per token count, the head's draft time per
drafting row count, and how many candidates pay for their verify.

On a GPU a target forward costs about the same for 1 or 64 tokens, so every candidate is
worth verifying. On a CPU it does not: with SmolLM2 on 2 cores and the measured linear
forms (:mod:`..cpu.small_linear`), 1 token takes ~20 ms, 2-5 ~24, 8 ~30 and 16 ~37
(torch's own linears: 40, 71, 63, 71, 84 ms for 1, 2, 4, 8, 16). So the target's forward
time per number of tokens is measured once (:func:`..cpu.tuning.tune`, cached on disk), and
each iteration verifies the ``n`` most probable candidates that maximise

    (1 + Σ_{i ≤ n} p_i) / cost(n + 1)

(p_i: each candidate's estimated chance to be accepted; the 1 is the target's own next
token). n = 0 is a plain decoding step: speculation is skipped when it would not pay.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence


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


def best_width(rows: Sequence[Sequence[float]], cost: VerifyCost, limit: int | None = None,
               margin: float = 0.0) -> int:
    """Each row's candidate probabilities (in the order they would be verified) -> W, the
    tokens per row of ONE fused verify forward over all rows (the root included).

    The forward computes rows × W tokens whatever each row fills (rows are padded to W),
    so every row verifies its W - 1 best candidates and W maximises

        Σ_rows (1 + Σ_{i < W} p_row,i) / cost(rows · W)

    — the batch's total token count is what the forward costs. With one row this is
    :func:`best_count` + 1. ``limit`` caps W; a width past 1 must beat plain decoding by
    ``margin`` (the measured costs' error)."""
    most = max((len(p) for p in rows), default=0) + 1
    most = min(most, limit) if limit else most
    prefix = [[0.0] for _ in rows]
    for sums, probs in zip(prefix, rows):
        for p in probs[:most - 1]:
            sums.append(sums[-1] + p)
    best, best_rate = 1, len(rows) / cost(len(rows)) * (1 + margin)
    for width in range(2, most + 1):
        expected = sum(1 + sums[min(width - 1, len(sums) - 1)] for sums in prefix)
        rate = expected / cost(len(rows) * width)
        if rate > best_rate:
            best, best_rate = width, rate
    return best


class DraftCost:
    """Seconds of the head's work in one iteration when ``rows`` rows draft: their step 0 over
    the tokens they accepted and their candidate tree (:func:`..cpu.tuning.tune` times both
    per row count for the decoding's tree shape); 0 rows cost nothing."""

    def __init__(self, rows: Sequence[int], seconds: Sequence[float]):
        self._curve = VerifyCost(rows, seconds)

    @classmethod
    def free(cls) -> "DraftCost":
        """Drafting costs nothing next to the verify (an accelerator's regime)."""
        return cls([1], [0.0])

    def __call__(self, rows: int) -> float:
        return 0.0 if rows <= 0 else self._curve(rows)


@dataclass(frozen=True)
class Costs:
    """The measured costs the speculation policy weighs (:mod:`.policy`)."""

    verify: VerifyCost
    draft: DraftCost
    anchor: float = 0.0  # seconds of step 0 per anchor a row that waited catches up (one forward over its backlog)

    @classmethod
    def flat(cls) -> "Costs":
        """An accelerator's regime: every verify width costs the same and drafting is free,
        so every row drafts and verifies its whole tree."""
        return cls(VerifyCost.flat(), DraftCost.free())


CLIP = 3.0  # the most one iteration's measurement moves a cost's scale towards, either way


class MeasuredCosts:
    """The tuned costs rescaled by what this decoder's own iterations take.

    The tuning times a verify of one row and a drafting iteration on random states; a real
    batch also reads every row's cache, catches up rows that waited and keeps each row's
    books, so at 16 rows on 2 CPU cores drafting took ~3x its tuned time. Each component
    keeps an average of measured / tuned (weight ``memory`` for each new iteration) and
    scales its whole curve by it: the curves' shapes come from the tuning, their levels
    from the decoding itself."""

    def __init__(self, tuned: Costs, memory: float = 0.2):
        self.tuned, self.memory = tuned, memory
        self.verify_scale = self.draft_scale = 1.0
        self.anchor = tuned.anchor  # a catch-up's seconds per anchor, measured as catch-ups happen

    def verify(self, tokens: int) -> float:
        return self.verify_scale * self.tuned.verify(tokens)

    def draft(self, rows: int) -> float:
        return self.draft_scale * self.tuned.draft(rows)

    @property
    def sizes(self) -> list[int]:
        return self.tuned.verify.sizes

    def observe_verify(self, tokens: int, seconds: float) -> None:
        self.verify_scale = self._blend(self.verify_scale, seconds, self.tuned.verify(tokens))

    def observe_draft(self, rows: int, seconds: float) -> None:
        if rows:
            self.draft_scale = self._blend(self.draft_scale, seconds, self.tuned.draft(rows))

    def observe_catch_up(self, anchors: int, seconds: float) -> None:
        if anchors and self.tuned.anchor > 0:
            self.anchor = self.tuned.anchor * self._blend(self.anchor / self.tuned.anchor, seconds / anchors,
                                                          self.tuned.anchor)

    def _blend(self, scale: float, seconds: float, tuned: float) -> float:
        """One observation's ratio to the tuned figure, clipped to [1/CLIP, CLIP]: a first call
        (kernels not warm, buffers allocated) or a pause of the machine moves the average, it
        does not take it over (one such catch-up once read 11x its steady cost)."""
        if tuned <= 0:
            return scale
        return scale + self.memory * (min(max(seconds / tuned, 1 / CLIP), CLIP) - scale)
