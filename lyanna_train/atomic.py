"""Atomic writes: an interrupted run never leaves something that looks complete.

Files are written to a temporary sibling and renamed into place; directories are
built in a hidden temporary sibling and renamed only once everything is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from .errors import LyannaError


def _tmp_sibling(path: Path, tag: str) -> Path:
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    tmp = _tmp_sibling(path, "tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def check_output_dir(path: str | os.PathLike, overwrite: bool) -> Path:
    """Fail *before* any work if ``path`` exists and may not be replaced."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise LyannaError(f"output directory {path} already exists (pass --overwrite to replace it)")
    if path.exists() and not path.is_dir():
        raise LyannaError(f"output path {path} exists and is not a directory")
    return path


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``path`` only if the block succeeds.

    On any exception (KeyboardInterrupt included) the temporary directory is removed
    and ``path`` is left exactly as it was.
    """
    path = check_output_dir(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path, "partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = _tmp_sibling(path, "old")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
