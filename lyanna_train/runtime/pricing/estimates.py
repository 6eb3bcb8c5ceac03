"""Each row's acceptance estimates, learned online from what the target confirms in that row.

Every running row has its own :class:`AcceptanceEstimates` (never shared: a row's choice
reads only its own acceptance). They price candidates already proposed (each node's
chance to be accepted, for the verify width) and, before the head runs, what drafting
would bring this row (:attr:`AcceptanceEstimates.head_samples`, for the policy's choice
of which rows draft).
"""

from __future__ import annotations

POOL = 0  # the "n-gram length" under which pool candidates (:mod:`..drafting.pool_lookup`) are counted
HEAD_SAMPLES = 8  # the head's last trees a row keeps: what drafting bought it, tree by tree
RETRY = 0.05  # per iteration without drafting, the kept trees relax this far back toward the cold start


def cold_chain(acceptance: tuple[float, ...], depth: int, nodes: int) -> list[float]:
    """The cold start: a chain whose step j is accepted at the head's measured held-out rate
    ``acceptance[j]`` (the last one repeated deeper), its other candidates not counted; with
    nothing measured, the head's best case (a perfect chain)."""
    rates = list(acceptance) or [1.0]
    chain, p = [], 1.0
    for j in range(min(depth, nodes)):
        p *= rates[min(j, len(rates) - 1)]
        chain.append(p)
    return chain + [0.0] * (nodes - len(chain))


class AcceptanceEstimates:
    """Each candidate's chance to be accepted, learned from what the target confirms.

    Draft candidates: their cumulative draft probability (EAGLE-2's observation: a draft's
    confidence tracks acceptance) scaled by confirmed / predicted over the verified ones
    (a head trained on other text is overconfident). Lookup candidates: a geometric rate
    per matched n-gram length, the MLE of "the next lookup token is right" (prior 1/2);
    pool candidates are counted as length ``POOL``.

    Head samples: the calibrated probabilities of the head's candidates in each of the
    row's last ``HEAD_SAMPLES`` drafted trees, best first: what drafting is expected to
    bring before the head runs. Kept tree by tree, not averaged: after drafting the verify
    still picks its width from the tree it got, so drafting is worth the *mean of the best
    choice over such trees*, more than the best choice for their mean. Cold start, before
    the row has drafted: a chain accepted at the head's measured held-out rates
    (:func:`cold_chain`; a perfect chain when none were measured). While a row does not draft, its samples drift
    back toward that start (``RETRY``), so a row whose text changes gets tried again.
    """

    def __init__(self, acceptance: tuple[float, ...] = ()):
        self.draft = [1.0, 1.0]  # [draft candidates confirmed, their summed draft probabilities]
        self.guesses: dict[tuple, float] = {}  # this iteration's draft paths (tokens) -> raw probability
        self.lookup: dict[int, list[int]] = {}  # n-gram length -> [tokens confirmed, chains broken]
        self.proposals: list[tuple[int, list[int]]] = []  # this iteration's (n-gram length, continuation)
        self.head_samples: list[list[float]] = []
        self.acceptance = acceptance  # the head's measured held-out acceptance per step: the cold start  # the last trees' candidate chances, best first; [] = cold

    def draft_scale(self) -> float:
        return self.draft[0] / self.draft[1]

    def calibrate_draft(self, tree, nodes: list[int]) -> None:
        """Remember the draft's own probabilities of ``nodes`` and scale them in ``tree``."""
        scale = self.draft_scale()
        self.guesses = {}
        for node in nodes:
            self.guesses[tuple(tree.path_tokens(tree.ancestors(node))[1:])] = tree.probs[node]
            tree.probs[node] = min(1.0, tree.probs[node] * scale)

    def expected_head(self, depth: int, nodes: int) -> list[list[float]]:
        """The head's next ``nodes`` candidates' acceptance chances, best first, one list per
        kept tree (a tree of ``depth`` levels: at most ``depth`` can be accepted at once)."""
        if not self.head_samples:
            return [cold_chain(self.acceptance, depth, nodes)]
        return [(sample + [0.0] * nodes)[:nodes] for sample in self.head_samples]

    def observe_head(self, probs: list[float]) -> None:
        """A drafted tree's calibrated candidate probabilities join the row's samples."""
        self.head_samples = (self.head_samples + [sorted(probs, reverse=True)])[-HEAD_SAMPLES:]

    def idle_head(self, depth: int) -> None:
        """An iteration this row did not draft: drift toward the cold start (to be tried again)."""
        self.head_samples = [[p + RETRY * (c - p) for p, c in zip(sample, cold_chain(self.acceptance, depth, len(sample)))]
                             for sample in self.head_samples]

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
