"""Conformance with the speculators library's own code (0.9.0, the release pinned in the Makefile).

speculators runs in a subprocess with the transformers release it supports (5.19, beside
ours in ``<venv>/consumers``; with ours its ``from_pretrained`` leaves the verifier's
embeddings uninitialised), driven by tests/export/speculators_probe.py. Both directions:
it loads our ``speculators/`` folder and, through its converter, our eagle3 folder; and
heads its trainer code builds and saves import here. Each time: no missing or unexpected
keys, and the same draft logits as ours within 1e-5 over 3 training-time-test steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lyanna_train.export import formats as F
from lyanna_train.export.importer import import_head
from lyanna_train.export.reader import load_exported
from lyanna_train.export.writer import export_checkpoint
from lyanna_train.models.config import DraftConfig
from lyanna_train.models.draft_head import DraftHead
from lyanna_train.target.fingerprint import tokenizer_fingerprint

from .test_export import make_run

PROBE = Path(__file__).with_name("speculators_probe.py")
CONSUMERS = Path(os.environ.get("LYANNA_CONSUMERS", Path(sys.prefix) / "consumers"))
V, H, LAYERS, T, STEPS = 256, 64, 8, 128, 3  # T: speculators' flex attention works in blocks of 128
TOLERANCE = 1e-5

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow,  # probes in subprocesses
              pytest.mark.skipif(not (CONSUMERS / "speculators").is_dir(),
                                 reason=f"speculators is not installed in {CONSUMERS} (make install puts it there)")]


def probe(*args) -> None:
    env = {**os.environ, "PYTHONPATH": str(CONSUMERS), "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([sys.executable, str(PROBE), *map(str, args)], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    """(tiny random Llama target, its directory): the verifier speculators loads embeddings from."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    out = tmp_path_factory.mktemp("verifier")
    model.save_pretrained(out)
    return model, out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("inputs") / "inputs.safetensors"
    save_file({"aux": torch.randn(1, T, 3 * H), "ids": torch.randint(0, V, (1, T))}, str(path))
    return path


def max_logit_difference(draft, inputs: Path, theirs: dict) -> list[float]:
    """Per step, max |ours - theirs| over the anchors whose step-j input token exists
    (past the end speculators feeds token 0 and we a zero embedding; neither is trained on)."""
    data = load_file(str(inputs))
    with torch.no_grad():
        ours = draft.forward_unrolled(data["aux"], data["ids"], STEPS)
    return [float((ours[j].logits[:, : T - 1 - j].float() - theirs[f"logits_{j}"][:, : T - 1 - j]).abs().max())
            for j in range(STEPS)]


HEADS = {  # speculators' EAGLE-3 trainer defaults to norm_before_fc + norm_output
    "trainer-defaults": {"draft_vocab_size": 48},
    "plain-eagle3": {"draft_vocab_size": 48, "norm_before_fc": False, "norm_output": False},
    "fc-norm": {"draft_vocab_size": 48, "norm_before_fc": False, "fc_norm": True},
    "full-vocabulary": {"draft_vocab_size": V, "seed": 1},
}


@pytest.fixture(scope="module")
def speculators_heads(verifier, inputs, tmp_path_factory) -> Path:
    """Every head of HEADS, built and saved by speculators (one subprocess: its import takes ~10 s)."""
    out = tmp_path_factory.mktemp("speculators-heads")
    probe("write", verifier[1], out, inputs, json.dumps(HEADS))
    return out


@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_head_saved_by_speculators_imports_with_its_logits(tmp_path, verifier, inputs, smollm2_tokenizer,
                                                            speculators_heads, name, capsys):
    target, _ = verifier
    head = speculators_heads / name
    import_head(head, tmp_path / "imported", "tiny", target=target, tokenizer=smollm2_tokenizer, say=lambda *_: None)
    draft, manifest = load_exported(tmp_path / "imported", target, smollm2_tokenizer)
    written = json.loads(Path(f"{head}.json").read_text())
    assert [i + 1 for i in draft.cfg.aux_layer_ids] == written["eagle_aux_hidden_state_layer_ids"]
    for flag in ("norm_before_fc", "fc_norm", "norm_output", "draft_vocab_size"):
        assert getattr(draft.cfg, flag) == written[flag], flag
    assert "embeddings" in manifest["imported"]["checked"]
    diffs = max_logit_difference(draft, inputs, load_file(f"{head}.safetensors"))
    with capsys.disabled():
        print(f"\n  speculators-written head '{name}' -> lyanna-export import: max |logit difference| per step "
              f"{[f'{d:.2e}' for d in diffs]}")
    assert max(diffs) < TOLERANCE, diffs


