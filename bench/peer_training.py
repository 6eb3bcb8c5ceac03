"""Benchmark: a finished ``lyanna-train`` run against speculators' EAGLE-3 trainer at the same budget.

The peer (``bench/peer_speculators.py``, speculators 0.9.0 with its own defaults) trains on
exactly the batches the run trained on — the same cached target features (same layers),
the same tokens, the same number of optimizer steps — then comes back through
``lyanna-export import`` and is served by the same runtime. Both heads are measured the
same way: chain τ (depth 5, greedy) on MT-Bench first turns with the fp32 target, and
teacher-forced top-1 agreement on the run's held-out samples (and on as many of its
training samples: the over-fit gap).

    python bench/peer_training.py --run checkpoints/smollm2_135m --out checkpoints/peer
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch


def run_plan(cfg, cache) -> list[list]:
    """The run's optimizer steps as [shard, rows] (one micro-batch each), in training order."""
    from lyanna_train.training.batches import cache_lengths, first_tokens, plan_epoch

    if cfg.train.grad_accum != 1:
        raise SystemExit("this comparison replays runs with train.grad_accum=1 only")
    lengths = first_tokens(cache_lengths(cache), cfg.data.get("max_tokens"))
    per_epoch = len(plan_epoch(lengths, cfg.data.batch_tokens, cfg.train.seed, 0, 1))
    total = cfg.train.max_steps or per_epoch * cfg.train.epochs
    steps, epoch = [], 0
    while len(steps) < total:
        steps += [[ref.shard, list(ref.rows)] for ref in plan_epoch(lengths, cfg.data.batch_tokens, cfg.train.seed,
                                                                     epoch, 1)]
        epoch += 1
    return steps[:total]


def verifier_dir(out: Path, target_name: str) -> Path:
    """The target as a Hugging Face directory with its tokenizer (what speculators reads)."""
    from lyanna_train.target.source import resolve_target, tokenizer_dir
    from lyanna_train.target.model import model_dir

    ref = resolve_target(target_name)
    out.mkdir(parents=True, exist_ok=True)
    for source in (Path(model_dir(ref)), Path(tokenizer_dir(ref))):
        for item in source.iterdir():
            link = out / item.name
            if not link.exists():
                link.symlink_to(item.resolve())
    return out


