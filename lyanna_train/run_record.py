"""What a checkpoint says about itself, for whoever reads it: its name and its ``run.json``.

Training writes checkpoints and export reads them; both meet here, below either, so that
export never imports training code. A checkpoint is complete once it carries its final
name ``step-NNNNNNNN`` (a save in progress is hidden under ``.partial-*``), and its
``run.json`` holds the target's and tokenizer's fingerprints, the resolved run config
and the last value of every metric logged up to its step.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .atomic import write_json_atomic
from .errors import LyannaError

CHECKPOINT_NAME = re.compile(r"^step-(\d{8})$")
RUN_RECORD = "run.json"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and CHECKPOINT_NAME.match(p.name)), key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def write_run_record(directory: Path, record: dict) -> None:
    """``run.json``: fingerprints, resolved config and metrics (JSON only: nothing in it can run code)."""
    write_json_atomic(directory / RUN_RECORD, record)


def read_run_record(checkpoint: Path) -> dict | None:
    """The checkpoint's ``run.json``, or None for checkpoints written before it existed; corrupt -> one line."""
    path = checkpoint / RUN_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LyannaError(f"{path} is unreadable or not valid JSON: {err}") from None
    if not isinstance(record, dict):
        raise LyannaError(f"{path} does not hold a JSON object")
    return record
