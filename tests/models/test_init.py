"""Initialisation from the target: each part computes what the target's own weights compute."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lyanna_train.errors import LyannaError
from lyanna_train.models.config import DraftConfig
from lyanna_train.models.draft_head import DraftHead
from lyanna_train.models.init import init_from_target

V, VD = 120, 30


def tiny_target(hidden=32):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, rope_theta=5000.0, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so copying them is visible
        model.model.norm.weight.uniform_(0.5, 2.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 2.0)
            layer.post_attention_layernorm.weight.uniform_(0.5, 2.0)
    return model


def draft_for(target, **overrides) -> DraftHead:
    torch.manual_seed(1)
    cfg = DraftConfig.from_target(target.config, VD, pool_size=0, alpha_max=0.0, **overrides)
    return DraftHead(cfg, torch.randperm(V)[:VD], target.get_input_embeddings().weight)


def test_lm_head_init_scores_a_copied_state_like_the_target_over_the_hot_rows():
    target = tiny_target()
    draft = init_from_target(draft_for(target), target, lm_head=True)
    state = torch.randn(5, 32) * 3
    with torch.no_grad():
        expected = target.lm_head(target.model.norm(state))[:, draft.hot_ids]
        torch.testing.assert_close(draft.score(state), expected, rtol=1e-5, atol=1e-5)


def test_layer_init_makes_the_draft_layer_the_target_layer_on_a_state_sequence():
    """With fc passing the top feature through and the embedding half at zero, step 0 over a
    sequence is target layer L applied to that sequence (same attention, rotary, MLP, norms)."""
    target = tiny_target()
    draft = init_from_target(draft_for(target, num_aux_layers=2), target, lm_head=True, layer=1, fc="top_layer")
    states = torch.randn(2, 9, 32)
    aux = torch.cat([torch.randn(2, 9, 32), states], dim=-1)  # the lower layer's block is ignored by fc
    ids = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        step0 = draft.forward_unrolled(aux, ids, steps=1)[0]
        positions = torch.arange(9).expand(2, 9)
        emb = target.model.rotary_emb(states, positions)
        mask = torch.full((9, 9), float("-inf")).triu(1)[None, None]
        layer_out = target.model.layers[1](states, attention_mask=mask, position_ids=positions, position_embeddings=emb)
        layer_out = layer_out[0] if isinstance(layer_out, tuple) else layer_out
        torch.testing.assert_close(step0.hidden, layer_out, rtol=1e-4, atol=1e-4)
        expected = target.lm_head(target.model.norm(layer_out))[..., draft.hot_ids]
        torch.testing.assert_close(step0.logits, expected, rtol=1e-4, atol=1e-4)


def test_layer_init_still_learns_from_the_next_token():
    target = tiny_target()
    draft = init_from_target(draft_for(target), target, layer=2)
    out = draft.forward_unrolled(torch.randn(1, 6, 96), torch.randint(0, V, (1, 6)), steps=2)
    sum(o.logits.square().mean() for o in out).backward()
    h = draft.cfg.hidden_size
    assert draft.midlayer.self_attn.q_proj.weight.grad[:, :h].abs().sum() > 0  # the zeroed embedding half trains


def test_fc_top_layer_passes_the_last_block_through():
    target = tiny_target()
    draft = init_from_target(draft_for(target), target, fc="top_layer")
    aux = torch.randn(3, 96)
    torch.testing.assert_close(draft.fc(aux), aux[:, 64:])


def test_defaults_leave_the_random_initialisation_alone():
    target = tiny_target()
    a, b = draft_for(target), draft_for(target)
    init_from_target(b, target)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_shape_mismatches_are_one_line_errors():
    target = tiny_target()
    with pytest.raises(LyannaError, match="hidden size 48 differs from the target's 32"):
        init_from_target(draft_for(target, hidden_size=48, head_dim=12), target, lm_head=True)
    with pytest.raises(LyannaError, match="intermediate"):
        init_from_target(draft_for(target, intermediate_size=64), target, layer=0)
    with pytest.raises(LyannaError, match="out of range"):
        init_from_target(draft_for(target), target, layer=7)
    with pytest.raises(LyannaError, match="must be one of"):
        init_from_target(draft_for(target), target, fc="identity")


def test_feature_scale_skips_first_tokens_and_set_aux_scale_can_keep_fc_s_function():
    from lyanna_train.models.init import feature_scale, set_aux_scale

    aux = torch.randn(200, 96) * torch.linspace(0.5, 50, 96)
    first = torch.zeros(200, dtype=torch.bool)
    first[::50] = True
    aux[first] = 1e4  # a massive first-token activation must not set the scale
    scale = feature_scale(aux, first)
    torch.testing.assert_close(scale, aux[~first].pow(2).mean(0).rsqrt())
    target = tiny_target()
    draft = init_from_target(draft_for(target, aux_scale=True), target, fc="top_layer")
    x = torch.randn(4, 96)
    before = draft.fuse_features(x)
    set_aux_scale(draft, scale, keep_function=True)
    torch.testing.assert_close(draft.fuse_features(x), before, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(draft.aux_scale, scale)
    plain = draft_for(target)
    with pytest.raises(LyannaError, match="no feature scale"):
        set_aux_scale(plain, scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_feature_scale_from_the_host_goes_to_a_draft_on_the_gpu():
    """The trainer measures the scale on cached features (on the host) once the draft is on its GPU."""
    from lyanna_train.models.init import set_aux_scale

    target = tiny_target()
    draft = init_from_target(draft_for(target, aux_scale=True), target, fc="top_layer").cuda()
    scale = torch.rand(96) + 0.5
    x = torch.randn(4, 96, device="cuda")
    before = draft.fuse_features(x)
    set_aux_scale(draft, scale, keep_function=True)
    torch.testing.assert_close(draft.fuse_features(x), before, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(draft.aux_scale.cpu(), scale)
