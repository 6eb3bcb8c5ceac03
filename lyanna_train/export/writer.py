"""Export a training checkpoint to a serving directory that describes itself.

The directory (``model.safetensors``, ``config.json``, ``hot_vocab.safetensors``,
``manifest.json``) is built in a hidden sibling and renamed into place only when
complete. The manifest records what a reader must check (target and tokenizer
fingerprints, the sha256 of every file) and what a reader wants to know (training
config, final metrics). All of it comes from the checkpoint itself (``run.json``,
written with every checkpoint), never from the run folder around it, so a checkpoint
copied elsewhere exports the same and exporting does not load the target.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from .. import __version__
from ..atomic import atomic_directory, check_output_dir
from ..errors import LyannaError
from ..locks import output_lock
from ..models.config import DraftConfig
from ..run_record import RUN_RECORD, latest_checkpoint, read_run_record
from . import formats as F
from . import serving_engines
from .integrity import check_finite, digests
from .reader import check_state, read_json, read_tensors

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory itself, or the latest complete checkpoint of a run (or checkpoints) directory."""
    path = Path(path)
    if not path.is_dir():
        raise LyannaError(f"checkpoint or run directory not found: {path}")
    if (path / "draft_config.json").is_file():
        return path
    for root in (path / "checkpoints", path):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise LyannaError(f"{path} holds no complete checkpoint (step-NNNNNNNN/ with draft_config.json)")


def read_checkpoint(ckpt: Path) -> tuple[DraftConfig, dict, dict]:
    """(DraftConfig, extra keys of draft_config.json, DraftHead state dict), checked against each other."""
    config_file = ckpt / "draft_config.json"
    raw = read_json(config_file)
    known = {f.name for f in dataclasses.fields(DraftConfig)}
    cfg = F.config_from_lyanna({k: v for k, v in raw.items() if k in known}, str(config_file))
    state = read_tensors(ckpt / F.WEIGHTS_FILE)
    check_state(state, cfg, config_file, ckpt / F.WEIGHTS_FILE)
    check_finite(state, ckpt / F.WEIGHTS_FILE)
    return cfg, {k: v for k, v in raw.items() if k not in known}, state


def _fingerprint_target(target, target_name: str | None, say: Callable) -> str:
    from ..target.model import load_target_model, target_fingerprint

    if target is None:
        say(f"loading target {target_name} to fingerprint it")
        target = load_target_model(target_name)
    return target_fingerprint(target)


def fingerprints(record: dict | None, ckpt: Path, recorded_name: str | None, target_name: str | None = None,
                 target=None, tokenizer=None, say: Callable = print) -> tuple[dict, dict]:
    """({fingerprint, source}, {fingerprint, source}) of the target and tokenizer the draft was trained on.

    They come from the checkpoint's ``run.json``. A target or tokenizer the caller names
    (``--target``, or objects) is fingerprinted and must match: exporting a draft for a
    target it was not trained on is refused. Checkpoints from before ``run.json`` are
    fingerprinted from the target they name (or ``--target``).
    """
    from ..target.fingerprint import tokenizer_fingerprint

    saved_t = ((record or {}).get("target") or {}).get("fingerprint")
    saved_k = ((record or {}).get("tokenizer") or {}).get("fingerprint")
    source = f"checkpoint {RUN_RECORD}"
    if saved_t is not None:
        t = {"fingerprint": saved_t, "source": source}
        if target is not None or target_name:
            given = _fingerprint_target(target, target_name, say)
            if given != saved_t:
                raise LyannaError(f"{ckpt} was trained on another target than {target_name or 'the one given'}: "
                                  f"checkpoint fingerprint {saved_t}, that target's {given}")
    else:
        name = target_name or recorded_name
        if target is None and not name:
            raise LyannaError(f"{ckpt} does not name its target: pass --target")
        t = {"fingerprint": _fingerprint_target(target, name, say),
             "source": "target model given" if target is not None else f"target {name}"}
    if saved_k is not None:
        k = {"fingerprint": saved_k, "source": source}
        if tokenizer is not None and tokenizer_fingerprint(tokenizer) != saved_k:
            raise LyannaError(f"{ckpt} was trained with another tokenizer: checkpoint fingerprint {saved_k}, "
                              f"the given tokenizer's {tokenizer_fingerprint(tokenizer)}")
    elif tokenizer is not None:
        k = {"fingerprint": tokenizer_fingerprint(tokenizer), "source": "tokenizer given"}
    else:
        from ..target.source import load_tokenizer

        name = target_name or recorded_name
        if not name:
            raise LyannaError(f"{ckpt} does not name its target: pass --target")
        k = {"fingerprint": tokenizer_fingerprint(load_tokenizer(name)), "source": f"tokenizer {name}"}
    return t, k


