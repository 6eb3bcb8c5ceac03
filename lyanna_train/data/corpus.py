"""Resolve ``--corpus`` arguments to files and stream their records in a fixed order.

A corpus argument may be an embedded name (``sharegpt``), a file, a directory (searched
recursively, or loaded with ``datasets.load_from_disk`` when it is a saved dataset) or a
glob. Every record -- malformed ones included -- gets a global index in stream order;
sharding and the held-out split are functions of that index only. A file that cannot be
decoded (a truncated or garbled ``.gz``, a corrupt Parquet file) is one ``LyannaError``
naming it and the cause; a text file holding bytes that are not UTF-8 is read with U+FFFD
in their place and noted (:class:`Binary`), so that the caller can warn with a count.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Union

from ..embedded import EMBEDDED_CORPORA
from ..errors import LyannaError, os_error_line
from .conversations import Document, Skip, to_document
from .json_stream import Malformed, Truncated, iter_json_array, iter_jsonl, open_binary

_SUFFIX_FORMATS = {
    ".json": "json",
    ".json.gz": "json",
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl",
    ".ndjson": "jsonl",
    ".txt": "txt",
    ".txt.gz": "txt",
    ".parquet": "parquet",
}
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
MALFORMED = "malformed JSON"
SUPPORTED = ".json, .jsonl, .txt (optionally .gz), .parquet, or a directory saved by datasets"


@dataclass(frozen=True)
class Source:
    path: str
    fmt: str  # json | jsonl | txt | parquet | hf-disk
    origin: str  # the corpus argument it came from


@dataclass(frozen=True)
class Binary:
    """A text file with ``lines`` lines that are not UTF-8 text (or hold NUL bytes): binary data?"""

    path: str
    lines: int


@dataclass
class ReadNotes:
    """What reading found besides documents: truncations, binary text files, skipped records."""

    truncated: list[Truncated] = field(default_factory=list)
    binary: list[Binary] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    first_skip: dict[str, str] = field(default_factory=dict)  # reason -> example location

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.first_skip.setdefault(reason, where)

    def merge(self, other: "ReadNotes") -> None:
        for reason, n in other.skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n
            self.first_skip.setdefault(reason, other.first_skip[reason])

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())


def _format_of(path: Path) -> str | None:
    name = path.name.lower()
    for suffix in sorted(_SUFFIX_FORMATS, key=len, reverse=True):
        if name.endswith(suffix):
            return _SUFFIX_FORMATS[suffix]
    return None


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in _DATASET_MARKERS)


def _file_source(path: Path, origin: str) -> Source:
    fmt = _format_of(path)
    if fmt is None:
        raise LyannaError(f"unknown corpus format: {path} (expected {SUPPORTED})")
    return Source(str(path), fmt, origin)


def _dir_sources(path: Path, origin: str) -> list[Source]:
    if _is_saved_dataset(path):
        return [Source(str(path), "hf-disk", origin)]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    sources = [_file_source(p, origin) for p in files if _format_of(p)]
    if not sources:
        raise LyannaError(f"corpus directory {path} holds no supported files ({SUPPORTED})")
    return sources


def resolve_sources(spec: str) -> list[Source]:
    """One ``--corpus`` argument -> its sources, in a deterministic order."""
    if spec in EMBEDDED_CORPORA and not os.path.exists(spec):
        return [_file_source(EMBEDDED_CORPORA[spec].path(), spec)]
    path = Path(spec).expanduser()
    if path.is_file():
        return [_file_source(path, spec)]
    if path.is_dir():
        return _dir_sources(path, spec)
    if glob.has_magic(spec):
        matches = sorted(glob.glob(os.path.expanduser(spec), recursive=True))
        if not matches:
            raise LyannaError(f"corpus glob matches no files: {spec}")
        out: list[Source] = []
        for m in matches:
            out += _dir_sources(Path(m), spec) if os.path.isdir(m) else [_file_source(Path(m), spec)]
        return out
    known = ", ".join(sorted(EMBEDDED_CORPORA))
    raise LyannaError(f"corpus not found: {spec} (not a file, directory, glob or embedded name: {known})")


@dataclass
class Corpus:
    """The resolved ``--corpus`` arguments; cheap to pickle into worker processes."""

    specs: list[str]
    sources: list[Source]

    @classmethod
    def resolve(cls, specs: list[str]) -> "Corpus":
        if not specs:
            raise LyannaError("no corpus given")
        sources = [s for spec in specs for s in resolve_sources(spec)]
        return cls(list(specs), sources)

    def describe(self) -> list[dict]:
        out = []
        for s in self.sources:
            entry = {"path": s.path, "format": s.fmt, "from": s.origin}
            if s.origin in EMBEDDED_CORPORA:
                entry["embedded"] = EMBEDDED_CORPORA[s.origin].description
            out.append(entry)
        return out

    def content_hash(self) -> str:
        """sha256 over the bytes of every source, in order (what makes counts reproducible)."""
        h = hashlib.sha256()
        for s in self.sources:
            files = sorted(Path(s.path).rglob("*")) if s.fmt == "hf-disk" else [Path(s.path)]
            for f in files:
                if f.is_file():
                    h.update(f.name.encode() + b"\0")
                    with open(f, "rb") as fh:
                        for block in iter(lambda: fh.read(1 << 22), b""):
                            h.update(block)
        return "sha256:" + h.hexdigest()


def _iter_text_blocks(path: Path) -> Iterator[Union[str, Binary]]:
    """Documents of a text file: blocks separated by blank lines; then, if some lines were
    not text, one :class:`Binary` event counting them."""
    block: list[str] = []
    binary = 0
    with open_binary(path) as fh:
        for raw in fh:
            try:
                line = raw.decode("utf-8")
                binary += b"\0" in raw
            except UnicodeDecodeError:
                line, binary = raw.decode("utf-8", errors="replace"), binary + 1
            if line.strip():
                block.append(line)
            elif block:
                yield "".join(block).rstrip("\n")
                block = []
    if block:
        yield "".join(block).rstrip("\n")
    if binary:
        yield Binary(str(path), binary)


def _iter_parquet(path: Path) -> Iterator[dict]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        yield from batch.to_pylist()


def _iter_saved_dataset(path: Path) -> Iterator[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001 - the library raises many types
        raise LyannaError(f"cannot load saved dataset {path}: {str(err).splitlines()[0]}") from None
    splits = [ds[k] for k in sorted(ds)] if isinstance(ds, datasets.DatasetDict) else [ds]
    for split in splits:
        for batch in split.iter(batch_size=1024):
            keys = list(batch)
            for i in range(len(batch[keys[0]]) if keys else 0):
                yield {k: batch[k][i] for k in keys}


def _unreadable(source: Source, err: Exception) -> str | None:
    """Why ``source`` cannot be read, in words, or None when ``err`` is not about its bytes."""
    if type(err).__module__.startswith("pyarrow"):  # ArrowInvalid, ArrowIOError...
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        return f"{source.path} is not a readable Parquet file (truncated or corrupted?): {first}"
    if isinstance(err, EOFError):
        return f"{source.path} is truncated: the compressed stream ends before its end marker (an interrupted copy?)"
    if isinstance(err, (gzip.BadGzipFile, zlib.error)):
        return f"{source.path} is not valid gzip data ({err}): a corrupted file, or not gzip despite its name"
    if isinstance(err, OSError):
        return os_error_line(err, source.path)
    return None


def _read(source: Source) -> Iterator:
    """The source's items; a file whose bytes cannot be decoded is one line naming it."""
    try:
        yield from _iter_source(source)
    except LyannaError:
        raise
    except Exception as err:  # noqa: BLE001 - gzip, zlib and pyarrow raise several types
        why = _unreadable(source, err)
        if why is None:
            raise
        raise LyannaError(why) from None


