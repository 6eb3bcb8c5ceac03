"""``training.png`` in the run folder: the loss and accuracy curves without opening W&B.

Drawn from ``metrics.jsonl`` (each step once, across resumes) at the end of a run:
total loss and learning rate, and top-1 accuracy per unroll step with the held-out
agreement of the final evaluation marked beside it, which is where the over-fit gap shows.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl -> rows; a line cut short by a crash is skipped, not fatal."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_training(metrics: Path, out: Path) -> Path | None:
    """Write ``out`` from ``metrics`` (None when no step was logged)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics) if metrics.is_file() else []
    steps, loss = _series(rows, "loss/total")
    if not steps:
        return None
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    ax_loss.plot(steps, loss, color="C0", lw=1.5, label="total loss")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("loss (KL over unroll steps)")
    lr_steps, lr = _series(rows, "lr")
    if lr_steps:
        ax_lr = ax_loss.twinx()
        ax_lr.plot(lr_steps, lr, color="0.6", lw=1, ls="--", label="learning rate")
        ax_lr.set_ylabel("learning rate", color="0.4")
    ax_loss.set_title("loss")
    last = steps[-1]
    for j in range(8):
        acc_steps, acc = _series(rows, f"acc/step{j}")
        if not acc_steps:
            break
        ax_acc.plot(acc_steps, acc, color=f"C{j}", lw=1.3, label=f"train top-1, unroll step {j}")
        held = [r[f"eval/heldout_top1_step{j}"] for r in rows if f"eval/heldout_top1_step{j}" in r]
        if held:
            ax_acc.plot([last], [held[-1]], "D", color=f"C{j}", ms=7, label=f"held-out, step {j}: {held[-1]:.3f}")
    taus = [r["eval/mean_tau_verify"] for r in rows if "eval/mean_tau_verify" in r]
    title = "top-1 agreement with the target" + (f" (chain τ {taus[-1]:.3f})" if taus else "")
    ax_acc.set_title(title)
    ax_acc.set_xlabel("optimizer step")
    ax_acc.set_ylim(0, 1)
    ax_acc.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
