"""``train(cfg)``: the distillation recipe — set up, train epoch by epoch, evaluate, save.

:func:`train` validates the config and claims the run folder; :class:`DistillationRecipe`
does the rest in named steps that read top to bottom (torchtune's recipe shape):
:meth:`~DistillationRecipe.run` is the table of contents, ``train_epoch`` the step loop
written out (micro-step, backward, optimizer step, log), and everything a resume needs is
:class:`Progress` plus the RNGs beside DeepSpeed's own state, saved in one atomic checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import LyannaError
from ..target.fingerprint import tokenizer_fingerprint
from ..target.model import target_fingerprint
from ..run_record import latest_checkpoint, read_run_record, write_run_record
from . import checkpoint as ckpt
from . import run_folder
from .batches import CachedBatches, OnlineBatches, cache_lengths, first_tokens, plan_epoch
from .budget import sample_count
from .config import validate
from .deepspeed_engine import Engine, init_distributed  # the one module that talks to DeepSpeed
from .heldout import AgreementSets, head_metrics, heldout_start
from .setup import build_parts, cache_spec, feature_cache, training_samples
from .step import distill_loss, step_autocast
from .tracking import Tracker


def train(cfg, config_dict: dict | None = None) -> dict:
    """Validate, claim the run folder (one run at a time, same config), then run the recipe."""
    started = time.perf_counter()  # the time budget counts from here
    validate(cfg)  # every value, before any work
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    rank, world = init_distributed(cfg.deepspeed.backend)
    say = print if rank == 0 else (lambda *_: None)
    resolve_auto_precision(cfg, say)
    out_dir = Path(cfg.train.out_dir)
    with run_folder.claim(cfg, out_dir, rank, world, say) as claimed, contextlib.ExitStack() as held:
        return DistillationRecipe(cfg, config_dict, rank, world, say, held).run(claimed, started)


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


@dataclass
class Progress:
    """Where the run is. With every rank's RNG state it is a checkpoint's client state (saved
    as a plain dict: checkpoints load ``weights_only``)."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch: int = 0  # micro-batches of this epoch's plan done, on each rank
    tokens: int = 0  # trained on, all ranks together, as of the last log
    wandb_id: str | None = None  # the W&B run a resume continues

    @classmethod
    def saved(cls, state: dict) -> Progress:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in state.items() if k in names})


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


@dataclass
class TrainingData:
    """What the epochs draw from, built once from the run's samples."""

    source: object  # BatchRef -> training batch (CachedBatches, HybridBatches or OnlineBatches)
    lengths: list  # per shard, the token count of each sample: what each epoch's plan is made from
    agreement: AgreementSets | None = None  # held-out and training agreement, when samples are held out


class MetricWindow:
    """Each micro-step's metrics summed on the device since the last log; read (synced to the
    host and averaged over ranks) only at the log interval."""

    def __init__(self):
        self.sums: dict = {}
        self.micro = 0

    def add(self, loss: torch.Tensor, metrics: dict) -> None:
        for k, v in {**metrics, "loss/total": loss.detach()}.items():
            self.sums[k] = self.sums.get(k, 0) + v
        self.micro += 1

    def read(self, engine: Engine) -> tuple[dict, float]:
        """(each metric's mean over the micro-steps and ranks, tokens trained on by all ranks); empties the window."""
        tokens = self.sums.pop("tokens")
        means = engine.mean({k: v / self.micro for k, v in self.sums.items()})
        seen = engine.mean({"t": tokens})["t"] * engine.world_size
        self.sums, self.micro = {}, 0
        return means, seen


def done_line(step: int, checkpoint, final: dict) -> str:
    """The run's last line: the step, the checkpoint and the final metrics, if any were measured."""
    metrics = ", ".join(f"{k} {v:.3f}" for k, v in final.items())
    return f"done: step {step}, checkpoint {checkpoint}" + (f"; {metrics}" if metrics else "")


