"""Chain speculative decoding on a tiny random Llama: lossless against target.generate,
roll-back at every cut, and the draft's serving steps against its training forward."""

from __future__ import annotations

import math

import pytest
import torch

from lyanna_train.runtime import chain
from lyanna_train.runtime.draft_step import DraftState, draft_chain, draft_extend
from lyanna_train.data.features import LayerCapture
from lyanna_train.runtime.target_step import crop_cache, target_prefill, verify

from .conftest import LAYER_IDS, V, greedy_reference, make_draft, oracle_chain

PROMPTS = [[1, 17, 200, 5, 99, 42, 7, 130, 64], [1], [1, 250, 3, 3, 3, 3, 8, 160, 77, 21, 90, 45, 12, 199, 31, 2]]
MAX_NEW = 24


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
@pytest.mark.parametrize("depth", [0, 1, 3, 5])
def test_lossless_against_target_generate(tiny_target, pool, depth):
    draft = make_draft(tiny_target, pool)
    for prompt in PROMPTS:
        ref = greedy_reference(tiny_target, prompt, MAX_NEW)
        out = chain.generate(tiny_target, draft, prompt, MAX_NEW, depth, eos_ids=(), layer_ids=LAYER_IDS)
        assert out.tokens == ref
        assert out.target_forwards == 1 + len(out.accept_lengths)
        assert 1 + sum(out.accept_lengths) >= len(out.tokens) > sum(out.accept_lengths)  # only the last is cut
        assert all(1 <= tau <= depth + 1 for tau in out.accept_lengths)


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_perfect_draft_accepts_everything(tiny_target, monkeypatch, depth):
    prompt = PROMPTS[0]
    full = prompt + greedy_reference(tiny_target, prompt, MAX_NEW + depth + 1)
    monkeypatch.setattr(chain, "draft_chain", oracle_chain(full))
    out = chain.generate(tiny_target, make_draft(tiny_target, True), prompt, MAX_NEW, depth, eos_ids=(), layer_ids=LAYER_IDS)
    assert out.tokens == full[len(prompt):len(prompt) + MAX_NEW]
    assert out.accept_lengths == [depth + 1] * math.ceil((MAX_NEW - 1) / (depth + 1))
    assert out.mean_acceptance == MAX_NEW / out.target_forwards


def test_roll_back_at_every_cut(tiny_target, monkeypatch):
    """The oracle is right for 0..depth tokens in turn: the caches must roll back to each cut."""
    prompt, depth = PROMPTS[2], 4
    schedule = [0, 3, 1, 4, 2, 0, 4, 1, 3]
    full = prompt + greedy_reference(tiny_target, prompt, 40 + depth + 1)
    oracle = oracle_chain(full, good=lambda i: schedule[i % len(schedule)])
    monkeypatch.setattr(chain, "draft_chain", oracle)
    for pool in (True, False):
        oracle.calls.clear()
        out = chain.generate(tiny_target, make_draft(tiny_target, pool), prompt, 40, depth, eos_ids=(), layer_ids=LAYER_IDS)
        assert out.tokens == full[len(prompt):len(prompt) + 40]
        assert out.accept_lengths == [schedule[i % len(schedule)] + 1 for i in range(len(out.accept_lengths))]
        assert oracle.calls == [len(prompt) + 1 + sum(out.accept_lengths[:i]) for i in range(len(oracle.calls))]


def test_stops_after_eos_even_inside_an_accepted_run(tiny_target, monkeypatch):
    prompt = PROMPTS[0]
    ref = greedy_reference(tiny_target, prompt, MAX_NEW)
    stop = next(i for i in range(6, MAX_NEW) if ref[i] not in ref[:i])
    expected = greedy_reference(tiny_target, prompt, MAX_NEW, eos=ref[stop])
    assert expected == ref[:stop + 1]
    draft = make_draft(tiny_target, True)
    assert chain.generate(tiny_target, draft, prompt, MAX_NEW, 3, eos_ids=[ref[stop]], layer_ids=LAYER_IDS).tokens == expected
    # eos_ids=None stops where target.generate would, from the target's generation_config
    monkeypatch.setattr(tiny_target.generation_config, "eos_token_id", ref[stop])
    assert chain.generate(tiny_target, draft, prompt, MAX_NEW, 3, layer_ids=LAYER_IDS).tokens == expected
    monkeypatch.setattr(chain, "draft_chain", oracle_chain(prompt + ref + [0] * 8))
    out = chain.generate(tiny_target, draft, prompt, MAX_NEW, 5, eos_ids=[ref[stop]], layer_ids=LAYER_IDS)
    assert out.tokens == expected and max(out.accept_lengths) == 6


