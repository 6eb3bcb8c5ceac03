"""The serving pool's kept unit vectors: retrieval with them is retrieval without them."""

from __future__ import annotations

import torch

from lyanna_train.models.state_pool import EMPTY, StatePool, best_match, unit


def test_kept_units_follow_pushes_evictions_and_row_views():
    torch.manual_seed(0)
    pool = StatePool(2, 8, 16)
    for step in range(5):  # 15 pushes per row into 8 slots: evictions
        pool.push(torch.randn(2, 3, 16) * 40, torch.arange(3 * step, 3 * step + 3).expand(2, 3))
    torch.testing.assert_close(pool.units, unit(pool.states), rtol=0, atol=0)
    view = pool.rows(slice(1, 2))
    view.push(torch.randn(1, 2, 16), torch.tensor([[15, 16]]))
    torch.testing.assert_close(pool.units, unit(pool.states), rtol=0, atol=0)


def test_retrieval_with_extras_is_retrieval_over_the_concatenation():
    """What the pool plus a not-yet-pushed chunk return equals best_match over both,
    ties to the pool's slot (it comes first), with the kept units or without them."""
    torch.manual_seed(1)
    pool = StatePool(3, 16, 24)
    pool.push(torch.randn(3, 12, 24), torch.arange(12).expand(3, 12))
    queries = torch.randn(3, 4, 24)
    queries[0, 0] = pool.states[0, 5] * 2  # the pool's slot and ...
    extra = torch.randn(3, 5, 24)
    extra[0, 1] = pool.states[0, 5] * 4  # ... an extra with exactly its direction (x4 is exact): a tie
    extra_pos = torch.arange(12, 17).expand(3, 5).clone()
    extra_pos[2] = EMPTY  # row 2: no extras
    anchors = torch.tensor([14, 15, 16, 17]).expand(3, 4)
    sim, got = pool.retrieve(queries, anchors, extra, extra_pos)
    states = torch.cat([pool.states, extra], dim=1)
    positions = torch.cat([pool.positions, extra_pos], dim=1)
    want_sim, want = best_match(queries, states, pool.window(anchors, positions))
    torch.testing.assert_close(sim, want_sim, rtol=0, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(got[0, 0], pool.states[0, 5])


def test_most_similar_is_the_best_in_the_window_or_nothing():
    pool = StatePool(1, 4, 8)
    query = torch.ones(8)
    assert pool.most_similar(query, 3) == (float("-inf"), EMPTY)  # empty pool
    pool.push(torch.stack([-query, query * 0.5, query.flip(0) * torch.arange(8.0)])[None], torch.tensor([[0, 1, 2]]))
    sim, position = pool.most_similar(query, 3)
    assert position == 1 and abs(sim - 1.0) < 1e-6
    assert pool.most_similar(query, 10)[1] == EMPTY  # every pooled position is out of the window (size 4)
