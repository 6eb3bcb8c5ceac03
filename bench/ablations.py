"""Benchmark: the levers of the CPU recipe, one row each, at the same budget.

Runs ``lyanna-train +recipe=smollm2_135m`` once per variant on the first ~265k tokens of ONE
shared feature cache (``data.max_tokens``) for 3 epochs (411 steps of 2,048 tokens), with
one shared hot-vocabulary artifact, and tabulates what each run measured at its end:
chain τ per verify (depth 5, greedy, 16 MT-Bench first turns, 64 tokens) with acceptance
by depth, teacher-forced top-1 agreement on 64 held-out ShareGPT samples (steps 0-2) and
on as many training samples (the over-fit gap), and the run's minutes. Each row changes
one thing against the recipe (``recipe``); "one pass over 3x the data" keeps the number
of steps and changes where they come from.

    python bench/ablations.py [--out checkpoints/ablations] [--variants recipe,no_pool,...] [--resume]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BUDGET_TOKENS = 265_000  # the first 8 shards of the shared cache
SAMPLES = 4000  # the shared cache holds the corpus' first 4,000 samples; held-out ones follow
VARIANTS = {
    "recipe": ("the recipe as it is", []),
    "one_pass": ("one pass over 3x the data (same steps)", [f"data.max_tokens={3 * BUDGET_TOKENS}", "train.epochs=1"]),
    "no_pool": ("state pool and α-gate off", ["draft=no_pool"]),
    "init_lm_head": ("lm_head + norm from the target (hot rows)", ["draft.target_init.lm_head=true"]),
    "init_lm_head_frozen": ("... and kept frozen", ["draft.target_init.lm_head=true", "draft.freeze_lm_head=true"]),
    "init_layer": ("+ decoder layer from target layer 29, fc passes layer 26 through",
                   ["draft.target_init.lm_head=true", "draft.target_init.layer=29", "draft.target_init.fc=top_layer"]),
    "normed": ("normed residual + per-dimension feature scale",
               ["draft.norm_before_residual=true", "draft.aux_scale=true"]),
    "tv": ("+ total-variation loss (weight 1)", ["loss.tv_weight=1.0"]),
    "hidden": ("+ hidden-state regression (weight 1) with lm_head from the target",
               ["loss.hidden_weight=1.0", "draft.target_init.lm_head=true"]),
    "ttt5": ("5 unroll steps instead of 3", ["loss.ttt_steps=5"]),
    "ttt1": ("1 unroll step", ["loss.ttt_steps=1"]),
    "all_positions": ("user-turn positions trained too", ["loss.positions=all"]),
    "weight_decay": ("weight decay 0.1", ["train.weight_decay=0.1"]),
    "lr_3e-3": ("peak lr 3e-3", ["train.lr=3.0e-3"]),
    "hot10": ("10 % hot vocabulary (86.5 % held-out coverage, vs 79.3 %)", ["hotvocab.ratio=0.10"]),
    "full_vocab": ("full-vocabulary head (no hot vocabulary)", ["hotvocab=full"]),
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
    final = {k: v for r in rows if "eval/mean_tau_verify" in r for k, v in r.items()}
    return {**final, "minutes": (time.perf_counter() - start) / 60}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("checkpoints/ablations"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--resume", action="store_true",
                    help="continue each variant from its latest checkpoint (resume reproduces the uninterrupted run)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    hot = args.out / "hotvocab"
    if not (hot / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "lyanna_train.cli.hotvocab", "--corpus", "sharegpt", "--tokenizer", "smollm2",
                        "--ratios", "0.05,0.08,0.10", "--out", str(hot), "--no-progress"], check=True)
    # One budget for every variant, pinned here so the table does not move with the recipe's size.
    common = [f"data.cache_dir={args.out / 'features'}", f"hotvocab.path={hot}", f"data.max_samples={SAMPLES}",
              f"data.max_tokens={BUDGET_TOKENS}", "train.epochs=3", f"eval.heldout_from={SAMPLES}",
              "eval.num_prompts=16", "eval.max_new_tokens=64", "tracking.wandb.enabled=false"]
    saved = args.out / "results.json"
    results = json.loads(saved.read_text()) if saved.exists() else {}  # earlier variants are kept
    for name in args.variants.split(","):
        label, extra = VARIANTS[name]
        results[name] = run(name, extra, args.out, common, args.resume)
        r = results[name]
        saved.write_text(json.dumps(results, indent=2))
        print(f"{name}: tau {r['eval/mean_tau_verify']:.3f}, held-out top-1 {r.get('eval/heldout_top1_step0', 0):.3f}, "
              f"{r['minutes']:.1f} min", flush=True)
    print("\n| variant | τ (chain, per verify) | accept ≥1 | ≥2 | ≥3 | held-out top-1 step 0 | 1 | 2 | train top-1 | gap "
          "| minutes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        held = " | ".join(f"{r.get(f'eval/heldout_top1_step{j}', float('nan')):.3f}" for j in range(3))
        print(f"| {VARIANTS[name][0]} | {r['eval/mean_tau_verify']:.3f} | {r['eval/accept_rate_d1']:.3f} | "
              f"{r['eval/accept_rate_d2']:.3f} | {r['eval/accept_rate_d3']:.3f} | {held} | "
              f"{r.get('eval/train_top1_step0', float('nan')):.3f} | {r.get('eval/top1_gap', float('nan')):.3f} | "
              f"{r['minutes']:.1f} |")


if __name__ == "__main__":
    main()
