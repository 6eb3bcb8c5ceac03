"""Benchmark: τ on MT-Bench for the Lyanna parts, same training budget for each.

Runs ``lyanna-train +recipe=smollm2_135m`` once per variant at a fixed budget (400 samples,
2 epochs: the recipe's earlier setting, the one the README table was measured at), sharing one feature cache and
one hot-vocabulary artifact (5 / 8 / 10 %), and prints a Markdown table of the final
evaluation (chain depth 5, greedy): τ per verify forward, acceptance by depth, training
accuracy of the last logged step.

    python bench/ablations.py [--out checkpoints/ablations] [--variants full,no_pool,...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "full": ("full Lyanna (5 % hot vocab, pool + α-gate)", []),
    "no_pool": ("pool and α-gate off", ["draft=no_pool"]),
    "full_vocab": ("full-vocabulary head (no hot vocab)", ["hotvocab=full"]),
    "hot8": ("8 % hot vocabulary", ["hotvocab.ratio=0.08"]),
    "hot10": ("10 % hot vocabulary", ["hotvocab.ratio=0.10"]),
    "other_bucket": ("out-of-vocab 'other' bucket instead of masking", ["loss.out_of_vocab=other"]),
}


def run(name: str, extra: list[str], out: Path, common: list[str], resume: bool) -> dict:
    run_dir = out / name
    cmd = [sys.executable, "-m", "lyanna_train.cli.train", "+recipe=smollm2_135m", f"train.out_dir={run_dir}",
           f"train.resume={'auto' if resume else 'never'}", *common, *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if "eval/mean_tau_verify" in r][-1]
    last_train = [r for r in rows if "acc/step0" in r][-1]
    return {**final, "acc0": last_train["acc/step0"], "minutes": (time.perf_counter() - start) / 60}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("checkpoints/ablations"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--prompts", type=int, default=16, help="MT-Bench first turns evaluated")
    ap.add_argument("--resume", action="store_true",
                    help="continue each variant from its latest checkpoint (resume reproduces the uninterrupted run)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    hot = args.out / "hotvocab"
    if not (hot / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "lyanna_train.cli.hotvocab", "--corpus", "sharegpt", "--tokenizer", "smollm2",
                        "--ratios", "0.05,0.08,0.10", "--out", str(hot), "--no-progress"], check=True)
    # One budget for every variant, pinned here so the table does not move with the recipe.
    common = [f"data.cache_dir={args.out / 'features'}", f"hotvocab.path={hot}", f"eval.num_prompts={args.prompts}",
              "tracking.wandb.enabled=false", "data.max_samples=400", "train.epochs=2"]
    saved = args.out / "results.json"
    results = json.loads(saved.read_text()) if saved.exists() else {}  # earlier variants are kept
    for name in args.variants.split(","):
        label, extra = VARIANTS[name]
        results[name] = run(name, extra, args.out, common, args.resume)
        r = results[name]
        saved.write_text(json.dumps(results, indent=2))
        print(f"{name}: tau {r['eval/mean_tau_verify']:.3f}, acc0 {r['acc0']:.3f}, {r['minutes']:.1f} min", flush=True)
    print("\n| variant | τ (per verify) | accept d1 | d2 | d3 | train acc step0 | minutes |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {VARIANTS[name][0]} | {r['eval/mean_tau_verify']:.3f} | {r['eval/accept_rate_d1']:.3f} | "
              f"{r['eval/accept_rate_d2']:.3f} | {r['eval/accept_rate_d3']:.3f} | {r['acc0']:.3f} | {r['minutes']:.1f} |")


if __name__ == "__main__":
    main()
