"""The on-disk feature cache: its layout, its checks, and a streaming reader for training.

Layout of a cache directory (written by :mod:`.feature_cache_writer`)::

    manifest.json                      settings, fingerprints and the shard plan
    shards/shard-00007.safetensors     aux [N, k*H] and last [N, H] in the manifest's ``dtype``
                                       (bf16, or fp8 with fp32 aux_scale [N, k] and last_scale
                                       [N, 1]: :mod:`.feature_dtype`), input_ids [N] int32,
                                       loss_mask [N] bool, offsets [n+1], sample_index [n],
                                       teacher_top1 [N] int32 and teacher_lse [N] fp32: the
                                       full-vocabulary top-1 and logsumexp of lm_head(last)
                                       (absent from caches written before them: training
                                       then computes them)
    shards/shard-00007.json            index entry: sha256 and size of the file above

Samples are packed back to back in a shard: sample j is rows ``offsets[j]:offsets[j+1]``.
A cache is complete when every shard the manifest plans has an index entry made from
the same inputs; the reader refuses an incomplete cache, one made with another target,
tokenizer, layer choice or feature dtype, and any shard whose bytes do not match its checksum.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..errors import LyannaError
from .feature_dtype import DEFAULT, bytes_per_value, read_rows, scale_bytes_per_token

FORMAT = "lyanna-feature-cache"
VERSION = 1
SHARDS = "shards"
FEATURE_KEYS = ("aux", "last", "loss_mask", "teacher_top1", "teacher_lse")  # per-token rows besides input_ids


def shard_path(root: Path, shard: int) -> Path:
    return Path(root) / SHARDS / f"shard-{shard:05d}.safetensors"


def entry_path(root: Path, shard: int) -> Path:
    return Path(root) / SHARDS / f"shard-{shard:05d}.json"


def bytes_per_token(aux_size: int, hidden_size: int, feature_dtype: str = DEFAULT) -> int:
    """Disk bytes per token: aux and last in ``feature_dtype`` (and their fp8 scales), int32 id,
    bool mask, int32 + fp32 teacher summary (offsets are per sample)."""
    return ((aux_size + hidden_size) * bytes_per_value(feature_dtype)
            + scale_bytes_per_token(feature_dtype, aux_size // hidden_size) + 4 + 1 + 8)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def read_entry(root: Path, shard: int) -> dict | None:
    try:
        return json.loads(entry_path(root, shard).read_text())
    except (OSError, ValueError):
        return None


def shard_problem(root: Path, planned: dict, verify_checksum: bool = True) -> str | None:
    """Why shard ``planned["shard"]`` is not complete and valid on disk, or None when it is."""
    k = planned["shard"]
    entry = read_entry(root, k)
    path = shard_path(root, k)
    if entry is None:
        return "partial (no index entry)" if path.exists() else "missing"
    if entry.get("inputs_sha256") != planned["inputs_sha256"]:
        return "made from other samples"
    try:
        size = path.stat().st_size
    except OSError:
        return "file missing"
    if size != entry.get("bytes"):
        return f"size {size} != {entry.get('bytes')} recorded (truncated?)"
    if verify_checksum and file_sha256(path) != entry.get("sha256"):
        return "checksum mismatch (corrupted)"
    return None


def load_checked_shard(root: Path, k: int, entry: dict) -> dict[str, torch.Tensor]:
    """The tensors of shard ``k`` as stored, after checking its bytes against its index ``entry``."""
    from safetensors.torch import load

    data = shard_path(root, k).read_bytes()
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise LyannaError(f"feature cache {root}, shard {k}: checksum mismatch (corrupted); "
                          "run the build again to redo it")
    return load(data)


def read_manifest(root: Path) -> dict | None:
    try:
        manifest = json.loads((Path(root) / "manifest.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise LyannaError(f"cannot read {root}/manifest.json: {err}") from None
    if manifest.get("format") != FORMAT:
        raise LyannaError(f"{root} is not a feature cache (manifest format {manifest.get('format')!r})")
    if manifest.get("version") != VERSION:
        raise LyannaError(f"feature cache {root} has format version {manifest.get('version')}, expected {VERSION}")
    return manifest


def _expect(root: Path, what: str, have, want) -> None:
    if want is not None and have != want:
        raise LyannaError(f"feature cache {root} was made with {what} {have}, not {want}: "
                          f"rebuild the cache for this {what}")


class FeatureCache:
    """A complete cache, checked against the fingerprints the caller expects.

    Shard checksums are verified whenever a shard is loaded (its bytes are read anyway);
    :meth:`verify` checks them all up front.
    """

    def __init__(self, root: str | Path, target_fingerprint: str | None = None,
                 tokenizer_fingerprint: str | None = None, layer_ids: Sequence[int] | None = None,
                 feature_dtype: str | None = None):
        self.root = Path(root)
        manifest = read_manifest(self.root)
        if manifest is None:
            raise LyannaError(f"{self.root} is not a feature cache (no manifest.json)")
        _expect(self.root, "target", manifest["target"]["fingerprint"], target_fingerprint)
        _expect(self.root, "tokenizer", manifest["tokenizer"], tokenizer_fingerprint)
        _expect(self.root, "layer ids", manifest["layers"]["ids"], None if layer_ids is None else list(layer_ids))
        _expect(self.root, "feature dtype", manifest.get("dtype"), feature_dtype)
        self.manifest = manifest
        self.entries = [read_entry(self.root, p["shard"]) for p in manifest["shards"]]
        missing = [p["shard"] for p, e in zip(manifest["shards"], self.entries)
                   if e is None or e.get("inputs_sha256") != p["inputs_sha256"]]
        if missing:
            raise LyannaError(f"feature cache {self.root} is incomplete: {len(missing)} of {len(self.entries)} "
                              f"shards missing (first: shard {missing[0]}); run the build again (every --shard I/N)")

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest["layers"]["ids"])

    @property
    def num_samples(self) -> int:
        return self.manifest["totals"]["samples"]

    @property
    def num_tokens(self) -> int:
        return self.manifest["totals"]["tokens"]

    def __len__(self) -> int:
        """Number of shards."""
        return len(self.entries)

    def verify(self) -> None:
        """Check every shard's size and checksum now (reads the whole cache)."""
        for planned in self.manifest["shards"]:
            problem = shard_problem(self.root, planned)
            if problem is not None:
                raise LyannaError(f"feature cache {self.root}, shard {planned['shard']}: {problem}; "
                                  "run the build again to redo it")

    def load_shard(self, k: int) -> dict[str, torch.Tensor]:
        """All tensors of shard ``k`` as stored (features encoded: decode rows with
        :func:`~.feature_dtype.read_rows`), after checking its bytes against the index entry."""
        return load_checked_shard(self.root, k, self.entries[k])

    def iter_samples(self, shards: Sequence[int] | None = None) -> Iterator[dict]:
        """Per-sample dicts from ``shards`` (default: all), in stored order, for inspection;
        training reads whole shards through its batch plan (``training.batches``)."""
        for k in range(len(self)) if shards is None else shards:
            t = self.load_shard(k)
            for j in range(len(t["sample_index"])):
                a, b = int(t["offsets"][j]), int(t["offsets"][j + 1])
                # clone: a view would keep the whole shard alive
                yield {"index": int(t["sample_index"][j]), "input_ids": t["input_ids"][a:b].long(),
                       **{key: read_rows(t, key, a, b).clone() for key in FEATURE_KEYS if key in t}}
