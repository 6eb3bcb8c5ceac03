"""Atomic writes (an interrupted run never leaves something that looks complete), and
checked reads of what they wrote.

Files are written to a temporary sibling and renamed into place; directories are
built in a hidden temporary sibling and renamed only once everything is written.
Temporary siblings carry the writer's pid (``.<name>.partial-<pid>``), so the next
run in that folder removes those of processes that no longer exist (killed with
``kill -9``, or on a machine that lost power). Writability is checked before long work
(:func:`check_writable`), so a read-only or missing folder fails in the first second,
and an output that is, holds or lies inside what the command reads is refused whatever
``--overwrite`` says (:func:`check_apart`): replacing it would delete the input.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

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
        cause = err.strerror or str(err)
        if err.errno == errno.ENOENT:  # the folder is there: its filesystem takes no new files (/proc, /sys)
            kind = _filesystem_type(probe_dir)
            cause = f"files cannot be created there ({kind + ' ' if kind else ''}filesystem)"
        raise LyannaError(f"cannot write {what} {path}: {probe_dir}: {cause}") from None
    return path


def _filesystem_type(path: Path) -> str | None:
    """The type of the filesystem ``path`` is on (``proc``, ``sysfs``, ``ext4``), from the mount table."""
    real, best = os.path.realpath(path), (-1, None)
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and (real == fields[1] or real.startswith(fields[1].rstrip("/") + "/")):
                best = max(best, (len(fields[1]), fields[2]))
    return best[1]


def check_apart(output: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], flag: str = "--out") -> None:
    """Refuse an ``output`` that is, contains or lies inside one of the ``inputs`` that exist
    on disk (symlinks and relative paths resolved), whatever ``--overwrite`` says: writing it
    would replace or mix with what the command reads (``lyanna-export RUN --out RUN`` deleted the run)."""
    out = Path(os.path.realpath(output))
    found = []  # (severity, relation, input): the one that would lose most is named
    for given in inputs:
        if given is None or not os.path.exists(given):
            continue  # a name (an embedded model or corpus), not a path
        source = Path(os.path.realpath(given))
        for severity, (relation, overlaps) in enumerate((("is", out == source), ("contains", source.is_relative_to(out)),
                                                         ("lies inside", out.is_relative_to(source)))):
            if overlaps:
                found.append((severity, relation, given))
                break
    if found:
        _, relation, given = min(found, key=lambda f: f[0])
        raise LyannaError(f"{flag} {output} {relation} the input {given}: writing it would "
                          f"{'change' if relation == 'lies inside' else 'replace'} what this command reads; "
                          "choose an output outside it")


def check_output_dir(path: str | os.PathLike, overwrite: bool, inputs: Iterable = ()) -> Path:
    """Fail *before* any work if ``path`` exists and may not be replaced, overlaps one of
    ``inputs`` (:func:`check_apart`), or cannot be written."""
    path = Path(path)
    check_apart(path, inputs)
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
