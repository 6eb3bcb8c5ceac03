"""Declared ranges: a dataclass field declares its default and its allowed values together,
``ranged(default, rule)``, and every check is read off those declarations.

Shared by the training config (:mod:`.training.config`) and the decoding settings
(:mod:`.runtime.settings`), so each field is declared once, with its range beside it, and
a field declared without one is refused (:func:`rules` raises, and with it a test). A bad
value is one line naming the field, the value and what is allowed. Nothing here imports
torch: composing a config must not wait for it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from .errors import LyannaError


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


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer(low: int, high: int | None = None) -> Rule:
    text = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    outside = (low - 1, low + 0.5) + (() if high is None else (high + 1,))
    return Rule(lambda v: is_int(v) and v >= low and (high is None or v <= high), text, outside)


def number(low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False) -> Rule:
    def ok(v) -> bool:
        if not is_number(v):
            return False
        above = v > low if low_open else v >= low
        below = high is None or (v < high if high_open else v <= high)
        return above and below

    left, right = "(" if low_open else "[", ")" if high_open or high is None else "]"
    outside = (low if low_open else low - 1, math.nan, math.inf)
    outside += () if high is None else (high if high_open else high + 1,)
    return Rule(ok, f"a finite number in {left}{low}, {'inf' if high is None else high}{right}", outside)


def one_of(*values) -> Rule:
    ints = all(is_int(x) for x in values)
    outside = (max(values) + 1, min(values) - 1) if ints else ("bogus",)
    return Rule(lambda v: v in values, "one of " + ", ".join("null" if x is None else str(x) for x in values),
                outside)


def one_of_names(names: Callable[[], tuple]) -> Rule:
    """:func:`one_of` names read when a value is checked, not when the schema is imported:
    their module needs torch, which composing a config must not load."""
    return Rule(lambda v: v in names(), lambda: "one of " + ", ".join(names()), ("bogus",))


def optional(rule: Rule) -> Rule:
    return Rule(lambda v: v is None or rule.ok(v), lambda: f"null or {rule.allowed}",
                tuple(x for x in rule.outside if x is not None))


def off_or(rule: Rule, what: str) -> Rule:
    """0 turns ``what`` off; anything else must satisfy ``rule``."""
    return Rule(lambda v: (is_int(v) and v == 0) or rule.ok(v), lambda: f"0 ({what} off) or {rule.allowed}",
                tuple(x for x in rule.outside if x != 0))


def flag() -> Rule:
    return Rule(lambda v: isinstance(v, bool), "true or false", ("true", 1))


def text() -> Rule:
    return Rule(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string", ("", " ", 1))


def as_list(v) -> list | None:
    """Lists arrive as ``ListConfig`` from Hydra: anything iterable but a string or a mapping."""
    if isinstance(v, (str, bytes, dict)) or not hasattr(v, "__iter__") or hasattr(v, "keys"):
        return None
    return list(v)


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
    items = as_list(value)
    return repr(items if items is not None else value)


def check_values(cfg, schema, what: str = "config") -> None:
    """Raise :class:`LyannaError` for the first field of ``cfg`` outside the range its
    declaration in the dataclass ``schema`` allows (``what`` opens the message)."""
    for dotted, rule in rules(schema).items():
        value = lookup(cfg, dotted)
        if not rule.ok(value):
            raise LyannaError(f"{what}: {dotted} = {_shown(value)} is not allowed (allowed: {rule.allowed})")


def check_fields(obj, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` for the first of the dataclass ``obj``'s own fields (nested dataclasses
    check themselves) outside its declared range: for a frozen settings object's
    ``__post_init__``, so one built in code is checked as one read from YAML is."""
    for f in dataclasses.fields(obj):
        rule = f.metadata.get("allowed")
        value = getattr(obj, f.name)
        if rule is not None and not rule.ok(value):
            raise error(f"{type(obj).__name__}.{f.name} = {_shown(value)} is not allowed (allowed: {rule.allowed})")
