"""Importing EAGLE-3 heads written by speculators, SpecForge and EAGLE: round trips, the
vocabulary map kept, served losslessly, and one-line refusals (bad files, another target).

Each source layout is written here from the names and config keys its toolkit documents
(see lyanna_train/export/layouts.py), with tiny random weights; the speculators layout
as written by the speculators package itself is covered in test_conformance_speculators.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from lyanna_train.cli.export import main as cli_main
from lyanna_train.errors import LyannaError
from lyanna_train.export import formats as F
from lyanna_train.export.importer import import_head
from lyanna_train.export.reader import load_exported
from lyanna_train.models.config import DraftConfig
from lyanna_train.models.draft_head import DraftHead

V, H, LAYERS, DRAFT_VOCAB = 256, 64, 8, 48
DEFAULT_IDS = (1, 3, 4)  # EAGLE-3's default for 8 layers, in our convention

pytestmark = pytest.mark.usefixtures("one_thread")


def make_target(seed=0, hidden=H, vocab=V):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target():
    return make_target()


def make_head(target, draft_vocab=DRAFT_VOCAB, seed=0, sorted_ids=False, **variants) -> DraftHead:
    torch.manual_seed(seed)
    cfg = DraftConfig(target_hidden_size=H, vocab_size=V, draft_vocab_size=draft_vocab, hidden_size=H,
                      intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      aux_layer_ids=DEFAULT_IDS, pool_size=0, alpha_max=0.0, **variants)
    hot = torch.randperm(V)[:draft_vocab]
    draft = DraftHead(cfg, hot.sort().values if sorted_ids else hot, target.model.embed_tokens.weight)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return draft.eval()


def _llama_fields(cfg: DraftConfig) -> dict:
    return {"model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
            "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": False}


def write_source(root, draft: DraftHead, layout: str, vocab_map=("d2t", "t2d"), embed=None, ids=True, **config_extra):
    """A head directory as ``layout``'s toolkit writes it (its documented names and config keys)."""
    root.mkdir(parents=True)
    cfg = draft.cfg
    state = {k: v for k, v in draft.state_dict().items() if not k.startswith("gate.") and k not in ("d2t", "t2d")}
    state.update({k: draft.state_dict()[k] for k in vocab_map})
    if embed is not None:
        state["embed_tokens.weight"] = embed
    if layout == "speculators":
        state = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
                 for k, v in state.items()}
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "draft_vocab_size": cfg.draft_vocab_size, "norm_before_residual": False, "target_hidden_size": None,
                  "norm_before_fc": cfg.norm_before_fc, "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output,
                  "transformer_layer_config": {**_llama_fields(cfg), "rope_theta": cfg.rope_theta},
                  "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "some/verifier",
                                                                             "architectures": ["LlamaForCausalLM"]}}}
        if ids:
            config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in cfg.aux_layer_ids]  # vLLM's convention
    else:  # SpecForge and EAGLE: a Llama config with the draft keys; EAGLE's training config says LlamaForCausalLM
        config = {"architectures": ["LlamaForCausalLMEagle3" if layout == "specforge" else "LlamaForCausalLM"],
                  **_llama_fields(cfg), "draft_vocab_size": cfg.draft_vocab_size, "torch_dtype": "float32"}
        if ids:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids)}  # SGLang's
    config.update(config_extra)
    (root / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in state.items()}
    if layout == "eagle":
        torch.save(state, root / "pytorch_model.bin")  # DeepSpeed save_16bit_model
    else:
        save_file(state, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def logits(draft, steps=3):
    torch.manual_seed(1)
    aux, ids = torch.randn(2, 12, 3 * H), torch.randint(0, V, (2, 12))
    with torch.no_grad():
        return [s.logits for s in draft.forward_unrolled(aux, ids, steps)]


def imported(tmp_path, src, target, tokenizer, name="out", **kw):
    import_head(src, tmp_path / name, "tiny", target=target, tokenizer=tokenizer, say=lambda *_: None, **kw)
    return load_exported(tmp_path / name, target, tokenizer)


@pytest.mark.parametrize("layout,vocab_map,ids", [
    ("speculators", ("d2t", "t2d"), True), ("speculators", ("d2t", "t2d"), False),
    ("specforge", ("d2t", "t2d"), True), ("specforge", ("d2t",), False), ("specforge", ("t2d",), True),
    ("eagle", ("d2t", "t2d"), False), ("eagle", ("t2d",), True),
])
@pytest.mark.slow
def test_round_trip_per_layout_gives_identical_logits_and_keeps_the_map(tmp_path, target, smollm2_tokenizer,
                                                                         layout, vocab_map, ids):
    head = make_head(target, sorted_ids=vocab_map == ("t2d",))  # t2d alone implies ascending draft ids
    src = write_source(tmp_path / "src", head, layout, vocab_map, embed=target.model.embed_tokens.weight, ids=ids)
    draft, manifest = imported(tmp_path, src, target, smollm2_tokenizer)
    assert torch.equal(draft.hot_ids, head.hot_ids) and draft.cfg.aux_layer_ids == DEFAULT_IDS
    assert not draft.cfg.pool_enabled and manifest["format"] == "lyanna"
    for a, b in zip(logits(head), logits(draft)):
        assert torch.equal(a, b)
    info = manifest["imported"]
    assert info["layout"] == layout and "embeddings" in info["checked"]
    assert len(info["sha256"]["config.json"]) == 64 and bool(info["notes"]) == (not ids)


@pytest.mark.parametrize("variants", [dict(norm_before_fc=True, norm_output=True), dict(fc_norm=True)])
@pytest.mark.slow
def test_speculators_trainer_variants_are_computed_as_it_does(tmp_path, target, smollm2_tokenizer, variants):
    """speculators' EAGLE-3 trainer defaults to norm_before_fc + norm_output and a 2048-token window."""
    head = make_head(target, **variants)
    layer = {"sliding_window": 2048, "use_sliding_window": True, "layer_types": ["sliding_attention"]}
    src = write_source(tmp_path / "src", head, "speculators")
    config = json.loads((src / "config.json").read_text())
    config["transformer_layer_config"].update(layer)
    (src / "config.json").write_text(json.dumps(config))
    draft, manifest = imported(tmp_path, src, target, smollm2_tokenizer)
    assert all(getattr(draft.cfg, k) for k in variants)
    for a, b in zip(logits(head), logits(draft)):
        assert torch.equal(a, b)
    assert any("sliding window of 2048" in note for note in manifest["imported"]["notes"])
    with pytest.raises(LyannaError, match="export this head with --format lyanna"):
        from lyanna_train.export.formats import check_eagle3

        check_eagle3(draft.cfg)


@pytest.mark.parametrize("layout", ["speculators", "specforge"])
@pytest.mark.slow
def test_full_vocabulary_head_without_a_map(tmp_path, target, smollm2_tokenizer, layout):
    head = make_head(target, draft_vocab=V)
    with torch.no_grad():  # a full-vocabulary head written without a map scores token i in row i
        head.lm_head.weight.copy_(head.lm_head.weight[torch.argsort(head.hot_ids)])
        head.d2t.zero_()
    src = write_source(tmp_path / "src", head, layout, vocab_map=())
    draft, _ = imported(tmp_path, src, target, smollm2_tokenizer)
    assert torch.equal(draft.hot_ids, torch.arange(V))
    for a, b in zip(logits(head), logits(draft)):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_imported_head_is_served_losslessly(tmp_path, target, smollm2_tokenizer):
    from lyanna_train.runtime.scheduling.scheduler import generate
    from lyanna_train.runtime.settings import DecodeSettings, LookupSettings, TreeShape

    src = write_source(tmp_path / "src", make_head(target), "speculators")
    draft, _ = imported(tmp_path, src, target, smollm2_tokenizer)
    prompt = [5, 17, 33, 2, 90, 41]
    chain = DecodeSettings(TreeShape(5, 1, 1, 5), LookupSettings(0, pool_tokens=0))  # the imported head's drafts only
    out = generate(target, draft, prompt, 24, chain, eos_ids=())
    reference = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
    assert out.tokens == reference and out.target_forwards <= 24


@pytest.mark.slow
def test_cli_imports_onto_a_target_directory(tmp_path, smollm2_tokenizer, capsys):
    target = make_target()
    target.save_pretrained(tmp_path / "target")
    smollm2_tokenizer.save_pretrained(tmp_path / "target")
    src = write_source(tmp_path / "src", make_head(target), "specforge")
    assert cli_main(["import", str(src), "--target", str(tmp_path / "target"), "--out", str(tmp_path / "out")]) == 0
    assert "specforge layout" in capsys.readouterr().out
    draft, manifest = load_exported(tmp_path / "out", target)
    assert manifest["target"]["name"] == str(tmp_path / "target") and draft.cfg.draft_vocab_size == DRAFT_VOCAB


def _spoil(src, case):
    weights = src / ("pytorch_model.bin" if (src / "pytorch_model.bin").exists() else "model.safetensors")
    if case == "missing-config":
        (src / "config.json").unlink()
    elif case == "missing-weights":
        weights.unlink()
    elif case == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif case == "bad-json":
        (src / "config.json").write_text("{oops")
    elif case == "nan":
        from safetensors.torch import load_file

        tensors = load_file(str(weights))
        tensors["fc.weight"][0, 0] = float("nan")
        save_file(tensors, str(weights))


@pytest.mark.parametrize("layout,case,names", [
    ("speculators", "missing-config", "config.json"), ("specforge", "missing-weights", "no weights"),
    ("specforge", "truncated", "model.safetensors"), ("eagle", "truncated", "pytorch_model.bin"),
    ("speculators", "bad-json", "config.json"), ("speculators", "nan", "fc.weight holds 1 non-finite"),
])
def test_bad_source_files_fail_with_one_line_and_write_nothing(tmp_path, target, smollm2_tokenizer, layout, case,
                                                              names):
    src = write_source(tmp_path / "src", make_head(target), layout)
    _spoil(src, case)
    with pytest.raises(LyannaError) as err:
        import_head(src, tmp_path / "out", "tiny", target=target, tokenizer=smollm2_tokenizer, say=lambda *_: None)
    assert names in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.slow
def test_a_head_for_another_target_is_refused_naming_the_mismatch(tmp_path, target, smollm2_tokenizer):
    head = make_head(target)
    src = write_source(tmp_path / "src", head, "speculators", embed=target.model.embed_tokens.weight)
    cases = [(make_target(hidden=32), "hidden size 64; tiny has 32"),
             (make_target(vocab=300), "256-token vocabulary; tiny has 300"),
             (make_target(seed=1), "embed_tokens differ")]
    for other, message in cases:
        with pytest.raises(LyannaError, match=message) as err:
            import_head(src, tmp_path / "out", "tiny", target=other, tokenizer=smollm2_tokenizer, say=lambda *_: None)
        assert "\n" not in str(err.value)
    import copy

    other_tok = copy.deepcopy(smollm2_tokenizer)
    other_tok.add_special_tokens({"additional_special_tokens": ["<|draft-only|>"]})
    other_tok.save_pretrained(src)  # the source says which tokenizer it was trained with
    with pytest.raises(LyannaError, match="another tokenizer"):
        import_head(src, tmp_path / "out", "tiny", target=target, tokenizer=smollm2_tokenizer, say=lambda *_: None)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout,change,message", [
    ("speculators", {"transformer_layer_config": {"model_type": "qwen3"}}, "qwen3"),
    ("specforge", {"num_hidden_layers": 2}, "2 decoder layers"),
    ("specforge", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope scaling"),
    ("specforge", {"extra_tensor": "midlayer.self_attn.q_norm.weight"}, "q_norm"),
    ("specforge", {"drop_map": True}, "no d2t/t2d map"),
])
def test_unsupported_variants_are_refused_by_name(tmp_path, target, smollm2_tokenizer, layout, change, message):
    change = dict(change)
    extra = change.pop("extra_tensor", None)
    vocab_map = () if change.pop("drop_map", False) else ("d2t", "t2d")
    src = write_source(tmp_path / "src", make_head(target), layout, vocab_map)
    config = json.loads((src / "config.json").read_text())
    for key, value in change.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) and key in config and config[key] else value
    (src / "config.json").write_text(json.dumps(config))
    if extra:
        from safetensors.torch import load_file

        save_file({**load_file(str(src / "model.safetensors")), extra: torch.ones(16)}, str(src / "model.safetensors"))
    with pytest.raises(LyannaError, match=message) as err:
        import_head(src, tmp_path / "out", "tiny", target=target, tokenizer=smollm2_tokenizer, say=lambda *_: None)
    assert "\n" not in str(err.value)


def test_our_own_export_is_not_imported_twice(tmp_path, target, smollm2_tokenizer):
    src = write_source(tmp_path / "src", make_head(target), "specforge")
    imported(tmp_path, src, target, smollm2_tokenizer, name="once")
    with pytest.raises(LyannaError, match="already a Lyanna export"):
        import_head(tmp_path / "once", tmp_path / "twice", "tiny", target=target, tokenizer=smollm2_tokenizer)


def test_cli_bad_import_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli_main(["import", str(tmp_path / "nowhere"), "--target", "smollm2", "--out", str(tmp_path / "out")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("lyanna-export: error: source directory not found"), err
    assert not (tmp_path / "out").exists()
