"""training.png: drawn from metrics.jsonl, tolerant of a line a crash cut short."""

from __future__ import annotations

import json

from lyanna_train.training.curves import plot_training, read_metrics


def test_curves_from_metrics_with_a_cut_line(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss/total": 10 - s, "lr": 1e-3, "acc/step0": 0.1 * s, "acc/step1": 0.05 * s}
            for s in range(1, 6)]
    rows.append({"step": 5, "eval/heldout_top1_step0": 0.3, "eval/heldout_top1_step1": 0.2,
                 "eval/mean_tau_verify": 1.25})
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"step": 6, "loss/to')
    assert len(read_metrics(metrics)) == 6  # the cut line is skipped
    out = plot_training(metrics, tmp_path / "training.png")
    assert out == tmp_path / "training.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_no_logged_step_no_plot(tmp_path):
    assert plot_training(tmp_path / "missing.jsonl", tmp_path / "training.png") is None
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "eval/mean_tau": 1.0}) + "\n")
    assert plot_training(tmp_path / "metrics.jsonl", tmp_path / "training.png") is None
    assert not (tmp_path / "training.png").exists()
