"""Load a target's tokenizer from an embedded name, a GGUF file or a local directory.

GGUF checkpoints are converted by transformers on first use (slow: it de-quantises)
and the converted copy is cached under ``$LYANNA_CACHE`` (default
``~/.cache/lyanna_train``), keyed by the file's name, size and mtime. Nothing is ever
fetched from the network: hub ids resolve only from the local Hugging Face cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..atomic import atomic_directory
from ..embedded import EMBEDDED_TARGETS
from ..errors import LyannaError


REMOTE_CODE_REFUSED = ("it needs Python code shipped in its folder (auto_map / trust_remote_code), which "
                       "Lyanna never runs; use a model whose architecture transformers supports natively")


def refuses_remote_code(err: BaseException) -> bool:
    """Whether transformers refused to load because the folder asks to run its own code."""
    text = str(err)
    return "trust_remote_code" in text or "custom code" in text


def cache_root() -> Path:
    return Path(os.environ.get("LYANNA_CACHE", Path.home() / ".cache" / "lyanna_train")).expanduser()


@dataclass(frozen=True)
class TargetRef:
    """Where a target lives: a directory ``from_pretrained`` can read, maybe via a GGUF file."""

    spec: str  # what the user typed
    path: str  # directory (or hub id) for from_pretrained
    gguf_file: str | None = None  # file name inside ``path`` when the source is GGUF
    description: str = ""

    @property
    def cache_dir(self) -> Path | None:
        """Where the converted copy of a GGUF target is kept."""
        if self.gguf_file is None:
            return None
        st = (Path(self.path) / self.gguf_file).stat()
        return cache_root() / f"{Path(self.gguf_file).stem}-{st.st_size}-{st.st_mtime_ns}"


def resolve_target(spec: str) -> TargetRef:
    """Turn a tokenizer/target argument into a :class:`TargetRef` (no loading yet)."""
    if spec in EMBEDDED_TARGETS and not os.path.exists(spec):
        entry = EMBEDDED_TARGETS[spec]
        gguf = entry.path()
        return TargetRef(spec, str(gguf.parent), gguf.name, entry.description)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise LyannaError(f"cannot load tokenizer {spec}: a file must be a .gguf checkpoint")
        return TargetRef(spec, str(path.parent), path.name, f"GGUF file {path}")
    if path.is_dir():
        if not any(path.glob("tokenizer*")) and not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return TargetRef(spec, str(path), ggufs[0].name, f"GGUF file {ggufs[0]}")
            raise LyannaError(f"cannot load tokenizer {spec}: no tokenizer files in that directory")
        return TargetRef(spec, str(path), None, f"local directory {path}")
    if "/" in spec and not spec.startswith((".", "/", "~")):
        return TargetRef(spec, spec, None, f"hub id {spec} (local cache only)")
    known = ", ".join(sorted(EMBEDDED_TARGETS))
    raise LyannaError(f"tokenizer not found: {spec} (not a path, GGUF file, cached hub id or embedded name: {known})")


def tokenizer_dir(ref: TargetRef) -> str:
    """A directory (or cached hub id) from which ``AutoTokenizer`` loads quickly."""
    if ref.gguf_file is None:
        return ref.path
    cached = ref.cache_dir / "tokenizer"
    if not (cached / "tokenizer_config.json").exists():
        tok = _from_pretrained(ref, ref.path, gguf_file=ref.gguf_file)
        with atomic_directory(cached, overwrite=True) as tmp:
            tok.save_pretrained(tmp)
    return str(cached)


def _from_pretrained(ref: TargetRef, path: str, **kwargs):
    from transformers import AutoTokenizer

    try:
        # trust_remote_code=False, never None: with None transformers asks on stdin, and a piped
        # "y" would run the folder's own Python (auto_map) — a target folder must never run code
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False, **kwargs)
    except Exception as err:  # noqa: BLE001 - transformers raises many types
        if refuses_remote_code(err):
            raise LyannaError(f"cannot load tokenizer {ref.spec}: {REMOTE_CODE_REFUSED}") from None
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise LyannaError(f"cannot load tokenizer {ref.spec}: {first}") from None
    if not getattr(tok, "is_fast", False):
        raise LyannaError(f"tokenizer {ref.spec} has no fast (Rust) implementation, which is required")
    return tok


def load_tokenizer(spec: str | TargetRef):
    """Load the fast tokenizer of a target given by name, GGUF file or directory."""
    ref = spec if isinstance(spec, TargetRef) else resolve_target(spec)
    return _from_pretrained(ref, tokenizer_dir(ref))
