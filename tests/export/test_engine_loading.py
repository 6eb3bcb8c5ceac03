"""Our eagle3 exports as SGLang and vLLM load them: the files they read, where each tensor
goes, and which target layers they capture (rules restated in engine_rules.py, with the
source file and function each mirrors; bench/engine_load_check.py runs the real engines)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lyanna_train.export import formats as F

from . import engine_rules as E
from .test_export import H, LAYER_IDS, export, make_draft

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def exported(target, smollm2_tokenizer, tmp_path_factory):
    from lyanna_train.target.fingerprint import tokenizer_fingerprint

    root = tmp_path_factory.mktemp("engines")
    target.save_pretrained(root / "verifier")
    draft = make_draft(target, pool=True)
    out = export(root, draft, target, tokenizer_fingerprint(smollm2_tokenizer), "eagle3", speculators=True,
                 verifier=str(root / "verifier"))
    return out, draft


def engine_config(folder) -> dict:
    """The draft config an engine builds: config.json, or for a speculators folder its
    transformer_layer_config plus the EAGLE-3 keys vLLM's ``update_eagle3`` copies over."""
    config = json.loads((folder / F.CONFIG_FILE).read_text())
    if "speculators_model_type" not in config:
        return config
    return {**config["transformer_layer_config"], "draft_vocab_size": config["draft_vocab_size"],
            **({"target_hidden_size": config["target_hidden_size"]} if config.get("target_hidden_size") else {})}


def test_engines_read_only_the_drafts_own_weights(exported):
    out, _ = exported
    for folder in (out, out / F.SPECULATORS_DIR):
        assert E.discover(folder).keys() == load_file(str(folder / F.WEIGHTS_FILE)).keys()
    assert "hot_ids" not in E.discover(out)


@pytest.mark.parametrize("folder", ["eagle3", "speculators"])
def test_vllm_routes_every_tensor_to_its_parameter(exported, folder):
    out, _ = exported
    path = out if folder == "eagle3" else out / F.SPECULATORS_DIR
    config = engine_config(path)
    loaded = E.vllm_route(config, E.discover(path))
    for name, shards in E.required(config, "layers.0").items():
        assert loaded.get(name) == shards, name
    assert "draft_id_to_target_id" in loaded
    assert ("model.embed_tokens.weight" in loaded) == (folder == "speculators")  # vLLM shares the target's otherwise


def test_sglang_routes_every_tensor_and_drops_none(exported):
    out, draft = exported
    config = engine_config(out)
    loaded, skipped = E.sglang_route(config, E.discover(out))
    assert skipped == []
    for name, shards in E.required(config, "midlayer").items():
        assert loaded.get(name) == shards, name
    d2t = load_file(str(out / F.WEIGHTS_FILE))["d2t"]
    assert torch.equal(d2t + torch.arange(len(d2t)), draft.hot_ids)  # SGLang's hot_token_id


def test_the_rules_catch_what_the_issue_found(exported, tmp_path):
    """The layouts issue 12 found wrong fail here: a map file beside the weights (vLLM's
    KeyError) and speculators' names in the engines' folder (SGLang skips them silently)."""
    out, _ = exported
    config = engine_config(out)
    old = tmp_path / "old-layout"
    old.mkdir()
    (old / F.WEIGHTS_FILE).write_bytes((out / F.WEIGHTS_FILE).read_bytes())
    save_file({"hot_ids": torch.arange(48)}, str(old / F.HOT_VOCAB_FILE))
    with pytest.raises(KeyError, match="model.hot_ids"):
        E.vllm_route(config, E.discover(old))
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in E.discover(out).items()}
    assert len(E.sglang_route(config, renamed)[1]) == 10  # the whole decoder layer left at random
    (old / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.weight": F.WEIGHTS_FILE}}))
    assert "hot_ids" not in E.discover(old)  # an index naming only the weights would have been the other fix


def test_each_engine_captures_the_layers_the_head_was_trained_on(exported, target):
    """vLLM captures the residual stream entering layer i (HF hidden_states[i]) for its
    top-level ids; SGLang the input of layer id + 1 for eagle_config's ids: both must equal
    the features training used (``FeatureExtractor``: output of layer i)."""
    from lyanna_train.data.features import FeatureExtractor

    out, _ = exported
    config = json.loads((out / F.CONFIG_FILE).read_text())
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    ours = FeatureExtractor(target, LAYER_IDS)(ids).aux
    vllm = torch.cat([hidden[i] for i in config["eagle_aux_hidden_state_layer_ids"]], dim=-1)
    sglang = torch.cat([hidden[i + 1] for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]], dim=-1)
    assert ours.shape[-1] == 3 * H
    torch.testing.assert_close(vllm, ours.to(vllm.dtype))
    torch.testing.assert_close(sglang, ours.to(sglang.dtype))


def test_a_norm_before_residual_head_is_not_offered_to_sglang(target, smollm2_tokenizer, tmp_path):
    """SGLang's layer adds the un-normed state whatever the config says: the manifest gives no
    SGLang command for such a head, and speculators' converter is told the flag."""
    from lyanna_train.target.fingerprint import tokenizer_fingerprint

    target.save_pretrained(tmp_path / "verifier")
    out = export(tmp_path, make_draft(target, pool=False, norm_before_residual=True), target,
                 tokenizer_fingerprint(smollm2_tokenizer), "eagle3", embeddings=True, verifier=str(tmp_path / "verifier"))
    serving = json.loads((out / F.MANIFEST_FILE).read_text())["serving"]
    assert serving["sglang"] is None and "vLLM" in serving["notes"][0]
    assert '"norm_before_residual": true' in serving["speculators_convert"] and serving["vllm"].startswith("vllm serve")
