"""Every config value checked before any work, each against the range its field declares.

Each field of :class:`~lyanna_train.training.config.Config` declares its default and its
allowed range together, ``ranged(default, rule)``; :func:`rules` reads them off the
dataclasses, so there is no second table to keep in step, and a field declared without a
range is refused (:func:`rules` raises, and with it every run and a test). A bad value stops
the run in its first second with one line naming the field, the value and what is allowed
— never a traceback an hour later, and never after a half-built artifact has been left in
the run folder (``hotvocab.size=-5`` used to build a one-token hot vocabulary that broke
every later run there).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import LyannaError


@dataclass(frozen=True)
class Rule:
    ok: Callable[[Any], bool]
    describe: str | Callable[[], str]  # what a reader is told is allowed (callable: known only when checked)
    outside: tuple = ()  # values just outside the range: what the tests give each field to be refused

    @property
    def allowed(self) -> str:
        return self.describe() if callable(self.describe) else self.describe


def ranged(default, rule: Rule):
    """A dataclass field declared once: its default and the range :func:`rules` checks it against."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"allowed": rule})
    return dataclasses.field(default=default, metadata={"allowed": rule})


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer(low: int, high: int | None = None) -> Rule:
    text = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    outside = (low - 1, low + 0.5) + (() if high is None else (high + 1,))
    return Rule(lambda v: _is_int(v) and v >= low and (high is None or v <= high), text, outside)


def number(low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False) -> Rule:
    def ok(v) -> bool:
        if not _is_number(v):
            return False
        above = v > low if low_open else v >= low
        below = high is None or (v < high if high_open else v <= high)
        return above and below

    left, right = "(" if low_open else "[", ")" if high_open or high is None else "]"
    outside = (low if low_open else low - 1, math.nan, math.inf)
    outside += () if high is None else (high if high_open else high + 1,)
    return Rule(ok, f"a finite number in {left}{low}, {'inf' if high is None else high}{right}", outside)


def one_of(*values) -> Rule:
    ints = all(_is_int(x) for x in values)
    outside = (max(values) + 1, min(values) - 1) if ints else ("bogus",)
    return Rule(lambda v: v in values, "one of " + ", ".join("null" if x is None else str(x) for x in values),
                outside)


def one_of_names(names: Callable[[], tuple]) -> Rule:
    """:func:`one_of` names read when a value is checked, not when the schema is imported:
    their module needs torch, which composing a config must not load."""
    return Rule(lambda v: v in names(), lambda: "one of " + ", ".join(names()), ("bogus",))


def feature_dtypes() -> tuple:
    """The feature cache's storage dtypes (``data.feature_dtype``), named where they are encoded."""
    from ..data.feature_dtype import FEATURE_DTYPES

    return tuple(FEATURE_DTYPES)


def optional(rule: Rule) -> Rule:
    return Rule(lambda v: v is None or rule.ok(v), lambda: f"null or {rule.allowed}",
                tuple(x for x in rule.outside if x is not None))


def off_or(rule: Rule, what: str) -> Rule:
    """0 turns ``what`` off; anything else must satisfy ``rule``."""
    return Rule(lambda v: (_is_int(v) and v == 0) or rule.ok(v), lambda: f"0 ({what} off) or {rule.allowed}",
                tuple(x for x in rule.outside if x != 0))


def flag() -> Rule:
    return Rule(lambda v: isinstance(v, bool), "true or false", ("true", 1))


def text() -> Rule:
    return Rule(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string", ("", " ", 1))


def _as_list(v) -> list | None:
    """Lists arrive as ``ListConfig`` from Hydra: anything iterable but a string or a mapping."""
    if isinstance(v, (str, bytes, dict)) or not hasattr(v, "__iter__") or hasattr(v, "keys"):
        return None
    return list(v)


def layer_list() -> Rule:
    def ok(v) -> bool:
        items = _as_list(v)
        return bool(items) and all(_is_int(x) and x >= 0 for x in items) and len(set(items)) == len(items)
    return Rule(ok, "a non-empty list of distinct layer indices >= 0", ([], [1, 1], [-1], "0"))


def corpus_list() -> Rule:
    def ok(v) -> bool:
        items = _as_list(v)
        return bool(items) and all(isinstance(x, str) and x.strip() for x in items)
    return Rule(ok, "a non-empty list of corpus paths or names", ([], [""], "sharegpt"))


def beta_pair() -> Rule:
    def ok(v) -> bool:
        items = _as_list(v)
        return items is not None and len(items) == 2 and all(_is_number(b) and 0 <= b < 1 for b in items)
    return Rule(ok, "two numbers in [0, 1)", ([0.9], [0.9, 1.0], [-0.1, 0.9], 0.9))


def resume_spec() -> Rule:
    return Rule(lambda v: isinstance(v, str) and v.strip() != "",
                "auto, never, force or the path of a step-NNNNNNNN checkpoint", ("", None))


def rules(schema) -> dict[str, Rule]:
    """Every leaf field of the dataclass ``schema``, dotted (``train.lr``), with its declared
    rule, in declaration order; a nested dataclass field is walked, not checked itself.
    Raises TypeError naming a field declared without a range."""
    out = {}
    for f in dataclasses.fields(schema):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out.update({f"{f.name}.{k}": rule for k, rule in rules(type(default)).items()})
        elif "allowed" in f.metadata:
            out[f.name] = f.metadata["allowed"]
        else:
            raise TypeError(f"{schema.__name__}.{f.name} declares no allowed range "
                            "(declare it with ranged(default, rule))")
    return out


def lookup(cfg, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _shown(value) -> str:
    items = _as_list(value)
    return repr(items if items is not None else value)


def check_values(cfg, schema) -> None:
    """Raise :class:`LyannaError` for the first field of ``cfg`` outside the range its
    declaration in the dataclass ``schema`` allows."""
    for dotted, rule in rules(schema).items():
        value = lookup(cfg, dotted)
        if not rule.ok(value):
            raise LyannaError(f"config: {dotted} = {_shown(value)} is not allowed (allowed: {rule.allowed})")


def check_paths(cfg) -> None:
    """Everything the run will read must exist before anything is built (cheap: no loading)."""
    from pathlib import Path

    from ..data.corpus import Corpus
    from ..target.source import resolve_target

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
                          f"(allowed: {resume_spec().allowed}; that path does not exist)")
