"""Atomic writes (an interrupted run never leaves something that looks complete), and
checked reads of what they wrote.

Files are written to a temporary sibling and renamed into place; directories are
built in a hidden temporary sibling and renamed only once everything is written.
Temporary siblings carry the writer's pid (``.<name>.partial-<pid>``), so the next
run in that folder removes those of processes that no longer exist (killed with
``kill -9``, or on a machine that lost power). Writability is checked before long work
(:func:`check_writable`), so a read-only or missing folder fails in the first second.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import LyannaError, os_error_line, write_failure

_TEMPORARY = re.compile(r"^\..+\.(partial|tmp|old)-(\d+)$")


def _tmp_sibling(path: Path, tag: str) -> Path:
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}")


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete ``.<name>.{partial,tmp,old}-<pid>`` entries of ``directory`` whose process is gone."""
    directory = Path(directory)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        match = _TEMPORARY.match(entry.name)
        if match is None or pid_alive(int(match.group(2))):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
    return removed


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    tmp = _tmp_sibling(path, "tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def read_json(path: Path) -> dict:
    """A JSON object from ``path``; a missing or malformed file is a one-line error naming it."""
    if not path.is_file():
        raise LyannaError(f"missing {path.name} in {path.parent}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LyannaError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(obj, dict):
        raise LyannaError(f"{path} does not hold a JSON object")
    return obj


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(path: str | os.PathLike, what: str = "output") -> Path:
    """Fail with one line unless files can be created where ``path`` lives (or will be created).

    Tries the real thing (creating and removing a temporary file), because permission
    bits say nothing about read-only mounts, root, ACLs or quotas.
    """
    path = Path(path)
    probe_dir = path if path.is_dir() else _nearest_existing(path.parent)
    if not probe_dir.is_dir():
        raise LyannaError(f"cannot write {what} {path}: {probe_dir} is not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=probe_dir, prefix=".lyanna-write-probe-"):
            pass
    except OSError as err:
        raise LyannaError(f"cannot write {what} {path}: {probe_dir}: {err.strerror or err}") from None
    return path


def check_output_dir(path: str | os.PathLike, overwrite: bool) -> Path:
    """Fail *before* any work if ``path`` exists and may not be replaced, or cannot be written."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise LyannaError(f"output directory {path} already exists (pass --overwrite to replace it)")
    if path.exists() and not path.is_dir():
        raise LyannaError(f"output path {path} exists and is not a directory")
    check_writable(path, "output directory")
    return path


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``path`` only if the block succeeds.

    On any exception (KeyboardInterrupt and a full disk included) the temporary
    directory is removed and ``path`` is left exactly as it was; an ``OSError`` becomes
    one line naming the file and the cause.
    """
    path = check_output_dir(path, overwrite)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise LyannaError(f"cannot create {path}: {os_error_line(err, path.parent)}") from None
    remove_stale_temporaries(path.parent)
    tmp = _tmp_sibling(path, "partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        yield tmp
        old = _tmp_sibling(path, "old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    except Exception as err:  # noqa: BLE001 - a failed write is reworded, anything else re-raised
        cause = write_failure(err, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if cause is None:
            raise
        raise LyannaError(f"cannot write {path}: {cause} (nothing was left behind)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
