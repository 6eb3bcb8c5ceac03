"""``train(cfg)``: setup -> train -> save, with the step loop written out."""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import LyannaError
from . import checkpoint as ckpt
from . import run_folder
from .batches import CachedBatches, OnlineBatches, cache_lengths, first_tokens, plan_epoch
from .config import validate
from .deepspeed_engine import Engine, init_distributed
from .heldout import AgreementSets, heldout_start
from .setup import build_parts, cache_spec, feature_cache, online_samples, training_samples
from .step import distill_loss, step_autocast
from .tracking import Tracker


def _rng_state() -> dict:
    """Every generator's state as tensors and plain data (checkpoints load ``weights_only``: no numpy objects)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def evaluate(cfg, parts, draft, agreement=None) -> dict:
    """Mean acceptance length τ of the current head under chain drafting (the runtime's code),
    and its teacher-forced top-1 agreement on held-out and training samples."""
    from ..evaluation.acceptance import mean_acceptance

    out = {}
    if agreement is not None:
        out.update(agreement.metrics(draft, cfg.eval.agreement_steps))
    if not parts.eval_prompts:
        return out
    draft.eval()
    try:
        result = mean_acceptance(parts.target, draft, parts.eval_prompts, depth=cfg.eval.depth,
                                 max_new_tokens=cfg.eval.max_new_tokens)
    finally:
        draft.train()
    out.update({f"eval/{k}": v for k, v in result.items() if isinstance(v, (int, float))})
    for depth, rate in enumerate(result.get("accept_rate", []), start=1):  # acceptance by depth
        out[f"eval/accept_rate_d{depth}"] = rate
    return out


def train(cfg, config_dict: dict | None = None) -> dict:
    """Validate, claim the run folder (one run at a time, same config), then set up, train and save."""
    started = time.perf_counter()  # the time budget counts from here
    validate(cfg)  # every value, before any work
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    rank, world = init_distributed(cfg.deepspeed.backend)
    say = print if rank == 0 else (lambda *_: None)
    resolve_auto_precision(cfg, say)
    out_dir = Path(cfg.train.out_dir)
    with run_folder.claim(cfg, out_dir, rank, world, say) as claimed, contextlib.ExitStack() as held:
        return _train(cfg, config_dict, claimed, out_dir, rank, world, say, started, held)


def resolve_auto_precision(cfg, say) -> None:
    """``target.dtype=auto`` / ``train.autocast=auto`` -> what this machine computes natively,
    written into ``cfg`` before the run folder records it (so a resume compares real dtypes)."""
    from omegaconf import read_write

    from ..target import precision

    with read_write(cfg):
        for group, key, resolve in (("target", "dtype", precision.resolve_dtype),
                                    ("train", "autocast", precision.resolve_autocast)):
            name = cfg[group][key]
            cfg[group][key] = resolve(name)
            line = precision.describe(f"{group}.{key}", name, cfg[group][key])
            if line:
                say(line)


def _plot_curves(out_dir: Path, say) -> None:
    """training.png beside metrics.jsonl; the run is already saved, so a failure here only says so."""
    from ..errors import os_error_line
    from .curves import plot_training

    try:
        written = plot_training(out_dir / "metrics.jsonl", out_dir / "training.png")
    except OSError as err:
        say(f"training.png not written: {os_error_line(err)}")
        return
    if written:
        say(f"wrote {written} (loss, learning rate, top-1 per unroll step, held-out agreement)")


def _check_same_target(record: dict | None, fingerprints: dict, checkpoint: Path) -> None:
    """A checkpoint continues only on the target (and tokenizer) it was trained on, even under force."""
    for part in ("target", "tokenizer"):
        saved = ((record or {}).get(part) or {}).get("fingerprint")
        if saved is not None and saved != fingerprints[part]["fingerprint"]:
            raise LyannaError(f"cannot resume from {checkpoint}: it was trained on another {part} (fingerprint "
                              f"{saved}, this {part}'s {fingerprints[part]['fingerprint']}); use a new train.out_dir")


def done_line(step: int, checkpoint, final: dict) -> str:
    """The run's last line: the step, the checkpoint and the final metrics, if any were measured."""
    metrics = ", ".join(f"{k} {v:.3f}" for k, v in final.items())
    return f"done: step {step}, checkpoint {checkpoint}" + (f"; {metrics}" if metrics else "")


def _train(cfg, config_dict, claimed, out_dir: Path, rank: int, world: int, say, started: float,
           held: contextlib.ExitStack) -> dict:
    from ..target.fingerprint import tokenizer_fingerprint
    from ..target.model import target_fingerprint

    if cfg.data.features == "hybrid" and world > 1:
        raise LyannaError(f"data.features=hybrid runs on one rank (it assembles each shard where it is computed), "
                          f"not {world}: on several, use data.features=cached (each rank builds its shards)")
    # ---- setup
    parts = build_parts(cfg, out_dir, rank == 0)
    agreement = None
    fingerprints = {"target": {"name": cfg.target.name, "fingerprint": target_fingerprint(parts.target)},
                    "tokenizer": {"fingerprint": tokenizer_fingerprint(parts.tokenizer)}}
    if cfg.train.time_budget_min:
        from omegaconf import read_write

        from .budget import budgeted_samples

        with read_write(cfg):
            cfg.data.max_samples = budgeted_samples(cfg, parts, training_samples(cfg, parts.tokenizer), out_dir,
                                                    rank, say, started)
    if cfg.data.features in ("cached", "hybrid"):
        samples = training_samples(cfg, parts.tokenizer)
        if cfg.data.features == "cached":
            cache = feature_cache(cfg, samples, parts.target, parts.tokenizer, parts.layer_ids, out_dir, rank, world)
            all_lengths, source = cache_lengths(cache), CachedBatches(cache)
        else:
            from .hybrid import hybrid_batches

            source = hybrid_batches(cache_spec(cfg, samples, out_dir), parts.target, parts.tokenizer, parts.layer_ids,
                                    held, say)
            cache, all_lengths = source, source.lengths
        lengths = first_tokens(all_lengths, cfg.data.max_tokens)
        start = heldout_start(cfg, samples, say)
        if start is not None:
            heldout = feature_cache(cfg, samples, parts.target, parts.tokenizer, parts.layer_ids, out_dir, rank, world,
                                    heldout_from=start)
            agreement = AgreementSets.over(heldout, cache, all_lengths, cfg.data.batch_tokens)
    else:
        from ..data.features import FeatureExtractor

        samples = online_samples(cfg, parts.tokenizer)
        lengths = [[len(s) for s in samples]]
        source = OnlineBatches(samples, FeatureExtractor(parts.target, parts.layer_ids), parts.tokenizer.pad_token_id or 0)
    accum = cfg.train.grad_accum
    per_epoch = len(plan_epoch(lengths, cfg.data.batch_tokens, cfg.train.seed, 0, world, accum)) // world // accum
    if per_epoch == 0:
        raise LyannaError(f"not enough data for one optimizer step on {world} ranks with grad_accum {accum}")
    total = cfg.train.max_steps or per_epoch * cfg.train.epochs
    # the feature scale, from the first batches (a resumed run loads the saved one; an imported head has its own)
    if parts.draft.cfg.aux_scale and not cfg.draft.init_from:
        from ..models.init import feature_scale, set_aux_scale

        first = [source(ref) for ref in plan_epoch(lengths, cfg.data.batch_tokens, cfg.train.seed, 0, 1)[:4]]
        aux = torch.cat([b["aux"][b["valid"]] for b in first])
        starts = torch.cat([(torch.arange(b["valid"].shape[1]) == 0).expand_as(b["valid"])[b["valid"]] for b in first])
        set_aux_scale(parts.draft, feature_scale(aux, starts), keep_function=cfg.draft.target_init.fc == "top_layer")
    engine = Engine(parts.draft, cfg.deepspeed, cfg.train, total)
    state = {"step": 0, "epoch": 0, "batch": 0, "tokens": 0, "wandb_id": None}
    root = out_dir / "checkpoints"
    latest_metrics: dict = {}
    if claimed.resume_from is not None:
        resume = Path(claimed.resume_from)
        record = ckpt.read_run_record(resume)
        _check_same_target(record, fingerprints, resume)
        client = engine.load(resume.parent, resume.name)
        state.update(client["state"])
        _set_rng_state(client["rng"][rank] if isinstance(client["rng"], list) else client["rng"])
        latest_metrics = (record or {}).get("metrics") or {}
        if claimed.forced:
            engine.apply_hyperparameters(cfg.deepspeed, cfg.train, total)
        say(f"resumed from {resume} at step {state['step']}")
        if state["step"] >= total:
            say(f"{resume} is already at step {state['step']} of {total}: nothing to train")
            return {"step": state["step"], "out_dir": str(out_dir),
                    **{k: v for k, v in latest_metrics.items() if k.startswith("eval/")}}
    tracker = Tracker(cfg.tracking, out_dir, rank == 0, config_dict or {}, state["wandb_id"],
                      start_step=state["step"], latest=latest_metrics)
    state["wandb_id"] = tracker.run_id
    say(f"training: {total} steps ({per_epoch} per epoch) on {world} rank(s), draft vocabulary {len(parts.hot_ids)}, "
        f"{sum(p.numel() for p in parts.draft.parameters() if p.requires_grad):,} trainable parameters")
    resolved = run_folder.resolved(cfg)

    def save() -> None:
        rngs = [None] * world
        torch.distributed.all_gather_object(rngs, _rng_state())

        def write_main(directory: Path) -> None:
            ckpt.write_draft_weights(directory, engine.module, {"layer_ids": list(parts.layer_ids),
                                                                "target": cfg.target.name})
            ckpt.write_run_record(directory, {"step": state["step"], **fingerprints, "config": resolved,
                                              "metrics": dict(tracker.latest)})

        ckpt.save(engine, root, state["step"], {"state": dict(state), "rng": rngs}, write_main, cfg.train.keep_last)

    # ---- train
    bar = None
    if rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=state["step"], unit="step", desc="training", dynamic_ncols=True)
    window: dict = {}
    autocast = step_autocast(engine.module, cfg.train.autocast)
    last_log, tokens_at_log = time.perf_counter(), state["tokens"]
    while state["step"] < total:
        plan = plan_epoch(lengths, cfg.data.batch_tokens, cfg.train.seed, state["epoch"], world, accum)[rank::world]
        while state["batch"] < len(plan) and state["step"] < total:
            batch = source(plan[state["batch"]])
            with autocast:
                loss, metrics = distill_loss(engine.module, batch, parts.lm_weight, cfg.loss)
            stepped = engine.backward_and_step(loss)
            state["batch"] += 1
            for k, v in metrics.items():
                window[k] = window.get(k, 0) + v
            window["loss/total"] = window.get("loss/total", 0) + loss.detach()
            window["micro"] = window.get("micro", 0) + 1
            if not stepped:
                continue
            state["step"] += 1
            if bar is not None:
                bar.update(1)
            if state["step"] % cfg.train.log_every == 0 or state["step"] == total:
                micro = window.pop("micro")
                tokens = window.pop("tokens")
                logged = engine.mean({k: v / micro for k, v in window.items()})
                seen = engine.mean({"t": tokens})["t"] * world
                state["tokens"] += int(seen)
                now = time.perf_counter()
                logged.update({"lr": engine.lr, "tokens_per_s": (state["tokens"] - tokens_at_log) / (now - last_log),
                               "epoch": state["epoch"], "tokens_seen": state["tokens"]})
                last_log, tokens_at_log, window = now, state["tokens"], {}
                tracker.log(state["step"], logged)
                if bar is not None:
                    bar.set_postfix(loss=f"{logged['loss/total']:.3f}", acc0=f"{logged.get('acc/step0', 0):.2f}",
                                    tok_s=f"{logged['tokens_per_s']:.0f}", refresh=False)
            if cfg.eval.every and state["step"] % cfg.eval.every == 0 and state["step"] < total:
                if rank == 0:
                    tracker.log(state["step"], evaluate(cfg, parts, engine.module, agreement))
                engine.barrier()
            if cfg.train.save_every and state["step"] % cfg.train.save_every == 0 and state["step"] < total:
                save()
        if state["batch"] >= len(plan):
            if cfg.data.features == "hybrid":  # the rows no step computed: later epochs read every batch
                source.finish([k for k, rows in enumerate(lengths) if rows])
            state["epoch"] += 1
            state["batch"] = 0
    if bar is not None:
        bar.close()

    # ---- evaluate, save (the checkpoint records the final metrics) and clean up
    final = {}
    if rank == 0:
        final = evaluate(cfg, parts, engine.module, agreement)
        if final:
            tracker.log(state["step"], final)
    engine.barrier()
    save()
    if rank == 0:
        _plot_curves(out_dir, say)
    say(done_line(state["step"], ckpt.latest_checkpoint(root), final))
    tracker.finish()
    return {"step": state["step"], "out_dir": str(out_dir), **final}