def test_verify_scores_like_one_forward_and_crop_rolls_back(tiny_target):
    """verify's argmax/aux equal a cache-free forward over the whole sequence; after a
    crop, the next verify continues as if the rejected tokens were never seen."""
    capture = LayerCapture(tiny_target, LAYER_IDS)
    seq = torch.tensor([PROMPTS[0] + [11, 12, 13, 14]])
    with torch.inference_mode():
        with capture:
            full = tiny_target(seq, use_cache=False).logits.argmax(-1)
        full_aux = capture.aux()
        cache, nxt, aux = target_prefill(tiny_target, capture, seq[:, :6])
        assert int(nxt) == int(full[0, 5]) and torch.allclose(aux, full_aux[:, :6], atol=1e-4, rtol=1e-4)
        argmax, aux = verify(tiny_target, capture, cache, seq[:, 6:7], torch.tensor([[99, 98]]))  # wrong drafts
        crop_cache(cache, 7)
        argmax, aux = verify(tiny_target, capture, cache, seq[:, 7:8], seq[:, 8:])
        assert cache.get_seq_length() == seq.shape[1]
        assert torch.equal(argmax, full[:, 7:]) and torch.allclose(aux, full_aux[:, 7:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
def test_draft_steps_equal_the_training_forward(tiny_target, pool):
    """Chunked step 0 (prefill, then accepted runs of any length, past the 128-state pool
    window) followed by a chain gives, at every step, the logits forward_unrolled trains on
    when the drafted tokens are taken as the sequence."""
    draft, depth = make_draft(tiny_target, pool), 5
    torch.manual_seed(3)
    chunks = (131, 1, 4, 2, 1, 5) + (1,) * 24 + (3,) * 4  # many anchors near the window's edge
    total = sum(chunks) + depth + 1
    aux, ids = torch.randn(1, total, 3 * 64), torch.randint(0, V, (1, total))
    state = DraftState(draft, capacity=8)  # small: growth is exercised too
    start = 0
    with torch.no_grad():
        for chunk in chunks:
            draft_extend(draft, state, aux[:, start:start + chunk], ids[:, start + 1:start + chunk + 1], start)
            start += chunk
            t = start - 1
            tokens, logits = draft_chain(draft, state, depth)
            assert state.length == start and state.anchor_pos == t
            seq = torch.cat([ids[:, :t + 2], tokens[:, :-1]], dim=1)  # drafted tokens as the continuation
            train = draft.forward_unrolled(aux[:, :seq.shape[1]], seq, depth)
            for j in range(depth):
                torch.testing.assert_close(logits[:, j], train[j].logits[:, t], atol=2e-5, rtol=1e-4)
            assert torch.equal(tokens, draft.draft_to_target(torch.stack([s.logits[:, t] for s in train], 1).argmax(-1)))
            if pool:
                assert bool(train[1].hit[:, t])  # fusion really took part
                # exactly the training window [t - 128, t - 1]: the anchor itself is held back
                assert sorted(state.pool.positions[0].tolist()) == list(range(t - 128, t))
            seen = spy_on_retrieval(state)
            again, _ = draft_chain(draft, state, depth)
            assert torch.equal(again, tokens)  # the chain left the cache and the pool as they were
            assert seen == ([[[t]]] * (depth - 1) if pool else [])  # steps >= 1 retrieve for the anchor's window


def spy_on_retrieval(state: DraftState) -> list:
    """Record the anchor positions of every pool retrieval (the window's edge is too
    rarely the best match for the logits comparison alone to catch a shifted window)."""
    seen = []
    if state.pool is not None:
        real = type(state.pool).retrieve.__get__(state.pool)

        def retrieve(queries, anchors, *args, **kwargs):
            seen.append(anchors.tolist())
            return real(queries, anchors, *args, **kwargs)

        state.pool.retrieve = retrieve
    return seen


def test_draft_and_target_layers_must_fit(tiny_target):
    with pytest.raises(ValueError, match="fc reads"):
        chain.generate(tiny_target, make_draft(tiny_target, False), [1, 2], 4, 2, layer_ids=(0, 1))
