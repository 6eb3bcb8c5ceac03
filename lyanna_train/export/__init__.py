"""Export a trained draft head to a serving directory, and load it back.

Two formats: ``lyanna`` (everything, pool and α-gate included) and ``eagle3`` (what
SGLang and vLLM load; see :mod:`lyanna_train.export.formats` for the layer-id
conventions). Imports are lazy so that serving code importing the reader never pulls
in the writer (which reads training checkpoints).
"""

from __future__ import annotations

_LAZY = {"export_checkpoint": "writer", "resolve_checkpoint": "writer", "load_exported": "reader",
         "read_manifest": "reader"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
