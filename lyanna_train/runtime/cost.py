"""How many candidates to verify: expected tokens per second of target time, from each
candidate's estimated chance of acceptance (:class:`AcceptanceEstimates`).

On a GPU a target forward costs about the same for 1 or 64 tokens, so every candidate is
worth verifying. On a CPU it does not: with SmolLM2 on 2 cores and the measured linear
forms (:mod:`.small_linear`), 1 token takes ~20 ms, 2-5 ~24, 8 ~30 and 16 ~37
(torch's own linears: 40, 71, 63, 71, 84 ms for 1, 2, 4, 8, 16). So the target's forward
time per number of tokens is measured once (:func:`.cpu_tuning.tune`, cached on disk), and
each iteration verifies the ``n`` most probable candidates that maximise

    (1 + Σ_{i ≤ n} p_i) / cost(n + 1)

(p_i: each candidate's estimated chance to be accepted; the 1 is the target's own next
token). n = 0 is a plain decoding step: speculation is skipped when it would not pay.
"""

from __future__ import annotations

from bisect import bisect_left
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


def best_width(rows: Sequence[Sequence[float]], cost: VerifyCost, limit: int | None = None) -> int:
    """Each row's candidate probabilities (in the order they would be verified) -> W, the
    tokens per row of ONE fused verify forward over all rows (the root included).

    The forward computes rows × W tokens whatever each row fills (rows are padded to W),
    so every row verifies its W - 1 best candidates and W maximises

        Σ_rows (1 + Σ_{i < W} p_row,i) / cost(rows · W)

    — the batch's total token count is what the forward costs. With one row this is
    :func:`best_count` + 1. ``limit`` caps W."""
    most = max((len(p) for p in rows), default=0) + 1
    most = min(most, limit) if limit else most
    prefix = [[0.0] for _ in rows]
    for sums, probs in zip(prefix, rows):
        for p in probs[:most - 1]:
            sums.append(sums[-1] + p)
    best, best_rate = 1, len(rows) / cost(len(rows))
    for width in range(2, most + 1):
        expected = sum(1 + sums[min(width - 1, len(sums) - 1)] for sums in prefix)
        rate = expected / cost(len(rows) * width)
        if rate > best_rate:
            best, best_rate = width, rate
    return best


POOL = 0  # the "n-gram length" under which pool candidates (:mod:`.pool_lookup`) are counted


class AcceptanceEstimates:
    """Each candidate's chance to be accepted, learned from what the target confirms.

    Draft candidates: their cumulative draft probability (EAGLE-2's observation: a draft's
    confidence tracks acceptance) scaled by confirmed / predicted over the verified ones
    (a head trained on other text is overconfident). Lookup candidates: a geometric rate
    per matched n-gram length, the MLE of "the next lookup token is right" (prior 1/2);
    pool candidates are counted as length ``POOL``.
    """

    def __init__(self):
        self.draft = [1.0, 1.0]  # [draft candidates confirmed, their summed draft probabilities]
        self.guesses: dict[tuple, float] = {}  # this iteration's draft paths (tokens) -> raw probability
        self.lookup: dict[int, list[int]] = {}  # n-gram length -> [tokens confirmed, chains broken]
        self.proposals: list[tuple[int, list[int]]] = []  # this iteration's (n-gram length, continuation)

    def draft_scale(self) -> float:
        return self.draft[0] / self.draft[1]

    def calibrate_draft(self, tree, nodes: list[int]) -> None:
        """Remember the draft's own probabilities of ``nodes`` and scale them in ``tree``."""
        scale = self.draft_scale()
        self.guesses = {}
        for node in nodes:
            self.guesses[tuple(tree.path_tokens(tree.ancestors(node))[1:])] = tree.probs[node]
            tree.probs[node] = min(1.0, tree.probs[node] * scale)

    def lookup_rate(self, n: int) -> float:
        right, broken = self.lookup.get(n, (1, 1))
        return right / (right + broken)

    def lookup_probs(self, n: int, length: int) -> list[float]:
        rate = self.lookup_rate(n)
        return [rate ** (j + 1) for j in range(length)]

    def proposed_lookup(self, n: int, continuation: list[int]) -> None:
        if continuation:
            self.proposals.append((n, continuation))

    def update(self, verified, new: list[int]) -> None:
        """After a verify: ``verified`` is the tree the target scored, ``new`` the tokens it emitted."""
        for node in range(1, len(verified)):
            path = tuple(verified.path_tokens(verified.ancestors(node))[1:])
            if path in self.guesses:
                self.draft[1] += self.guesses[path]
                self.draft[0] += list(path) == new[:len(path)]
        for n, follow in self.proposals:
            right = 0
            while right < min(len(follow), len(new)) and follow[right] == new[right]:
                right += 1
            counts = self.lookup.setdefault(n, [1, 1])
            counts[0] += right
            counts[1] += right < min(len(follow), len(new))
        self.guesses, self.proposals = {}, []
