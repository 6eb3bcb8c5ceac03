"""Target features (aux layers + final hidden state) against Hugging Face's own hidden states."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.data.features import FeatureExtractor
from lyanna_train.target.capture import default_layer_ids
from lyanna_train.errors import LyannaError
from lyanna_train.target.model import load_target_model, target_fingerprint


def _save_tiny_llama(path, seed: int, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A tiny random Llama (hidden 64, 4 layers, vocab 256) saved as a local HF directory."""
    return _save_tiny_llama(tmp_path_factory.mktemp("tiny-target"), seed=0)


@pytest.fixture(scope="session")
def other_target_dir(tmp_path_factory):
    """Same architecture, other weights: must fingerprint differently."""
    return _save_tiny_llama(tmp_path_factory.mktemp("other-target"), seed=1)


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    return load_target_model(str(tiny_target_dir))


def _reference(model, ids, layer_ids):
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, use_cache=False)
    aux = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return aux, out.hidden_states[-1], out.logits


def test_features_equal_hidden_states_and_last_gives_the_logits(tiny_target):
    ids = torch.randint(0, 256, (3, 19), generator=torch.Generator().manual_seed(0))
    fx = FeatureExtractor(tiny_target, layer_ids=(0, 1, 2))
    feats = fx(ids)
    aux, last, logits = _reference(tiny_target, ids, (0, 1, 2))
    assert feats.aux.shape == (3, 19, 3 * 64) and fx.aux_size == 192
    torch.testing.assert_close(feats.aux, aux, rtol=0, atol=1e-6)
    torch.testing.assert_close(feats.last, last, rtol=0, atol=1e-6)
    torch.testing.assert_close(tiny_target.lm_head(feats.last), logits, rtol=1e-5, atol=1e-5)
    # the order of the ids is the order of concatenation
    swapped = FeatureExtractor(tiny_target, layer_ids=(2, 0))(ids).aux
    torch.testing.assert_close(swapped, torch.cat([aux[..., 128:], aux[..., :64]], dim=-1), rtol=0, atol=1e-6)


def test_hooks_are_removed_after_each_call(tiny_target):
    fx = FeatureExtractor(tiny_target, layer_ids=(0, 1, 2))
    before = [len(layer._forward_hooks) for layer in fx.layers]  # transformers may install its own
    fx(torch.randint(0, 256, (1, 5)))
    with pytest.raises(Exception):
        fx(torch.full((1, 5), 10_000))  # id outside the vocabulary: the forward fails
    assert [len(layer._forward_hooks) for layer in fx.layers] == before


def test_right_padding_does_not_change_real_tokens(tiny_target):
    """The cache writer pads on the right and passes no attention mask (causal attention)."""
    fx = FeatureExtractor(tiny_target, layer_ids=(0, 1, 2))
    short = torch.randint(3, 256, (7,), generator=torch.Generator().manual_seed(1))
    padded = torch.zeros(2, 12, dtype=torch.long)
    padded[0, :7] = short
    padded[1] = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(2))
    alone, batched = fx(short[None]), fx(padded)
    torch.testing.assert_close(batched.aux[0, :7], alone.aux[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched.last[0, :7], alone.last[0], rtol=1e-5, atol=1e-5)


def test_default_layers_are_the_eagle3_capture_points(tmp_path):
    assert default_layer_ids(30) == (1, 14, 26)  # SmolLM2-135M
    assert default_layer_ids(32) == (1, 15, 28)  # Llama-3-8B
    with pytest.raises(LyannaError, match="pass layer ids"):
        default_layer_ids(4)
    # SGLang/vLLM capture the *inputs* of layers 2, L//2, L-3: the same tensors as our outputs
    model = load_target_model(str(_save_tiny_llama(tmp_path / "eight", seed=2, layers=8)))
    fx = FeatureExtractor(model)
    assert fx.layer_ids == (1, 3, 4)
    inputs = {}
    handles = [model.model.layers[i].register_forward_pre_hook(lambda m, a, kw, i=i: inputs.__setitem__(i, a[0] if a else kw["hidden_states"]), with_kwargs=True)
               for i in (2, 4, 5)]
    ids = torch.randint(0, 256, (2, 9))
    feats = fx(ids)
    for h in handles:
        h.remove()
    torch.testing.assert_close(feats.aux, torch.cat([inputs[2], inputs[4], inputs[5]], dim=-1), rtol=0, atol=0)


def test_load_errors_are_one_line(tmp_path, tiny_target_dir):
    with pytest.raises(LyannaError, match="target model") as missing:
        load_target_model(str(tmp_path / "nowhere"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text((tiny_target_dir / "config.json").read_text())
    with pytest.raises(LyannaError, match="cannot load target model") as broken:
        load_target_model(str(tmp_path / "broken"))  # a config without weights
    for err in (missing, broken):
        assert "\n" not in str(err.value)


def test_fingerprint_tells_targets_apart_but_not_dtypes(tiny_target_dir, other_target_dir, tiny_target):
    fp = target_fingerprint(tiny_target)
    assert fp.startswith("sha256:") and fp == target_fingerprint(load_target_model(str(tiny_target_dir)))
    assert fp == target_fingerprint(load_target_model(str(tiny_target_dir), dtype=torch.bfloat16))
    assert fp != target_fingerprint(load_target_model(str(other_target_dir)))


@pytest.mark.slow
def test_embedded_smollm2_features_match_hidden_states(smollm2_tokenizer):
    model = load_target_model("smollm2")  # first run converts the GGUF (~20 s), later runs read the cache
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    ids = smollm2_tokenizer("The capital of France is", return_tensors="pt").input_ids
    fx = FeatureExtractor(model)
    assert fx.layer_ids == (1, 14, 26)
    feats = fx(ids)
    aux, last, logits = _reference(model, ids, fx.layer_ids)
    torch.testing.assert_close(feats.aux, aux, rtol=0, atol=1e-5)
    torch.testing.assert_close(feats.last, last, rtol=0, atol=1e-5)
    torch.testing.assert_close(model.lm_head(feats.last), logits, rtol=1e-4, atol=1e-4)
    assert smollm2_tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_target_on_the_gpu_takes_ids_from_the_host(tiny_target, tiny_target_dir):
    """Samples are tokenized on the host: the extractor hands them to the target's device, and
    a cache shard computed there holds the same rows, on the host."""
    from lyanna_train.data.feature_cache_writer import ShardSamples, compute_shard

    on_gpu = load_target_model(str(tiny_target_dir)).cuda()
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    want, got = FeatureExtractor(tiny_target, (0, 1, 2))(ids), FeatureExtractor(on_gpu, (0, 1, 2))(ids)
    assert got.aux.is_cuda and got.last.is_cuda
    torch.testing.assert_close(got.aux.cpu(), want.aux, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.last.cpu(), want.last, rtol=1e-4, atol=1e-4)
    group = ShardSamples(shard=0, first=0)
    for i, row in enumerate(ids):
        group.add(i, row.to(torch.int32), torch.ones(len(row), dtype=torch.bool))
    host = compute_shard(FeatureExtractor(tiny_target, (0, 1, 2)), group, 64)
    shard = compute_shard(FeatureExtractor(on_gpu, (0, 1, 2)), group, 64)
    assert all(t.device.type == "cpu" for t in shard.values())
    torch.testing.assert_close(shard["aux"].float(), host["aux"].float(), rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(shard["teacher_lse"], host["teacher_lse"], rtol=1e-4, atol=1e-4)