def format_tensors(state: dict, cfg: DraftConfig, fmt: str, dtype: torch.dtype | None) -> dict:
    """Export names (through the format's table) and dtype; the eagle3 head loses its "other" row."""
    state = dict(state)
    if fmt == F.EAGLE3 and cfg.other_bucket:
        state["lm_head.weight"] = state["lm_head.weight"][: cfg.draft_vocab_size]
    out = F.rename(state, F.NAMES[fmt], "checkpoint")
    if dtype is not None:
        out = {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}
    return {k: v.contiguous() for k, v in out.items()}


def base_manifest(fmt: str, cfg: DraftConfig, target_info: dict, tokenizer_info: dict) -> dict:
    """What every export's manifest starts with: what it is, and what a reader must check."""
    return {
        "kind": F.KIND, "version": F.VERSION, "format": fmt, "lyanna_train": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "files": {"weights": F.WEIGHTS_FILE, "config": F.CONFIG_FILE, "hot_vocab": F.hot_vocab_file(fmt)},
        "target": target_info,
        "tokenizer": tokenizer_info,
        "aux_layers": {"ids": [int(i) for i in cfg.aux_layer_ids], "convention": F.AUX_CONVENTION,
                       "sglang": F.sglang_layer_ids(cfg.aux_layer_ids), "vllm": F.vllm_layer_ids(cfg.aux_layer_ids)},
    }


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, fmt: str = F.LYANNA, **options) -> Path:
    """Write ``out_dir`` from a checkpoint (or a run's latest one); returns the checkpoint used.

    ``out_dir`` has one writer at a time (a second export there stops at once, naming the first).
    Options: ``target``, ``tokenizer``, ``target_name``, ``dtype``, ``overwrite``, ``speculators``,
    ``verifier``, ``speculative_tokens``, ``embeddings`` (eagle3: also store the verifier's
    ``embed_tokens.weight`` beside the head, as SpecForge does, for speculators' converter,
    whose output otherwise loads uninitialised), ``say``.
    """
    with output_lock(out_dir):
        return _export(checkpoint_dir, out_dir, fmt, **options)


def _export(checkpoint_dir: str | Path, out_dir: str | Path, fmt: str = F.LYANNA, *,
            target=None, tokenizer=None, target_name: str | None = None, dtype: str | None = None,
            overwrite: bool = False, speculators: bool = False, verifier: str | None = None,
            speculative_tokens: int = 3, embeddings: bool = False, say: Callable = print) -> Path:
    if fmt not in F.FORMATS:
        raise LyannaError(f"unknown export format {fmt!r} (choose from {', '.join(F.FORMATS)})")
    if dtype is not None and dtype not in DTYPES:
        raise LyannaError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if (speculators or embeddings) and fmt != F.EAGLE3:
        raise LyannaError("--speculators-config and --with-embeddings belong to the eagle3 format")
    ckpt = resolve_checkpoint(checkpoint_dir)
    # the run folder named, not only its checkpoint: --out RUN/features --overwrite would delete its features
    out_dir = check_output_dir(out_dir, overwrite, inputs=(checkpoint_dir, ckpt, target_name, verifier))
    cfg, extra, state = read_checkpoint(ckpt)
    cfg, state = F.fold_aux_scale(cfg, state)
    if fmt == F.EAGLE3:
        F.check_eagle3(cfg)
    record = read_run_record(ckpt)  # export reads the checkpoint alone, never the run folder around it
    step = int(ckpt.name.split("-")[-1]) if ckpt.name.startswith("step-") else None
    say(f"exporting {ckpt} ({fmt} format)")
    target_info, tokenizer_info = fingerprints(record, ckpt, extra.get("target"), target_name, target, tokenizer, say)
    target_name = target_name or ((record or {}).get("target") or {}).get("name") or extra.get("target")
    dropped = [] if fmt == F.LYANNA else [p for p, on in (("state pool", cfg.pool_size > 0),
                                                           ("alpha-gate", cfg.pool_enabled),
                                                           ("other-bucket logit", cfg.other_bucket)) if on]
    manifest = {
        **base_manifest(fmt, cfg, {"name": target_name, **target_info}, tokenizer_info),
        "dropped": dropped,
        "training": {"checkpoint": str(ckpt.resolve()), "step": step, "draft_config": {**F.lyanna_config(cfg), **extra},
                     "run_config": (record or {}).get("config")},
        "metrics": (record or {}).get("metrics"),
    }
    engine_verifier = None
    if fmt == F.EAGLE3:
        engine_verifier = _verifier_for_engines(target_name, verifier, target, required=speculators or embeddings)
        manifest["verifier"] = engine_verifier
        manifest["serving"] = serving_engines.serving_commands(
            out_dir, cfg, (engine_verifier or {}).get("name_or_path") or verifier or target_name or "TARGET",
            speculative_tokens, speculators, embeddings)
    for note in (manifest.get("serving") or {}).get("notes", []):
        say(f"note: {note}")
    embed = serving_engines.speculators_embeddings(engine_verifier, cfg, target) if speculators or embeddings else None
    write_directory(out_dir, cfg, state, fmt, manifest, tokenizer_info["fingerprint"], dtype=DTYPES.get(dtype),
                    overwrite=overwrite, speculators=(engine_verifier, speculative_tokens) if speculators else None,
                    embed=embed, embed_in_root=embeddings, say=say)
    return ckpt


