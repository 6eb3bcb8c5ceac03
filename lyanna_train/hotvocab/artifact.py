"""The hot-vocabulary artifact: the on-disk interface later stages read.

Directory layout (names are an interface, keep them)::

    counts.safetensors      counts, heldout_counts: int64 [vocab]
    hot-<size>.safetensors  hot_ids, d2t: int64 [size]; t2d: bool [vocab]
    manifest.json           provenance + selections (written last)
    coverage.png, report.md
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import LyannaError
from .selection import HotVocab

FORMAT = "lyanna.hotvocab"
VERSION = 1
COUNTS_FILE = "counts.safetensors"
MANIFEST_FILE = "manifest.json"


def hot_file_name(size: int) -> str:
    return f"hot-{size}.safetensors"


def save_counts(directory: Path, counts: np.ndarray, heldout_counts: np.ndarray) -> None:
    save_file(
        {"counts": torch.from_numpy(counts.astype(np.int64)), "heldout_counts": torch.from_numpy(heldout_counts.astype(np.int64))},
        str(directory / COUNTS_FILE),
    )


def save_hot_vocab(directory: Path, hot: HotVocab, fingerprint: str) -> str:
    name = hot_file_name(hot.size)
    meta = {"format": FORMAT, "tokenizer_fingerprint": fingerprint, "size": str(hot.size), "vocab_size": str(len(hot.t2d))}
    save_file({"hot_ids": hot.hot_ids, "d2t": hot.d2t, "t2d": hot.t2d}, str(directory / name), metadata=meta)
    return name


def read_manifest(directory: str | Path) -> dict:
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not directory.is_dir():
        raise LyannaError(f"hot-vocabulary directory not found: {directory}")
    if not path.is_file():
        raise LyannaError(f"{directory} is not a complete hot-vocabulary artifact (no {MANIFEST_FILE})")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise LyannaError(f"{path} is not valid JSON: {err.msg}") from None
    if manifest.get("format") != FORMAT:
        raise LyannaError(f"{directory} is not a hot-vocabulary artifact (format {manifest.get('format')!r})")
    return manifest


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise LyannaError(f"cannot read {path}: {err}") from None


def load_counts(directory: str | Path) -> tuple[dict, np.ndarray, np.ndarray]:
    """(manifest, train counts, held-out counts) of a count directory."""
    manifest = read_manifest(directory)
    tensors = _load_tensors(Path(directory) / COUNTS_FILE)
    return manifest, tensors["counts"].numpy(), tensors["heldout_counts"].numpy()


def load_hot_vocab(path: str | Path, size: Optional[int] = None, expect_fingerprint: Optional[str] = None) -> HotVocab:
    """Load a hot vocabulary from a ``hot-<size>.safetensors`` file or an artifact directory.

    With a directory, ``size`` picks the selection (default: the smallest). A
    fingerprint mismatch means the map was built for another tokenizer: refused.
    """
    path = Path(path)
    if path.is_dir():
        manifest = read_manifest(path)
        sizes = sorted(s["size"] for s in manifest["selections"])
        if not sizes:
            raise LyannaError(f"{path} holds no hot-vocabulary selection")
        if size is None:
            size = sizes[0]
        if size not in sizes:
            raise LyannaError(f"{path} has no selection of size {size} (available: {sizes})")
        path = path / hot_file_name(size)
    if not path.is_file():
        raise LyannaError(f"hot-vocabulary file not found: {path}")
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as fh:
            meta = fh.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise LyannaError(f"cannot read {path}: {err}") from None
    if expect_fingerprint and meta.get("tokenizer_fingerprint") != expect_fingerprint:
        raise LyannaError(
            f"{path} was built for another tokenizer (fingerprint {meta.get('tokenizer_fingerprint', '?')[:19]}…, "
            f"expected {expect_fingerprint[:19]}…)"
        )
    t = _load_tensors(path)
    return HotVocab(t["hot_ids"], t["d2t"], t["t2d"])
