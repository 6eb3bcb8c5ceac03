"""Every config value checked before any work, each against a stated allowed range.

One table, one row per field of :class:`~lyanna_train.training.config.Config`: a bad
value stops the run in its first second with one line naming the field, the value and
what is allowed — never a traceback an hour later, and never after a half-built
artifact has been left in the run folder (``hotvocab.size=-5`` used to build a
one-token hot vocabulary that broke every later run there). A test checks that every
field has a row, so a new field cannot be added unchecked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..data.feature_dtype import FEATURE_DTYPES
from ..errors import LyannaError


@dataclass(frozen=True)
class Rule:
    ok: Callable[[Any], bool]
    allowed: str  # what a reader is told is allowed


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer(low: int, high: int | None = None) -> Rule:
    text = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    return Rule(lambda v: _is_int(v) and v >= low and (high is None or v <= high), text)


def number(low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False) -> Rule:
    def ok(v) -> bool:
        if not _is_number(v):
            return False
        above = v > low if low_open else v >= low
        below = high is None or (v < high if high_open else v <= high)
        return above and below

    left, right = "(" if low_open else "[", ")" if high_open or high is None else "]"
    return Rule(ok, f"a finite number in {left}{low}, {'inf' if high is None else high}{right}")


def one_of(*values) -> Rule:
    return Rule(lambda v: v in values, "one of " + ", ".join("null" if x is None else str(x) for x in values))


def optional(rule: Rule) -> Rule:
    return Rule(lambda v: v is None or rule.ok(v), f"null or {rule.allowed}")


def flag() -> Rule:
    return Rule(lambda v: isinstance(v, bool), "true or false")


def text() -> Rule:
    return Rule(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")


def _as_list(v) -> list | None:
    """Lists arrive as ``ListConfig`` from Hydra: anything iterable but a string or a mapping."""
    if isinstance(v, (str, bytes, dict)) or not hasattr(v, "__iter__") or hasattr(v, "keys"):
        return None
    return list(v)


def layer_list() -> Rule:
    def ok(v) -> bool:
        items = _as_list(v)
        return bool(items) and all(_is_int(x) and x >= 0 for x in items) and len(set(items)) == len(items)
    return Rule(ok, "a non-empty list of distinct layer indices >= 0")


def corpus_list() -> Rule:
    def ok(v) -> bool:
        items = _as_list(v)
        return bool(items) and all(isinstance(x, str) and x.strip() for x in items)
    return Rule(ok, "a non-empty list of corpus paths or names")


def betas() -> Rule:
    def ok(v) -> bool:
        items = _as_list(v)
        return items is not None and len(items) == 2 and all(_is_number(b) and 0 <= b < 1 for b in items)
    return Rule(ok, "two numbers in [0, 1)")


def resume() -> Rule:
    return Rule(lambda v: isinstance(v, str) and v.strip() != "",
                "auto, never, force or the path of a step-NNNNNNNN checkpoint")


RULES: dict[str, Rule] = {
    "run_name": text(),
    "target.name": text(),
    "target.dtype": one_of("auto", "float32", "bfloat16", "float16"),
    "target.aux_layers": optional(layer_list()),
    "draft.hidden_size": optional(integer(1)),
    "draft.intermediate_size": optional(integer(1)),
    "draft.num_attention_heads": optional(integer(1)),
    "draft.num_key_value_heads": optional(integer(1)),
    "draft.head_dim": optional(integer(1)),
    "draft.pool_size": Rule(lambda v: _is_int(v) and (v == 0 or v >= 128), "0 (pool off) or an integer >= 128"),
    "draft.pool_threshold": number(-1, 1),
    "draft.alpha_max": number(0, 1),
    "draft.gate_hidden": integer(1),
    "draft.target_init.lm_head": flag(),
    "draft.target_init.layer": optional(integer(0)),
    "draft.target_init.fc": one_of("random", "top_layer"),
    "draft.freeze_lm_head": flag(),
    "draft.norm_before_residual": flag(),
    "draft.aux_scale": flag(),
    "draft.init_from": optional(text()),
    "draft.init_vocab": one_of("keep", "rebuild"),
    "hotvocab.path": optional(text()),
    "hotvocab.ratio": number(0, 1, low_open=True),
    "hotvocab.size": optional(integer(1)),
    "hotvocab.full_vocab": flag(),
    "data.corpus": corpus_list(),
    "data.max_length": integer(2),
    "data.max_samples": optional(integer(1)),
    "data.features": one_of("cached", "online", "hybrid"),
    "data.feature_dtype": one_of(*FEATURE_DTYPES),
    "data.cache_dir": optional(text()),
    "data.batch_tokens": integer(2),
    "data.shard_tokens": integer(1),
    "data.teacher_summary": flag(),
    "data.max_tokens": optional(integer(1)),
    "loss.ttt_steps": integer(1),
    "loss.step_weight": number(0, 1, low_open=True),
    "loss.out_of_vocab": one_of("mask", "other"),
    "loss.hidden_weight": number(0),
    "loss.tv_weight": number(0),
    "loss.positions": one_of("assistant", "all"),
    "loss.feature_noise": number(0),
    "train.out_dir": text(),
    "train.epochs": integer(1),
    "train.max_steps": optional(integer(1)),
    "train.lr": number(0, 1, low_open=True),
    "train.min_lr_ratio": number(0, 1),
    "train.warmup_steps": integer(0),
    "train.weight_decay": number(0),
    "train.grad_clip": number(0),
    "train.grad_accum": integer(1),
    "train.seed": integer(0, 2**32 - 1),
    "train.log_every": integer(1),
    "train.save_every": integer(0),
    "train.keep_last": integer(0),
    "train.resume": resume(),
    "train.threads": optional(integer(1)),
    "train.time_budget_min": optional(number(0, low_open=True)),
    "train.autocast": one_of(None, "auto", "bfloat16", "float16"),
    "deepspeed.zero_stage": one_of(0, 1, 2),
    "deepspeed.precision": one_of("auto", "fp32", "bf16"),
    "deepspeed.backend": one_of("auto", "gloo", "nccl"),
    "deepspeed.betas": betas(),
    "deepspeed.eps": number(0, low_open=True),
    "tracking.wandb.enabled": flag(),
    "tracking.wandb.project": text(),
    "tracking.wandb.entity": optional(text()),
    "tracking.wandb.mode": one_of("auto", "online", "offline"),
    "tracking.metrics_jsonl": flag(),
    "eval.every": integer(0),
    "eval.prompts": text(),
    "eval.num_prompts": integer(0),
    "eval.depth": integer(1),
    "eval.max_new_tokens": integer(1),
    "eval.heldout_samples": integer(0),
    "eval.heldout_from": optional(integer(0)),
    "eval.agreement_steps": integer(1),
}


def lookup(cfg, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _shown(value) -> str:
    items = _as_list(value)
    return repr(items if items is not None else value)


def check_values(cfg) -> None:
    """Raise :class:`LyannaError` for the first field outside its allowed range."""
    for dotted, rule in RULES.items():
        value = lookup(cfg, dotted)
        if not rule.ok(value):
            raise LyannaError(f"config: {dotted} = {_shown(value)} is not allowed (allowed: {rule.allowed})")


def check_paths(cfg) -> None:
    """Everything the run will read must exist before anything is built (cheap: no loading)."""
    from pathlib import Path

    from ..data.corpus import Corpus
    from ..target.loading import resolve_target

    try:
        resolve_target(cfg.target.name)
    except LyannaError as err:
        raise LyannaError(f"config: target.name: {err}") from None
    for name, specs in (("data.corpus", list(cfg.data.corpus)),
                        ("eval.prompts", [cfg.eval.prompts] if cfg.eval.num_prompts > 0 else [])):
        if specs:
            try:
                Corpus.resolve(specs)
            except LyannaError as err:
                raise LyannaError(f"config: {name}: {err}") from None
    if cfg.hotvocab.path is not None and not cfg.hotvocab.full_vocab and not Path(cfg.hotvocab.path).exists():
        raise LyannaError(f"config: hotvocab.path = {cfg.hotvocab.path!r} does not exist")
    if cfg.draft.init_from is not None and not Path(cfg.draft.init_from).is_dir():
        raise LyannaError(f"config: draft.init_from = {cfg.draft.init_from!r} is not an export directory")
    if cfg.train.resume not in ("auto", "never", "force") and not Path(cfg.train.resume).is_dir():
        raise LyannaError(f"config: train.resume = {cfg.train.resume!r} is not allowed "
                          f"(allowed: {RULES['train.resume'].allowed}; that path does not exist)")