def _iter_source(source: Source) -> Iterator:
    path = Path(source.path)
    if source.fmt == "json":
        with open_binary(path) as fh:
            head = fh.read(64).lstrip()
        return iter_json_array(path) if head[:1] == b"[" or head[3:4] == b"[" else iter_jsonl(path)
    if source.fmt == "jsonl":
        return iter_jsonl(path)
    if source.fmt == "txt":
        return _iter_text_blocks(path)
    if source.fmt == "parquet":
        return _iter_parquet(path)
    return _iter_saved_dataset(path)


def iter_documents(
    corpus: Corpus, notes: ReadNotes, keep: Callable[[int], bool] = lambda i: True
) -> Iterator[Union[Document, Skip]]:
    """Stream the corpus as documents; records rejected by ``keep(index)`` are passed over.

    Malformed and unusable records are counted into ``notes`` (only those kept), and
    truncated files are noted once each.
    """
    index = 0
    for source in corpus.sources:
        for item in _read(source):
            if isinstance(item, Truncated):
                notes.truncated.append(item)
                continue
            if isinstance(item, Binary):
                notes.binary.append(item)
                continue
            i, index = index, index + 1
            if not keep(i):
                continue
            if isinstance(item, Malformed):
                notes.skip(MALFORMED, f"{item.where}: {item.reason}")
                yield Skip(i, f"{MALFORMED} at {item.where}: {item.reason}", malformed=True)
                continue
            doc = to_document(i, item)
            if isinstance(doc, Skip):
                notes.skip(doc.reason, f"{source.path} record {i}")
            yield doc