def _verifier_for_engines(target_name, verifier, target, required: bool) -> dict | None:
    """The verifier as engines open it; without --speculators-config a failure only leaves it unrecorded."""
    try:
        return serving_engines.resolve_verifier(target_name, verifier, target)
    except LyannaError:
        if required:
            raise
        return None


def write_directory(out_dir: Path, cfg: DraftConfig, state: dict, fmt: str, manifest: dict, tokenizer_fp: str, *,
                    dtype: torch.dtype | None = None, overwrite: bool = False, speculators: tuple | None = None,
                    embed: torch.Tensor | None = None, embed_in_root: bool = False, say: Callable = print) -> None:
    """Write an export directory atomically from a DraftHead state dict and its manifest (with
    the sha256 of every file, which the reader checks).

    ``speculators``: (verifier {"name_or_path", "architectures"}, speculative tokens) to add the
    ``speculators/`` directory, which carries ``embed`` (the verifier's embeddings), as the
    root's weights do with ``embed_in_root``.
    Shared by :func:`export_checkpoint` and the importer, so both write one layout.
    """
    from safetensors.torch import save_file

    from ..hotvocab.artifact import save_hot_vocab
    from ..hotvocab.selection import HotVocab

    tensors = format_tensors(state, cfg, fmt, dtype)
    dtype_name = str(tensors["fc.weight"].dtype).removeprefix("torch.")
    if embed is not None:
        embed = embed.detach().to(tensors["fc.weight"].dtype).contiguous()
    config = F.lyanna_config(cfg) if fmt == F.LYANNA else F.eagle3_config(cfg, dtype_name)
    if speculators:
        manifest["files"]["speculators"] = f"{F.SPECULATORS_DIR}/{F.CONFIG_FILE}"
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        root = {**tensors, F.EMBED_TOKENS: embed} if embed_in_root else tensors
        save_file(root, str(tmp / F.WEIGHTS_FILE), metadata={"format": "pt", "lyanna_export": fmt})
        (tmp / F.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        hot = HotVocab(state["d2t"] + torch.arange(len(state["d2t"])), state["d2t"], state["t2d"])
        hot_file = tmp / F.hot_vocab_file(fmt)
        hot_file.parent.mkdir(exist_ok=True)
        os.replace(hot_file.parent / save_hot_vocab(hot_file.parent, hot, tokenizer_fp), hot_file)
        if speculators:
            serving_engines.write_speculators(tmp, cfg, tensors, *speculators, dtype_name, embed)
        manifest["sha256"] = digests(tmp, skip=(F.MANIFEST_FILE,))  # checked by the reader
        (tmp / F.MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        for path in tmp.rglob("*"):  # safetensors writes 0600; a serving directory is read by other users
            if path.is_file():
                path.chmod(0o644)
    size = (Path(out_dir) / F.WEIGHTS_FILE).stat().st_size / 2**20
    dropped = manifest.get("dropped") or []
    say(f"wrote {out_dir}: {len(tensors)} tensors, {size:.1f} MiB" +
        (f"; left out (not expressible in EAGLE-3 engines): {', '.join(dropped)}" if dropped else ""))
