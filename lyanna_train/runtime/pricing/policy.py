"""What each row speculates with, chosen per iteration from measured costs and its own estimates.

Each iteration has two decisions, both made to maximise the batch's expected accepted
tokens per second of (draft + fused verify) time:

1. :func:`choose_drafting`, before the head runs: which rows draft. A row's free
   candidates (prompt lookup, its pool's continuation) cost nothing to propose; the head's
   cost ``Costs.draft(rows drafting)`` buys each drafting row a tree like its last ones
   (:attr:`.estimates.AcceptanceEstimates.head_samples`). Rows are ranked by what their
   head adds on average; for every count s, the s best draft, and the rate is averaged
   over the kept trees of the best verify width W for each (tokens per row of the fused
   forward, rows padded to W) — drafting keeps the option of verifying little when the
   tree it gets is poor. The best s wins. A row that does not draft decodes with its free
   candidates or plainly (W = 1), and the head's forward never runs for it.
2. :func:`fit_trees`, after drafting: the width W of the fused verify and each row's W - 1
   best candidates (:func:`.cost.best_width`), the draft time now spent.

Where verify cost is flat and drafting free (an accelerator, :meth:`.cost.Costs.flat`)
every row drafts and verifies its whole tree; where a draft step costs more than any
head could return, nobody drafts.

**Draining.** While requests wait, or more may come (a server), a freed slot takes the
next one at once, so every accepted token is worth the same. Once none wait and none will
come (:meth:`..scheduling.scheduler.BatchDecoder.run`), the batch only shrinks: its time left
is set by the row with the most tokens left, and a row that runs ahead only leaves its
slot idle sooner while the last rows still pay for whole iterations. Each row's tokens
then count in proportion to its tokens left (:func:`drain_weights`): the rows behind
speculate, the ones ahead decode plainly instead of running further ahead (with 16 rows of
64 tokens on 2 CPU cores, a batch that sped every row alike spent its last ~10% of the
time on iterations of a few rows; the fused verify pads every row to one width, so rows
still finish apart).
"""

from __future__ import annotations

import heapq
from itertools import accumulate
from typing import Sequence

import torch

from ..verification.tree import TokenTree
from .cost import CATCH_UP_HORIZON, Costs, best_width


def _prefix(probs: Sequence[float], most: int) -> list[float]:
    """[0, p_1, p_1 + p_2, ...] over the ``most`` largest of ``probs``, padded to ``most + 1``."""
    sums = [0.0] + list(accumulate(heapq.nlargest(most, probs)))
    return sums + [sums[-1]] * (most + 1 - len(sums))


def drain_weights(left: Sequence[int]) -> list[float]:
    """Each row's tokens left -> what one of its tokens is worth to a draining batch (the
    rows with the most left: 1)."""
    most = max(left, default=0)
    return [max(n, 1) / most if most > 0 else 1.0 for n in left]


