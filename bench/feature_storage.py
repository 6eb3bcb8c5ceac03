"""Benchmark: how the feature cache is stored and filled, at one budget — bf16 or fp8, cached or hybrid.

Runs ``lyanna-train +recipe=smollm2_135m`` (in this process) once per variant and seed, every run on the same
samples (the first run's time budget decides how many, ``budget.json``; the others are
pinned to it with the budget off, or ``--samples N`` pins all) with one shared hot
vocabulary, each with its own feature cache built from nothing. Per run it reports the
cache's bytes per token (the shard files over the tokens in them), chain τ per verify
(the run's final evaluation: MT-Bench first turns on the runtime), teacher-forced top-1
agreement on the held-out samples as the run measured it (on held-out features in its own
dtype) and again on the first variant's held-out cache (bf16: what serving feeds every head
alike), the steps, the minutes from the run's start to its last step (set-up, features and
training: hybrid computes its features in the first epoch's steps, cached before them; the
final evaluation left out) and its wall minutes in all. With several seeds, ± is half the
spread across seeds: the noise a difference is read against. Run it on an idle machine.

    python bench/feature_storage.py --name fp8-zen1 --variants bf16,fp8 --seeds 0,1,2
    python bench/feature_storage.py --name hybrid-zen1 --variants bf16,hybrid
writes runs under ``--out``/NAME and ``bench/results/NAME/summary.json`` (+ ``summary.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from lyanna_train.evaluation.report import markdown_table

VARIANTS = {
    "bf16": ("cached, bf16 features (the recipe)", ["data.features=cached", "data.feature_dtype=bfloat16"]),
    "fp8": ("cached, fp8 features (e4m3, a scale per token and layer)",
            ["data.features=cached", "data.feature_dtype=float8_e4m3fn"]),
    "hybrid": ("hybrid: the first epoch's steps compute and write bf16 features",
               ["data.features=hybrid", "data.feature_dtype=bfloat16"]),
    "hybrid_fp8": ("hybrid, fp8 features", ["data.features=hybrid", "data.feature_dtype=float8_e4m3fn"]),
}
ROOT = Path(__file__).resolve().parents[1]


def train_run(run_dir: Path, overrides: list[str]) -> tuple[float, float]:
    """One lyanna-train run in this process (resumed if it stopped), as the CLI runs it;
    returns its start (epoch seconds) and wall minutes. The slow imports come before the
    clock (a run in a fresh process pays them: ~4 s of every variant alike)."""
    from omegaconf import OmegaConf

    from lyanna_train.cli.plan import compose
    from lyanna_train.errors import LyannaError
    from lyanna_train.training.loop import train

    cfg = compose(["+recipe=smollm2_135m", f"train.out_dir={run_dir}", *overrides])
    started, start = time.time(), time.perf_counter()
    try:
        train(cfg, OmegaConf.to_container(cfg, resolve=True))
    except LyannaError as err:
        raise SystemExit(f"{run_dir.name} failed: {err}") from None
    return started, (time.perf_counter() - start) / 60


def final_metrics(run_dir: Path, started: float) -> dict:
    """The final evaluation's figures, the steps, and the minutes from the start to the last
    step (set-up, features and training: the final evaluation left out)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = {k: v for r in rows if any(k.startswith("eval/") for k in r) for k, v in r.items()}
    last = max((r for r in rows if "loss/total" in r), key=lambda r: r["step"])
    out.update(steps=last["step"], minutes_to_last_step=(last["time"] - started) / 60)
    return out


def cache_bytes_per_token(root: Path) -> float:
    tokens = json.loads((root / "manifest.json").read_text())["totals"]["tokens"]
    return sum(p.stat().st_size for p in (root / "shards").glob("*.safetensors")) / tokens


def heldout_on(run_dir: Path, heldout_root: Path, parts: dict) -> dict:
    """Held-out top-1 agreement of the run's final head on the features of ``heldout_root``."""
    from lyanna_train.data.feature_cache import FeatureCache
    from lyanna_train.export.reader import load_exported
    from lyanna_train.export.writer import export_checkpoint
    from lyanna_train.training.heldout import AgreementSets

    export = run_dir.with_name(run_dir.name + "-export")  # never inside the run it reads
    export_checkpoint(run_dir, export, target=parts["target"], tokenizer=parts["tokenizer"],
                      target_name=parts["name"], overwrite=True, say=lambda *_: None)
    draft, _ = load_exported(export, parts["target"], parts["tokenizer"])
    held = FeatureCache(heldout_root)
    sets = AgreementSets.of(held, held, parts["batch_tokens"])  # only the held-out side is read here
    return {k.removeprefix("eval/"): v for k, v in sets.metrics(draft, 3).items() if "heldout_top1" in k}


def summarise(rows: list[dict]) -> list[dict]:
    """Per variant: the mean over seeds of each figure and, with several seeds, its spread (max - min)."""
    keys = ("bytes_per_token", "tau", "heldout_top1_step0", "heldout_top1_step0_on_bf16", "minutes",
            "minutes_to_last_step", "steps")
    out = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        row = {"variant": variant, "label": VARIANTS[variant][0], "seeds": [r["seed"] for r in mine]}
        for k in keys:
            values = [r[k] for r in mine if r.get(k) is not None]
            if values:
                row[k] = statistics.fmean(values)
                row[f"{k}_spread"] = max(values) - min(values)
        out.append(row)
    return out