class DistillationRecipe:
    """One training run in a claimed folder; :meth:`run` is its table of contents."""

    def __init__(self, cfg, config_dict: dict | None, rank: int, world: int, say, held: contextlib.ExitStack):
        self.cfg, self.config_dict = cfg, config_dict or {}
        self.rank, self.world, self.say, self.held = rank, world, say, held  # held: locks kept for the run
        self.out_dir = Path(cfg.train.out_dir)
        self.root = self.out_dir / "checkpoints"
        self.progress = Progress()
        self.window = MetricWindow()
        self.bar = None

    def run(self, claimed, started: float) -> dict:
        """Set up, resume, train epoch by epoch, evaluate, save, clean up."""
        self.setup(started)
        latest = self.resume(claimed)
        if self.progress.step >= self.total:
            self.say(f"{claimed.resume_from} is already at step {self.progress.step} of {self.total}: nothing to train")
            return self.result({k: v for k, v in latest.items() if k.startswith("eval/")})
        self.start(latest)
        while self.progress.step < self.total:
            self.train_epoch()
        if self.bar is not None:
            self.bar.close()
        final = self.evaluate()  # before the last save: its run.json records the final metrics
        self.save()
        self.cleanup(final)
        return self.result(final)

    # ---- setup

    def setup(self, started: float) -> None:
        """Target, hot vocabulary and draft; the samples, built once, and how many train (the time
        budget's count, measured from ``started``); the data; the schedule; the DeepSpeed engine."""
        cfg = self.cfg
        if cfg.data.features == "hybrid" and self.world > 1:
            raise LyannaError(f"data.features=hybrid runs on one rank (it assembles each shard where it is computed), "
                              f"not {self.world}: on several, use data.features=cached (each rank builds its shards)")
        self.parts = build_parts(cfg, self.out_dir, self.rank == 0)
        self.fingerprints = {"target": {"name": cfg.target.name, "fingerprint": target_fingerprint(self.parts.target)},
                             "tokenizer": {"fingerprint": tokenizer_fingerprint(self.parts.tokenizer)}}
        samples = training_samples(cfg, self.parts.tokenizer)
        self.max_samples = sample_count(cfg, self.parts, samples, self.out_dir, self.rank, self.say, started)
        self.data = self.online_data(samples) if cfg.data.features == "online" else self.cached_data(samples)
        self.per_epoch, self.total = self.schedule()
        self.scale_features()
        self.engine = Engine(self.parts.draft, cfg.deepspeed, cfg.train, self.total)

    def cached_data(self, samples) -> TrainingData:
        """Cached features (built now where missing) or hybrid ones (computed in the first epoch's
        steps and written to the same cache); the held-out samples' cache beside it."""
        cfg, parts = self.cfg, self.parts
        if cfg.data.features == "cached":
            cache = self._feature_cache(samples)
            all_lengths, source = cache_lengths(cache), CachedBatches(cache)
        else:
            from .hybrid import hybrid_batches

            source = hybrid_batches(cache_spec(cfg, samples, self.out_dir, self.max_samples), parts.target,
                                    parts.tokenizer, parts.layer_ids, self.held, self.say)
            cache, all_lengths = source, source.lengths
        data = TrainingData(source, first_tokens(all_lengths, cfg.data.max_tokens))
        start = heldout_start(cfg, samples, self.max_samples, self.say)
        if start is not None:
            heldout = self._feature_cache(samples, heldout_from=start)
            data.agreement = AgreementSets.over(heldout, cache, all_lengths, cfg.data.batch_tokens)
        return data

    def _feature_cache(self, samples, heldout_from: int | None = None):
        parts = self.parts
        return feature_cache(self.cfg, samples, parts.target, parts.tokenizer, parts.layer_ids, self.out_dir,
                             self.rank, self.world, self.max_samples, heldout_from=heldout_from)

    def online_data(self, samples) -> TrainingData:
        """The target runs inside every step, over the run's samples (kept in memory)."""
        from ..data.features import FeatureExtractor

        kept = list(itertools.islice(samples, self.max_samples))
        extractor = FeatureExtractor(self.parts.target, self.parts.layer_ids)
        return TrainingData(OnlineBatches(kept, extractor, self.parts.tokenizer.pad_token_id or 0), [[len(s) for s in kept]])

    def schedule(self) -> tuple[int, int]:
        """(optimizer steps per epoch, optimizer steps in the run)."""
        cfg, accum = self.cfg, self.cfg.train.grad_accum
        per_epoch = len(plan_epoch(self.data.lengths, cfg.data.batch_tokens, cfg.train.seed, 0, self.world, accum)) \
            // self.world // accum
        if per_epoch == 0:
            raise LyannaError(f"not enough data for one optimizer step on {self.world} ranks with grad_accum {accum}")
        return per_epoch, cfg.train.max_steps or per_epoch * cfg.train.epochs

    def scale_features(self) -> None:
        """The feature scale, from the first batches (a resumed run loads the saved one; an imported head has its own)."""
        cfg, draft = self.cfg, self.parts.draft
        if not draft.cfg.aux_scale or cfg.draft.init_from:
            return
        from ..models.init import feature_scale, set_aux_scale

        first = [self.data.source(ref) for ref in plan_epoch(self.data.lengths, cfg.data.batch_tokens, cfg.train.seed,
                                                             0, 1)[:4]]
        aux = torch.cat([b["aux"][b["valid"]] for b in first])
        starts = torch.cat([(torch.arange(b["valid"].shape[1]) == 0).expand_as(b["valid"])[b["valid"]] for b in first])
        set_aux_scale(draft, feature_scale(aux, starts), keep_function=cfg.draft.target_init.fc == "top_layer")

    def resume(self, claimed) -> dict:
        """Continue the claimed checkpoint, if any: DeepSpeed's model, optimizer and schedule, then
        :class:`Progress` and this rank's RNGs (:meth:`load_client_state`). Returns its metrics."""
        if claimed.resume_from is None:
            return {}
        checkpoint = Path(claimed.resume_from)
        record = read_run_record(checkpoint)
        _check_same_target(record, self.fingerprints, checkpoint)
        self.load_client_state(self.engine.load(checkpoint.parent, checkpoint.name))
        if claimed.forced:
            self.engine.apply_hyperparameters(self.cfg.deepspeed, self.cfg.train, self.total)
        self.say(f"resumed from {checkpoint} at step {self.progress.step}")
        return (record or {}).get("metrics") or {}

    def start(self, latest: dict) -> None:
        """Tracking (metrics.jsonl; W&B, continuing a resumed run's), the first line, the progress bar."""
        cfg, parts, p = self.cfg, self.parts, self.progress
        self.tracker = Tracker(cfg.tracking, self.out_dir, self.rank == 0, self.config_dict, p.wandb_id,
                               start_step=p.step, latest=latest)
        p.wandb_id = self.tracker.run_id
        self.say(f"training: {self.total} steps ({self.per_epoch} per epoch) on {self.world} rank(s), draft vocabulary "
                 f"{len(parts.hot_ids)}, {sum(q.numel() for q in parts.draft.parameters() if q.requires_grad):,} "
                 "trainable parameters")
        # run.json's config says what was trained: data.max_samples as the time budget cut it
        self.trained_config = run_folder.resolved(cfg)
        self.trained_config["data"]["max_samples"] = self.max_samples
        if self.rank == 0:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, initial=p.step, unit="step", desc="training", dynamic_ncols=True)
        self.autocast = step_autocast(self.engine.module, cfg.train.autocast)
        self.last_log = (time.perf_counter(), p.tokens)

    # ---- train

    def train_epoch(self) -> None:
        """This rank's share of the epoch's plan, from where a resumed run stopped: a micro-step per
        batch, the optimizer step at each accumulation boundary, then what is due after it."""
        cfg, p = self.cfg, self.progress
        plan = plan_epoch(self.data.lengths, cfg.data.batch_tokens, cfg.train.seed, p.epoch, self.world,
                          cfg.train.grad_accum)[self.rank::self.world]
        while p.batch < len(plan) and p.step < self.total:
            batch = self.data.source(plan[p.batch])
            with self.autocast:
                loss, metrics = distill_loss(self.engine.module, batch, self.parts.lm_weight, cfg.loss)
            stepped = self.engine.backward_and_step(loss)  # the optimizer steps at accumulation boundaries
            p.batch += 1
            self.window.add(loss, metrics)
            if stepped:
                p.step += 1
                self.after_step()
        if p.batch >= len(plan):
            if cfg.data.features == "hybrid":  # the rows no step computed: later epochs read every batch
                self.data.source.finish([k for k, rows in enumerate(self.data.lengths) if rows])
            p.epoch, p.batch = p.epoch + 1, 0

    def after_step(self) -> None:
        """What is due after an optimizer step: the progress bar, the log, an evaluation, a checkpoint."""
        cfg, step = self.cfg, self.progress.step
        if self.bar is not None:
            self.bar.update(1)
        if step % cfg.train.log_every == 0 or step == self.total:
            self.log()
        if cfg.eval.every and step % cfg.eval.every == 0 and step < self.total:
            self.evaluate()
        if cfg.train.save_every and step % cfg.train.save_every == 0 and step < self.total:
            self.save()

    def log(self) -> None:
        """The step loop's one host sync: the window's means over ranks and the throughput, to the
        tracker and the progress bar."""
        p = self.progress
        logged, seen = self.window.read(self.engine)
        p.tokens += int(seen)
        now, (then, tokens_then) = time.perf_counter(), self.last_log
        logged.update({"lr": self.engine.lr, "tokens_per_s": (p.tokens - tokens_then) / (now - then),
                       "epoch": p.epoch, "tokens_seen": p.tokens})
        self.last_log = (now, p.tokens)
        self.tracker.log(p.step, logged)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{logged['loss/total']:.3f}", acc0=f"{logged.get('acc/step0', 0):.2f}",
                                 tok_s=f"{logged['tokens_per_s']:.0f}", refresh=False)

    # ---- evaluate, save, clean up

    def evaluate(self) -> dict:
        """The main rank measures the head (:func:`head_metrics`) and logs it; every rank waits for it."""
        measured = head_metrics(self.cfg, self.parts, self.engine.module, self.data.agreement) if self.rank == 0 else {}
        if measured:
            self.tracker.log(self.progress.step, measured)
        self.engine.barrier()
        return measured

    def client_state(self) -> dict:
        """All a checkpoint holds besides DeepSpeed's model, optimizer and schedule: the progress
        and every rank's RNG state (each rank restores its own)."""
        rngs = [None] * self.world
        torch.distributed.all_gather_object(rngs, _rng_state())
        return {"state": dataclasses.asdict(self.progress), "rng": rngs}

    def load_client_state(self, client: dict) -> None:
        self.progress = Progress.saved(client["state"])
        _set_rng_state(client["rng"][self.rank] if isinstance(client["rng"], list) else client["rng"])

    def save(self) -> Path:
        """One checkpoint, renamed into place only once complete (:func:`checkpoint.save`), with the
        draft's weights and ``run.json`` (fingerprints, config, latest metrics) that export reads."""
        p, parts = self.progress, self.parts

        def write_main(directory: Path) -> None:
            ckpt.write_draft_weights(directory, self.engine.module, {"layer_ids": list(parts.layer_ids),
                                                                     "target": self.cfg.target.name})
            write_run_record(directory, {"step": p.step, **self.fingerprints, "config": self.trained_config,
                                              "metrics": dict(self.tracker.latest)})

        return ckpt.save(self.engine, self.root, p.step, self.client_state(), write_main, self.cfg.train.keep_last)

    def cleanup(self, final: dict) -> None:
        """training.png, the last line, the tracker closed."""
        if self.rank == 0:
            _plot_curves(self.out_dir, self.say)
        self.say(done_line(self.progress.step, latest_checkpoint(self.root), final))
        self.tracker.finish()

    def result(self, metrics: dict) -> dict:
        return {"step": self.progress.step, "out_dir": str(self.out_dir), **metrics}


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
