"""One prompt through :func:`generate` (the scheduler's batch of one) on a tiny random Llama:
prompt lookup alone, a perfect draft, EOS inside an accepted run, streaming, the Triton
kernels, and the draft's calibration by what the target confirms. The lossless matrix
over tree shapes, pools and lookup is ``test_batch_decode.py``'s (batch 1 included)."""

from __future__ import annotations

import math

import pytest
import torch

from lyanna_train.runtime.drafting import propose
from lyanna_train.runtime.scheduling.scheduler import BatchDecoder, generate
from lyanna_train.runtime.settings import DecodeSettings, LookupSettings, TreeShape

from .conftest import FIT_PROMPTS, LAYER_IDS, V, drafted_tokens, greedy_reference, make_draft, oracle_trees

PROMPTS = list(FIT_PROMPTS[:3])  # the fitted drafts know the target's continuations of these
MAX_NEW = 24
NO_LOOKUP = LookupSettings(max_tokens=0, pool_tokens=0)  # the defaults propose lookup and pool candidates


def settings(tree: TreeShape, lookup: LookupSettings = NO_LOOKUP) -> DecodeSettings:
    """Every candidate verified: node counts must not depend on this machine's timings."""
    return DecodeSettings(tree, lookup, verify="all")


def chain(depth: int) -> DecodeSettings:
    return settings(TreeShape(depth, 1, 1, depth))


def _oracle(full, **kw):
    return oracle_trees(lambda slot: (full, 0), **kw)


