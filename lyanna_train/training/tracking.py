"""Metrics: a local JSONL always, W&B on the main rank (imported lazily, offline without a key)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class Tracker:
    def __init__(self, cfg, out_dir: Path, is_main: bool, config_dict: dict, resume_id: str | None = None):
        self.is_main = is_main
        self.run = None
        self.jsonl = None
        if not is_main:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if cfg.metrics_jsonl:
            self.jsonl = open(out_dir / "metrics.jsonl", "a", encoding="utf-8")
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
