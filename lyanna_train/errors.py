"""The one exception type that reaches users as a one-line message, and how OS errors are worded.

Raise :class:`LyannaError` for anything the *user* can fix (a missing file, a bad
flag, a mismatched artifact, a full or read-only disk); the CLIs print its message
without a traceback and exit non-zero. Programming errors stay ordinary exceptions.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path


class LyannaError(Exception):
    """A problem with the user's input, stated in one line."""


def os_error_line(err: OSError, path: str | os.PathLike | None = None) -> str:
    """``PATH: cause`` for an OSError (``PATH: Read-only file system``), naming the file it concerns."""
    where = err.filename if err.filename is not None else path
    cause = err.strerror or type(err).__name__
    return f"{where}: {cause}" if where is not None else cause


# Writers that hide the errno: safetensors (Rust) says "os error 28"; torch's zip writer
# says "unexpected pos", "file write failed" or "basic_ios::clear: iostream error".
_RUST_OS_ERROR = re.compile(r"os error (\d+)")
_TORCH_WRITE_FAILURE = ("inline_container", "iostream error", "file write failed", "PytorchStreamWriter")


def write_failure(err: BaseException, where: str | os.PathLike) -> str | None:
    """The cause of a failed write to ``where`` in words, or None when ``err`` is not about writing.

    Call it before cleaning up: for torch's writer, which hides the errno, the cause is
    read from the disk (a disk with almost nothing free was full).
    """
    if isinstance(err, OSError):
        return err.strerror or type(err).__name__
    text = str(err)
    match = _RUST_OS_ERROR.search(text)
    if match:
        return os.strerror(int(match.group(1)))
    if isinstance(err, RuntimeError) and any(marker in text for marker in _TORCH_WRITE_FAILURE):
        path = Path(where).absolute()
        while not path.exists() and path != path.parent:
            path = path.parent
        free = shutil.disk_usage(path).free
        if free < 4 * 2**20:
            return f"No space left on device ({free:,} bytes free)"
        return "write failed: " + (text.strip().splitlines() or [""])[0][:160]
    return None
