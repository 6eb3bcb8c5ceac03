"""The draft for many rows at once: ragged step 0 and tree drafting give each row what the
batch-1 steps give it alone, and a row's pool is never read by another row."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.models.state_pool import unit
from lyanna_train.runtime.batch_draft_step import BatchDraftState, catch_up_rows, extend_rows
from lyanna_train.runtime.batch_draft_tree import draft_trees
from lyanna_train.runtime.draft_step import DraftState, draft_extend
from lyanna_train.runtime.draft_tree import TreeShape, draft_tree
from lyanna_train.runtime.pool_lookup import pool_continuation
from lyanna_train.runtime.tree import TokenTree

from .conftest import V, make_draft

# Per row: the accepted runs after the prompt chunk (rows accept different counts per iteration).
CHUNKS = [(7, 1, 3, 2, 1, 4), (2, 4, 1, 1, 2, 1), (12, 2, 2, 5, 1, 1)]
SHAPES = [TreeShape(1, 3, 1, 3), TreeShape(4, 1, 1, 4), TreeShape(3, 3, 2, 8)]


def _features(seed: int, n: int):
    torch.manual_seed(seed)
    return torch.randn(1, n, 3 * 64), torch.randint(0, V, (1, n + 1))


def _run_both(draft, shape: TreeShape, deferred: tuple[int, ...] = ()):
    """Feed every row its chunks through BatchDraftState (all rows per call) and through
    its own DraftState; after each round, draft a tree both ways -> (batched, alone) trees.
    Rounds in ``deferred`` go to the rows' backlog (no drafting); the next round catches
    up: row 1 on its own first, then all rows in one forward (row 1 with nothing left)."""
    rows = len(CHUNKS)
    data = [_features(r, sum(c) + 1) for r, c in enumerate(CHUNKS)]
    batched, alone = BatchDraftState(draft, slots=rows, capacity=4), [DraftState(draft, capacity=4) for _ in CHUNKS]
    starts = [0] * rows
    trees_b, trees_a = [], []
    for step in range(len(CHUNKS[0])):
        counts = [c[step] for c in CHUNKS]
        width = max(counts)
        aux = torch.zeros(rows, width, 3 * 64)
        nxt = torch.zeros(rows, width, dtype=torch.long)
        for r, (a, ids) in enumerate(data):
            s, n = starts[r], counts[r]
            aux[r, :n], nxt[r, :n] = a[0, s:s + n], ids[0, s + 1:s + n + 1]
            draft_extend(draft, alone[r], a[:, s:s + n], ids[:, s + 1:s + n + 1], s)
        starts = [s + n for s, n in zip(starts, counts)]
        if step == 0:  # rows join one by one (each prefill is its own call), then run together
            for r in range(rows):
                extend_rows(draft, batched, slice(r, r + 1), aux[r:r + 1, :counts[r]], nxt[r:r + 1, :counts[r]],
                            counts[r:r + 1])
        elif step in deferred or batched.behind(0):
            batched.defer(slice(0, rows), aux, nxt, counts)
            if step in deferred:
                assert all(batched.behind(r) for r in range(rows))
                continue
            catch_up_rows(draft, batched, slice(1, 2))
            catch_up_rows(draft, batched, slice(0, rows))
            assert not any(batched.behind(r) for r in range(rows))
        else:
            extend_rows(draft, batched, slice(0, rows), aux, nxt, counts)
        roots = [TokenTree.rooted_at(int(data[r][1][0, starts[r]])) for r in range(rows)]
        draft_trees(draft, batched, slice(0, rows), roots, shape)
        trees_b.append(roots)
        singles = [TokenTree.rooted_at(t.tokens[0]) for t in roots]
        for r in range(rows):
            draft_tree(draft, alone[r], singles[r], shape)
        trees_a.append(singles)
        for r in range(rows):
            assert batched.lengths[r] == alone[r].length and batched.anchor_pos[r] == alone[r].anchor_pos
            torch.testing.assert_close(batched.anchor_state[r], alone[r].anchor_state[0], atol=2e-5, rtol=1e-4)
            if alone[r].pool is not None:
                torch.testing.assert_close(batched.pending[r], alone[r].pending[0], atol=2e-5, rtol=1e-4)
                assert sorted(batched.pool.positions[r].tolist()) == sorted(alone[r].pool.positions[0].tolist())
    return batched, alone, trees_b, trees_a


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
@pytest.mark.parametrize("shape", SHAPES, ids=["top3", "chain4", "tree"])
def test_each_row_drafts_what_it_drafts_alone(tiny_target, pool, shape):
    draft = make_draft(tiny_target, pool)
    with torch.inference_mode():
        _, _, trees_b, trees_a = _run_both(draft, shape)
    for batched, alone in zip(trees_b, trees_a):
        for b, a in zip(batched, alone):
            assert (b.tokens, b.parents) == (a.tokens, a.parents)
            assert b.probs == pytest.approx(a.probs, rel=1e-4, abs=1e-6)
            assert len(b) > 1


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
def test_deferred_step0_caught_up_in_one_forward_is_what_each_row_gets_alone(tiny_target, pool):
    """Drafting backed off for rounds 1-3: each row's anchors wait in its backlog, then one
    forward over all of them leaves caches, pool and anchor as the eager extensions would."""
    draft = make_draft(tiny_target, pool)
    with torch.inference_mode():
        batched, _, trees_b, trees_a = _run_both(draft, TreeShape(3, 3, 2, 8), deferred=(1, 2, 3))
    assert len(trees_b) == len(CHUNKS[0]) - 3
    for batched_trees, alone_trees in zip(trees_b, trees_a):
        for b, a in zip(batched_trees, alone_trees):
            assert (b.tokens, b.parents) == (a.tokens, a.parents)
            assert b.probs == pytest.approx(a.probs, rel=1e-4, abs=1e-6)


def test_a_rows_pool_is_never_read_by_another_row(tiny_target):
    """Fill every other row's pool with row 0's own query state (cosine 1, positions inside
    row 0's window): row 0's trees, fused states and pool candidates do not change."""
    draft = make_draft(tiny_target, True)
    shape = TreeShape(3, 2, 2, 6)
    with torch.inference_mode():
        batched, _, trees_b, _ = _run_both(draft, shape)
        before = TokenTree.rooted_at(5)
        draft_trees(draft, batched, slice(0, 3), [before, TokenTree.rooted_at(5), TokenTree.rooted_at(5)], shape)
        context = torch.randint(0, V, (64,))
        follow = pool_continuation(batched.row(0), context, 64, 8, 0.0)
        anchor = batched.anchor_pos[0]
        for other in (1, 2):
            batched.pool.states[other] = batched.pending[0].expand_as(batched.pool.states[other]) * 3.0
            batched.pool.units[other] = unit(batched.pool.states[other])
            batched.pool.positions[other] = torch.arange(anchor - 1, anchor - 1 - batched.pool.size, -1)
        after = TokenTree.rooted_at(5)
        draft_trees(draft, batched, slice(0, 3), [after, TokenTree.rooted_at(5), TokenTree.rooted_at(5)], shape)
        assert (after.tokens, after.parents) == (before.tokens, before.parents)
        assert after.probs == pytest.approx(before.probs, rel=1e-5)
        assert pool_continuation(batched.row(0), context, 64, 8, 0.0) == follow
        # and the poisoned rows do read their own (poisoned) pools: the test can fail
        assert pool_continuation(batched.row(1), context, 64, 8, 0.0) != []


def test_a_freed_slot_starts_with_an_empty_pool(tiny_target):
    draft = make_draft(tiny_target, True)
    with torch.inference_mode():
        batched, alone, _, _ = _run_both(draft, TreeShape(1, 3, 1, 3))
        batched.move_row(2, 0)  # row 0 left: the last row takes its slot
        assert batched.lengths[0] == alone[2].length and batched.lengths[2] == 0
        assert sorted(batched.pool.positions[0].tolist()) == sorted(alone[2].pool.positions[0].tolist())
        assert int(batched.pool.count[2]) == 0 and batched.anchor_pos[2] == -1
        aux, ids = _features(9, 6)
        extend_rows(draft, batched, slice(2, 3), aux, ids[:, 1:], [6])  # a new request in the freed slot
        fresh = DraftState(draft)
        draft_extend(draft, fresh, aux, ids[:, 1:], 0)
        torch.testing.assert_close(batched.anchor_state[2], fresh.anchor_state[0], atol=2e-5, rtol=1e-4)
        assert sorted(batched.pool.positions[2].tolist()) == sorted(fresh.pool.positions[0].tolist())
