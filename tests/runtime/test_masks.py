"""Masks in the form each attention implementation reads: eager adds the mask, SDPA reads
a bool one, sliding-window layers get their window; checked against the target's plain
forward (transformers' own masks), and targets that cannot be served refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lyanna_train.runtime.verification.ragged_cache import RaggedCache
from lyanna_train.runtime.verification import masks
from lyanna_train.runtime.verification.masks import MaskForm, UnsupportedTarget, layer_windows, ragged_mask
from lyanna_train.runtime.verification.target_step import check_target_masks, ragged_forward
from lyanna_train.runtime.token_tree import TokenTree

SEQ = [3, 17, 29, 41, 5, 88, 120, 7, 64, 33, 201, 9, 14, 150]


def _target(kind: str, impl: str, window: int = 4):
    """A tiny random target of ``kind`` under attention ``impl`` (sliding kinds: a small window)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, \
        MistralForCausalLM

    shapes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, pad_token_id=0)
    config, model = {"llama": (LlamaConfig(**shapes), LlamaForCausalLM),
                     "mistral": (MistralConfig(**shapes, sliding_window=window), MistralForCausalLM),
                     "gemma2": (Gemma2Config(**shapes, head_dim=16, sliding_window=window), Gemma2ForCausalLM)}[kind]
    torch.manual_seed(0)
    return model._from_config(config, attn_implementation=impl).eval().requires_grad_(False)


def _plain(target, seq) -> torch.Tensor:
    with torch.inference_mode():
        return target(torch.tensor([seq]), use_cache=False).logits[0]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_tree_verified_after_the_cache_scores_each_node_after_its_own_path(impl):
    """A tree verify under eager attention: a bool tree mask handed to eager attention
    masks nothing and every node sees its siblings (what made Gemma2 decode wrongly)."""
    target = _target("llama", impl)
    past = 8
    tree = TokenTree.rooted_at(SEQ[past])
    a = tree.add_path(SEQ[past + 1:past + 4])  # the true continuation
    tree.add_path([77, 78], parent=a[0])  # a sibling branch
    with torch.inference_mode():
        cache = RaggedCache.for_model(target, 1)
        offsets = cache.begin(slice(0, 1), past)
        ragged_forward(target, None, cache, torch.tensor([SEQ[:past]]), torch.arange(past)[None],
                       ragged_mask(offsets, torch.arange(-1, past - 1)[None], past))
        cache.advance(0, past)
        offsets = cache.begin(slice(0, 1), len(tree))
        logits, _ = ragged_forward(target, None, cache, torch.tensor([tree.tokens]), past + torch.tensor([tree.depths]),
                                   ragged_mask(offsets, torch.tensor([tree.parents]), cache.plan.kv_length))
    plain = _plain(target, SEQ[:past + 4])
    torch.testing.assert_close(logits[0, :4], plain[past:past + 4], atol=1e-4, rtol=1e-4)
    branch = _plain(target, SEQ[:past + 2] + [77, 78])
    torch.testing.assert_close(logits[0, 4:6], branch[past + 2:past + 4], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,impl", [("llama", "eager"), ("llama", "sdpa"), ("mistral", "eager"),
                                       ("mistral", "sdpa"), ("gemma2", "eager")])
