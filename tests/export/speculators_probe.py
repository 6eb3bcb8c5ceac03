"""Drive the speculators library (0.9.0) on our folders, in its own environment.

Run by tests/export/test_conformance_speculators.py as a subprocess with
``PYTHONPATH=<venv>/consumers`` (speculators and the transformers release it supports,
installed there by the Makefile), so nothing here imports lyanna_train. Commands:

    load DIR INPUTS OUT        Eagle3DraftModel.from_pretrained(DIR): keys, weights, logits of 3 steps
    convert SRC VERIFIER OUT [IDS_JSON]   speculators' EAGLE-3 converter (convert_model)
    write VERIFIER OUT INPUTS HEADS_JSON   heads built and saved by speculators' trainer code
    batch JSON                 several of these ([[command, arg, ...], ...]) in one interpreter

INPUTS: safetensors with ``aux`` [1, T, 3H] and ``ids`` [1, T] (T a multiple of 128, the
flex-attention block); the draft at anchor t reads aux[t] and ids[t + 1], as ours does.
OUT (load, write): ``OUT.safetensors`` (``logits_j``) and ``OUT.json``.
"""

from __future__ import annotations

import json
import re
import sys
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

STEPS = 3


def file_tensors(directory: Path) -> dict:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__


def draft_logits(model, inputs: Path) -> dict:
    """The lm_head outputs of each training-time-test step of the library's own forward."""
    data = load_file(str(inputs))
    aux, ids = data["aux"], data["ids"]
    shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # its input_ids[t] = our ids[t + 1]
    caught = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: caught.append(out.detach().clone()))
    with torch.no_grad():
        model(hidden_states=aux.to(model.fc.weight.dtype), input_ids=shifted,
              document_ids=torch.zeros_like(ids), ttt_steps=STEPS)
    hook.remove()
    return {f"logits_{j}": t.float().contiguous() for j, t in enumerate(caught)}


def verifier_embeddings(verifier: str) -> torch.Tensor:
    from speculators.utils.loading import load_model_layers

    return load_model_layers(["embed_tokens.weight"], verifier)["embed_tokens.weight"]


def describe(model) -> dict:
    config = model.config
    return {"eagle_aux_hidden_state_layer_ids": config.eagle_aux_hidden_state_layer_ids,
            "verifier": config.speculators_config.verifier.name_or_path,
            "architectures": config.speculators_config.verifier.architectures,
            **{k: getattr(config, k) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
                                               "draft_vocab_size")}}


def load(directory: str, inputs: str, out: str) -> None:
    from speculators.models.eagle3 import Eagle3DraftModel

    directory = Path(directory)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = Eagle3DraftModel.from_pretrained(str(directory)).eval()
    stored = file_tensors(directory)
    state = model.state_dict()
    ignored = model._keys_to_ignore_on_load_missing  # noqa: SLF001 - the library's own rule for absent keys
    missing = sorted(k for k in set(state) - set(stored) if not any(re.search(p, k) for p in ignored))
    unexpected = sorted(set(stored) - set(state))
    differ = sorted(k for k in set(stored) & set(state) if not torch.equal(state[k].to(stored[k].dtype), stored[k]))
    embed = verifier_embeddings(model.config.speculators_config.verifier.name_or_path)
    report = {"missing": missing, "unexpected": unexpected, "loaded_differently": differ,
              "embeddings_from_verifier": bool(torch.equal(model.embed_tokens.weight.float(), embed.float())),
              "warnings": [str(w.message)[:200] for w in caught], **describe(model)}
    save_file(draft_logits(model, Path(inputs)), f"{out}.safetensors")
    Path(f"{out}.json").write_text(json.dumps(report, indent=2))


def convert(src: str, verifier: str, out: str, ids_json: str | None = None) -> None:
    from speculators.convert import convert_model

    kwargs = {"eagle_aux_hidden_state_layer_ids": json.loads(ids_json)} if ids_json else {}
    convert_model(model=src, verifier=verifier, algorithm="eagle3", output_path=out, **kwargs)


def write(verifier: str, out: str, inputs: str, heads_json: str) -> None:
    """HEADS: {name: variants}; writes OUT/name (and OUT/name.safetensors, .json) for each."""
    for name, variants in json.loads(heads_json).items():
        write_one(verifier, str(Path(out) / name), inputs, variants)


def write_one(verifier: str, out: str, inputs: str, variants: dict) -> None:
    """A random head as speculators' trainer builds it (create_transformer_layer_config +
    from_training_args, its defaults unless ``variants`` say otherwise), saved with save_pretrained."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    variants = dict(variants)
    torch.manual_seed(variants.pop("seed", 0))
    layer = create_transformer_layer_config(verifier, num_layers=1, draft_arch="llama", hidden_act=None,
                                            sliding_window=2048, full_attention_indices=[])
    vocab, size = layer.vocab_size, variants.pop("draft_vocab_size")
    kwargs = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True,
              **variants}  # the trainer's EAGLE-3 defaults
    hot = torch.randperm(vocab)[:size].sort().values
    t2d, d2t = None, None
    if size < vocab:
        t2d = torch.zeros(vocab, dtype=torch.bool).scatter_(0, hot, True)
        d2t = hot - torch.arange(size)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, draft_vocab_size=size, ttt_steps=STEPS,
        verifier_name_or_path=verifier, draft_attn_impl="simple_flex_attention", **kwargs)
    with torch.no_grad():  # off its initialisation (norms at 1, lm_head copied from the verifier)
        for name, p in model.named_parameters():
            if not name.startswith(("embed_tokens", "verifier_")):
                p.add_(torch.randn_like(p) * 0.05)
    model.eval().save_pretrained(out)
    save_file(draft_logits(model, Path(inputs)), f"{out}.safetensors")
    Path(f"{out}.json").write_text(json.dumps(describe(model), indent=2))


COMMANDS = {"load": load, "convert": convert, "write": write}

if __name__ == "__main__":
    if sys.argv[1] == "batch":  # one interpreter for several commands: importing speculators takes ~10 s
        for command, *args in json.loads(sys.argv[2]):
            COMMANDS[command](*args)
    else:
        COMMANDS[sys.argv[1]](*sys.argv[2:])
