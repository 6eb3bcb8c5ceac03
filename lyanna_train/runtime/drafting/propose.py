"""Every row's candidates for one iteration, as a tree below its last accepted token.

Free candidates come first: prompt lookup's continuations and the row's pool's (what
followed its most similar earlier state), each with the row's learned acceptance
estimate. Then :func:`..pricing.policy.choose_drafting` decides which rows the head drafts
for, knowing those free candidates, each row's head profile and the measured costs; the
head runs once per level over the drafting rows (those between them ride along as
padding, untouched) and every drafted row's tree is calibrated by the row's own record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..pricing.cost import MeasuredCosts
from ..pricing.estimates import POOL, AcceptanceEstimates
from ..pricing.policy import choose_drafting
from ..settings import LookupSettings
from ..token_tree import TokenTree
from .pool_lookup import pool_continuation
from .prompt_lookup import lookup_continuations
from .state import RowView, catch_up_rows
from .tree import draft_trees


@dataclass
class FreeCandidate:
    tokens: list[int]
    probs: list[float]  # the row's estimate of each being accepted (a chain: non-increasing)
    source: int  # the n-gram length that matched, POOL for the pool's continuation


def free_candidates(context: torch.Tensor, length: int, lookup: LookupSettings, estimates: AcceptanceEstimates,
                    draft_row: RowView | None = None, pool_threshold: float = 0.0) -> list[FreeCandidate]:
    """Prompt-lookup and pool continuations after ``context[:length]`` (the accepted ids),
    each with the row's estimates. ``draft_row``: the row's draft state, current (its pool
    gives a continuation); None: no pool candidates."""
    out = []
    if lookup.max_tokens:
        n, found = lookup_continuations(context[:length], lookup.max_tokens, lookup.max_ngram,
                                        branches=lookup.branches)
        out += [FreeCandidate(follow, estimates.lookup_probs(n, len(follow)), n) for follow in found]
    if lookup.pool_tokens and draft_row is not None:
        follow = pool_continuation(draft_row, context, length, lookup.pool_tokens, pool_threshold)
        out.append(FreeCandidate(follow, estimates.lookup_probs(POOL, len(follow)), POOL))
    return out


def add_free(tree: TokenTree, candidates: list[FreeCandidate], estimates: AcceptanceEstimates) -> None:
    """Insert the free candidates below the root and remember them for the row's estimates
    (the first continuation of each source is what its rate learns from)."""
    learned = set()
    for cand in candidates:
        tree.add_path(cand.tokens, cand.probs)
        if cand.source not in learned:
            estimates.proposed_lookup(cand.source, cand.tokens)
            learned.add(cand.source)


def plain_rows(batch, rows: slice) -> list[TokenTree]:
    """Every row of ``rows`` decodes plainly this iteration (its root alone, no draft): what
    a due measurement of plain decoding's cost (:meth:`..pricing.cost.MeasuredCosts.plain_due`)
    runs."""
    for row in batch.rows[rows]:
        row.drafted = False
        row.estimates.idle_head(batch.settings.tree.depth)
    return [TokenTree.rooted_at(row.last_token) for row in batch.rows[rows]]


def propose_rows(batch, rows: slice) -> list[TokenTree]:
    """Every row of ``rows``'s candidate tree (``batch``: a :class:`..scheduling.batch.Batch`);
    sets each row's ``drafted``."""
    active = batch.rows[rows]
    settings, draft = batch.settings, batch.draft
    frees, behind = [], []
    for slot, row in zip(range(rows.start, rows.stop), active):
        behind.append(draft is not None and batch.draft_state.behind(slot))  # a pool behind its row has no candidates
        frees.append([] if row.closing is not None else  # a closing row's root is scored alone
                     free_candidates(row.context, row.length, settings.lookup, row.estimates,
                                     batch.draft_state.row(slot) if draft is not None and not behind[-1] else None,
                                     draft.cfg.pool_threshold if draft is not None else 0.0))
    trees = [TokenTree.rooted_at(row.last_token) for row in active]
    shape = settings.tree
    drafting = [False] * len(active)
    if draft is not None and shape.depth and shape.max_nodes:
        if settings.verify != "auto":  # "fit", "all": the head drafts for every row (a closing row never)
            drafting = [row.closing is None for row in active]
        else:
            head = [row.estimates.expected_head(shape.depth, shape.max_nodes) if row.closing is None else None
                    for row in active]
            waiting = [batch.draft_state.waiting(slot) for slot in range(rows.start, rows.stop)]
            drafting = choose_drafting([[p for c in f for p in c.probs] for f in frees], head,
                                       batch.costs, limit=batch.width_limit, margin=settings.margin, behind=waiting,
                                       left=batch.left[rows] if batch.left is not None else None)
    if any(drafting):
        begin = time.perf_counter()
        first = drafting.index(True)
        last = len(drafting) - drafting[::-1].index(True)
        span = slice(rows.start + first, rows.start + last)
        only = drafting[first:last]
        caught = sum(batch.draft_state.waiting(rows.start + i) for i in range(first, last) if drafting[i])
        start = time.perf_counter()
        catch_up_rows(draft, batch.draft_state, span, only)
        spent = time.perf_counter() - start
        batch.catch_up_seconds += spent
        if isinstance(batch.costs, MeasuredCosts):  # a one-off, not an iteration's cost: priced apart
            batch.costs.observe_catch_up(caught, spent)
        begin += spent
        for i in range(first, last):  # caught up now: the pool's continuation too
            if drafting[i] and behind[i] and settings.lookup.pool_tokens:
                frees[i] += free_candidates(active[i].context, active[i].length, LookupSettings(max_tokens=0,
                                            pool_tokens=settings.lookup.pool_tokens), active[i].estimates,
                                            batch.draft_state.row(rows.start + i), draft.cfg.pool_threshold)
        nodes = draft_trees(draft, batch.draft_state, span, [t if d else None for t, d in zip(trees[first:last], only)],
                            shape)
        for row, tree, new, d in zip(active[first:last], trees[first:last], nodes, only):
            if d:
                row.estimates.calibrate_draft(tree, new)
                row.estimates.observe_head([tree.probs[n] for n in new])
        batch.draft_seconds += time.perf_counter() - begin
    for row, tree, free, d in zip(active, trees, frees, drafting):
        row.drafted = d
        if not d:
            row.estimates.idle_head(shape.depth)
        add_free(tree, free, row.estimates)
    return trees
