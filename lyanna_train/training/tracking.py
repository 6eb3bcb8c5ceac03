"""Metrics: a local JSONL always, W&B on the main rank (imported lazily, offline without a key).

A resumed run starts from its checkpoint's step, so records the interrupted session
logged after that step are dropped from ``metrics.jsonl`` before the first new one:
every step appears once. The last value of every metric is kept in memory
(:attr:`Tracker.latest`) and saved with each checkpoint, so export reads it there.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..atomic import write_text_atomic

METRICS_FILE = "metrics.jsonl"


def trim_metrics(path: Path, last_step: int) -> None:
    """Keep the records up to ``last_step`` (a torn last line, cut by a crash, is dropped too)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
            kept.append(line + "\n")
    write_text_atomic(path, "".join(kept))


class Tracker:
    def __init__(self, cfg, out_dir: Path, is_main: bool, config_dict: dict, resume_id: str | None = None,
                 start_step: int = 0, latest: dict | None = None):
        self.is_main = is_main
        self.run = None
        self.jsonl = None
        self.latest: dict = dict(latest or {})
        if not is_main:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if cfg.metrics_jsonl:
            trim_metrics(out_dir / METRICS_FILE, start_step)
            self.jsonl = open(out_dir / METRICS_FILE, "a", encoding="utf-8")
        if cfg.wandb.enabled:
            import wandb  # lazily: only the main rank of a tracked run pays for it

            mode = cfg.wandb.mode
            if mode == "auto":
                mode = "online" if os.environ.get("WANDB_API_KEY") and os.environ.get("WANDB_MODE") != "offline" else "offline"
            self.run = wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, mode=mode, dir=str(out_dir),
                                  config=config_dict, id=resume_id, resume="allow" if resume_id else None)

    @property
    def run_id(self) -> str | None:
        return self.run.id if self.run is not None else None

    def log(self, step: int, metrics: dict) -> None:
        if not self.is_main:
            return
        self.latest.update(metrics, step=step)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, "time": round(time.time(), 3), **metrics}) + "\n")
            self.jsonl.flush()
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.run is not None:
            self.run.finish()