def choose_drafting(free: Sequence[Sequence[float]], head: Sequence[Sequence[Sequence[float]] | None], costs: Costs,
                    limit: int | None = None, margin: float = 0.0, behind: Sequence[int] | None = None,
                    weights: Sequence[float] | None = None) -> list[bool]:
    """Which rows draft this iteration.

    free[r]: the acceptance chances of row r's free candidates; head[r]: for each of row
    r's kept trees, the chances of the head's candidates best first (None: row r cannot
    draft). ``limit`` caps the verify width; any speculation must beat plain decoding by
    ``margin``. behind[r]: the anchors row r has waiting, caught up before it drafts (their
    step 0, ``costs.anchor`` each, charged over ``CATCH_UP_HORIZON`` iterations).
    ``weights[r]``: what a token of row r is worth (:func:`drain_weights`; None: 1 each).
    -> a flag per row."""
    rows = len(free)
    drafting = [r for r in range(rows) if head[r]]
    if not drafting:
        return [False] * rows
    most = 1 + max(len(f) + max((len(t) for t in h or [()]), default=0) for f, h in zip(free, head))
    most = min(most, limit) if limit else most
    samples = max(len(head[r]) for r in drafting)
    alone_rows = [_prefix(f, most - 1) for f in free]
    alone = torch.tensor(alone_rows, dtype=torch.float64)  # [R, W]
    nothing = [0.0] * most
    gain_rows = [[nothing] * rows for _ in range(samples)]  # [K][R][W]: what the head adds at width W
    for r in drafting:  # Python lists, one tensor at the end: at 16 rows, a tensor per row and tree cost ~5 ms
        per_tree = [[b - a for b, a in zip(_prefix(list(free[r]) + list(tree), most - 1), alone_rows[r])]
                    for tree in head[r]]
        for k in range(samples):  # a row with fewer kept trees repeats them
            gain_rows[k][r] = per_tree[k % len(per_tree)]
    gain = torch.tensor(gain_rows, dtype=torch.float64)  # [K, R, W]
    if weights is not None:
        worth = torch.tensor(weights, dtype=torch.float64)
        gain, alone = gain * worth[None, :, None], alone * worth[:, None]
    means = gain.mean(dim=(0, 2)).tolist()
    order = sorted(drafting, key=lambda r: -means[r])
    widths = torch.arange(1, most + 1)
    curve = costs.verify_at(rows)
    verify = torch.tensor([curve(rows * int(w)) for w in widths], dtype=torch.float64)
    plain = costs.plain(rows)  # nobody drafts, one token per row: a plain iteration, priced apart
    base = (rows if weights is None else sum(weights)) + alone.sum(0)  # [W]: every row's own token and free candidates
    added = torch.cumsum(gain[:, order], dim=1)  # [K, s, W]: the s best rows' head, for s = 1..
    totals = torch.cat([torch.zeros(samples, 1, most, dtype=torch.float64), added], dim=1) + base  # [K, s + 1, W]
    catch_up = [0.0] + list(accumulate((behind[r] if behind else 0) * costs.anchor / CATCH_UP_HORIZON for r in order))
    draft = torch.tensor([costs.draft(s) + catch_up[s] for s in range(len(order) + 1)], dtype=torch.float64)
    seconds = draft[:, None] + verify[None, :]  # [s + 1, W]
    seconds[0, 0] = plain
    rates = totals / seconds[None]  # [K, s + 1, W]
    rates[:, :, 1:] /= 1 + margin  # speculation has to beat plain decoding (s = 0, W = 1) by the margin
    rates[:, 1:, 0] /= 1 + margin
    rates = rates.amax(dim=2).mean(dim=0)  # [s + 1]
    best = int(torch.argmax(rates))  # the first of equal rates: fewer drafting rows
    chosen = set(order[:best])
    return [r in chosen for r in range(rows)]


def fit_trees(trees: list[TokenTree], room: Sequence[int | None], costs: Costs | None,
              shallow_first: bool = False, margin: float = 0.0, drafted: bool = False,
              weights: Sequence[float] | None = None) -> list[TokenTree]:
    """The nodes each row verifies: no node past its row's ``room`` (depths left in the
    target's context, None: unbounded); with ``costs`` (``verify: auto``) the best W - 1
    of every row, W chosen for the whole fused forward (W = 1 priced as a plain iteration
    unless a row ``drafted``: then the iteration is a speculative one whatever W), each
    row's tokens worth its ``weights`` entry."""
    trees = [tree if depth is None else _within_depth(tree, depth) for tree, depth in zip(trees, room)]
    if costs is None:
        return trees
    ranked = [tree.ranked(shallow_first) for tree in trees]
    width = best_width([[tree.probs[n] for n in order] for tree, order in zip(trees, ranked)], costs.verify_at(len(trees)),
                       margin=margin, plain=None if drafted else costs.plain(len(trees)), weights=weights)
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
