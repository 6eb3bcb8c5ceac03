"""One writer per folder: a lock that names its holder and dies with it.

Two runs in one run folder, or two commands writing the same ``--out``, would overwrite
each other's files, resume from each other's checkpoints and both report success. The
lock is ``filelock``'s ``flock`` on a hidden file, so the kernel frees it when the holder
exits in any way (``kill -9`` included) and no stale lock ever needs breaking. Beside it
the holder writes who it is (pid, host, command, start time), so that the process that
is refused can say whom it is waiting for.

Acquisition never waits: a second writer stops at once with one line, before any work.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

from .errors import LyannaError

_HOLDER_SUFFIX = ".holder"
_HELD: set[str] = set()  # lock files this process holds


def _command() -> str:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        program = f"python -m {spec.name}"  # python -m lyanna_train.cli.train
    else:
        program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    return " ".join([program, *sys.argv[1:]])


def _holder_record() -> dict:
    command = _command()
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": command[:200],
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _describe(holder_file: Path) -> str:
    try:
        record = json.loads(holder_file.read_text(encoding="utf-8"))
        return (f"pid {record['pid']} on {record['host']} ({record['command']}, since {record['since']})")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (which did not record itself yet)"


@contextlib.contextmanager
def hold(lock_file: str | os.PathLike, what: str, hint: str) -> Iterator[None]:
    """Hold ``lock_file`` while the block runs, or raise one line naming the holder.

    ``what`` names the folder in the message ("run folder X"); ``hint`` says what to do.
    """
    from filelock import FileLock, Timeout

    lock_file = Path(lock_file)
    key = str(lock_file.absolute())
    if key in _HELD:  # this process holds it already (a CLI around a library call): nested, not refused
        yield
        return
    holder = lock_file.with_name(lock_file.name + _HOLDER_SUFFIX)
    lock = FileLock(str(lock_file), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise LyannaError(f"{what} is in use by {_describe(holder)}; {hint}") from None
    except OSError as err:
        raise LyannaError(f"cannot lock {what}: {lock_file}: {err.strerror or err}") from None
    tmp = holder.with_name(f"{holder.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(_holder_record()), encoding="utf-8")
        os.replace(tmp, holder)
    except OSError:  # a full disk must not stop the holder; others then see an unnamed holder
        with contextlib.suppress(OSError):
            tmp.unlink()  # (created before the write failed: nothing may be left beside the output)
    _HELD.add(key)
    try:
        yield
    finally:
        _HELD.discard(key)
        # Removed while still held, so no trace is left beside the output. A process that
        # opened the file just before and locks it just after finds it unlinked, which
        # filelock treats as not acquired (it checks the inode's link count).
        for path in (holder, lock_file):
            with contextlib.suppress(OSError):
                path.unlink()
        lock.release()


def run_folder_lock(out_dir: str | os.PathLike):
    """The lock of a training run folder (``<out_dir>/.lock``): one run at a time."""
    out_dir = Path(out_dir)
    return hold(out_dir / ".lock", f"run folder {out_dir}",
                "wait for that run to finish or set another train.out_dir")


def output_lock(path: str | os.PathLike, tag: str = ""):
    """The lock of an output written by a command (``.<name><tag>.lock`` beside it).

    It sits beside the output, not inside, because outputs are built in a temporary
    sibling and renamed into place. ``tag`` separates independent writers of one
    output (the ``--shard I/N`` processes of a feature cache).
    """
    from .atomic import check_writable

    path = Path(path)
    check_writable(path, "output")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise LyannaError(f"cannot create {path.parent}: {err.strerror or err}") from None
    return hold(path.parent / f".{path.name}{tag}.lock", f"{path}" + (f" ({tag.strip('.')})" if tag else ""),
                "wait for it to finish or choose another output")
