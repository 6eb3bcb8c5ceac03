"""Benchmark: what more training tokens buy — chain τ and held-out agreement against tokens.

Trains the recipe once per size on the first shards of ONE feature cache
(``data.max_tokens``; the cache is built by the first run when missing), everything else as
the recipe says, and plots τ (depth-5 chain, greedy, MT-Bench first turns) and
teacher-forced top-1 agreement on held-out samples (from ``eval.heldout_from``, after every
size's data) against training tokens, with the CPU recipe's own budget marked.

    python bench/scaling.py --out checkpoints/scaling --samples 4000 \\
        --sizes 125000,250000,500000,1000000,1900000 [--recipe-tokens 715000] [override ...]
    python bench/scaling.py --run checkpoints/smollm2_135m --sizes 54000,107000,215000
        # smaller budgets on a finished recipe run's own cache and hot vocabulary; the run is a point
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def train(out: Path, size: int, common: list[str], extra: list[str]) -> dict:
    run = out / f"tokens-{size}"
    cmd = [sys.executable, "-m", "lyanna_train.cli.train", "+recipe=smollm2_135m", f"train.out_dir={run}",
           f"data.max_tokens={size}", *common, *extra]
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    final = {k: v for r in rows if "eval/mean_tau_verify" in r for k, v in r.items()}
    seen = max(r.get("tokens_seen", 0) for r in rows)
    return {**final, "size": size, "tokens_seen": seen, "minutes": (time.perf_counter() - start) / 60}


def run_point(run: Path) -> dict:
    """A finished run as a point: its final evaluation and the distinct tokens it trained on."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    final = {k: v for r in rows if "eval/mean_tau_verify" in r for k, v in r.items()}
    manifest = json.loads((run / "features" / "manifest.json").read_text())
    size = manifest["totals"]["tokens"]
    return {**final, "size": size, "tokens_seen": max(r.get("tokens_seen", 0) for r in rows), "minutes": float("nan"),
            "run": str(run)}


def plot(results: list[dict], path: Path, recipe_tokens: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["size"] for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(xs, [r["eval/mean_tau_verify"] for r in results], "o-")
    ax1.set_ylabel("chain τ (depth 5, MT-Bench)")
    for j in range(3):
        key = f"eval/heldout_top1_step{j}"
        if key in results[0]:
            ax2.plot(xs, [r[key] for r in results], "o-", label=f"step {j}")
    if "eval/heldout_in_hot" in results[0]:
        ax2.plot(xs, [r["eval/heldout_in_hot"] for r in results], "k--", label="ceiling (top-1 in hot vocab)")
    ax2.set_ylabel("held-out top-1 agreement")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("distinct training tokens")
        ax.grid(alpha=0.3)
        if recipe_tokens:
            ax.axvline(recipe_tokens, color="gray", ls=":", label="CPU recipe")
    fig.suptitle("What more tokens buy (SmolLM2-135M, one feature cache)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("checkpoints/scaling"))
    p.add_argument("--samples", type=int, default=4000, help="samples in the shared feature cache")
    p.add_argument("--sizes", default="125000,250000,500000,1000000,1900000")
    p.add_argument("--recipe-tokens", type=int, default=None, help="mark the CPU recipe's budget on the plot")
    p.add_argument("--run", type=Path, help="a finished recipe run: train the sizes on its feature cache, hot "
                   "vocabulary and held-out samples, and add the run itself as the largest point")
    p.add_argument("overrides", nargs="*", help="extra lyanna-train overrides for every size")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    features, hotvocab = args.out / "features", args.out / "hotvocab"
    if args.run:
        import yaml

        run_cfg = yaml.safe_load((args.run / "config.yaml").read_text())
        features, hotvocab, args.samples = args.run / "features", args.run / "hotvocab", run_cfg["data"]["max_samples"]
    common = [f"data.cache_dir={features}", f"hotvocab.path={hotvocab}",
              f"data.max_samples={args.samples}", f"eval.heldout_from={args.samples}", "tracking.wandb.enabled=false",
              "eval.num_prompts=16", "eval.max_new_tokens=64"]
    if not args.run and not (hotvocab / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "lyanna_train.cli.hotvocab", "--corpus", "sharegpt", "--tokenizer",
                        "smollm2", "--ratios", "0.05", "--out", str(args.out / "hotvocab")], check=True)
    saved = args.out / "results.json"
    results = {r["size"]: r for r in (json.loads(saved.read_text()) if saved.exists() else [])}
    if args.run:
        point = run_point(args.run)
        results[point["size"]] = point
        args.recipe_tokens = args.recipe_tokens or point["size"]
    for size in (int(s) for s in args.sizes.split(",")):
        if size not in results:
            results[size] = train(args.out, size, common, args.overrides)
            saved.write_text(json.dumps(sorted(results.values(), key=lambda r: r["size"]), indent=2))
    ordered = sorted(results.values(), key=lambda r: r["size"])
    plot(ordered, args.out / "scaling.png", args.recipe_tokens)
    print("\n| training tokens | chain τ | accept ≥1 | held-out top-1 step 0 | step 1 | step 2 | train top-1 | gap | minutes |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in ordered:
        print(f"| {r['size']:,} | {r['eval/mean_tau_verify']:.3f} | {r['eval/accept_rate_d1']:.3f} | "
              + " | ".join(f"{r.get(f'eval/heldout_top1_step{j}', float('nan')):.3f}" for j in range(3))
              + f" | {r.get('eval/train_top1_step0', float('nan')):.3f} | {r.get('eval/top1_gap', float('nan')):.3f}"
              + f" | {r['minutes']:.1f} |")
    print(f"\nplot: {args.out / 'scaling.png'}")


if __name__ == "__main__":
    main()
