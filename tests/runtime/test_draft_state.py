"""The draft's state and trees: its serving steps give the logits its training forward gives,
rows of a batch get what each gets in a state of its own (ragged step 0, deferred and
caught up, drafted alone or among rows that do not draft), and a row's pool is never read
by another row."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.models.state_pool import unit
from lyanna_train.runtime.drafting import state as state_module
from lyanna_train.runtime.drafting import tree as tree_module
from lyanna_train.runtime.drafting.pool_lookup import pool_continuation
from lyanna_train.runtime.drafting.state import BatchDraftState, catch_up_rows, extend_rows
from lyanna_train.runtime.drafting.tree import draft_trees
from lyanna_train.runtime.settings import TreeShape
from lyanna_train.runtime.token_tree import TokenTree

from .conftest import V, make_draft

# Per row: the accepted runs after the prompt chunk (rows accept different counts per iteration).
CHUNKS = [(7, 1, 3, 2, 1, 4), (2, 4, 1, 1, 2, 1), (12, 2, 2, 5, 1, 1)]
SHAPES = [TreeShape(1, 3, 1, 3), TreeShape(4, 1, 1, 4), TreeShape(3, 3, 2, 8)]


def _features(seed: int, n: int):
    torch.manual_seed(seed)
    return torch.randn(1, n, 3 * 64), torch.randint(0, V, (1, n + 1))


def _alone_extend(draft, state: BatchDraftState, aux, ids) -> None:
    extend_rows(draft, state, slice(0, 1), aux, ids, [ids.shape[1]])


def _alone_tree(draft, state: BatchDraftState, tree: TokenTree, shape: TreeShape) -> list[int]:
    return draft_trees(draft, state, slice(0, 1), [tree], shape)[0]


def _run_both(draft, shape: TreeShape, deferred: tuple[int, ...] = ()):
    """Feed every row its chunks through one BatchDraftState (all rows per call) and through
    a state of its own (one slot); after each round, draft a tree both ways -> (batched,
    alone) trees.
    Rounds in ``deferred`` go to the rows' backlog (no drafting); the next round catches
    up: row 1 on its own first, then all rows in one forward (row 1 with nothing left)."""
    rows = len(CHUNKS)
    data = [_features(r, sum(c) + 1) for r, c in enumerate(CHUNKS)]
    batched = BatchDraftState(draft, slots=rows, capacity=4)
    alone = [BatchDraftState(draft, slots=1, capacity=4) for _ in CHUNKS]
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
            _alone_extend(draft, alone[r], a[:, s:s + n], ids[:, s + 1:s + n + 1])
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
            _alone_tree(draft, alone[r], singles[r], shape)
        trees_a.append(singles)
        for r in range(rows):
            assert batched.lengths[r] == alone[r].lengths[0] and batched.anchor_pos[r] == alone[r].anchor_pos[0]
            torch.testing.assert_close(batched.anchor_state[r], alone[r].anchor_state[0], atol=2e-5, rtol=1e-4)
            if alone[r].pool is not None:
                torch.testing.assert_close(batched.pending[r], alone[r].pending[0], atol=2e-5, rtol=1e-4)
                assert sorted(batched.pool.positions[r].tolist()) == sorted(alone[r].pool.positions[0].tolist())
    return batched, alone, trees_b, trees_a


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
@pytest.mark.parametrize("shape", SHAPES, ids=["top3", "chain4", "tree"])
@pytest.mark.slow
def test_each_row_drafts_what_it_drafts_alone(tiny_target, pool, shape):
    draft = make_draft(tiny_target, pool)
    with torch.inference_mode():
        _, _, trees_b, trees_a = _run_both(draft, shape)
    for batched, alone in zip(trees_b, trees_a):
        for b, a in zip(batched, alone):
            assert (b.tokens, b.parents) == (a.tokens, a.parents)
            assert b.probs == pytest.approx(a.probs, rel=1e-4, abs=1e-6)
            assert len(b) > 1


@pytest.mark.parametrize("alone", [16, 7], ids=["padded", "long-alone"])
@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
def test_deferred_step0_caught_up_in_one_forward_is_what_each_row_gets_alone(tiny_target, pool, alone, monkeypatch):
    """Drafting backed off for rounds 1-3: each row's anchors wait in its backlog (7, 8 and
    10 anchors), then the catch-up leaves caches, pool and anchor as the eager extensions
    would: in one padded forward, or (``ALONE`` 7) rows 1 and 2 each in a forward of its own
    and row 0 in the padded one."""
    monkeypatch.setattr(state_module, "ALONE", alone)
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
        assert batched.lengths[0] == alone[2].lengths[0] and batched.lengths[2] == 0
        assert sorted(batched.pool.positions[0].tolist()) == sorted(alone[2].pool.positions[0].tolist())
        assert int(batched.pool.count[2]) == 0 and batched.anchor_pos[2] == -1
        aux, ids = _features(9, 6)
        extend_rows(draft, batched, slice(2, 3), aux, ids[:, 1:], [6])  # a new request in the freed slot
        fresh = BatchDraftState(draft, 1)
        _alone_extend(draft, fresh, aux, ids[:, 1:])
        torch.testing.assert_close(batched.anchor_state[2], fresh.anchor_state[0], atol=2e-5, rtol=1e-4)
        assert sorted(batched.pool.positions[2].tolist()) == sorted(fresh.pool.positions[0].tolist())


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
def test_rows_that_do_not_draft_ride_along_untouched(tiny_target, pool):
    """The policy drafts for rows 0 and 2 only: row 1, between them, is padding in the
    forwards — its backlog stays, its caches and pool are not touched — and rows 0 and 2
    get the trees they get when drafted with every row."""
    draft, shape = make_draft(tiny_target, pool), TreeShape(3, 3, 2, 8)
    with torch.inference_mode():
        batched, _, _, _ = _run_both(draft, shape)
        everyone = [TokenTree.rooted_at(5) for _ in CHUNKS]
        draft_trees(draft, batched, slice(0, 3), everyone, shape)
        aux, ids = _features(11, 3)
        batched.defer(slice(1, 2), aux, ids[:, 1:], [3])  # row 1 is behind: it is not drafting
        keys, length, anchor = batched.keys[1].clone(), batched.lengths[1], batched.anchor_state[1].clone()
        pooled = batched.pool.positions[1].clone() if pool else None
        catch_up_rows(draft, batched, slice(0, 3), only=[True, False, True])
        some = [TokenTree.rooted_at(5), None, TokenTree.rooted_at(5)]
        nodes = draft_trees(draft, batched, slice(0, 3), some, shape)
        assert nodes[1] == [] and batched.behind(1) and batched.lengths[1] == length
        assert torch.equal(batched.keys[1, :, :length], keys[:, :length])
        assert torch.equal(batched.anchor_state[1], anchor)
        if pool:
            assert torch.equal(batched.pool.positions[1], pooled)
        for r in (0, 2):
            assert (some[r].tokens, some[r].parents) == (everyone[r].tokens, everyone[r].parents)
            assert some[r].probs == pytest.approx(everyone[r].probs, rel=1e-5)
        catch_up_rows(draft, batched, slice(1, 2))
        assert not batched.behind(1) and batched.lengths[1] == length + 3


NORMED = dict(norm_before_residual=True, norm_before_fc=True, norm_output=True, aux_scale=True)


@pytest.mark.parametrize("pool,variant", [(True, {}), (False, {}), (True, NORMED),
                                          (False, dict(fc_norm=True, norm_output=True))],
                         ids=["pool", "no-pool", "pool-normed", "no-pool-fc-norm"])
@pytest.mark.slow
def test_draft_steps_equal_the_training_forward(tiny_target, pool, variant, monkeypatch):
    """Chunked step 0 (prefill, then accepted runs of any length, past the 128-state pool
    window) followed by chain drafting gives, at every step, the logits forward_unrolled
    trains on when the drafted tokens are taken as the sequence (also for the EAGLE-3
    variants: normed residual, normed features, normed carried state, feature scale)."""
    draft, depth = make_draft(tiny_target, pool, **variant), 5
    torch.manual_seed(3)
    chunks = (131, 1, 4, 2, 1, 5) + (1,) * 24 + (3,) * 4  # many anchors near the window's edge
    total = sum(chunks) + depth + 1
    aux, ids = torch.randn(1, total, 3 * 64), torch.randint(0, V, (1, total))
    state = BatchDraftState(draft, 1, capacity=8)  # small: growth is exercised too
    scored = []  # the logits of every state the drafting scores
    real_score_top = tree_module.score_top

    def score_top(draft, fused, k):
        scored.append(draft.score(fused))
        return real_score_top(draft, fused, k)

    monkeypatch.setattr(tree_module, "score_top", score_top)
    start = 0
    chain = TreeShape(depth, 1, 1, depth)
    with torch.no_grad():
        for chunk in chunks:
            _alone_extend(draft, state, aux[:, start:start + chunk], ids[:, start + 1:start + chunk + 1])
            start += chunk
            t = start - 1
            scored.clear()
            tree = TokenTree.rooted_at(int(ids[0, t + 1]))
            _alone_tree(draft, state, tree, chain)
            tokens = tree.tokens[1:]
            assert state.lengths[0] == start and state.anchor_pos[0] == t and len(tokens) == depth
            seq = torch.cat([ids[:, :t + 2], torch.tensor([tokens[:-1]])], dim=1)  # drafted tokens as the continuation
            train = draft.forward_unrolled(aux[:, :seq.shape[1]], seq, depth)
            for j in range(depth):
                torch.testing.assert_close(scored[j].reshape(-1), train[j].logits[0, t], atol=2e-5, rtol=1e-4)
            assert tokens == draft.draft_to_target(torch.stack([s.logits[0, t] for s in train]).argmax(-1)).tolist()
            if pool:
                assert bool(train[1].hit[:, t])  # fusion really took part
                # exactly the training window [t - 128, t - 1]: the anchor itself is held back
                assert sorted(state.pool.positions[0].tolist()) == list(range(t - 128, t))
            seen = _spy_on_retrieval(state, monkeypatch)
            again = TokenTree.rooted_at(tree.tokens[0])
            _alone_tree(draft, state, again, chain)
            assert again.tokens == tree.tokens  # drafting left the cache and the pool as they were
            assert seen == ([[[t]]] * (depth - 1) if pool else [])  # steps >= 1 retrieve for the anchor's window


def _spy_on_retrieval(state: BatchDraftState, monkeypatch) -> list:
    """Record the anchor positions of every pool retrieval from now on (the window's edge
    is too rarely the best match for the logits comparison alone to catch a shifted window)."""
    seen = []
    if state.pool is not None:
        real = type(state.pool).window

        def window(self, anchors, *args, **kwargs):
            seen.append(anchors.tolist())
            return real(self, anchors, *args, **kwargs)

        monkeypatch.setattr(type(state.pool), "window", window)
    return seen


def test_tree_drafting_keeps_the_best_nodes_and_leaves_no_trace(tiny_target):
    """EAGLE-2-style selection: the kept nodes are the best by cumulative draft
    log-probability among those scored, closed under parents; drafting twice gives the
    same tree (scratch keys are not part of the cache)."""
    draft = make_draft(tiny_target, True)
    torch.manual_seed(5)
    aux, ids = torch.randn(1, 20, 3 * 64), torch.randint(0, V, (1, 21))
    state = BatchDraftState(draft, 1)
    with torch.no_grad():
        _alone_extend(draft, state, aux, ids[:, 1:])
        shape = TreeShape(depth=4, branch=3, beam=2, max_nodes=9)
        first, second = TokenTree.rooted_at(5), TokenTree.rooted_at(5)
        nodes = _alone_tree(draft, state, first, shape)
        _alone_tree(draft, state, second, shape)
    assert first.tokens == second.tokens and first.parents == second.parents
    assert len(nodes) == len(first) - 1 == 9
    assert max(first.depths) <= 4 and len(first.children[0]) <= 3
    assert all(len(c) <= 3 for c in first.children)
    assert state.lengths[0] == 20