@pytest.fixture(scope="module")
def our_export(verifier, smollm2_tokenizer, tmp_path_factory) -> Path:
    """``lyanna-export --format eagle3 --speculators-config --with-embeddings`` of a random head (its
    pool is dropped); the embeddings are for speculators' converter, whose output otherwise loads
    with uninitialised ones."""
    target, verifier_dir = verifier
    torch.manual_seed(2)
    cfg = DraftConfig(target_hidden_size=H, vocab_size=V, draft_vocab_size=48, hidden_size=H, intermediate_size=96,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, aux_layer_ids=(1, 3, 4),
                      pool_size=128, pool_threshold=0.0)
    draft = DraftHead(cfg, torch.randperm(V)[:48], target.model.embed_tokens.weight)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    root = tmp_path_factory.mktemp("our-export")
    run = make_run(root / "run", draft, target, tokenizer_fingerprint(smollm2_tokenizer))
    export_checkpoint(run, root / "eagle3", "eagle3", speculators=True, embeddings=True, verifier=str(verifier_dir),
                      say=lambda *_: None)
    return root / "eagle3"


@pytest.fixture(scope="module")
def speculators_view(our_export, verifier, inputs) -> Path:
    """What speculators makes of our export: its from_pretrained on speculators/, its converter on
    the eagle3 folder with the layer ids the manifest gives (then from_pretrained), and without them."""
    out, manifest = our_export.parent, json.loads((our_export / F.MANIFEST_FILE).read_text())
    ids = json.dumps(manifest["aux_layers"]["vllm"])
    probe("batch", json.dumps([
        ["load", str(our_export / F.SPECULATORS_DIR), str(inputs), str(out / "folder")],
        ["convert", str(our_export), str(verifier[1]), str(out / "converted"), ids],
        ["load", str(out / "converted"), str(inputs), str(out / "converted-load")],
        ["convert", str(our_export), str(verifier[1]), str(out / "converted-no-ids")],
    ]))
    return out


@pytest.mark.parametrize("route", ["folder", "converted-load"], ids=["speculators-folder", "converter"])
def test_speculators_loads_our_export_with_our_logits(our_export, speculators_view, verifier, inputs, route, capsys):
    report = json.loads((speculators_view / f"{route}.json").read_text())
    assert report["missing"] == [] and report["unexpected"] == [] and report["loaded_differently"] == [], report
    assert report["embeddings_from_verifier"] and report["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert report["verifier"] == str(verifier[1].resolve()) and report["architectures"] == ["LlamaForCausalLM"]
    assert not [w for w in report["warnings"] if "target layers" in w]  # its layer-id default was not used
    draft, _ = load_exported(our_export, verifier[0])
    diffs = max_logit_difference(draft, inputs, load_file(str(speculators_view / f"{route}.safetensors")))
    with capsys.disabled():
        print(f"\n  our eagle3 export -> speculators ({route}): max |logit difference| per step "
              f"{[f'{d:.2e}' for d in diffs]}")
    assert max(diffs) < TOLERANCE, diffs


def test_speculators_converter_needs_the_layer_ids_the_manifest_gives(our_export, speculators_view):
    """Its converter reads no ids from config.json: without the flag the manifest spells out,
    the converted head has none and speculators falls back to its defaults."""
    config = json.loads((speculators_view / "converted-no-ids" / F.CONFIG_FILE).read_text())
    assert config.get("eagle_aux_hidden_state_layer_ids") is None
    converted = json.loads((speculators_view / "converted" / F.CONFIG_FILE).read_text())
    assert converted["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    manifest = json.loads((our_export / F.MANIFEST_FILE).read_text())
    assert '"eagle_aux_hidden_state_layer_ids": [2, 4, 5]' in manifest["serving"]["speculators_convert"]
