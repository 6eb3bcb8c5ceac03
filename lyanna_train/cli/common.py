"""What every console entry point shares: one-line errors and clean warnings."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings


def parse_shard(text: str) -> tuple[int, int]:
    """``I/N`` -> (I, N), for every ``--shard`` flag (argparse ``type=``)."""
    import argparse

    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N (e.g. 0/4), got {text!r}") from None
    return i, n


def _format_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def user_error_status(prog: str, err: BaseException) -> int | None:
    """Print a user's error as one line (``prog: error: ...``) and return its exit status: 2,
    or 130 for Ctrl-C. None for anything else: a bug, whose traceback the caller lets through."""
    from ..errors import LyannaError, os_error_line

    if isinstance(err, LyannaError):
        line, status = f"{prog}: error: {err}", 2
    elif isinstance(err, OSError):  # a read-only or full disk, a permission: the path and the cause
        line, status = f"{prog}: error: {os_error_line(err)}", 2
    elif isinstance(err, KeyboardInterrupt):
        line, status = f"{prog}: interrupted; nothing partial was left behind", 130
    else:
        return None
    print(line, file=sys.stderr)
    return status


def entry_point(prog: str):
    """Wrap ``main(argv) -> int``: user errors become ``prog: error: ...`` and exit 2."""

    def decorate(main):
        @functools.wraps(main)
        def wrapper(argv=None) -> int:
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            warnings.formatwarning = _format_warning
            try:
                return main(sys.argv[1:] if argv is None else argv) or 0
            except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - anything else is re-raised
                status = user_error_status(prog, err)
                if status is None:
                    raise
                return status

        return wrapper

    return decorate


@contextlib.contextmanager
def exit_on_user_error(prog: str):
    """:func:`entry_point`'s handling for code that cannot return a status: the same line,
    then ``SystemExit``. For Hydra's task function, whose own handler would print a traceback
    and exit 1 before an error could reach the entry point."""
    try:
        yield
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - anything else is re-raised
        status = user_error_status(prog, err)
        if status is None:
            raise
        raise SystemExit(status) from None
