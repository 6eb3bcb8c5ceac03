"""What every benchmark writes for a reader: markdown tables, the summary page and the plots.

``lyanna-bench`` (methods side by side, :mod:`.benchmark`) and ``lyanna-bench --batch-size``
(:mod:`.batched`) both render here, through one table writer and one figure writer, so the
tables read alike and a change of format is made once. The scripts in ``bench/`` use
:func:`markdown_table` for their own tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable


def markdown_table(head: list[str], rows: Iterable[list[str]], left: Iterable[str] = ("method",)) -> str:
    """A GitHub markdown table: the columns named in ``left`` (text) are left-aligned, the
    others (figures) right-aligned."""
    left = set(left)
    lines = ["| " + " | ".join(head) + " |", "|" + "".join("---|" if h in left else "---:|" for h in head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def summary_page(title: str, table: str, lines: list[str]) -> str:
    """``summary.md``: a title, the table, then the verdict lines."""
    return f"# {title}\n\n{table}\n\n" + "\n".join(lines) + "\n"


def method_table(summary: dict, lossless: dict, depths: int = 3) -> str:
    """One row per method: tokens/s, speedup, τ, tree size, acceptance at depths 1..``depths``, identical prompts."""
    head = ["method", "new tokens", "tok/s", "speedup", "τ", "tree size"] + \
        [f"accept ≥{k}" for k in range(1, depths + 1)] + ["identical"]
    rows = []
    n = lossless.get("prompts")
    for method, s in summary.items():
        check = lossless.get("methods", {}).get(method)
        identical = "reference" if lossless.get("checked") and method == "target" else \
            f"{n - check['mismatches']}/{n}" if check else "–"
        speedup = f"{s['speedup']:.2f}×" if s["speedup"] is not None else "–"
        rates = [f"{r:.3f}" for r in s["accept_rate"][:depths]] if method not in ("target", "stock") else []
        rates += ["–"] * (depths - len(rates))  # a shallower decoding measured fewer depths: the columns stay aligned
        rows.append([method, str(s["new_tokens"]), f"{s['tokens_per_s']:.1f}", speedup,
                     f"{s['tau']:.2f}", f"{s['mean_tree_size']:.1f}", *rates, identical])
    return markdown_table(head, rows)


def batch_table(results: dict[int, dict[str, dict]]) -> str:
    """One row per batch size and method: throughput (wall and CPU; with several passes the
    median one's, the slowest and fastest pass beside it), latency, τ, identical requests."""
    head = ["batch", "method", "requests", "new tokens", "tok/s", "vs target", "tok/CPU-s", "vs target (CPU)",
            "latency mean (s)", "p50", "p95", "τ", "tree size", "identical"]
    rows = []
    for batch, methods in results.items():
        for name, s in methods.items():
            vs = f"{s['vs_target']:.2f}×" if s.get("vs_target") else "–"
            vs_cpu = f"{s['vs_target_cpu']:.2f}×" if s.get("vs_target_cpu") else "–"
            same = f"{s['identical']}/{s['requests']}" if "identical" in s else "–"
            passes = s.get("tokens_per_s_passes", [])
            spread = f" ({passes[0]:.1f}–{passes[-1]:.1f})" if len(passes) > 1 else ""
            rows.append([str(batch), name, str(s["requests"]), str(s["new_tokens"]),
                         f"{s['tokens_per_s']:.1f}{spread}", vs, f"{s['tokens_per_cpu_s']:.1f}", vs_cpu,
                         f"{s['latency_mean']:.2f}", f"{s['latency_p50']:.2f}", f"{s['latency_p95']:.2f}",
                         f"{s['tau']:.2f}", f"{s['mean_tree_size']:.1f}", same])
    return markdown_table(head, rows)


def _figure(columns: int, width: float):
    """A row of ``columns`` axes on matplotlib's file-only backend (no display is needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, columns, figsize=(width, 4))


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def method_plot(summary: dict, path: Path) -> None:
    """Speedup bars and acceptance-by-depth curves, one per method."""
    fig, (bars, curves) = _figure(2, 10)
    names = list(summary)
    drawn = bars.bar(names, [summary[m]["speedup"] or 0.0 for m in names], color="tab:blue")
    bars.bar_label(drawn, fmt="%.2f×")
    bars.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    bars.set_ylabel("speedup vs target (tokens/s ratio)")
    bars.set_title("speedup")
    for m in names:
        if m != "target":
            rates = summary[m]["accept_rate"]
            curves.plot(range(1, len(rates) + 1), rates, marker="o", label=m)
    curves.xaxis.get_major_locator().set_params(integer=True)
    curves.set_xlabel("drafted tokens accepted ≥ k")
    curves.set_ylabel("fraction of verify forwards")
    curves.set_ylim(0, 1)
    curves.set_title("acceptance by depth")
    if len(names) > 1:
        curves.legend()
    _save(fig, path)


def batch_plot(results: dict[int, dict[str, dict]], path: Path) -> None:
    """Total tokens/s, ratio to target-only and median latency against batch size."""
    fig, axes = _figure(3, 14)
    names = list(dict.fromkeys(n for rows in results.values() for n in rows))
    for name in names:
        sizes = [b for b in results if name in results[b]]
        style = {"marker": "o", "label": name}
        axes[0].plot(sizes, [results[b][name]["tokens_per_s"] for b in sizes], **style)
        axes[1].plot(sizes, [results[b][name]["vs_target"] or 0.0 for b in sizes], **style)
        axes[2].plot(sizes, [results[b][name]["latency_p50"] for b in sizes], **style)
    for ax, label in zip(axes, ("total tokens/s", "tokens/s ÷ target-only at the same batch", "median latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(results), [str(b) for b in results])
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].axhline(1.0, color="grey", linestyle="--", linewidth=1)
    axes[0].legend()
    _save(fig, path)
