"""bench/feature_storage.py end to end on a tiny random target: equal samples per variant, the
cache's bytes per token from its files, every head scored on the first variant's held-out cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..training.conftest import tiny_corpus, tiny_target_dir  # noqa: F401 (fixtures)
from ..training.test_train import _clean_env

BENCH = Path(__file__).resolve().parents[2] / "bench" / "feature_storage.py"


@pytest.mark.slow  # three lyanna-train subprocesses
def test_variants_train_on_equal_samples_and_are_tabulated(tmp_path, tiny_target_dir, tiny_corpus):
    tiny = [f"target.name={tiny_target_dir}", "target.aux_layers=[0,1,2]", "target.dtype=float32",
            "train.autocast=null", "data.max_length=128", "data.batch_tokens=512", "data.shard_tokens=1024",
            "loss.ttt_steps=2", "draft.pool_size=128", "train.epochs=2", "train.warmup_steps=2", "train.threads=1",
            "eval.num_prompts=1", "eval.max_new_tokens=4", "eval.depth=2", "eval.heldout_samples=4"]
    proc = subprocess.run([sys.executable, str(BENCH), "--name", "tiny", "--variants", "bf16,fp8,hybrid",
                           "--samples", "12", "--corpus", str(tiny_corpus), "--out", str(tmp_path / "runs"),
                           "--results", str(tmp_path / "results"), "--", *tiny],
                          capture_output=True, text=True, timeout=900, env=_clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    saved = json.loads((tmp_path / "results" / "tiny" / "summary.json").read_text())
    rows = {r["variant"]: r for r in saved["summary"]}
    assert saved["samples"] == 12 and list(rows) == ["bf16", "fp8", "hybrid"]
    for run in ("bf16-s0", "fp8-s0", "hybrid-s0"):
        assert "max_samples: 12" in (tmp_path / "runs" / "tiny" / run / "config.yaml").read_text()
    assert rows["fp8"]["bytes_per_token"] < 0.56 * rows["bf16"]["bytes_per_token"]  # 64-wide: 285 vs 525 + headers
    assert rows["hybrid"]["bytes_per_token"] == pytest.approx(rows["bf16"]["bytes_per_token"])
    assert rows["hybrid"]["steps"] == rows["bf16"]["steps"] == rows["fp8"]["steps"]
    for r in rows.values():
        assert 0 <= r["heldout_top1_step0_on_bf16"] <= 1 and r["tau"] >= 1 and r["minutes_to_last_step"] > 0
    # the bf16 head scored on its own held-out cache, again: the same figure
    assert rows["bf16"]["heldout_top1_step0_on_bf16"] == pytest.approx(rows["bf16"]["heldout_top1_step0"], abs=1e-6)
    assert "| cached, fp8 features" in (tmp_path / "results" / "tiny" / "summary.md").read_text()
