"""Checkpoints: written atomically, found by name, pruned to the last N.

A checkpoint is saved under a hidden ``.partial-*`` name and renamed to ``step-NNNNNNNN``
only once every rank has written its part, so a crash mid-save never leaves a
directory that is chosen as the latest. Besides DeepSpeed's own files (model,
optimizer, scheduler, per-rank state), the main rank writes the draft's weights as
``model.safetensors`` with ``draft_config.json`` for export.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from safetensors.torch import save_file

from ..errors import LyannaError

_NAME = re.compile(r"^step-(\d{8})$")


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)), key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def resolve_resume(resume: str, root: Path) -> Path | None:
    """``auto`` -> latest complete checkpoint (or None); ``never`` -> None; else a path that must exist."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(root)
    path = Path(resume)
    if not path.is_dir() or not _NAME.match(path.name):
        raise LyannaError(f"train.resume: {resume} is not a complete checkpoint directory (step-NNNNNNNN)")
    return path


def write_draft_weights(directory: Path, draft, extra_config: dict) -> None:
    """The draft's own weights (no DeepSpeed wrapper), for export and inspection."""
    state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    (directory / "draft_config.json").write_text(json.dumps({**draft.cfg.to_dict(), **extra_config}, indent=2))


def finalize(partial: Path, root: Path, step: int, keep_last: int) -> Path:
    """Main rank, after every rank wrote: rename into place, then prune old checkpoints."""
    final = root / f"step-{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    for old in complete_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def partial_name(step: int) -> str:
    return f".partial-step-{step:08d}"
