"""Checkpoints: written atomically, found by name, pruned to the last N, self-describing.

A checkpoint is saved under a hidden ``.partial-*`` name and renamed to ``step-NNNNNNNN``
only once every rank has written its part, so a crash mid-save never leaves a
directory that is chosen as the latest; a failed save (a full disk) removes its
partial directory and stops with one line. Besides DeepSpeed's own files (model,
optimizer, scheduler, per-rank state; loaded back with ``weights_only=True``), the
main rank writes what export needs, so that export reads the checkpoint alone:

* ``model.safetensors`` + ``draft_config.json``: the draft's weights and shape;
* ``run.json``: the target's and tokenizer's fingerprints, the resolved run config and
  the last value of every metric logged up to this step (``run_record.py``: its name,
  reader and writer, shared with export).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import LyannaError, write_failure
# the checkpoint's name and run.json live below training and export, which both read them
from ..run_record import CHECKPOINT_NAME, complete_checkpoints, latest_checkpoint


def resolve_resume(resume: str, root: Path) -> Path | None:
    """``auto``/``force`` -> latest complete checkpoint (or None); ``never`` -> None; else a path that must exist."""
    if resume == "never":
        return None
    if resume in ("auto", "force"):
        return latest_checkpoint(root)
    path = Path(resume)
    if not path.is_dir() or not CHECKPOINT_NAME.match(path.name):
        raise LyannaError(f"train.resume: {resume} is not a complete checkpoint directory (step-NNNNNNNN)")
    return path


def remove_partials(root: Path) -> list[Path]:
    """Delete ``.partial-*`` saves; call only while holding the run folder's lock (they are then stale)."""
    found = sorted(root.glob(".partial-*")) if root.is_dir() else []
    for stale in found:
        shutil.rmtree(stale, ignore_errors=True)
    return found


def write_draft_weights(directory: Path, draft, extra_config: dict) -> None:
    """The draft's own weights (no DeepSpeed wrapper), for export and inspection."""
    state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    (directory / "draft_config.json").write_text(json.dumps({**draft.cfg.to_dict(), **extra_config}, indent=2))


def save(engine, root: Path, step: int, client_state: dict, write_main, keep_last: int) -> Path:
    """Every rank writes its part into ``.partial-step-N``; then the main rank renames it into place.

    ``write_main(directory)`` adds the main rank's own files. A write failure on any
    rank (full disk, read-only folder) removes the partial directory on every rank's
    behalf and raises one line naming it and the cause; earlier checkpoints stay intact.
    """
    partial = root / partial_name(step)
    cause = None
    try:
        engine.save(root, partial.name, client_state)
        if engine.rank == 0:
            write_main(partial)
    except Exception as err:  # noqa: BLE001 - reworded below when it is a write failure
        cause = write_failure(err, partial)
        if cause is None:
            raise
    failed = torch.tensor([0.0 if cause is None else 1.0], device=engine.device)  # NCCL reduces GPU tensors only
    if engine.world_size > 1:
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
    if failed.item():
        engine.barrier()
        if engine.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise LyannaError(f"cannot save checkpoint {root / f'step-{step:08d}'}: {cause or 'another rank failed to write'}"
                          f" (the partial save was removed; earlier checkpoints are intact)")
    engine.barrier()
    final = root / f"step-{step:08d}"
    if engine.rank == 0:
        finalize(partial, root, step, keep_last)
    engine.barrier()
    return final


def finalize(partial: Path, root: Path, step: int, keep_last: int) -> Path:
    """Main rank, after every rank wrote: rename into place, then prune old checkpoints."""
    final = root / f"step-{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    for old in complete_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
        # renamed out of the step-* names first: a kill mid-delete must not leave a half-deleted
        # folder that looks complete (the next claim removes .partial-* leftovers)
        doomed = root / f".partial-pruned-{old.name}"
        try:
            os.replace(old, doomed)
        except OSError:
            doomed = old
        shutil.rmtree(doomed, ignore_errors=True)
    for stale in root.glob(".partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def partial_name(step: int) -> str:
    return f".partial-step-{step:08d}"
