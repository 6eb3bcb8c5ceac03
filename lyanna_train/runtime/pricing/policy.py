"""What each row speculates with, chosen per iteration from measured costs and its own estimates.

Each iteration has two decisions, both made to maximise the batch's expected accepted
tokens per second of (draft + fused verify) time:

1. :func:`choose_drafting`, before the head runs: which rows draft. A row's free
   candidates (prompt lookup, its pool's continuation) cost nothing to propose; the head's
   cost ``Costs.draft(rows drafting)`` buys each drafting row what its head profile
   expects (:class:`.estimates.AcceptanceEstimates`). For every verify width W (tokens per
   row of the fused forward, rows padded to W) and every count s, the s rows whose head
   adds most at W draft; the best (W, s) wins. A row that does not draft decodes with its
   free candidates or plainly (W = 1), and the head's forward never runs for it.
2. :func:`fit_trees`, after drafting: the width W of the fused verify and each row's W - 1
   best candidates (:func:`.cost.best_width`), the draft time now spent.

Where verify cost is flat and drafting free (an accelerator, :meth:`.cost.Costs.flat`)
every row drafts and verifies its whole tree; where a draft step costs more than any
head could return, nobody drafts.
"""

from __future__ import annotations

import heapq
from itertools import accumulate
from typing import Sequence

from ..verification.tree import TokenTree
from .cost import Costs, VerifyCost, best_width


def _prefix(probs: Sequence[float], most: int) -> list[float]:
    """[0, p_1, p_1 + p_2, ...] over the ``most`` largest of ``probs``."""
    return [0.0] + list(accumulate(heapq.nlargest(most, probs)))


def choose_drafting(free: Sequence[Sequence[float]], head: Sequence[Sequence[float] | None], costs: Costs,
                    limit: int | None = None) -> list[bool]:
    """Which rows draft this iteration.

    free[r]: the acceptance chances of row r's free candidates; head[r]: what the head is
    expected to add for row r, its candidates' chances best first (None: row r cannot
    draft). ``limit`` caps the verify width. -> a flag per row."""
    rows = len(free)
    if rows == 0:
        return []
    most = 1 + max(len(f) + len(h or ()) for f, h in zip(free, head))
    most = min(most, limit) if limit else most
    alone = [_prefix(f, most - 1) for f in free]
    both = [_prefix(list(f) + list(h or ()), most - 1) for f, h in zip(free, head)]
    best_rate, best_rows = -1.0, []
    for width in range(1, most + 1):
        k = width - 1
        base = [1 + a[min(k, len(a) - 1)] for a in alone]
        gain = sorted(((b[min(k, len(b) - 1)] + 1 - base_r, r) for r, (b, base_r) in enumerate(zip(both, base))
                       if head[r] is not None), reverse=True)
        verify = costs.verify(rows * width)
        total = sum(base)
        for s in range(len(gain) + 1):
            if s:
                total += gain[s - 1][0]
            rate = total / (costs.draft(s) + verify)
            if rate > best_rate * (1 + 1e-9):  # ties: fewer drafting rows, narrower widths
                best_rate, best_rows = rate, [r for _, r in gain[:s]]
    chosen = set(best_rows)
    return [r in chosen for r in range(rows)]


def fit_trees(trees: list[TokenTree], room: Sequence[int | None], cost: VerifyCost | None,
              shallow_first: bool = False) -> list[TokenTree]:
    """The nodes each row verifies: no node past its row's ``room`` (depths left in the
    target's context, None: unbounded); with a ``cost`` (``verify: auto``) the best W - 1
    of every row, W chosen for the whole fused forward."""
    trees = [tree if depth is None else _within_depth(tree, depth) for tree, depth in zip(trees, room)]
    if cost is None:
        return trees
    ranked = [tree.ranked(shallow_first) for tree in trees]
    width = best_width([[tree.probs[n] for n in order] for tree, order in zip(trees, ranked)], cost)
    return [tree.best(width - 1, shallow_first) for tree in trees]


def _within_depth(tree: TokenTree, depth: int) -> TokenTree:
    if max(tree.depths) <= depth:
        return tree
    out = TokenTree.rooted_at(tree.tokens[0])
    new = {0: 0}
    for n in range(1, len(tree)):  # parents come first
        if tree.depths[n] <= depth:
            new[n] = out.add(new[tree.parents[n]], tree.tokens[n], tree.probs[n])
    return out
