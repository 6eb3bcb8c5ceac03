"""An export proves its own bytes: per-file sha256 in the manifest, and finite weights.

Flipped bytes inside a tensor leave a safetensors file perfectly readable, and an
all-NaN tensor decodes without complaint (the draft then just never gets accepted):
both must be refused when the export is loaded, naming the file or the tensor. The
writer records the digest of every file it wrote; the reader checks them before
reading any weights.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..errors import LyannaError

_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def digests(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root`` but ``skip`` (the manifest holding them)."""
    return {path.relative_to(root).as_posix(): file_sha256(path) for path in sorted(root.rglob("*"))
            if path.is_file() and path.relative_to(root).as_posix() not in skip}


def check_digests(manifest: dict, root: Path, manifest_file: Path) -> None:
    """The manifest lists exactly the files the directory holds (the manifest aside), each with
    the sha256 it has: a file left out of the map would be read unchecked, so an export that
    ships one, or names one it lacks, is refused (one line naming the first)."""
    recorded = manifest.get("sha256")
    if not isinstance(recorded, dict) or not recorded:
        raise LyannaError(f"{manifest_file} records no sha256 of its files (an export made before checksums "
                          "existed?): export the checkpoint again")
    for name in recorded:
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
            raise LyannaError(f"{manifest_file}: the sha256 entry {name!r} is not a file inside the export")
    shipped = sorted(path.relative_to(root).as_posix() for path in root.rglob("*")
                     if path.is_file() and path != manifest_file)
    unrecorded = [name for name in shipped if name not in recorded]
    if unrecorded:
        raise LyannaError(f"{root / unrecorded[0]} has no sha256 in {manifest_file.name}: an export lists every "
                          "file it ships; export the checkpoint again")
    for name, want in recorded.items():
        path = root / name
        if not path.is_file():
            raise LyannaError(f"missing {name} in {root} (the manifest lists it)")
        have = file_sha256(path)
        if have != want:
            raise LyannaError(f"{path} is corrupted: its sha256 {have[:16]}... is not the {want[:16]}... "
                              f"{manifest_file.name} recorded when it was written")


def check_finite(state: dict[str, torch.Tensor], where: Path | str) -> None:
    """Refuse weights holding NaN or infinity, naming the first such tensor."""
    for name, tensor in state.items():
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise LyannaError(f"{where}: tensor {name} holds {bad:,} non-finite values (NaN or inf) "
                                  f"of {tensor.numel():,}: these weights are unusable")
