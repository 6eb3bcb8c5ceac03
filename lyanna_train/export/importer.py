"""Import an EAGLE-3 head trained elsewhere (speculators, SpecForge, EAGLE) as a Lyanna export.

The result is an ordinary ``lyanna``-format directory (pool and α-gate off) that
``load_exported`` serves and ``lyanna-train draft.init_from=DIR`` fine-tunes, with the
head's own vocabulary map kept. A head made for another target is refused before
anything is written, with one line naming what differs: hidden size, vocabulary size,
layer count, embeddings (when the source carries a copy) or tokenizer (when the source
or the verifier it names has one on disk).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from ..errors import LyannaError
from . import formats as F
from . import layouts as L
from .integrity import check_finite, file_sha256
from .reader import read_json, read_tensors

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _read_bin(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises many types on bad bytes
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise LyannaError(f"{path} is not a readable PyTorch checkpoint (truncated or corrupted?): {first}") from None
    state = state.get("module", state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise LyannaError(f"{path} does not hold a tensor state dict")
    return state


def read_weights(src: Path) -> tuple[dict, str]:
    """(tensors, the file they came from): single-file or sharded safetensors, or PyTorch .bin."""
    found = next((name for name in _WEIGHT_FILES if (src / name).is_file()), None)
    if found is None:
        raise LyannaError(f"no weights in {src} (looked for {', '.join(_WEIGHT_FILES)})")
    if not found.endswith(".index.json"):
        return (read_tensors(src / found) if found.endswith(".safetensors") else _read_bin(src / found)), found
    weight_map = read_json(src / found).get("weight_map")
    if not isinstance(weight_map, dict):
        raise LyannaError(f"{src / found} has no weight_map")
    tensors: dict = {}
    for shard in sorted(set(weight_map.values())):
        tensors.update(read_tensors(src / shard) if shard.endswith(".safetensors") else _read_bin(src / shard))
    return tensors, found


def _check_embeddings(embed: torch.Tensor, ours: torch.Tensor, src: Path, target_name: str) -> None:
    """The source's copy of the target's embeddings must be the target's, to the source's precision."""
    if tuple(embed.shape) != tuple(ours.shape):
        raise LyannaError(f"{src} was made for another target: its embeddings are {tuple(embed.shape)}, "
                          f"{target_name}'s are {tuple(ours.shape)}")
    coarse = embed.dtype if torch.finfo(embed.dtype).eps > torch.finfo(ours.dtype).eps else ours.dtype
    diff = float((embed.float() - ours.detach().float().cpu()).abs().max())
    scale = float(ours.detach().float().abs().max())
    if diff > 2 * torch.finfo(coarse).eps * scale:
        raise LyannaError(f"{src} was made for another target: its embed_tokens differ from {target_name}'s by up "
                          f"to {diff:.3g} (or it trained its own embeddings, which this draft cannot keep)")


def _tokenizer_dirs(src: Path, verifier: dict | None) -> list[Path]:
    dirs = [src]
    name = (verifier or {}).get("name_or_path")
    if name and Path(name).expanduser().is_dir():
        dirs.append(Path(name).expanduser())
    return [d for d in dirs if any((d / f).is_file() for f in _TOKENIZER_FILES)]


def check_target(cfg, embed, verifier, src: Path, target, tokenizer, target_name: str) -> list[str]:
    """Refuse a head made for another target (one line naming the mismatch); returns what was checked."""
    from ..target.fingerprint import tokenizer_fingerprint
    from ..target.source import load_tokenizer

    hidden, layers = target.config.hidden_size, target.config.num_hidden_layers
    rows = target.get_input_embeddings().weight.shape[0]
    if cfg.target_hidden_size != hidden:
        raise LyannaError(f"{src} was made for a target with hidden size {cfg.target_hidden_size}; "
                          f"{target_name} has {hidden}")
    if cfg.vocab_size != rows:
        raise LyannaError(f"{src} was made for a {cfg.vocab_size}-token vocabulary; {target_name} has {rows}")
    if cfg.aux_layer_ids and max(cfg.aux_layer_ids) >= layers - 1:
        raise LyannaError(f"{src} reads target layer {max(cfg.aux_layer_ids)} (output of, 0-based); "
                          f"{target_name} has {layers} layers")
    checked = ["hidden size", "vocabulary size", "layer count"]
    if embed is not None:
        _check_embeddings(embed, target.get_input_embeddings().weight, src, target_name)
        checked.append("embeddings")
    ours = tokenizer_fingerprint(tokenizer)
    for d in _tokenizer_dirs(src, verifier):
        try:
            theirs = tokenizer_fingerprint(load_tokenizer(str(d)))
        except LyannaError:
            continue
        if theirs != ours:
            raise LyannaError(f"{src} was made for another tokenizer: {d}'s fingerprint {theirs}, "
                              f"{target_name}'s {ours}")
        checked.append(f"tokenizer ({d})")
    return checked


def read_head(src: Path, layout: str = "auto"):
    """(layout, DraftConfig, DraftHead state with d2t/t2d, source embeddings or None, verifier, weights file,
    notes on what serving here does differently)."""
    from .reader import check_state

    config_file = src / F.CONFIG_FILE
    config = read_json(config_file)
    if (src / F.MANIFEST_FILE).is_file() and not config.get("speculators_model_type"):
        manifest = read_json(src / F.MANIFEST_FILE)
        if manifest.get("kind") == F.KIND:
            raise LyannaError(f"{src} is already a Lyanna export: serve or fine-tune it directly")
    tensors, weights_file = read_weights(src)
    layout = L.detect_layout(config, weights_file) if layout == "auto" else layout
    if layout not in L.LAYOUTS:
        raise LyannaError(f"unknown layout {layout!r} (choose from auto, {', '.join(L.LAYOUTS)})")
    if layout == L.SPECULATORS:
        cfg, verifier, notes = L.config_from_speculators(config, str(config_file))
    else:
        cfg, verifier, notes = L.config_from_eagle3_family(config, str(config_file)), None, []
    where = str(src / weights_file)
    check_finite(tensors, where)
    state, embed = L.to_draft_names(tensors, layout, where)
    hot = L.hot_ids_of(state, cfg, where)
    state["d2t"] = hot - torch.arange(len(hot))
    state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).scatter_(0, hot, True)
    check_state(state, cfg, config_file, src / weights_file)
    return layout, cfg, state, embed, verifier, weights_file, notes


def import_head(src: str | Path, out_dir: str | Path, target_name: str, *, target=None, tokenizer=None,
                layout: str = "auto", dtype: str | None = None, overwrite: bool = False,
                say: Callable = print) -> Path:
    """Write ``out_dir`` (lyanna format) from an EAGLE-3 head directory; returns ``out_dir``.

    ``out_dir`` has one writer at a time, as for every export (a second one stops at once, naming the first).
    """
    from ..locks import output_lock

    with output_lock(out_dir):
        return _import_head(src, out_dir, target_name, target=target, tokenizer=tokenizer, layout=layout,
                            dtype=dtype, overwrite=overwrite, say=say)


def _import_head(src: str | Path, out_dir: str | Path, target_name: str, *, target, tokenizer, layout: str,
                 dtype: str | None, overwrite: bool, say: Callable) -> Path:
    import dataclasses

    from ..atomic import check_output_dir
    from ..target.capture import check_layer_ids, default_layer_ids
    from ..target.fingerprint import tokenizer_fingerprint
    from ..target.model import target_fingerprint
    from .writer import DTYPES, base_manifest, write_directory

    src = Path(src)
    if not src.is_dir():
        raise LyannaError(f"source directory not found: {src}")
    if dtype is not None and dtype not in DTYPES:
        raise LyannaError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    out_dir = check_output_dir(out_dir, overwrite, inputs=(src, target_name))
    layout, cfg, state, embed, verifier, weights_file, notes = read_head(src, layout)
    say(f"importing {src} ({layout} layout: {cfg.draft_vocab_size}-token head over a {cfg.vocab_size}-token "
        f"vocabulary, width {cfg.hidden_size})")
    if target is None or tokenizer is None:
        from ..target.source import load_tokenizer
        from ..target.model import load_target_model

        target = target if target is not None else load_target_model(target_name)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(target_name)
    checked = check_target(cfg, embed, verifier, src, target, tokenizer, target_name)
    if not cfg.aux_layer_ids:
        ids = default_layer_ids(target.config.num_hidden_layers)
        notes.append(f"the source records no target layer ids: EAGLE-3's default {list(ids)} assumed")
        cfg = dataclasses.replace(cfg, aux_layer_ids=ids)
    check_layer_ids(cfg.aux_layer_ids, target.config.num_hidden_layers)
    manifest = {
        **base_manifest(F.LYANNA, cfg, {"name": target_name, "fingerprint": target_fingerprint(target),
                                        "source": "target model given"},
                        {"fingerprint": tokenizer_fingerprint(tokenizer), "source": "tokenizer given"}),
        "dropped": [],
        "imported": {"layout": layout, "source": str(src.resolve()), "weights": weights_file,
                     "sha256": {name: file_sha256(src / name) for name in (F.CONFIG_FILE, weights_file)},
                     "verifier": verifier, "config": read_json(src / F.CONFIG_FILE), "checked": checked,
                     "notes": notes},
        "training": None,
        "metrics": None,
    }
    for note in notes:
        say(f"note: {note}")
    write_directory(out_dir, cfg, state, F.LYANNA, manifest, manifest["tokenizer"]["fingerprint"],
                    dtype=DTYPES.get(dtype), overwrite=overwrite, say=say)
    return out_dir
