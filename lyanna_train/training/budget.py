"""Fit a run into a wall-clock budget on this machine (``train.time_budget_min``).

The same recipe costs ~10x more on one CPU than on another (SmolLM2 features: 1,741
tokens/s from a bf16 target on a Zen 4, 170 from fp32 on an AVX2 Zen 1), so a recipe that
promises minutes measures, before any work, what one feature batch, one training step and
one decoding step cost here, and trains on as many samples as fit, never more than
``data.max_samples``. Epochs stay as configured: at this scale passes over cached features
are worth nearly as much as new tokens and cost a third (README, the CPU recipe).
"""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..atomic import read_json, write_json_atomic
from ..data.batching import collate
from ..data.features import FeatureExtractor, teacher_summary
from ..errors import LyannaError
from .step import distill_loss, step_autocast

FIXED_S = 45.0  # loading the target, tokenizing, writing checkpoints and the export: measured ~30-60 s
# The evaluation's chain decoding per new token, in single-token forwards: each iteration
# verifies depth + 1 tokens and runs the draft depth times (measured 2.1 on a Zen 1:
# 16 prompts x 64 tokens in 194 s against 11.2 single-token forwards/s)
EVAL_PER_DECODE = 2.0


@dataclass(frozen=True)
class Costs:
    """Seconds per token of each phase, measured on this machine with the run's own parts."""

    feature: float  # target forward + teacher summary, batched as the cache writer does
    train: float  # one pass of one token: draft forward over every unroll step, losses, backward
    decode: float  # one single-token target forward (what each evaluation decoding step costs at least)


@dataclass(frozen=True)
class Fit:
    samples: int  # training samples that fit (<= data.max_samples)
    tokens_per_sample: float
    minutes: dict  # phase -> estimated minutes at ``samples``
    wanted_minutes: float  # the configured data's estimate

    def describe(self, budget: float, configured: int) -> str:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in self.minutes.items())
        head = (f"time budget {budget:g} min: {self.samples} of {configured} samples fit "
                f"(all {configured} would take ~{self.wanted_minutes:.0f} min here)"
                if self.samples < configured else
                f"time budget {budget:g} min: all {configured} samples fit (~{self.wanted_minutes:.0f} min)")
        return f"{head}; estimated minutes: {phases}"


def _timed(fn, repeats: int = 2) -> float:
    """Best of ``repeats`` after one warm-up call (first calls pay allocation and dispatch);
    on a GPU each call is waited for, not only launched."""
    def call():
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def measure(parts, samples: list, cfg) -> Costs:
    """Time the run's own code on ``samples`` (a few real ones, about one batch of tokens)."""
    batch = collate(samples, parts.tokenizer.pad_token_id or 0)
    ids = batch["input_ids"]
    # per position computed, padding included: the run's batches are grouped by length and
    # carry little padding, this one a few uneven samples
    tokens = ids.numel()
    extractor = FeatureExtractor(parts.target, parts.layer_ids)

    def features():
        feats = extractor(ids)
        return feats, teacher_summary(feats.last.reshape(-1, feats.last.shape[-1]), parts.lm_weight)

    feature_s = _timed(features, repeats=1)  # a full batch of target forwards: steady, and the dearest to repeat
    feats, (top1, lse) = features()
    # the cached teacher summary rides along, as from the feature cache: without it the loss
    # would form the full-vocabulary logits itself (a training step 1.5x slower than the run's)
    step = {"aux": feats.aux.clone(), "last": feats.last.clone(), "input_ids": ids,
            "loss_mask": batch["loss_mask"], "valid": batch["attention_mask"],
            "teacher_top1": top1.view(ids.shape), "teacher_lse": lse.view(ids.shape)}
    draft = copy.deepcopy(parts.draft).train()
    autocast = step_autocast(draft, cfg.train.autocast)

    def train_step():
        with autocast:
            loss, _ = distill_loss(draft, step, parts.lm_weight, cfg.loss)
        loss.backward()
        draft.zero_grad(set_to_none=True)

    train_s = _timed(train_step)
    decode_s = _decode_step(parts.target, ids[:1, :1].to(parts.target.device))
    return Costs(feature_s / tokens, train_s / tokens, decode_s)


def _decode_step(target, token: torch.Tensor) -> float:
    """Seconds of one single-token target forward: a decoding step's cost (at these sizes
    the weights, not the attention over a few hundred cached positions, set it)."""
    with torch.inference_mode():
        return _timed(lambda: target(input_ids=token, use_cache=False, logits_to_keep=1), repeats=3)


