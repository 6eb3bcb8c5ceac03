"""Speculative decoding on a tiny random Llama: lossless against target.generate for
chains, trees and prompt lookup -- through drafts fitted to the target (``tiny_fitted``),
so accepted draft nodes are what is checked -- roll-back at every cut, tree verify against
plain forwards, and the draft's serving steps against its training forward."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from lyanna_train.target.capture import LayerCapture
from lyanna_train.runtime import decode
from lyanna_train.runtime.decode import DecodeSettings, LookupSettings
from lyanna_train.runtime.draft_step import DraftState, draft_extend
from lyanna_train.runtime import draft_tree as draft_tree_module
from lyanna_train.runtime.draft_tree import TreeShape, draft_tree
from lyanna_train.runtime.target_step import keep_cache_positions, target_forward, verify_tree
from lyanna_train.runtime.tree import TokenTree, attention_mask

from .conftest import FIT_PROMPTS, LAYER_IDS, V, drafted_tokens, greedy_reference, make_draft, oracle_tree

PROMPTS = list(FIT_PROMPTS[:3])  # the fitted drafts know the target's continuations of these
MAX_NEW = 24
SHAPES = {"plain": TreeShape(0, 1, 1, 0), "chain1": TreeShape(1, 1, 1, 1), "chain5": TreeShape(5, 1, 1, 5),
          "tree": TreeShape(4, 3, 2, 10), "wide": TreeShape(3, 4, 4, 30)}


def settings(tree: TreeShape, lookup: LookupSettings = LookupSettings()) -> DecodeSettings:
    """Every candidate verified: node counts must not depend on this machine's timings."""
    return DecodeSettings(tree, lookup, verify="all")


def chain(depth: int) -> DecodeSettings:
    return settings(TreeShape(depth, 1, 1, depth))


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("lookup", [0, 4], ids=["draft", "draft+lookup"])
def test_lossless_against_target_generate(tiny_target, tiny_fitted, pool, shape, lookup):
    """Through a draft fitted to the target: its candidates are accepted, so every tree
    shape's verification, acceptance and roll-back of draft nodes is what is compared."""
    draft = tiny_fitted[pool]
    for prompt in PROMPTS:
        free = LookupSettings(lookup, branches=2, pool_tokens=lookup)  # prompt lookup and pool candidates
        out = decode.generate(tiny_target, draft, prompt, MAX_NEW, settings(SHAPES[shape], free),
                              eos_ids=(), layer_ids=LAYER_IDS)
        assert out.tokens == greedy_reference(tiny_target, prompt, MAX_NEW)
        assert out.target_forwards == 1 + len(out.accept_lengths) == 1 + len(out.tree_sizes)
        # only the last iteration's surplus is cut (the prefill gave one token)
        assert 1 + sum(out.accept_lengths[:-1]) < len(out.tokens) <= 1 + sum(out.accept_lengths)
        assert all(1 <= tau <= size for tau, size in zip(out.accept_lengths, out.tree_sizes))
        assert all(size <= 1 + SHAPES[shape].max_nodes + 3 * lookup for size in out.tree_sizes)
        if SHAPES[shape].depth:  # draft nodes were verified and kept (without lookup: only the draft's)
            assert drafted_tokens(out) >= MAX_NEW // 4, out.accept_lengths


