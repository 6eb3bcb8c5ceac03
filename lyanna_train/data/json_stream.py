"""Streaming JSON readers that survive real-world files.

* :func:`iter_json_array` streams the records of a top-level JSON array in bounded
  memory and, when the file is truncated mid-record (the embedded ShareGPT file is),
  yields every complete record and then a :class:`Truncated` event naming the byte
  offset where the damage starts.
* :func:`iter_jsonl` yields one record per line and a :class:`Malformed` event for
  each line that is not valid JSON, so callers can count, report or refuse them.
"""

from __future__ import annotations

import codecs
import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator, Union

_CHUNK = 1 << 20
_WS = " \t\r\n,"


@dataclass(frozen=True)
class Malformed:
    """A record that could not be parsed: ``where`` is ``file:line`` or ``file@byte``."""

    where: str
    reason: str


@dataclass(frozen=True)
class Truncated:
    """The file ends inside a record; records before ``byte_offset`` were all recovered."""

    path: str
    byte_offset: int
    records: int


Event = Union[dict, list, str, int, float, None, Malformed, Truncated]


def open_binary(path: Path) -> IO[bytes]:
    """Open a file for reading, transparently un-gzipping ``*.gz``."""
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def iter_json_array(path: Path) -> Iterator[Event]:
    """Yield the elements of the top-level JSON array in ``path``, one at a time.

    Memory is bounded by the largest record plus one chunk, not by the file.
    """
    decoder = json.JSONDecoder()
    text_decoder = codecs.getincrementaldecoder("utf-8-sig")()
    buf, pos, consumed_bytes, records, eof = "", 0, 0, 0, False
    with open_binary(path) as fh:

        def fill() -> bool:
            nonlocal buf, pos, consumed_bytes, eof
            chunk = fh.read(_CHUNK)
            eof = not chunk
            consumed_bytes += len(buf[:pos].encode("utf-8"))
            buf = buf[pos:] + text_decoder.decode(chunk, final=eof)
            pos = 0
            return not eof

        fill()
        while True:  # find the opening bracket
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or eof:
                break
            fill()
        if pos >= len(buf) or buf[pos] != "[":
            yield Malformed(f"{path}@0", "expected a JSON array ('[' ...)")
            return
        pos += 1
        while True:
            while pos < len(buf) and buf[pos] in _WS:
                pos += 1
            if pos >= len(buf):
                if eof:  # no closing bracket: the file stops between records
                    yield Truncated(str(path), consumed_bytes + len(buf.encode("utf-8")), records)
                    return
                fill()
                continue
            if buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as err:
                # Running out of text looks like an error within a literal's length of the
                # buffer's end (or an unterminated string); anything earlier is a real error.
                incomplete = err.pos >= len(buf) - 8 or err.msg.startswith("Unterminated string")
                if incomplete and not eof:
                    fill()
                    continue
                offset = consumed_bytes + len(buf[:pos].encode("utf-8"))
                if incomplete:
                    yield Truncated(str(path), offset, records)
                else:  # an array cannot be re-synchronised after a syntax error
                    yield Malformed(f"{path}@{offset}", err.msg)
                return
            if end >= len(buf) and not eof:
                fill()  # a number or literal could continue; re-parse with more data
                continue
            records += 1
            yield obj
            pos = end


def iter_jsonl(path: Path) -> Iterator[Event]:
    """Yield one parsed record per non-blank line; bad lines become :class:`Malformed`."""
    with open_binary(path) as fh:
        for lineno, raw in enumerate(fh, start=1):
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                yield Malformed(f"{path}:{lineno}", err.msg)
