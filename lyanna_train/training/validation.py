"""Every training config value checked before any work, each against the range its field declares.

Each field of :class:`~lyanna_train.training.config.Config` declares its default and its
allowed range together, ``ranged(default, rule)`` (:mod:`lyanna_train.ranges`, shared with
the decoding settings); :func:`~lyanna_train.ranges.rules` reads them off the dataclasses,
so there is no second table to keep in step. Here: the rules only training needs, and the
paths a run will read. A bad value stops the run in its first second with one line naming
the field, the value and what is allowed — never a traceback an hour later, and never after
a half-built artifact has been left in the run folder (``hotvocab.size=-5`` used to build a
one-token hot vocabulary that broke every later run there).
"""

from __future__ import annotations

from ..errors import LyannaError
from ..ranges import Rule, as_list, is_int, is_number


def feature_dtypes() -> tuple:
    """The feature cache's storage dtypes (``data.feature_dtype``), named where they are encoded."""
    from ..data.feature_dtype import FEATURE_DTYPES

    return tuple(FEATURE_DTYPES)


def layer_list() -> Rule:
    def ok(v) -> bool:
        items = as_list(v)
        return bool(items) and all(is_int(x) and x >= 0 for x in items) and len(set(items)) == len(items)
    return Rule(ok, "a non-empty list of distinct layer indices >= 0", ([], [1, 1], [-1], "0"))


def corpus_list() -> Rule:
    def ok(v) -> bool:
        items = as_list(v)
        return bool(items) and all(isinstance(x, str) and x.strip() for x in items)
    return Rule(ok, "a non-empty list of corpus paths or names", ([], [""], "sharegpt"))


def beta_pair() -> Rule:
    def ok(v) -> bool:
        items = as_list(v)
        return items is not None and len(items) == 2 and all(is_number(b) and 0 <= b < 1 for b in items)
    return Rule(ok, "two numbers in [0, 1)", ([0.9], [0.9, 1.0], [-0.1, 0.9], 0.9))


def resume_spec() -> Rule:
    return Rule(lambda v: isinstance(v, str) and v.strip() != "",
                "auto, never, force or the path of a step-NNNNNNNN checkpoint", ("", None))


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