def table(summary: list[dict]) -> str:
    head = ["variant", "bytes/token", "chain τ", "held-out top-1 (own features)", "held-out top-1 (bf16 features)",
            "steps", "minutes to the last step", "minutes in all"]
    rows = []
    for r in summary:
        cell = lambda k, f: (f"{r[k]:{f}}" + (f" ± {r[k + '_spread'] / 2:{f}}" if r.get(k + "_spread") else "")  # noqa: E731
                             if k in r else "n/a")
        rows.append([r["label"], cell("bytes_per_token", ",.0f"), cell("tau", ".3f"), cell("heldout_top1_step0", ".3f"),
                     cell("heldout_top1_step0_on_bf16", ".3f"), cell("steps", ".0f"),
                     cell("minutes_to_last_step", ".1f"), cell("minutes", ".1f")])
    return markdown_table(head, rows, left=("variant",))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True, help="runs go to OUT/NAME, the summary to RESULTS/NAME")
    ap.add_argument("--variants", default="bf16,fp8", help=f"comma-separated, from {', '.join(VARIANTS)}; "
                    "the first one's held-out cache is the common yardstick")
    ap.add_argument("--seeds", default="0", help="train.seed values, comma-separated (several: the noise)")
    ap.add_argument("--samples", type=int, help="data.max_samples for every run (default: the first run's budget)")
    ap.add_argument("--corpus", default="sharegpt", help="training corpus (data.corpus) and hot-vocabulary corpus")
    ap.add_argument("--out", type=Path, default=Path("checkpoints/feature_storage"), help="where the runs go")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="summaries go to RESULTS/NAME")
    ap.add_argument("extra", nargs="*", metavar="OVERRIDE", help="more overrides for every run (e.g. a tiny setting)")
    args = ap.parse_args()
    out = args.out / args.name
    out.mkdir(parents=True, exist_ok=True)
    hot = out / "hotvocab"
    # DeepSpeed's CPU op is built once per environment, with its own ninja (as `make install` and
    # tests/conftest.py do), not timed in a run
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.prefix) / "bin"), os.environ.get("PATH", "")])
    import deepspeed  # noqa: F401 - imported before any run's clock starts
    import lyanna_train.training.loop  # noqa: F401
    from lyanna_train.hotvocab.build import build
    from lyanna_train.hotvocab.counting import CountSettings
    from lyanna_train.hotvocab.selection import SelectionRequest

    if not (hot / "manifest.json").exists():
        build([args.corpus], "smollm2", hot, [SelectionRequest(ratio=0.05)], CountSettings(), progress=False)
    common = [f"hotvocab.path={hot}", f"data.corpus=[{args.corpus}]", "tracking.wandb.enabled=false", *args.extra]
    samples = args.samples
    runs = [(v, int(s)) for v in args.variants.split(",") for s in args.seeds.split(",")]
    rows = []
    for variant, seed in runs:
        run_dir = out / f"{variant}-s{seed}"
        pinned = [] if samples is None else [f"data.max_samples={samples}", "train.time_budget_min=null"]
        started, minutes = train_run(run_dir, [*common, *VARIANTS[variant][1], f"train.seed={seed}", *pinned])
        if samples is None:  # the first run's budget decides the samples of all
            budget = run_dir / "budget.json"
            samples = json.loads(budget.read_text())["samples"] if budget.exists() else None
        metrics = final_metrics(run_dir, started)
        rows.append({"variant": variant, "seed": seed, "minutes": minutes, "steps": metrics["steps"],
                     "minutes_to_last_step": metrics["minutes_to_last_step"],
                     "bytes_per_token": cache_bytes_per_token(run_dir / "features"),
                     "tau": metrics.get("eval/mean_tau_verify"),
                     **{k.removeprefix("eval/"): v for k, v in metrics.items() if "top1" in k or "accept_rate" in k}})
        print(f"{variant} seed {seed}: {rows[-1]['bytes_per_token']:,.0f} bytes/token, tau {rows[-1]['tau']}, "
              f"held-out top-1 {rows[-1].get('heldout_top1_step0')}, {minutes:.1f} min", flush=True)
    yardstick = out / f"{runs[0][0]}-s{runs[0][1]}" / "features-heldout"
    if yardstick.exists():
        import torch
        from omegaconf import OmegaConf

        from lyanna_train.target.source import load_tokenizer
        from lyanna_train.target.model import load_target_model

        cfg = OmegaConf.load(out / f"{runs[0][0]}-s{runs[0][1]}" / "config.yaml")
        parts = {"name": cfg.target.name, "target": load_target_model(cfg.target.name, dtype=torch.float32),
                 "tokenizer": load_tokenizer(cfg.target.name), "batch_tokens": cfg.data.batch_tokens}
        for row in rows:
            on_bf16 = heldout_on(out / f"{row['variant']}-s{row['seed']}", yardstick, parts)
            row.update({f"{k}_on_bf16": v for k, v in on_bf16.items()})
    summary = summarise(rows)
    results = args.results / args.name
    results.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", "bench/feature_storage.py", *sys.argv[1:]])
    (results / "summary.json").write_text(json.dumps({"command": command, "samples": samples, "summary": summary,
                                                      "runs": rows}, indent=2))
    (results / "summary.md").write_text(f"`{command}` ({samples} samples per run)\n\n{table(summary)}\n")
    print(f"\n{table(summary)}\n\nwrote {results / 'summary.json'}")


if __name__ == "__main__":
    main()
