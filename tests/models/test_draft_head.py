"""Draft head, state pool and α-gate: shapes, gradients, switches, and train/serve parity."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.errors import LyannaError
from lyanna_train.models.alpha_gate import AlphaGate, fuse
from lyanna_train.models.config import DraftConfig
from lyanna_train.models.draft_head import DraftHead
from lyanna_train.models.state_pool import StatePool, retrieve_causal, window_mask

H, V, VD = 32, 100, 24


def make_head(**overrides) -> DraftHead:
    torch.manual_seed(0)
    base = dict(target_hidden_size=H, vocab_size=V, draft_vocab_size=VD, hidden_size=H, intermediate_size=64,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, pool_size=128, pool_threshold=0.85)
    base.update(overrides)
    cfg = DraftConfig(**base)
    return DraftHead(cfg, torch.randperm(V)[:VD], torch.randn(V, H))


def test_shapes_and_gradients_reach_every_trainable_part():
    head = make_head(pool_threshold=-1.0)  # always retrieve, so the gate is exercised
    aux, ids = torch.randn(2, 12, 3 * H), torch.randint(0, V, (2, 12))
    outs = head.forward_unrolled(aux, ids, steps=3)
    assert [o.logits.shape for o in outs] == [(2, 12, VD)] * 3
    assert all(o.hidden.shape == (2, 12, H) for o in outs)
    assert float(outs[1].alpha.max()) <= 0.3 and bool(outs[1].hit[:, 1:].all()) and not bool(outs[0].hit[:, 0].any())
    sum(o.logits.square().mean() for o in outs).backward()
    for name, p in head.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert head.embed_weight.grad is None and "embed_weight" not in head.state_dict()


def test_the_targets_embedding_table_is_shared_not_copied():
    table = torch.randn(V, H)
    head = DraftHead(make_head().cfg, torch.randperm(V)[:VD], table)
    assert head.embed_weight.data_ptr() == table.data_ptr()
    ids = torch.randint(0, V, (2, 5))
    torch.testing.assert_close(head.embed(ids), table[ids], rtol=0, atol=0)


def test_lyanna_parts_switch_off():
    no_pool = make_head(pool_size=0)
    assert no_pool.gate is None and not no_pool.cfg.pool_enabled
    outs = no_pool.forward_unrolled(torch.randn(1, 5, 3 * H), torch.randint(0, V, (1, 5)), steps=2)
    assert float(outs[1].alpha.abs().sum()) == 0
    assert make_head(alpha_max=0.0).gate is None
    full = DraftHead(DraftConfig(target_hidden_size=H, vocab_size=V, draft_vocab_size=V, hidden_size=H, intermediate_size=64,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8), torch.arange(V), torch.randn(V, H))
    assert full.lm_head.weight.shape == (V, H) and torch.equal(full.hot_ids, torch.arange(V))
    assert make_head(other_bucket=True).lm_head.weight.shape == (VD + 1, H)
    with pytest.raises(LyannaError, match="minimum of 128"):
        make_head(pool_size=64)


def test_alpha_gate_bounds_and_fusion_formula():
    gate = AlphaGate(H, 16, alpha_max=0.3)
    cur, ret = torch.randn(50, H) * 100, torch.randn(50, H)
    alpha = gate(cur, ret, torch.rand(50))
    assert alpha.shape == (50,) and bool(((alpha >= 0) & (alpha <= 0.3)).all())
    torch.testing.assert_close(fuse(cur, ret, alpha), alpha[:, None] * ret + (1 - alpha[:, None]) * cur)


def test_causal_window_retrieval_matches_brute_force():
    torch.manual_seed(1)
    states = torch.randn(2, 300, H)
    queries = torch.randn(2, 300, H)
    sim, got = retrieve_causal(queries, states, window=128)
    for b in range(2):
        for t in (0, 1, 5, 127, 128, 200, 299):
            lo = max(0, t - 128)
            if t == 0:
                assert sim[b, t] == float("-inf")
                continue
            cos = torch.nn.functional.cosine_similarity(queries[b, t][None], states[b, lo:t], dim=-1)
            assert torch.isclose(sim[b, t], cos.max(), atol=1e-5)
            torch.testing.assert_close(got[b, t], states[b, lo + int(cos.argmax())])
    assert window_mask(4, 2).tolist() == [[False] * 4, [True, False, False, False],
                                          [True, True, False, False], [False, True, True, False]]


@pytest.mark.parametrize("pool,variant", [("on", "plain"), ("off", "plain"), ("on", "normed")])
@pytest.mark.slow
def test_training_forward_equals_step_by_step_serving(pool, variant):
    """Chain drafting with a KV cache and a ring-buffer pool gives the training logits,
    for every unroll step (training-time test included) and across the pool window;
    also with the normed residual and a feature scale before fc."""
    normed = (dict(norm_before_residual=True, aux_scale=True, norm_before_fc=True, norm_output=True)
              if variant == "normed" else {})
    head = make_head(pool_threshold=0.0 if pool == "on" else 0.85, pool_size=128 if pool == "on" else 0, **normed).eval()
    if normed:
        with torch.no_grad():
            head.aux_scale.uniform_(0.1, 2.0)
            head.input_norm.weight.uniform_(0.5, 2.0)
            head.norm.weight.uniform_(0.5, 2.0)
    torch.manual_seed(2)
    b, t, steps = 2, 140, 3
    aux, ids = torch.randn(b, t, 3 * H), torch.randint(0, V, (b, t))
    with torch.no_grad():
        train = head.forward_unrolled(aux, ids, steps)
        pool_buf = StatePool(b, 128, H)
        keys, values = torch.zeros(b, 2, t + steps, 8), torch.zeros(b, 2, t + steps, 8)  # preallocated, written in place
        for anchor in range(t - steps - 1):
            pos = torch.full((b, 1), anchor)
            current = head.forward_cached(head.fuse_features(aux[:, anchor:anchor + 1]), ids[:, anchor + 1:anchor + 2],
                                          pos, keys, values, anchor, torch.ones(b, 1, 1, anchor + 1, dtype=torch.bool))
            state = current
            for j in range(steps):
                if j:  # the chain's keys go to the slots after the anchor's, overwritten by the next anchor
                    current = head.forward_cached(head.carry(state), ids[:, anchor + 1 + j:anchor + 2 + j], pos + j,
                                                  keys, values, anchor + j,
                                                  torch.ones(b, 1, 1, anchor + j + 1, dtype=torch.bool))
                if head.gate is not None:
                    sim, retrieved = pool_buf.retrieve(current, pos)
                    state, _, _ = head.pool_fuse(current, sim, retrieved)
                else:
                    state = current
                torch.testing.assert_close(head.score(state)[:, 0], train[j].logits[:, anchor], atol=2e-5, rtol=1e-4)
                if j == 0:
                    step0 = current
            if head.gate is not None:  # pushed after the chain: drafting from t sees exactly [t-128, t-1]
                pool_buf.push(step0, pos)
        if head.gate is not None:
            assert bool(train[0].hit[:, 130:].all())  # the window was full and used