def test_prompt_lookup_alone_is_lossless_and_accepts_on_repetition():
    """A small-initialised Llama falls into a loop at once: lookup must catch it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    looping = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, initializer_range=0.02,
                                           eos_token_id=None, pad_token_id=0)).eval()
    prompt = PROMPTS[0]
    out = decode.generate(looping, None, prompt, 60, settings(SHAPES["plain"], LookupSettings(6)), eos_ids=())
    assert out.tokens == greedy_reference(looping, prompt, 60)
    assert max(out.accept_lengths) == 7 and out.mean_acceptance > 1.5


@pytest.mark.parametrize("depth", [1, 3, 5])
@pytest.mark.parametrize("decoys", [0, 2])
def test_perfect_draft_accepts_everything(tiny_target, monkeypatch, depth, decoys):
    prompt = PROMPTS[0]
    full = prompt + greedy_reference(tiny_target, prompt, MAX_NEW + depth + 1)
    monkeypatch.setattr(decode, "draft_tree", oracle_tree(full, decoys=decoys))
    out = decode.generate(tiny_target, make_draft(tiny_target, True), prompt, MAX_NEW, chain(depth), eos_ids=(),
                          layer_ids=LAYER_IDS)
    assert out.tokens == full[len(prompt):len(prompt) + MAX_NEW]
    assert out.accept_lengths == [depth + 1] * math.ceil((MAX_NEW - 1) / (depth + 1))
    assert out.mean_acceptance == MAX_NEW / out.target_forwards


@pytest.mark.parametrize("decoys", [0, 2], ids=["chain", "tree"])
def test_roll_back_at_every_cut(tiny_target, monkeypatch, decoys):
    """The oracle is right for 0..depth tokens in turn, among decoy branches: the caches
    must roll back (or be gathered) to each accepted path."""
    prompt, depth = PROMPTS[2], 4
    schedule = [0, 3, 1, 4, 2, 0, 4, 1, 3]
    full = prompt + greedy_reference(tiny_target, prompt, 40 + depth + 1)
    oracle = oracle_tree(full, good=lambda i: schedule[i % len(schedule)], decoys=decoys)
    monkeypatch.setattr(decode, "draft_tree", oracle)
    for pool in (True, False):
        oracle.calls.clear()
        out = decode.generate(tiny_target, make_draft(tiny_target, pool), prompt, 40, chain(depth), eos_ids=(),
                              layer_ids=LAYER_IDS)
        assert out.tokens == full[len(prompt):len(prompt) + 40]
        assert out.accept_lengths == [schedule[i % len(schedule)] + 1 for i in range(len(out.accept_lengths))]
        assert oracle.calls == [len(prompt) + 1 + sum(out.accept_lengths[:i]) for i in range(len(oracle.calls))]


def test_stops_after_eos_even_inside_an_accepted_run(tiny_target, tiny_fitted, monkeypatch):
    prompt = PROMPTS[0]
    ref = greedy_reference(tiny_target, prompt, MAX_NEW)
    stop = next(i for i in range(6, MAX_NEW) if ref[i] not in ref[:i])
    expected = greedy_reference(tiny_target, prompt, MAX_NEW, eos=ref[stop])
    assert expected == ref[:stop + 1]
    draft = tiny_fitted[True]  # the eos lands inside runs of accepted draft tokens
    run = lambda depth, **kw: decode.generate(tiny_target, draft, prompt, MAX_NEW, chain(depth), layer_ids=LAYER_IDS, **kw)
    assert run(3, eos_ids=[ref[stop]]).tokens == expected
    # eos_ids=None stops where target.generate would, from the target's generation_config
    monkeypatch.setattr(tiny_target.generation_config, "eos_token_id", ref[stop])
    assert run(3).tokens == expected
    monkeypatch.setattr(decode, "draft_tree", oracle_tree(prompt + ref + [0] * 8))
    out = run(5, eos_ids=[ref[stop]])
    assert out.tokens == expected and max(out.accept_lengths) == 6


def test_streaming_sees_every_token_once(tiny_target, tiny_fitted):
    seen = []
    out = decode.generate(tiny_target, tiny_fitted[True], PROMPTS[2], 17,
                          settings(SHAPES["tree"], LookupSettings(3)), eos_ids=(), layer_ids=LAYER_IDS,
                          on_tokens=seen.extend)
    assert seen == out.tokens and len(seen) == 17
    assert max(out.accept_lengths) > 1  # some iterations streamed several accepted tokens at once


def test_tree_verify_scores_every_node_after_its_own_path(tiny_target):
    """One tree forward gives, at each node, the logits and features of a cache-free
    forward over the prompt plus that node's path; after keeping one path, the next
    forward continues as if the other branches were never seen."""
    capture = LayerCapture(tiny_target, LAYER_IDS)
    prompt = torch.tensor([PROMPTS[0]])
    tree = TokenTree.rooted_at(11)
    tree.add_path([12, 13, 14])
    tree.add_path([20, 21])
    tree.add_path([12, 30])
    tree.add(1, 31)
    with torch.inference_mode():
        cache = DynamicCache(config=tiny_target.config)
        target_forward(tiny_target, capture, cache, prompt)
        past = prompt.shape[1]
        logits, aux = verify_tree(tiny_target, capture, cache, torch.tensor([tree.tokens]),
                                  torch.tensor([tree.depths]), attention_mask(tree.parents, past))
        for node in range(len(tree)):
            path = tree.path_tokens(tree.ancestors(node))
            seq = torch.cat([prompt, torch.tensor([path])], dim=1)
            with capture:
                full = tiny_target(seq, use_cache=False).logits
            torch.testing.assert_close(logits[0, node], full[0, -1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(aux[0, node], capture.aux()[0, -1], atol=1e-4, rtol=1e-4)
        kept = tree.ancestors(7)  # root, 12, 30: not a prefix of the node order
        keep_cache_positions(cache, past, kept)
        assert cache.get_seq_length() == past + 3
        nxt = torch.tensor([[40, 41]])
        logits, _ = target_forward(tiny_target, capture, cache, nxt)
        seq = torch.cat([prompt, torch.tensor([tree.path_tokens(kept)]), nxt], dim=1)
        torch.testing.assert_close(logits[0], tiny_target(seq, use_cache=False).logits[0, -2:], atol=1e-4, rtol=1e-4)


NORMED = dict(norm_before_residual=True, norm_before_fc=True, norm_output=True, aux_scale=True)


@pytest.mark.parametrize("pool,variant", [(True, {}), (False, {}), (True, NORMED),
                                          (False, dict(fc_norm=True, norm_output=True))],
                         ids=["pool", "no-pool", "pool-normed", "no-pool-fc-norm"])
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
    state = DraftState(draft, capacity=8)  # small: growth is exercised too
    scored = []  # the logits of every state the drafting scores
    real_score_top = draft_tree_module.score_top

    def score_top(draft, fused, k):
        scored.append(draft.score(fused))
        return real_score_top(draft, fused, k)

    monkeypatch.setattr(draft_tree_module, "score_top", score_top)
    start = 0
    with torch.no_grad():
        for chunk in chunks:
            draft_extend(draft, state, aux[:, start:start + chunk], ids[:, start + 1:start + chunk + 1], start)
            start += chunk
            t = start - 1
            scored.clear()
            tree = TokenTree.rooted_at(int(ids[0, t + 1]))
            draft_tree(draft, state, tree, TreeShape(depth, 1, 1, depth))
            tokens = tree.tokens[1:]
            assert state.length == start and state.anchor_pos == t and len(tokens) == depth
            seq = torch.cat([ids[:, :t + 2], torch.tensor([tokens[:-1]])], dim=1)  # drafted tokens as the continuation
            train = draft.forward_unrolled(aux[:, :seq.shape[1]], seq, depth)
            for j in range(depth):
                torch.testing.assert_close(scored[j].reshape(-1), train[j].logits[0, t], atol=2e-5, rtol=1e-4)
            assert tokens == draft.draft_to_target(torch.stack([s.logits[0, t] for s in train]).argmax(-1)).tolist()
            if pool:
                assert bool(train[1].hit[:, t])  # fusion really took part
                # exactly the training window [t - 128, t - 1]: the anchor itself is held back
                assert sorted(state.pool.positions[0].tolist()) == list(range(t - 128, t))
            seen = spy_on_retrieval(state)
            again = TokenTree.rooted_at(tree.tokens[0])
            draft_tree(draft, state, again, TreeShape(depth, 1, 1, depth))
            assert again.tokens == tree.tokens  # drafting left the cache and the pool as they were
            assert seen == ([[[t]]] * (depth - 1) if pool else [])  # steps >= 1 retrieve for the anchor's window


def spy_on_retrieval(state: DraftState) -> list:
    """Record the anchor positions of every pool retrieval (the window's edge is too
    rarely the best match for the logits comparison alone to catch a shifted window)."""
    seen = []
    if state.pool is not None:
        real = type(state.pool).window.__get__(state.pool)

        def window(anchors, *args, **kwargs):
            seen.append(anchors.tolist())
            return real(anchors, *args, **kwargs)

        state.pool.window = window
    return seen


def test_tree_drafting_keeps_the_best_nodes_and_leaves_no_trace(tiny_target):
    """EAGLE-2-style selection: the kept nodes are the best by cumulative draft
    log-probability among those scored, closed under parents; drafting twice gives the
    same tree (scratch keys are not part of the cache)."""
    draft = make_draft(tiny_target, True)
    torch.manual_seed(5)
    aux, ids = torch.randn(1, 20, 3 * 64), torch.randint(0, V, (1, 21))
    state = DraftState(draft)
    with torch.no_grad():
        draft_extend(draft, state, aux, ids[:, 1:], 0)
        shape = TreeShape(depth=4, branch=3, beam=2, max_nodes=9)
        first, second = TokenTree.rooted_at(5), TokenTree.rooted_at(5)
        nodes = draft_tree(draft, state, first, shape)
        draft_tree(draft, state, second, shape)
    assert first.tokens == second.tokens and first.parents == second.parents
    assert len(nodes) == len(first) - 1 == 9
    assert max(first.depths) <= 4 and len(first.children[0]) <= 3
    assert all(len(c) <= 3 for c in first.children)
    assert state.length == 20 and state.scratch <= 20 + 2 * 4


def test_lossless_through_the_triton_kernels(tiny_target, tiny_fitted, monkeypatch):
    """The draft's hot paths (hot-vocabulary head + top-k, pool retrieval + α-fusion) run
    through the Triton kernels -- interpreted here, compiled on a GPU -- and decoding stays
    lossless with the same tree as the torch references give."""
    from lyanna_train.runtime import kernels

    if not kernels.interpreter_ready():
        pytest.skip("needs triton and TRITON_INTERPRET=1 from the start (tests/conftest.py sets it without CUDA)")
    draft = tiny_fitted[True]
    shape = settings(TreeShape(3, 2, 2, 6), LookupSettings(3))
    prompt = PROMPTS[2]
    reference = decode.generate(tiny_target, draft, prompt, 12, shape, eos_ids=(), layer_ids=LAYER_IDS)
    monkeypatch.setattr(kernels, "use_triton", lambda backend, *tensors: True)
    calls = {"hot_head_topk_triton": 0, "pool_fusion_triton": 0}
    for name in calls:
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name: calls.__setitem__(_name, calls[_name] + 1)
                            or _real(*a))
    out = decode.generate(tiny_target, draft, prompt, 12, shape, eos_ids=(), layer_ids=LAYER_IDS)
    assert out.tokens == reference.tokens == greedy_reference(tiny_target, prompt, 12)
    assert out.tree_sizes == reference.tree_sizes and drafted_tokens(out) >= 4  # kernel-drafted nodes kept
    assert calls["hot_head_topk_triton"] > 0 and calls["pool_fusion_triton"] > 0


def test_draft_confidence_is_calibrated_by_what_the_target_confirms(tiny_target):
    """A random draft is confident and always wrong: its probabilities get scaled down
    towards its (zero) acceptance, so the cost model stops verifying its candidates."""
    draft = make_draft(tiny_target, False)
    session = decode.prefill(tiny_target, draft, PROMPTS[0], chain(3), LAYER_IDS)
    with torch.inference_mode():
        for _ in range(6):
            tree = decode.propose(draft, session, chain(3))
            logits, aux = decode.verify(tiny_target, session, tree)
            decode.accept(draft, session, tree, logits, aux, chain(3).sampling)
    confirmed, predicted = session.estimates.draft
    assert predicted > 1.0 and session.estimates.draft_scale() == pytest.approx(confirmed / predicted)
    assert session.estimates.draft_scale() < 1.0
