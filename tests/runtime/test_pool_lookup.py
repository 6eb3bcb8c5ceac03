"""Pool candidates: the continuation after the most similar pooled state, within the
training window and above the threshold, and verified losslessly."""

from __future__ import annotations

import torch

from lyanna_train.models.state_pool import StatePool
from lyanna_train.runtime.pricing.estimates import AcceptanceEstimates, POOL
from lyanna_train.runtime.scheduling.scheduler import generate
from lyanna_train.runtime.settings import DecodeSettings, LookupSettings, TreeShape
from lyanna_train.runtime.drafting.pool_lookup import pool_continuation

from .conftest import LAYER_IDS, drafted_tokens, greedy_reference


class _State:
    """The three things pool_continuation reads from a DraftState."""

    def __init__(self, pool, pending, anchor_pos):
        self.pool, self.pending, self.anchor_pos = pool, pending, anchor_pos


def _pool(states: torch.Tensor, positions: list[int], size: int = 8) -> StatePool:
    pool = StatePool(1, size, states.shape[-1])
    pool.push(states[None], torch.tensor([positions]))
    return pool


def test_follows_the_most_similar_state_in_the_window():
    torch.manual_seed(0)
    states = torch.randn(6, 16)
    pool = _pool(states, [10, 11, 12, 13, 14, 15])
    context = torch.arange(100, 120)  # x_i = 100 + i
    anchor = 16
    query = (states[2] + 0.05 * torch.randn(16))[None, None]  # close to position 12's state
    # position 12's state predicts x_14: the continuation is x_14, x_15, ... up to what is known
    assert pool_continuation(_State(pool, query, anchor), context, 18, 3, 0.85) == [114, 115, 116]
    assert pool_continuation(_State(pool, query, anchor), context, 16, 5, 0.85) == [114, 115]  # known ids only
    assert pool_continuation(_State(pool, -query, anchor), context, 18, 3, 0.85) == []  # below the threshold
    assert pool_continuation(_State(pool, query, anchor), context, 18, 0, 0.85) == []
    # an anchor whose window [t - 8, t - 1] no longer holds position 12 finds nothing there
    assert pool_continuation(_State(pool, query, 21), context, 20, 3, 0.85) == []
    assert pool_continuation(_State(None, query, anchor), context, 18, 3, 0.85) == []
    assert pool_continuation(_State(pool, None, anchor), context, 18, 3, 0.85) == []


def test_pool_candidates_are_verified_losslessly_and_counted(tiny_target, tiny_fitted, monkeypatch):
    draft = tiny_fitted[True]  # threshold 0: something is always proposed; fitted: its nodes are accepted
    proposed = []
    real = AcceptanceEstimates.proposed_lookup
    monkeypatch.setattr(AcceptanceEstimates, "proposed_lookup",
                        lambda self, n, cont: (proposed.append((n, list(cont))), real(self, n, cont)))
    prompt = [1, 17, 200, 5, 99, 42, 7, 130, 64]
    settings = DecodeSettings(TreeShape(2, 2, 1, 3), LookupSettings(0, pool_tokens=5), verify="all")
    out = generate(tiny_target, draft, prompt, 30, settings, eos_ids=(), layer_ids=LAYER_IDS)
    assert out.tokens == greedy_reference(tiny_target, prompt, 30)
    pool_runs = [cont for n, cont in proposed if n == POOL]
    assert len(pool_runs) == len(out.accept_lengths) and all(1 <= len(c) <= 5 for c in pool_runs)
    assert max(out.tree_sizes) > 1 + 3  # the pool's run joined the draft's nodes
    assert drafted_tokens(out) >= 8  # and candidates were accepted, so the caches rolled past them