def test_prompt_lookup_alone_is_lossless_and_accepts_on_repetition():
    """A small-initialised Llama falls into a loop at once: lookup must catch it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    looping = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, initializer_range=0.02,
                                           eos_token_id=None, pad_token_id=0)).eval()
    prompt = PROMPTS[0]
    out = generate(looping, None, prompt, 60, settings(TreeShape(0, 1, 1, 0), LookupSettings(6, pool_tokens=0)),
                   eos_ids=())
    assert out.tokens == greedy_reference(looping, prompt, 60)
    assert max(out.accept_lengths) == 7 and out.mean_acceptance > 1.5


@pytest.mark.parametrize("depth", [1, 3, 5])
@pytest.mark.parametrize("decoys", [0, 2])
@pytest.mark.slow
def test_perfect_draft_accepts_everything(tiny_target, monkeypatch, depth, decoys):
    prompt = PROMPTS[0]
    full = prompt + greedy_reference(tiny_target, prompt, MAX_NEW + depth + 1)
    oracle = _oracle(full, decoys=decoys)
    monkeypatch.setattr(propose, "draft_trees", oracle)
    out = generate(tiny_target, make_draft(tiny_target, True), prompt, MAX_NEW, chain(depth), eos_ids=(),
                   layer_ids=LAYER_IDS)
    assert out.tokens == full[len(prompt):len(prompt) + MAX_NEW]
    assert out.accept_lengths == [depth + 1] * math.ceil((MAX_NEW - 1) / (depth + 1))
    assert out.mean_acceptance == MAX_NEW / out.target_forwards
    # each drafting starts where the accepted tokens end
    assert oracle.calls[0] == [len(prompt) + 1 + sum(out.accept_lengths[:i]) for i in range(len(oracle.calls[0]))]


@pytest.mark.slow
def test_stops_after_eos_even_inside_an_accepted_run(tiny_target, tiny_fitted, monkeypatch):
    prompt = PROMPTS[0]
    ref = greedy_reference(tiny_target, prompt, MAX_NEW)
    stop = next(i for i in range(6, MAX_NEW) if ref[i] not in ref[:i])
    expected = greedy_reference(tiny_target, prompt, MAX_NEW, eos=ref[stop])
    assert expected == ref[:stop + 1]
    draft = tiny_fitted[True]  # the eos lands inside runs of accepted draft tokens
    run = lambda depth, **kw: generate(tiny_target, draft, prompt, MAX_NEW, chain(depth), layer_ids=LAYER_IDS, **kw)
    assert run(3, eos_ids=[ref[stop]]).tokens == expected
    # eos_ids=None stops where target.generate would, from the target's generation_config
    monkeypatch.setattr(tiny_target.generation_config, "eos_token_id", ref[stop])
    assert run(3).tokens == expected
    monkeypatch.setattr(propose, "draft_trees", _oracle(prompt + ref + [0] * 8))
    out = run(5, eos_ids=[ref[stop]])
    assert out.tokens == expected and max(out.accept_lengths) == 6


def test_streaming_sees_every_token_once(tiny_target, tiny_fitted):
    seen = []
    shape = settings(TreeShape(4, 3, 2, 10), LookupSettings(3, pool_tokens=0))
    out = generate(tiny_target, tiny_fitted[True], PROMPTS[2], 17, shape, eos_ids=(), layer_ids=LAYER_IDS,
                   on_tokens=seen.extend)
    assert seen == out.tokens and len(seen) == 17
    assert max(out.accept_lengths) > 1  # some iterations streamed several accepted tokens at once


def test_a_request_that_cannot_be_served_raises_its_reason(tiny_target):
    with pytest.raises(ValueError, match="empty prompt"):
        generate(tiny_target, None, [], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny_target, None, [1, 2], 0)
    with pytest.raises(ValueError, match="one prompt at a time"):
        generate(tiny_target, None, [[1, 2], [3, 4]], 4)


@pytest.mark.slow
def test_lossless_through_the_triton_kernels(tiny_target, tiny_fitted, monkeypatch):
    """The draft's hot paths (hot-vocabulary head + top-k, pool retrieval + α-fusion) run
    through the Triton kernels -- interpreted here, compiled on a GPU -- and decoding stays
    lossless with the same tree as the torch references give."""
    from lyanna_train.runtime import kernels

    if not kernels.interpreter_ready():
        pytest.skip("needs triton and TRITON_INTERPRET=1 from the start (tests/conftest.py sets it without CUDA)")
    draft = tiny_fitted[True]
    shape = settings(TreeShape(3, 2, 2, 6), LookupSettings(3, pool_tokens=0))
    prompt = PROMPTS[2]
    reference = generate(tiny_target, draft, prompt, 12, shape, eos_ids=(), layer_ids=LAYER_IDS)
    monkeypatch.setattr(kernels, "use_triton", lambda backend, *tensors: True)
    calls = {"hot_head_topk_triton": 0, "pool_fusion_triton": 0}
    for name in calls:
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name: calls.__setitem__(_name, calls[_name] + 1)
                            or _real(*a))
    out = generate(tiny_target, draft, prompt, 12, shape, eos_ids=(), layer_ids=LAYER_IDS)
    assert out.tokens == reference.tokens == greedy_reference(tiny_target, prompt, 12)
    assert out.tree_sizes == reference.tree_sizes and drafted_tokens(out) >= 4  # kernel-drafted nodes kept
    assert calls["hot_head_topk_triton"] > 0 and calls["pool_fusion_triton"] > 0


def test_draft_confidence_is_calibrated_by_what_the_target_confirms(tiny_target):
    """A random draft is confident and always wrong: its probabilities get scaled down
    towards its (zero) acceptance, and so does the row's head profile."""
    draft = make_draft(tiny_target, False)
    decoder = BatchDecoder(tiny_target, draft, chain(3), max_batch=1, eos_ids=(), layer_ids=LAYER_IDS)
    decoder.submit(PROMPTS[0], 40)
    decoder.step()
    estimates = decoder.rows[0].estimates
    for _ in range(6):
        decoder.step()
    confirmed, predicted = estimates.draft
    assert predicted > 1.0 and estimates.draft_scale() == pytest.approx(confirmed / predicted)
    assert estimates.draft_scale() < 1.0
    assert estimates.head_samples and all(sum(tree) < 1.0 for tree in estimates.head_samples)
