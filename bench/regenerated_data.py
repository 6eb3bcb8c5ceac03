"""Benchmark: a head trained on the target's own answers against one trained on ShareGPT's.

Regenerates the first ``--conversations`` ShareGPT conversations with the target on our runtime
(``data_tools/self_distill.py``: multi-turn, greedy, speculation on, the feature cache
written in the same pass) and trains the recipe on them; trains the recipe on ShareGPT's own
answers over as many assistant (loss) tokens; and reads a ShareGPT head trained at the
recipe's 30-minute budget (``--budget-run``, e.g. a ``bench/feature_storage.py`` bf16 run).
Every run shares one hot vocabulary and the recipe's settings; none has its time budget on
(sample counts are pinned), so the figures do not depend on what else ran.

Per head: chain τ on MT-Bench first turns (the run's final evaluation) and teacher-forced
top-1 agreement on two held-out sets no head trained on: ShareGPT answers (the budget run's
held-out cache) and regenerated answers (conversations ``--heldout-from`` onwards,
regenerated with their features the same way). Minutes: the regeneration, timed here, and
each run's minutes to its last step; the regenerated head fits the budget when the two
together stay under ``--budget-min``. Run it on an idle machine.

    python bench/regenerated_data.py --name regen-xeon --draft /work/runs/export --conversations 570 \
        --budget-run /work/runs/fs/fp8-xeon/bf16-s0 --out /work/runs/regen

writes runs under ``--out``/NAME and ``bench/results/NAME/summary.json`` (+ ``summary.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from feature_storage import final_metrics, heldout_on, train_run  # noqa: E402

from lyanna_train.evaluation.report import markdown_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def regenerate(out: Path, features: Path, corpus: list[str], limit: int, args) -> dict:
    """One self_distill pass with features over the first ``limit`` conversations, timed; a
    larger ``limit`` later resumes it (nothing is regenerated twice) and adds its time."""
    timing = out.with_suffix(".timing.json")
    before = json.loads(timing.read_text()) if timing.exists() else {"limit": 0, "seconds": 0.0}
    if before["limit"] >= limit:
        return before
    cmd = [sys.executable, str(ROOT / "data_tools" / "self_distill.py"), "--corpus", *corpus, "--out", str(out),
           "--features", str(features), "--limit", str(limit), "--batch-size", str(args.batch_size),
           "--max-new-tokens", str(args.max_new_tokens), "--max-turns", str(args.max_turns),
           "--max-prompt-tokens", str(args.max_prompt_tokens), "--max-length", "512"]
    if args.draft:
        cmd += ["--draft", str(args.draft)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"regeneration failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    manifest = json.loads((features / "manifest.json").read_text())["totals"]
    result = {"limit": limit, "seconds": before["seconds"] + time.perf_counter() - start,
              "conversations": sum(1 for _ in open(out)), "samples": manifest["samples"],
              "tokens": manifest["tokens"], "loss_tokens": manifest["loss_tokens"],
              "log": [*before.get("log", []), *proc.stdout.strip().splitlines()[-2:]]}
    timing.write_text(json.dumps(result, indent=2))
    return result


def run_once(run_dir: Path, overrides: list[str]) -> dict:
    """A recipe run (skipped when it already ran to its final evaluation), with its final
    figures and its minutes from the start (its hydra folder's creation) to its last step."""
    done = (run_dir / "metrics.jsonl").exists() and "eval/mean_tau_verify" in (run_dir / "metrics.jsonl").read_text()
    if not done:
        train_run(run_dir, overrides)
    return final_metrics(run_dir, (run_dir / "hydra").stat().st_mtime)


def linked_copy(src: Path, dst: Path) -> Path:
    """``src`` as hard links under ``dst``: a run that rewrites the manifest leaves ``src`` whole."""
    if not dst.exists():
        for path in src.rglob("*"):
            target = dst / path.relative_to(src)
            if path.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(path, target)
    return dst


def subset_corpus(corpus: str, first: int, count: int, path: Path) -> Path:
    """Conversations ``first`` .. ``first + count`` of a corpus, as ShareGPT JSONL."""
    from lyanna_train.data.conversations import Document
    from lyanna_train.data.corpus import Corpus, ReadNotes, iter_documents
    from lyanna_train.data.self_distill import to_sharegpt

    if path.exists():
        return path
    lines = []
    for doc in iter_documents(Corpus.resolve([corpus]), ReadNotes()):
        if doc.index >= first + count:
            break
        if doc.index >= first and isinstance(doc, Document) and doc.is_conversation:
            lines.append(json.dumps(to_sharegpt(str(doc.index), doc.messages), ensure_ascii=False))
    path.write_text("\n".join(lines) + "\n")
    return path


def samples_for_loss_tokens(cache_root: Path, loss_tokens: int) -> int:
    """How many of a cache's samples (in order) hold ``loss_tokens`` assistant tokens."""
    from lyanna_train.data.feature_cache import FeatureCache

    cache, counts = FeatureCache(cache_root), []
    for k in range(len(cache)):
        t = cache.load_shard(k)
        counts += [int(t["loss_mask"][t["offsets"][i]:t["offsets"][i + 1]].sum()) for i in range(len(t["offsets"]) - 1)]
    total = 0
    for n, c in enumerate(counts, 1):
        total += c
        if total >= loss_tokens:
            return n
    raise SystemExit(f"{cache_root} holds {total} loss tokens, fewer than {loss_tokens}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--draft", type=Path, help="exported head to speculate with while regenerating")
    ap.add_argument("--conversations", type=int, default=570,
                    help="the first N ShareGPT conversations are regenerated (those without an assistant turn or "
                         "with a first prompt over --max-prompt-tokens are skipped) and trained on")
    ap.add_argument("--budget-run", type=Path, required=True,
                    help="a recipe run on ShareGPT at the time budget (its features, held-out cache, metrics)")
    ap.add_argument("--heldout-from", type=int, default=800, help="first conversation of the regenerated held-out set")
    ap.add_argument("--heldout", type=int, default=128, help="conversations read for the regenerated held-out set")
    ap.add_argument("--budget-min", type=float, default=30.0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-prompt-tokens", type=int, default=448, help="no turn regenerated past this (max_length 512)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    out = args.out / args.name
    out.mkdir(parents=True, exist_ok=True)
    budget_run = args.budget_run
    hot = budget_run.parent / "hotvocab"
    common = [f"hotvocab.path={hot}", "tracking.wandb.enabled=false", "train.time_budget_min=null"]

    regen = regenerate(out / "train.jsonl", out / "train-features", ["sharegpt"], args.conversations, args)
    print(f"regenerated {regen['conversations']} conversations in {regen['seconds'] / 60:.1f} min", flush=True)
    held_corpus = subset_corpus("sharegpt", args.heldout_from, args.heldout, out / "heldout-source.jsonl")
    held = regenerate(out / "heldout.jsonl", out / "heldout-features", [str(held_corpus)], args.heldout, args)

    runs = {"regenerated": out / "regenerated", "regenerated_budget": out / "regenerated-budget",
            "sharegpt_equal": out / "sharegpt-equal", "sharegpt_budget": budget_run}
    rows = {"regenerated": {**run_once(runs["regenerated"], [
        *common, f"data.corpus=[{out / 'train.jsonl'}]", f"data.cache_dir={out / 'train-features'}",
        f"data.max_samples={regen['samples']}", "eval.heldout_samples=0"]), "samples": regen["samples"]}}

    # At the budget the regeneration counts: as many samples as regeneration (its measured
    # seconds per conversation) and training (the run above, per sample) fit in it.
    per_conv = regen["seconds"] / regen["conversations"]
    per_sample = rows["regenerated"]["minutes_to_last_step"] * 60 / regen["samples"]
    fit = min(regen["samples"], int(args.budget_min * 60 / (per_conv + per_sample)))
    rows["regenerated_budget"] = {**run_once(runs["regenerated_budget"], [
        *common, f"data.corpus=[{out / 'train.jsonl'}]",
        f"data.cache_dir={linked_copy(out / 'train-features', out / 'budget-features')}",
        f"data.max_samples={fit}", "eval.heldout_samples=0"]), "samples": fit}
    for name in ("regenerated", "regenerated_budget"):
        r = rows[name]
        r["regeneration_minutes"] = per_conv * r["samples"] / 60
        r["minutes_with_regeneration"] = r["regeneration_minutes"] + r["minutes_to_last_step"]

    equal = samples_for_loss_tokens(budget_run / "features", regen["loss_tokens"])
    rows["sharegpt_equal"] = {**run_once(runs["sharegpt_equal"], [*common, "data.corpus=[sharegpt]",
                                                                  f"data.max_samples={equal}"]), "samples": equal}
    budget = json.loads((budget_run / "budget.json").read_text())
    rows["sharegpt_budget"] = {**final_metrics(budget_run, (budget_run / "hydra").stat().st_mtime),
                               "samples": budget["samples"]}

    import torch
    from omegaconf import OmegaConf

    from lyanna_train.target.model import load_target_model
    from lyanna_train.target.source import load_tokenizer

    cfg = OmegaConf.load(budget_run / "config.yaml")
    parts = {"name": cfg.target.name, "target": load_target_model(cfg.target.name, dtype=torch.float32),
             "tokenizer": load_tokenizer(cfg.target.name), "batch_tokens": cfg.data.batch_tokens}
    yardsticks = {"sharegpt": budget_run / "features-heldout", "regenerated": out / "heldout-features"}
    for name, run_dir in runs.items():
        for held_name, root in yardsticks.items():
            top1 = heldout_on(run_dir, root, parts)
            rows[name][f"heldout_top1_on_{held_name}"] = top1.get("heldout_top1_step0")
        cache = run_dir / "features" if (run_dir / "features").exists() else \
            (out / "budget-features" if name == "regenerated_budget" else out / "train-features")
        rows[name]["loss_tokens"] = json.loads((cache / "manifest.json").read_text())["totals"]["loss_tokens"]

    fits = rows["regenerated_budget"]["minutes_with_regeneration"] <= args.budget_min * 1.05
    summary = {"command": " ".join(["python", "bench/regenerated_data.py", *sys.argv[1:]]),
               "regeneration": regen, "heldout_regeneration": held, "budget_min": args.budget_min,
               "seconds_per_regenerated_conversation": per_conv, "training_seconds_per_sample": per_sample,
               "regenerated_budget_fits": fits, "heads": rows}
    head = ["head", "samples", "loss tokens", "chain τ (MT-Bench)", "held-out top-1: ShareGPT answers",
            "held-out top-1: regenerated answers", "minutes"]
    labels = {"regenerated": "regenerated answers (one pass: data + features), as many samples as regenerated",
              "regenerated_budget": f"regenerated answers, the {args.budget_min:g}-minute budget (regeneration counted)",
              "sharegpt_equal": "ShareGPT answers, as many loss tokens as the regenerated set",
              "sharegpt_budget": f"ShareGPT answers, the {args.budget_min:g}-minute budget (the recipe)"}
    table_rows = []
    for name, r in rows.items():
        minutes = (f"{r['regeneration_minutes']:.1f} regeneration + {r['minutes_to_last_step']:.1f} run"
                   if "regeneration_minutes" in r else f"{r['minutes_to_last_step']:.1f} run")
        table_rows.append([labels[name], f"{r['samples']}", f"{r['loss_tokens']:,}", f"{r['eval/mean_tau_verify']:.3f}",
                           f"{r['heldout_top1_on_sharegpt']:.3f}", f"{r['heldout_top1_on_regenerated']:.3f}", minutes])
    table = markdown_table(head, table_rows, left=("head", "minutes"))
    results = args.results / args.name
    results.mkdir(parents=True, exist_ok=True)
    (results / "summary.json").write_text(json.dumps(summary, indent=2))
    (results / "summary.md").write_text(f"`{summary['command']}`\n\n{table}\n")
    print(f"\n{table}\n\nbudget-fitted regenerated head within {args.budget_min:g} min (+5 %): {fits}; wrote {results / 'summary.json'}")


if __name__ == "__main__":
    main()
