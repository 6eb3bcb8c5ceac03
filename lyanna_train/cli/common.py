"""What every console entry point shares: one-line errors and clean warnings."""

from __future__ import annotations

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


def entry_point(prog: str):
    """Wrap ``main(argv) -> int``: user errors become ``prog: error: ...`` and exit 2."""

    def decorate(main):
        @functools.wraps(main)
        def wrapper(argv=None) -> int:
            from ..errors import LyannaError, os_error_line

            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            warnings.formatwarning = _format_warning
            try:
                return main(sys.argv[1:] if argv is None else argv) or 0
            except LyannaError as err:
                print(f"{prog}: error: {err}", file=sys.stderr)
                return 2
            except OSError as err:  # a read-only or full disk, a permission: the path and the cause
                print(f"{prog}: error: {os_error_line(err)}", file=sys.stderr)
                return 2
            except KeyboardInterrupt:
                print(f"{prog}: interrupted; nothing partial was left behind", file=sys.stderr)
                return 130

        return wrapper

    return decorate
