"""Export -> load round trips (both formats), the eagle3 layout engines read, and refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lyanna_train.cli.export import main as cli_main
from lyanna_train.errors import LyannaError
from lyanna_train.export import formats as F
from lyanna_train.export.reader import load_exported
from lyanna_train.export.writer import export_checkpoint
from lyanna_train.hotvocab.artifact import load_hot_vocab
from lyanna_train.models.config import DraftConfig
from lyanna_train.models.draft_head import DraftHead
from lyanna_train.run_record import write_run_record
from lyanna_train.target.model import target_fingerprint
from lyanna_train.training.checkpoint import write_draft_weights

V, H, LAYER_IDS = 256, 64, (0, 1, 2)
EAGLE3_TENSORS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see tests/conftest.py


def _target(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def make_draft(target, pool: bool, other_bucket: bool = False, seed: int = 0, **overrides) -> DraftHead:
    torch.manual_seed(seed)
    cfg = DraftConfig(**{**dict(target_hidden_size=H, vocab_size=V, draft_vocab_size=48, hidden_size=H,
                                intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                aux_layer_ids=LAYER_IDS, pool_size=128 if pool else 0, pool_threshold=0.0,
                                other_bucket=other_bucket), **overrides})
    draft = DraftHead(cfg, torch.randperm(V)[:48], target.model.embed_tokens.weight)
    with torch.no_grad():  # norms start at 1 and the gate near 0.5: move everything off its init
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return draft.eval()


def make_run(root, draft, target, tok_fp, steps=(1,), record=True, target_name="tiny"):
    """A run directory as training leaves it: checkpoints/step-*/ with weights, draft config and run.json
    (fingerprints, config, metrics); ``record=False``: a checkpoint from before run.json existed."""
    for step in steps:
        ckpt = root / "checkpoints" / f"step-{step:08d}"
        ckpt.mkdir(parents=True)
        write_draft_weights(ckpt, draft, {"layer_ids": list(LAYER_IDS), "target": target_name})
        if record:
            write_run_record(ckpt, {"step": step, "target": {"name": target_name,
                                                             "fingerprint": target_fingerprint(target)},
                                    "tokenizer": {"fingerprint": tok_fp}, "config": {"train": {"lr": 0.001}},
                                    "metrics": {"step": step, "loss/total": 3.0, "eval/mean_tau": 1.5}})
    return root


def logits(draft, steps=3):
    torch.manual_seed(1)
    aux, ids = torch.randn(2, 10, 3 * H), torch.randint(0, V, (2, 10))
    with torch.no_grad():
        return draft.forward_unrolled(aux, ids, steps)


def export(tmp_path, draft, target, tok_fp, fmt, name="out", **kw):
    run = make_run(tmp_path / f"run-{name}", draft, target, tok_fp)
    export_checkpoint(run, tmp_path / name, fmt, say=lambda *_: None, **kw)
    return tmp_path / name


def test_lyanna_round_trip_keeps_every_part_and_gives_identical_logits(tmp_path, target, tok_fp, smollm2_tokenizer):
    draft = make_draft(target, pool=True, other_bucket=True)
    out = export(tmp_path, draft, target, tok_fp, "lyanna")
    loaded, manifest = load_exported(out, target, smollm2_tokenizer)
    assert loaded.cfg == draft.cfg and loaded.gate is not None
    for a, b in zip(logits(draft), logits(loaded)):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.alpha, b.alpha) and torch.equal(a.hit, b.hit)
    assert bool(logits(loaded)[1].hit.any())  # the pool really took part
    assert json.loads((out / F.CONFIG_FILE).read_text()) == F.lyanna_config(draft.cfg)
    assert manifest["format"] == "lyanna" and manifest["dropped"] == []


def test_eagle3_round_trip_with_the_pool_off(tmp_path, target, tok_fp):
    draft = make_draft(target, pool=False)
    loaded, _ = load_exported(export(tmp_path, draft, target, tok_fp, "eagle3"), target)
    assert not loaded.cfg.pool_enabled and loaded.cfg.aux_layer_ids == LAYER_IDS
    for a, b in zip(logits(draft), logits(loaded)):
        assert torch.equal(a.logits, b.logits)


@pytest.mark.parametrize("fmt", ["lyanna", "eagle3"])
def test_the_feature_scale_is_folded_into_fc_and_norm_before_residual_is_kept(tmp_path, target, tok_fp, fmt):
    draft = make_draft(target, pool=False, aux_scale=True, norm_before_residual=True)
    with torch.no_grad():
        draft.aux_scale.copy_(torch.rand(3 * H) * 0.1 + 0.01)
    out = export(tmp_path, draft, target, tok_fp, fmt)
    loaded, _ = load_exported(out, target)
    assert not loaded.cfg.aux_scale and "aux_scale" not in load_file(out / F.WEIGHTS_FILE)
    assert loaded.cfg.norm_before_residual and json.loads((out / F.CONFIG_FILE).read_text())["norm_before_residual"]
    for a, b in zip(logits(draft), logits(loaded)):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-5)


def test_eagle3_drops_the_other_logit_and_keeps_the_rest(tmp_path, target, tok_fp):
    draft = make_draft(target, pool=False, other_bucket=True)
    loaded, manifest = load_exported(export(tmp_path, draft, target, tok_fp, "eagle3"), target)
    for a, b in zip(logits(draft), logits(loaded)):
        assert torch.equal(a.logits[..., :-1], b.logits)
    assert manifest["dropped"] == ["other-bucket logit"]


def test_eagle3_layout_is_what_sglang_and_vllm_read(tmp_path, target, tok_fp):
    draft = make_draft(target, pool=True)
    target.save_pretrained(tmp_path / "verifier")
    out = export(tmp_path, draft, target, tok_fp, "eagle3", speculators=True, verifier=str(tmp_path / "verifier"),
                 dtype="bfloat16")
    assert sorted(p.name for p in out.glob("*.safetensors")) == [F.WEIGHTS_FILE]  # engines load every one
    assert sorted(p.name for p in (out / F.SPECULATORS_DIR).glob("*.safetensors")) == [F.WEIGHTS_FILE]
    tensors = load_file(str(out / F.WEIGHTS_FILE))
    assert set(tensors) == EAGLE3_TENSORS
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (V,)
    assert tensors["lm_head.weight"].shape == (48, H) and tensors["fc.weight"].dtype == torch.bfloat16
    assert torch.equal(tensors["d2t"] + torch.arange(48), draft.hot_ids)
    config = json.loads((out / F.CONFIG_FILE).read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 48 and config["target_hidden_size"] == H and config["vocab_size"] == V
    assert config["tie_word_embeddings"] is False and config["norm_before_residual"] is False
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang adds 1 itself
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: captured before layer i
    spec = json.loads((out / F.SPECULATORS_DIR / F.CONFIG_FILE).read_text())
    assert spec["speculators_model_type"] == "eagle3" and spec["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    verifier = {"name_or_path": str((tmp_path / "verifier").resolve()), "architectures": ["LlamaForCausalLM"]}
    assert spec["speculators_config"]["verifier"] == verifier
    assert spec["transformer_layer_config"]["num_hidden_layers"] == 1 and spec["norm_before_residual"] is False
    spec_tensors = load_file(str(out / F.SPECULATORS_DIR / F.WEIGHTS_FILE))  # speculators names the layer layers.0
    assert set(spec_tensors) == {n.replace("midlayer.", "layers.0.") for n in EAGLE3_TENSORS} | {"embed_tokens.weight"}
    assert torch.equal(spec_tensors["embed_tokens.weight"], target.model.embed_tokens.weight.to(torch.bfloat16))
    assert torch.equal(spec_tensors["layers.0.mlp.up_proj.weight"], tensors["midlayer.mlp.up_proj.weight"])
    manifest = json.loads((out / F.MANIFEST_FILE).read_text())
    assert manifest["dropped"] == ["state pool", "alpha-gate"] and manifest["verifier"] == verifier
    assert manifest["files"]["hot_vocab"] == "lyanna/hot_vocab.safetensors"
    assert manifest["serving"]["vllm_speculators"] == f"vllm serve {out.resolve() / F.SPECULATORS_DIR}"
    assert manifest["serving"]["sglang"].startswith(f"python -m sglang.launch_server --model-path {verifier['name_or_path']}")
    assert "speculators_convert" not in manifest["serving"]  # that needs --with-embeddings


def test_with_embeddings_the_eagle3_folder_carries_them_and_the_converter_command(tmp_path, target, tok_fp):
    draft = make_draft(target, pool=False)
    target.save_pretrained(tmp_path / "verifier")
    out = export(tmp_path, draft, target, tok_fp, "eagle3", embeddings=True, verifier=str(tmp_path / "verifier"))
    assert torch.equal(load_file(str(out / F.WEIGHTS_FILE))[F.EMBED_TOKENS], target.model.embed_tokens.weight)
    loaded, manifest = load_exported(out, target)
    for a, b in zip(logits(draft), logits(loaded)):
        assert torch.equal(a.logits, b.logits)
    assert "--algorithm-kwargs '{\"eagle_aux_hidden_state_layer_ids\": [1, 2, 3]}'" in \
        manifest["serving"]["speculators_convert"]
    with pytest.raises(LyannaError, match="eagle3 format"):
        export(tmp_path, draft, target, tok_fp, "lyanna", name="lyanna", embeddings=True)
    assert manifest["aux_layers"] == {"ids": [0, 1, 2], "convention": F.AUX_CONVENTION,
                                      "sglang": [0, 1, 2], "vllm": [1, 2, 3]}


def test_full_vocabulary_speculators_folder_has_no_map_and_rows_in_token_order(tmp_path, target, tok_fp):
    import dataclasses

    cfg = dataclasses.replace(make_draft(target, pool=False).cfg, draft_vocab_size=V)
    draft = DraftHead(cfg, torch.randperm(V), target.model.embed_tokens.weight).eval()  # hot ids: a permutation
    target.save_pretrained(tmp_path / "verifier")
    out = export(tmp_path, draft, target, tok_fp, "eagle3", speculators=True, verifier=str(tmp_path / "verifier"))
    spec = load_file(str(out / F.SPECULATORS_DIR / F.WEIGHTS_FILE))
    assert "d2t" not in spec and "t2d" not in spec
    rows = draft.lm_head.weight.detach()
    assert torch.equal(spec["lm_head.weight"][draft.hot_ids], rows)  # token hot_ids[r] scored by row r


@pytest.mark.parametrize("verifier,message", [(None, "cannot locate the verifier for target tiny"),
                                              ("org/not-cached", "cannot read the architectures")])
def test_speculators_folder_needs_a_verifier_engines_can_open(tmp_path, target, tok_fp, verifier, message):
    with pytest.raises(LyannaError, match=message) as err:
        export(tmp_path, make_draft(target, pool=False), target, tok_fp, "eagle3", speculators=True, verifier=verifier)
    assert "--verifier" in str(err.value) and not (tmp_path / "out").exists()
    plain = export(tmp_path, make_draft(target, pool=False), target, tok_fp, "eagle3", name="plain")
    assert json.loads((plain / F.MANIFEST_FILE).read_text())["verifier"] is None  # recorded only when found


def test_manifest_describes_the_export(tmp_path, target, tok_fp):
    out = export(tmp_path, make_draft(target, pool=True), target, tok_fp, "lyanna")
    manifest = json.loads((out / F.MANIFEST_FILE).read_text())
    assert manifest["target"] == {"name": "tiny", "fingerprint": target_fingerprint(target),
                                  "source": "checkpoint run.json"}
    assert manifest["tokenizer"] == {"fingerprint": tok_fp, "source": "checkpoint run.json"} and manifest["lyanna_train"]
    assert manifest["training"]["step"] == 1 and manifest["training"]["draft_config"]["layer_ids"] == [0, 1, 2]
    assert manifest["training"]["run_config"] == {"train": {"lr": 0.001}}
    assert sorted(manifest["sha256"]) == ["config.json", "hot_vocab.safetensors", "model.safetensors"]
    assert manifest["metrics"]["loss/total"] == 3.0 and manifest["metrics"]["eval/mean_tau"] == 1.5
    assert load_hot_vocab(out / F.HOT_VOCAB_FILE, expect_fingerprint=tok_fp).size == 48


def test_another_target_or_tokenizer_is_refused(tmp_path, target, tok_fp, smollm2_tokenizer):
    out = export(tmp_path, make_draft(target, pool=False), target, tok_fp, "eagle3")
    other = _target(1)
    with pytest.raises(LyannaError, match="another target") as err:
        load_exported(out, other)
    assert target_fingerprint(target) in str(err.value) and target_fingerprint(other) in str(err.value)
    manifest = json.loads((out / F.MANIFEST_FILE).read_text())
    manifest["tokenizer"]["fingerprint"] = "sha256:0000"
    (out / F.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(LyannaError, match="another tokenizer") as err:
        load_exported(out, target, smollm2_tokenizer)
    assert "sha256:0000" in str(err.value) and tok_fp in str(err.value)


def _rehash(out):
    """Record the current bytes in the manifest, as if the export had been written like this."""
    from lyanna_train.export.integrity import digests

    manifest = json.loads((out / F.MANIFEST_FILE).read_text())
    manifest["sha256"] = digests(out, skip=(F.MANIFEST_FILE,))
    (out / F.MANIFEST_FILE).write_text(json.dumps(manifest))


def _spoil(out, case):
    weights, config = out / F.WEIGHTS_FILE, out / F.CONFIG_FILE
    if case.startswith("missing-"):
        (out / case.removeprefix("missing-")).unlink()
    elif case == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif case == "garbage":
        weights.write_bytes(b"\x07garbage" * 100)
    elif case == "unknown-key":
        save_file({**load_file(str(weights)), "mystery.weight": torch.zeros(2)}, str(weights))
    elif case == "shape":
        config.write_text(json.dumps({**json.loads(config.read_text()), "intermediate_size": 100}))
    elif case == "bad-json":
        config.write_text("{not json")
    if case in ("unknown-key", "shape", "bad-json"):  # checks behind the checksums
        _rehash(out)


@pytest.mark.parametrize("case,names", [
    ("missing-config.json", "config.json"), ("missing-manifest.json", "manifest.json"),
    ("missing-model.safetensors", "model.safetensors"), ("missing-hot_vocab.safetensors", "hot_vocab.safetensors"),
    ("truncated", "model.safetensors"), ("garbage", "model.safetensors"), ("unknown-key", "mystery.weight"),
    ("shape", "config.json"), ("bad-json", "config.json"),
])
def test_broken_exports_fail_with_one_line_naming_the_file(tmp_path, target, tok_fp, case, names):
    out = export(tmp_path, make_draft(target, pool=True), target, tok_fp, "lyanna")
    _spoil(out, case)
    with pytest.raises(LyannaError) as err:
        load_exported(out, target)
    assert names in str(err.value) and "\n" not in str(err.value)


def test_export_refuses_an_unknown_tensor_and_leaves_nothing(tmp_path, target, tok_fp):
    run = make_run(tmp_path / "run", make_draft(target, pool=False), target, tok_fp)
    weights = run / "checkpoints" / "step-00000001" / F.WEIGHTS_FILE
    save_file({**load_file(str(weights)), "mystery.weight": torch.zeros(2)}, str(weights))
    with pytest.raises(LyannaError, match="mystery.weight"):
        export_checkpoint(run, tmp_path / "out", "eagle3", say=lambda *_: None)
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
    wide = make_draft(target, pool=False, hidden_size=32, intermediate_size=64)  # needs embed_proj
    run = make_run(tmp_path / "wide", wide, target, tok_fp)
    with pytest.raises(LyannaError, match="draft width"):
        export_checkpoint(run, tmp_path / "out", "eagle3", say=lambda *_: None)
    shuffled = make_run(tmp_path / "shuffled", make_draft(target, pool=False, aux_layer_ids=(2, 0, 1)), target, tok_fp)
    with pytest.raises(LyannaError, match="ascending order"):
        export_checkpoint(shuffled, tmp_path / "out", "eagle3", say=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "shuffled", "wide"]


def test_cli_picks_the_latest_complete_checkpoint(tmp_path, target, tok_fp, capsys):
    run = make_run(tmp_path / "run", make_draft(target, pool=True), target, tok_fp, steps=(1, 2))
    (run / "checkpoints" / ".partial-step-00000003").mkdir()  # a save cut short: never chosen
    assert cli_main([str(run), "--out", str(tmp_path / "out")]) == 0
    assert "step-00000002" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "out" / F.MANIFEST_FILE).read_text())
    assert manifest["training"]["step"] == 2 and manifest["metrics"]["loss/total"] == 3.0


@pytest.mark.parametrize("case,message", [
    ("no-such-dir", "not found"), ("no-checkpoint", "no complete checkpoint"), ("exists", "already exists"),
    ("speculators-lyanna", "eagle3 format"), ("unknown-target", "target model"), ("corrupted", "safetensors"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, target, tok_fp, capsys, case, message):
    draft = make_draft(target, pool=False)
    run = make_run(tmp_path / "run", draft, target, tok_fp, record=case != "unknown-target",
                   target_name="no-such-target")
    args, out = [str(run), "--out", str(tmp_path / "out")], tmp_path / "out"
    if case == "no-such-dir":
        args[0] = str(tmp_path / "nowhere")
    elif case == "no-checkpoint":
        args[0] = str(tmp_path / "empty")
        (tmp_path / "empty").mkdir()
    elif case == "exists":
        out.mkdir()
    elif case == "speculators-lyanna":
        args.append("--speculators-config")
    elif case == "corrupted":
        (run / "checkpoints" / "step-00000001" / F.WEIGHTS_FILE).write_bytes(b"\0" * 3)
    assert cli_main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("lyanna-export: error:") and message in err[0], err
    assert out.exists() == (case == "exists") and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.slow
def test_the_loader_never_imports_training_code():
    """Serving code loads exports: it must not pull in the trainer (DeepSpeed, W&B, datasets)."""
    import subprocess
    import sys

    code = ("import sys, lyanna_train.export.reader; "
            "print(sorted(m for m in sys.modules if m.startswith('lyanna_train.training') or m == 'deepspeed'))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
