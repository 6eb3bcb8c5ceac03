"""bench/peer_training.py end to end on a tiny random target: speculators' trainer replays the
run's batches, its head comes back through the importer and both heads are measured alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..training.conftest import compose, tiny_corpus, tiny_overrides, tiny_target_dir  # noqa: F401 (fixtures)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "peer_training.py"
CONSUMERS = Path(os.environ.get("LYANNA_CONSUMERS", Path(sys.prefix) / "consumers"))


@pytest.mark.slow
@pytest.mark.skipif(not (CONSUMERS / "speculators").is_dir(), reason=f"speculators is not installed in {CONSUMERS}")
def test_the_peer_replays_the_runs_batches_and_is_served_here(tmp_path, tiny_target_dir, tiny_corpus):
    from lyanna_train.training.loop import train

    run = tmp_path / "run"
    train(compose(tiny_overrides(tiny_target_dir, tiny_corpus, run, "target.aux_layers=[0,1,2]", "train.max_steps=3",
                                 "data.max_samples=18", "eval.heldout_samples=4", "eval.num_prompts=0")))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
                                                            "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(BENCH), "--run", str(run), "--out", str(tmp_path / "peer"),
                           "--prompts", "1", "--max-new-tokens", "4"], capture_output=True, text=True, env=env,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "peer" / "results.json").read_text())
    assert results["steps"] == 3 and results["tokens"] > 0
    training = json.loads((tmp_path / "peer" / "peer" / "head" / "peer_training.json").read_text())
    assert training["steps"] == 3 and training["defaults"]["optimizer"] == "muon"  # the library's own defaults
    plan = json.loads((tmp_path / "peer" / "peer" / "plan.json").read_text())
    assert len(plan) == 3 and all(rows for _, rows in plan)
    ours, peer = results["rows"]
    for row in (ours, peer):
        assert row["tau"] >= 1.0 and 0.0 <= row["heldout_top1_step0"] <= 1.0 and len(row["accept"]) == 3
    imported = json.loads((tmp_path / "peer" / "peer" / "export" / "manifest.json").read_text())
    assert imported["imported"]["layout"] == "speculators"
    assert "| speculators EAGLE-3 defaults |" in proc.stdout