def test_ragged_rows_score_like_the_plain_forward(kind, impl):
    """Two rows at different lengths, prefilled in chunks, then one fused ragged forward:
    every logit equals the plain forward's, past the sliding window too."""
    target = _target(kind, impl)
    cache = RaggedCache.for_model(target, 2, capacity=8)
    plain = _plain(target, SEQ)
    cut = (9, 6)
    with torch.inference_mode():
        for row, n in enumerate(cut):
            offsets = cache.begin(slice(row, row + 1), n)
            out, _ = ragged_forward(target, None, cache, torch.tensor([SEQ[:n]]), torch.arange(n)[None],
                                    ragged_mask(offsets, torch.arange(-1, n - 1)[None], n))
            torch.testing.assert_close(out[0], plain[:n], atol=1e-4, rtol=1e-4)
            cache.advance(row, n)
        width = len(SEQ) - min(cut)
        tokens = torch.zeros(2, width, dtype=torch.long)
        parents = torch.full((2, width), -1)
        for row, n in enumerate(cut):
            tokens[row, :len(SEQ) - n] = torch.tensor(SEQ[n:])
            parents[row, :len(SEQ) - n] = torch.arange(-1, len(SEQ) - n - 1)
        offsets = cache.begin(slice(0, 2), width)
        out, _ = ragged_forward(target, None, cache, tokens, offsets[:, None] + torch.arange(width),
                                ragged_mask(offsets, parents, cache.plan.kv_length))
    for row, n in enumerate(cut):
        torch.testing.assert_close(out[row, :len(SEQ) - n], plain[n:], atol=1e-4, rtol=1e-4)


def test_each_implementation_gets_its_form_and_each_layer_kind_its_window():
    eager, sdpa, gemma2 = _target("llama", "eager"), _target("llama", "sdpa"), _target("gemma2", "eager")
    allowed = torch.tensor([[True, False, True]])[None, None]  # [1, 1, 1, 3]
    q, k = torch.tensor([[10]]), torch.tensor([[0, 5, 10]])
    assert MaskForm.of(sdpa).build(allowed, q, k).dtype == torch.bool
    additive = MaskForm.of(eager).build(allowed, q, k)
    assert additive.dtype == torch.float32 and additive[0, 0, 0].tolist() == [0.0, torch.finfo().min, 0.0]
    by_kind = MaskForm.of(gemma2).build(allowed, q, k)  # window 4: position 0 is out of reach from 10
    assert set(by_kind) == {"full_attention", "sliding_attention"}
    assert by_kind["full_attention"][0, 0, 0, 0] == 0 and by_kind["sliding_attention"][0, 0, 0, 0] < -1e30


def test_targets_the_runtime_cannot_mask_are_refused_by_name(monkeypatch):
    target = _target("llama", "sdpa")
    monkeypatch.setattr(target.config, "_attn_implementation", "flash_attention_2")
    with pytest.raises(UnsupportedTarget, match="flash_attention_2.*attn_implementation='sdpa'"):
        MaskForm.of(target)
    monkeypatch.setattr(target.config, "_attn_implementation", "flex_attention")
    with pytest.raises(UnsupportedTarget, match="flex_attention.*CPU"):  # its CPU kernel does not compile here
        MaskForm.of(target)
    monkeypatch.setattr(target.config, "layer_types", ["full_attention", "linear_attention"] * 2, raising=False)
    with pytest.raises(UnsupportedTarget, match="linear_attention"):
        layer_windows(target.config)
    with pytest.raises(UnsupportedTarget, match="linear_attention"):
        RaggedCache.for_model(target, 2)


@pytest.mark.parametrize("kind,impl", [("llama", "eager"), ("mistral", "sdpa"), ("gemma2", "eager")])
def test_the_start_check_refuses_a_mask_the_attention_misreads(kind, impl, monkeypatch):
    """check_target_masks passes the real forms and refuses a bool mask under eager and a
    dropped sliding window: what would have decoded wrongly, refused before decoding."""
    target = _target(kind, impl)
    check_target_masks(target)
    target._lyanna_masks_checked = False
    broken = dataclasses.replace(MaskForm.of(target), windows=tuple((k, None) for k, _ in MaskForm.of(target).windows))
    if impl == "eager":
        broken = dataclasses.replace(broken, additive=False)  # a bool mask handed to eager attention
    monkeypatch.setattr(masks.MaskForm, "of", classmethod(lambda cls, model: broken))
    with pytest.raises(UnsupportedTarget, match="would not be lossless"):
        check_target_masks(target)
