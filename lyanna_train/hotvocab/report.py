"""Human-readable outputs of a hot-vocabulary build: summary table, report.md, coverage.png."""

from __future__ import annotations

from pathlib import Path

import numpy as np

PLOT_POINTS = 2000  # coverage-curve points drawn, log-spaced


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
    from matplotlib.ticker import FuncFormatter

    vocab = len(train_curve)
    # ~2,000 sizes spaced evenly on the log axis draw the same curve as all of them (a
    # 49k-150k vocabulary's points took most of the figure's time)
    sizes = np.unique(np.geomspace(1, vocab, PLOT_POINTS).round().astype(np.int64)) if vocab else np.arange(1, 1)
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    ax.plot(sizes, 100 * train_curve[sizes - 1], color="0.6", lw=1.2, label="train split")
    if not np.isnan(heldout_curve).all():
        ax.plot(sizes, 100 * heldout_curve[sizes - 1], color="C0", lw=2, label="held-out split")
    lines = []
    for k, s in enumerate(selections, start=1):
        y = s["coverage_heldout"] if s["coverage_heldout"] is not None else s["coverage_train"]
        ax.plot([s["size"]], [100 * y], "o", color="C3", zorder=3)
        ax.annotate(str(k), (s["size"], 100 * y), textcoords="offset points", xytext=(0, -14), ha="center",
                    fontsize=8, color="C3")
        lines.append(f"{k}: {s['size']} tokens ({100 * s['size'] / vocab:.1f} %) -> {100 * y:.1f} %")
    ax.text(0.98, 0.04, "\n".join(lines), transform=ax.transAxes, ha="right", va="bottom", fontsize=8,
            family="monospace", bbox=dict(boxstyle="round,pad=0.4", fc="white", ec="0.8"))
    ax.set_xscale("log")  # the interesting range (a few % of the vocabulary) is at the left
    ax.set_xlim(1, vocab)
    ax.set_ylim(0, 101)
    ax.set_xlabel("hot-vocabulary size (tokens, log scale)")
    ax.set_ylabel("token coverage (%)")
    fig.suptitle(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left")
    secondary = ax.secondary_xaxis("top", functions=(lambda x: 100 * x / vocab, lambda p: p * vocab / 100))
    secondary.set_xlabel("% of vocabulary", fontsize=8)
    secondary.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    # fixed margins: tight_layout renders the whole figure once more to measure its text
    fig.subplots_adjust(left=0.09, right=0.96, bottom=0.11, top=0.83)
    fig.savefig(path)
    plt.close(fig)
