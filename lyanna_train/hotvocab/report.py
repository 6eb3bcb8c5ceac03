"""Human-readable outputs of a hot-vocabulary build: summary table, report.md, coverage.png."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.2f} %"


def selection_table(selections: list[dict], vocab: int) -> str:
    """A Markdown table of the selections (printed at the end and kept in report.md)."""
    rows = ["| request | size | % of vocab | coverage (train) | coverage (held-out) | file |", "|---|---:|---:|---:|---:|---|"]
    for s in selections:
        rows.append(
            f"| {s['request']} | {s['size']} | {100 * s['size'] / vocab:.2f} % | {_pct(s['coverage_train'])} "
            f"| {_pct(s['coverage_heldout'])} | {s['file']} |"
        )
    return "\n".join(rows)


def write_report(directory: Path, manifest: dict) -> None:
    vocab = manifest["tokenizer"]["vocab_size"]
    lines = [
        "# Hot vocabulary",
        "",
        f"- tokenizer: {manifest['tokenizer']['spec']} ({manifest['tokenizer']['description']}), vocabulary {vocab}",
        f"- corpus: {', '.join(manifest['corpus']['specs'])} ({manifest['corpus']['hash'][:19]}…)",
        f"- counted: {manifest['count']['mode']} tokens; documents {manifest['documents']}; tokens {manifest['tokens']}",
        f"- skipped records: {manifest['skipped']['total']}",
        "",
        selection_table(manifest["selections"], vocab),
        "",
        "![coverage](coverage.png)",
        "",
    ]
    (directory / "report.md").write_text("\n".join(lines), encoding="utf-8")


def plot_coverage(path: Path, train_curve: np.ndarray, heldout_curve: np.ndarray, selections: list[dict],
                  title: str) -> None:
    """Coverage against hot-vocabulary size, with each selection marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vocab = len(train_curve)
    top = max([s["size"] for s in selections] + [1])
    limit = min(vocab, max(4 * top, vocab // 5))
    sizes = np.arange(1, limit + 1)
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    ax.plot(sizes, 100 * train_curve[:limit], color="0.6", lw=1.2, label="train split")
    if not np.isnan(heldout_curve).all():
        ax.plot(sizes, 100 * heldout_curve[:limit], color="C0", lw=2, label="held-out split")
    for s in selections:
        y = s["coverage_heldout"] if s["coverage_heldout"] is not None else s["coverage_train"]
        ax.plot([s["size"]], [100 * y], "o", color="C3")
        ax.annotate(f"{s['size']} ({100 * s['size'] / vocab:.1f} %): {100 * y:.1f} %", (s["size"], 100 * y),
                    textcoords="offset points", xytext=(6, -12), fontsize=8)
    ax.set_xlabel("hot-vocabulary size (tokens)")
    ax.set_ylabel("token coverage (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    secondary = ax.secondary_xaxis("top", functions=(lambda x: 100 * x / vocab, lambda p: p * vocab / 100))
    secondary.set_xlabel("% of vocabulary")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