def train_peer(args, cfg, cache_root: Path, hot_file: Path, layer_ids, plan) -> tuple[Path, float]:
    out = args.out / "peer"
    head = out / "head"
    if (head / "model.safetensors").exists() and not args.retrain:
        return head, json.loads((head / "peer_training.json").read_text())["seconds"] / 60
    (out / "plan.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan))
    consumers = Path(sys.executable).resolve().parent.parent / "consumers"
    if not (consumers / "speculators").is_dir():
        consumers = Path(sys.prefix) / "consumers"
    env = {**os.environ, "PYTHONPATH": str(consumers)}
    cmd = [sys.executable, str(Path(__file__).with_name("peer_speculators.py")), "--plan", str(out / "plan.json"),
           "--cache", str(cache_root), "--verifier", str(verifier_dir(out / "verifier", cfg.target.name)),
           "--hot", str(hot_file), "--layers", ",".join(map(str, layer_ids)), "--out", str(head)]
    if cfg.train.threads:
        cmd += ["--threads", str(cfg.train.threads)]
    # the run's own precision (its config holds ``auto`` resolved): fp32 where bf16 is only emulated
    from lyanna_train.target.precision import resolve_autocast

    cmd += ["--dtype", resolve_autocast(cfg.train.get("autocast")) or "float32"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    return head, (time.perf_counter() - start) / 60


def heldout_batches(cache_root: Path, train_cache, batch_tokens: int):
    from lyanna_train.data.feature_cache import FeatureCache
    from lyanna_train.training.heldout import AgreementSets

    held_root = cache_root.with_name(cache_root.name + "-heldout")
    if not (held_root / "manifest.json").exists():
        return None
    return AgreementSets.of(FeatureCache(held_root), train_cache, batch_tokens)


def measure(name: str, draft, target, prompts, agreement, tokens: int) -> dict:
    from lyanna_train.evaluation.acceptance import mean_acceptance

    draft.eval()
    out = {"head": name}
    if agreement is not None:
        out.update({k.removeprefix("eval/"): v for k, v in agreement.metrics(draft, 3).items()})
    tau = mean_acceptance(target, draft, prompts, depth=5, max_new_tokens=tokens)
    out.update(tau=tau["mean_tau_verify"], accept=tau["accept_rate"][:3])
    return out


def main() -> None:
    from omegaconf import OmegaConf

    from lyanna_train.data.feature_cache import FeatureCache
    from lyanna_train.export.importer import import_head
    from lyanna_train.export.reader import load_exported
    from lyanna_train.export.writer import export_checkpoint
    from lyanna_train.evaluation.prompts import read_questions, render_prompt
    from lyanna_train.target.source import load_tokenizer
    from lyanna_train.target.model import load_target_model
    from lyanna_train.run_record import latest_checkpoint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, required=True, help="a finished lyanna-train run directory")
    p.add_argument("--out", type=Path, default=Path("checkpoints/peer"))
    p.add_argument("--prompts", type=int, default=16, help="MT-Bench first turns for chain τ")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--retrain", action="store_true", help="train the peer again even if its head exists")
    args = p.parse_args()
    cfg = OmegaConf.load(args.run / "config.yaml")
    cache_root = Path(cfg.data.cache_dir) if cfg.data.cache_dir else args.run / "features"
    ckpt = latest_checkpoint(args.run / "checkpoints")
    draft_config = json.loads((ckpt / "draft_config.json").read_text())
    layer_ids = draft_config["aux_layer_ids"]
    hot_root = Path(cfg.hotvocab.path) if cfg.hotvocab.path else args.run / "hotvocab"
    hot_file = hot_root / f"hot-{draft_config['draft_vocab_size']}.safetensors" if hot_root.is_dir() else hot_root
    cache = FeatureCache(cache_root)
    plan = run_plan(cfg, cache)
    print(f"replaying {len(plan)} steps ({sum(len(r) for _, r in plan)} samples) of {args.run} for the peer", flush=True)
    peer_head, peer_minutes = train_peer(args, cfg, cache_root, hot_file, layer_ids, plan)

    target = load_target_model(cfg.target.name, dtype=torch.float32)
    tokenizer = load_tokenizer(cfg.target.name)
    quiet = lambda *_: None  # noqa: E731
    export_checkpoint(ckpt, args.out / "ours", target=target, tokenizer=tokenizer, target_name=cfg.target.name,
                      overwrite=True, say=quiet)
    import_head(peer_head, args.out / "peer" / "export", cfg.target.name, target=target, tokenizer=tokenizer,
                overwrite=True, say=quiet)
    questions = read_questions("mtbench")
    stride = max(1, len(questions) // args.prompts)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": q.turns[0]}])
               for q in questions[::stride][: args.prompts]]
    agreement = heldout_batches(cache_root, cache, cfg.data.batch_tokens)
    rows = []
    for name, directory in (("lyanna (this run)", args.out / "ours"), ("speculators EAGLE-3 defaults",
                                                                      args.out / "peer" / "export")):
        draft, _ = load_exported(directory, target, tokenizer)
        rows.append(measure(name, draft, target, prompts, agreement, args.max_new_tokens))
    rows[1]["train_minutes"] = round(peer_minutes, 1)
    from lyanna_train.training.batches import cache_lengths

    lengths = cache_lengths(cache)
    summary = {"run": str(args.run), "steps": len(plan), "tokens": sum(lengths[s][r] for s, rows in plan for r in rows),
               "rows": rows}
    (args.out / "results.json").write_text(json.dumps(summary, indent=2))
    print("\n| head | chain τ | accept ≥1 | ≥2 | ≥3 | held-out top-1 step 0 | 1 | 2 | train top-1 | gap |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        held = [r.get(f"heldout_top1_step{j}", float("nan")) for j in range(3)]
        print(f"| {r['head']} | {r['tau']:.3f} | " + " | ".join(f"{a:.3f}" for a in r["accept"]) + " | "
              + " | ".join(f"{h:.3f}" for h in held)
              + f" | {r.get('train_top1_step0', float('nan')):.3f} | {r.get('top1_gap', float('nan')):.3f} |")


if __name__ == "__main__":
    main()