def fit(cfg, costs: Costs, tokens_per_sample: float, heldout_tokens: float, spent: float = 0.0) -> Fit:
    """The most samples whose features, ``train.epochs`` passes and the fixed phases
    (held-out features, evaluation, loading, and the ``spent`` seconds already gone: the hot
    vocabulary and this measurement) fit ``train.time_budget_min``."""
    budget_s = cfg.train.time_budget_min * 60
    evaluation = cfg.eval.num_prompts * cfg.eval.max_new_tokens * costs.decode * EVAL_PER_DECODE
    fixed = {"set-up so far": spent, "held-out features": heldout_tokens * costs.feature, "evaluation": evaluation,
             "loading, saving": FIXED_S}
    per_sample = tokens_per_sample * (costs.feature + cfg.train.epochs * costs.train)
    configured = cfg.data.max_samples
    room = budget_s - sum(fixed.values())
    samples = min(configured, int(room / per_sample)) if room > 0 else 0
    if samples < 1:
        raise LyannaError(f"train.time_budget_min={cfg.train.time_budget_min:g}: not even one sample fits on this "
                          f"machine (set-up so far, held-out features, evaluation and loading alone take ~{sum(fixed.values()) / 60:.1f}"
                          " min); raise the budget or lower eval.num_prompts / eval.heldout_samples")

    def minutes(n: int) -> dict:
        tokens = n * tokens_per_sample
        return {"features": tokens * costs.feature / 60, "training": tokens * cfg.train.epochs * costs.train / 60,
                **{k: v / 60 for k, v in fixed.items()}}

    return Fit(samples, tokens_per_sample, minutes(samples), sum(minutes(configured).values()))


def within_budget(cfg, parts, samples, say, started: float | None = None) -> int:
    """``data.max_samples`` cut to what ``train.time_budget_min`` allows here (measured now;
    ``started``: the run's ``perf_counter`` at its start, so what set-up took counts too)."""
    if not cfg.data.max_samples:
        raise LyannaError("train.time_budget_min needs data.max_samples (the most samples the run may use)")
    first = list(itertools.islice(iter(samples), 64))  # tokens per sample, and one batch to time
    tokens_per_sample = sum(len(s) for s in first) / max(len(first), 1)
    batch, total = [], 0
    for s in first:
        if batch and total + len(s) > cfg.data.batch_tokens:
            break
        batch.append(s)
        total += len(s)
    costs = measure(parts, batch, cfg)
    heldout = cfg.eval.heldout_samples * tokens_per_sample
    spent = time.perf_counter() - started if started is not None else 0.0
    result = fit(cfg, costs, tokens_per_sample, heldout, spent)
    say(f"{result.describe(cfg.train.time_budget_min, cfg.data.max_samples)} "
        f"(measured here: features {1 / costs.feature:.0f} tok/s, training {1 / costs.train:.0f} tok/s per pass, "
        f"decoding {1 / costs.decode:.1f} tok/s)")
    return result.samples


def sample_count(cfg, parts, samples, out_dir: Path, rank: int, say, started: float | None = None) -> int | None:
    """How many samples the run trains on: ``data.max_samples`` (None: all of them), cut to what
    ``train.time_budget_min`` allows when it is set (:func:`budgeted_samples`). The config is
    left as it is: the count is passed on."""
    if not cfg.train.time_budget_min:
        return cfg.data.max_samples
    return budgeted_samples(cfg, parts, samples, out_dir, rank, say, started)


def budgeted_samples(cfg, parts, samples, out_dir: Path, rank: int, say, started: float | None = None) -> int:
    """The run's sample count under its time budget, decided once per run folder.

    Rank 0 measures and records the decision in ``budget.json``; every rank reads it, and
    a resumed run reuses it (a new measurement could pick another count, and with it
    another feature cache and data order)."""
    record = out_dir / "budget.json"
    key = {"time_budget_min": cfg.train.time_budget_min, "max_samples": cfg.data.max_samples}
    if rank == 0:
        saved = read_json(record) if record.is_file() else None
        if saved is not None and {k: saved.get(k) for k in key} == key:
            say(f"time budget {cfg.train.time_budget_min:g} min: {saved['samples']} samples, as decided when "
                f"this run started ({record})")
        else:
            write_json_atomic(record, {**key, "samples": within_budget(cfg, parts, samples, say, started)})
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return int(read_json(record)["samples"])

