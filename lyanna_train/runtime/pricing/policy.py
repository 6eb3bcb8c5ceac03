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

**Draining.** While more requests may come (a server), a freed slot takes the next one at
once, so every accepted token is worth the same. In a closed run (none will come:
:meth:`..scheduling.scheduler.BatchDecoder.run`) what counts is when the last slot ends:
each slot's tokens left are its row's plus the budgets of the waiting requests it will
take, each placed in the slot that frees first
(:meth:`..scheduling.scheduler.BatchDecoder._slots_left`); an iteration is worth the
seconds it takes off that remaining time (:class:`Drain`), and a token of a row far ahead
is worth only what its slot adds to the iterations the rows behind still need. Tokens that
put one row ahead only start its slot's next request earlier; a closed run then ends with
a tail of rows admitted late. (Valued by tokens while more waited than the slots could
take, 48 MT-Bench prompts x 64 tokens at 16 rows on 2 CPU cores ran 0.92x plain decoding,
its speculative iterations about even with plain ones but its slots empty for 181-247
row-iterations against 65; valued as draining throughout, 0.98x, with the decoders' steps
interleaved. Valued by tokens until none waited, 16 mixed requests at 8 rows took 12.2 s
against plain decoding's 11.0 s.)
"""

from __future__ import annotations

import heapq
from itertools import accumulate
from typing import Callable, Sequence

import torch

from ..token_tree import TokenTree
from .cost import CATCH_UP_HORIZON, Costs, best_width


def _prefix(probs: Sequence[float], most: int) -> list[float]:
    """[0, p_1, p_1 + p_2, ...] over the ``most`` largest of ``probs``, padded to ``most + 1``."""
    sums = [0.0] + list(accumulate(heapq.nlargest(most, probs)))
    return sums + [sums[-1]] * (most + 1 - len(sums))


TIE = 1e-9  # seconds a token is worth in a draining batch when it takes nothing off (Drain.saved)


class Drain:
    """The seconds an iteration takes off a draining batch's remaining time.

    With every row's tokens left sorted, L_1 >= L_2 >= ... >= L_R, a batch that decoded
    plainly from here would run the k rows with the most left for L_k - L_(k+1)
    iterations of ``plain(k)`` seconds each. An iteration that delivers e_r tokens to each
    row r is worth what it takes off that estimate. A plain iteration takes off
    plain(R), one iteration of the whole batch. Tokens for the rows ahead take off only
    what their slots add to the iterations the rows behind still need, plain(k) -
    plain(k - 1), a few ms of a ~20 ms forward on a CPU. The row with the most left takes
    off a whole plain(1) per token. With one row, this is its tokens (up to its budget)
    times plain(1), so the choice is the same as a non-draining batch's."""

    def __init__(self, left: Sequence[int], plain: Callable[[int], float]):
        self.left = torch.tensor(list(left), dtype=torch.float64)
        self.step = torch.tensor([plain(k) for k in range(1, len(left) + 1)], dtype=torch.float64)
        self.now = self._seconds(self.left)

    def _seconds(self, left: torch.Tensor) -> torch.Tensor:
        """[..., R] tokens left -> [...] seconds of plain iterations to finish them all."""
        rest = left.clamp(min=0).sort(dim=-1, descending=True).values
        below = torch.cat([rest[..., 1:], torch.zeros_like(rest[..., :1])], dim=-1)
        return ((rest - below) * self.step).sum(dim=-1)

    def saved(self, expected: torch.Tensor) -> torch.Tensor:
        """[..., R] tokens each row is expected to get -> [...] seconds taken off, and
        ``TIE`` seconds for each token within its row's budget: where forwards cost the same
        at every width and drafting is free (an accelerator), the rows ahead's tokens take
        nothing off, and of choices that take off the same the one delivering most wins,
        so full trees are verified."""
        within = torch.minimum(expected, self.left.clamp(min=0)).sum(dim=-1)
        return self.now - self._seconds(self.left - expected) + TIE * within


def choose_drafting(free: Sequence[Sequence[float]], head: Sequence[Sequence[Sequence[float]] | None], costs: Costs,
                    limit: int | None = None, margin: float = 0.0, behind: Sequence[int] | None = None,
                    left: Sequence[int] | None = None) -> list[bool]:
    """Which rows draft this iteration.

    free[r]: the acceptance chances of row r's free candidates; head[r]: for each of row
    r's kept trees, the chances of the head's candidates best first (None: row r cannot
    draft). ``limit`` caps the verify width; any speculation must beat plain decoding by
    ``margin``. behind[r]: the anchors row r has waiting, caught up before it drafts (their
    step 0, ``costs.anchor`` each, charged over ``CATCH_UP_HORIZON`` iterations).
    ``left[r]``: row r's tokens left in a draining batch (:class:`Drain`; None: not draining,
    every token worth the same). -> a flag per row.

    In a draining batch of several rows a catch-up is charged whole, as the verdict on
    what speculation delivered charges it (:class:`.cost.MeasuredCosts`): the rows' tokens
    are worth only what they take off the batch's time, and spread over 8 iterations the
    investment was made and then not repaid. A closed batch of 16 MT-Bench prompts x 64
    tokens on 2 CPU cores (Xeon, medians of 3 alternated runs) went from 0.92x the best
    fixed method (τ 1.06: each row's prompt caught up, ~9 ms a row, for a few drafted
    iterations) to 1.00x; batch 4 from 1.02x to 1.06x, batch 2 from 0.95x to 1.02x. One
    row draining is valued as one row not draining (:class:`Drain`), so it keeps the
    horizon: charged whole, a long prompt's catch-up would keep a lone row from ever
    drafting."""
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
    means = gain.mean(dim=(0, 2)).tolist()
    lag = [1] * rows if left is None else [max(n, 1) for n in left]  # draining: the rows behind first
    order = sorted(drafting, key=lambda r: -means[r] * lag[r])
    widths = torch.arange(1, most + 1)
    curve = costs.verify_at(rows)
    verify = torch.tensor([curve(rows * int(w)) for w in widths], dtype=torch.float64)
    plain = costs.plain(rows)  # nobody drafts, one token per row: a plain iteration, priced apart
    if left is None:  # tokens
        base = rows + alone.sum(0)  # [W]: every row's own token and free candidates
        added = torch.cumsum(gain[:, order], dim=1)  # [K, s, W]: the s best rows' head, for s = 1..
        totals = torch.cat([torch.zeros(samples, 1, most, dtype=torch.float64), added], dim=1) + base  # [K, s + 1, W]
    else:  # seconds taken off the draining batch's time: each row's tokens apart
        chosen = torch.zeros(len(order) + 1, rows, dtype=torch.float64)  # [s + 1, R]: whether row r is among the s best
        for s, r in enumerate(order):
            chosen[s + 1:, r] = 1.0
        expected = 1 + alone[None, None] + gain[:, None] * chosen[None, :, :, None]  # [K, s + 1, R, W]
        totals = Drain(left, costs.plain).saved(expected.transpose(-1, -2))  # [K, s + 1, W]
    horizon = CATCH_UP_HORIZON if left is None or rows == 1 else 1  # see the docstring: draining, charged whole
    catch_up = [0.0] + list(accumulate((behind[r] if behind else 0) * costs.anchor / horizon for r in order))
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
              left: Sequence[int] | None = None) -> list[TokenTree]:
    """The nodes each row verifies: no node past its row's ``room`` (depths left in the
    target's context, None: unbounded); with ``costs`` (``verify: auto``) the best W - 1
    of every row, W chosen for the whole fused forward (W = 1 priced as a plain iteration
    unless a row ``drafted``: then the iteration is a speculative one whatever W), each
    a draining batch's rows with ``left`` tokens left each (:class:`Drain`)."""
    trees = [tree if depth is None else _within_depth(tree, depth) for tree, depth in zip(trees, room)]
    if costs is None:
        return trees
    ranked = [tree.ranked(shallow_first) for tree in trees]
    width = best_width([[tree.probs[n] for n in order] for tree, order in zip(trees, ranked)], costs.verify_at(len(trees)),
                       margin=margin, plain=None if drafted else costs.plain(len(trees)),
                       drain=None if left is None else Drain(left, costs.plain))
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
