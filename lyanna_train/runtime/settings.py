"""Every decoding setting, as data: the dataclasses, and ``conf/decode/<preset>.yaml`` plus
``key=value`` overrides checked against them.

Each field is declared once, here, with its default and its allowed range
(``ranged(default, rule)``, :mod:`lyanna_train.ranges`, as the training config declares
its fields): ``DecodeSettings()`` is the shipped ``default`` preset
(``conf/decode/default.yaml`` is empty), and the other presets state only what they change.
The YAML is checked against :class:`DecodeSettings` itself (an OmegaConf structured config),
so a misspelt key, a value of the wrong type or one outside its range stops with one line
naming it instead of being silently ignored; settings built in code check their own fields
(:func:`~lyanna_train.ranges.check_fields`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from ..configs import decode_dir
from ..errors import LyannaError
from ..ranges import check_fields, check_values, flag, integer, number, one_of, ranged


@dataclass(frozen=True)
class TreeShape:
    """The head's candidate tree: EAGLE-2's expand-then-rerank with static widths. The
    default is the draft's top-3 for the next token: deeper trees accept more per forward but
    cost more draft time than they save on a 2-core CPU with the CPU recipe's head."""

    # levels below the last accepted token (MT-Bench: 2 measured 1.79x vs 1.88x for 1)
    depth: int = ranged(1, integer(0))
    branch: int = ranged(3, integer(1))  # children scored per expanded node (top-k)
    beam: int = ranged(1, integer(1))  # nodes expanded per level
    max_nodes: int = ranged(6, integer(0))  # drafted nodes offered per target forward (the root excluded)
    # stop drafting deeper once no node of a level is this likely
    min_prob: float = ranged(0.0, number(0, 1, high_open=True))

    def __post_init__(self):
        check_fields(self)


@dataclass(frozen=True)
class LookupSettings:
    """Candidates beside the draft's that cost no draft forward: prompt lookup and the pool's
    continuation (each 0 = off)."""

    max_tokens: int = ranged(10, integer(0))  # prompt-lookup continuation length
    max_ngram: int = ranged(3, integer(1))  # longest context suffix matched
    # distinct continuations added to the tree (most recent matches first)
    branches: int = ranged(1, integer(1))
    # continuation after the most similar pooled draft state (:mod:`.drafting.pool_lookup`): raised
    # τ per forward 1.99 -> 2.03 beside prompt lookup, 1.54 -> 1.79 alone (bench/free_candidates.py)
    pool_tokens: int = ranged(10, integer(0))

    def __post_init__(self):
        check_fields(self)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 mean off."""

    # 0: greedy, lossless, token for token what target.generate gives
    temperature: float = ranged(0.0, number(0))
    top_k: int = ranged(0, integer(0))
    top_p: float = ranged(1.0, number(0, 1, low_open=True))

    def __post_init__(self):
        check_fields(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class FusionSettings:
    """How the scheduler fuses verification across rows (batched decoding only: BatchDecoder,
    ``lyanna-bench --batch-size``)."""

    # 1: verify every running row's tree in one target forward every iteration; k > 1: hold
    # verification until k micro-batches are drafted (the design's variant; lyanna-bench --hold K)
    micro_batches: int = ranged(1, integer(1))
    # under the fused token budget, admit nodes by depth before probability
    shallow_first: bool = ranged(False, flag())
    # requests admitted in one step are prefilled together, in forwards of at most this many
    # (padded) prompt tokens; 0: one forward per request
    prefill_tokens: int = ranged(2048, integer(0))
    # a freed slot waits up to this many iterations for a running row that will reach its
    # token budget by then, so that their next requests share one prefill; 0: admit at once
    admit_wait: int = ranged(4, integer(0))

    def __post_init__(self):
        check_fields(self)


@dataclass(frozen=True)
class DecodeSettings:
    """Every decoding setting; the defaults are the ``default`` preset (override any field with
    ``--set``, e.g. ``lyanna-generate --draft DIR --set tree.depth=6 --set sampling.temperature=0.7``)."""

    tree: TreeShape = TreeShape()
    lookup: LookupSettings = LookupSettings()
    sampling: SamplingParams = SamplingParams()
    seed: int = ranged(0, integer(0))  # of the sampling generator
    # "auto": each iteration, each row verifies what maximises the batch's expected tokens
    # per second of measured draft + verify time, the head drafting only for the rows where
    # it pays (:mod:`.pricing.policy`); "fit": the head drafts for every row, each verifies
    # what pays; "all": every row drafts and verifies every candidate
    verify: str = ranged("auto", one_of("auto", "fit", "all"))
    # "auto" / "fit": speculate only where the measured costs expect at least this gain over
    # plain decoding. 0 by default: where the costs mislead, what speculative iterations
    # delivered against plain ones holds speculation back (:class:`.pricing.cost.MeasuredCosts`);
    # a 5 % margin cost 6-13 % of the tokens/s at batch 2 on 2 CPU cores
    margin: float = ranged(0.0, number(0, 1, high_open=True))
    fusion: FusionSettings = FusionSettings()  # last: positional callers keep their meaning

    def __post_init__(self):
        check_fields(self)  # the nested settings checked themselves


def presets() -> list[str]:
    return sorted(p.stem for p in decode_dir().glob("*.yaml"))


def preset_path(preset: str) -> Path:
    """A preset name (``conf/decode/<name>.yaml``) or a path to a YAML file."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    path = decode_dir() / f"{preset}.yaml"
    if not path.is_file():
        raise LyannaError(f"unknown decode preset {preset!r} (choose from {', '.join(presets())}, or a .yaml file)")
    return path


def _fields(node, prefix: str = "") -> list[str]:
    """Every leaf key, dotted (``tree.depth``): what an error message lists."""
    from omegaconf import DictConfig

    out = []
    for key in node:
        child = node[key]
        out += _fields(child, f"{prefix}{key}.") if isinstance(child, DictConfig) else [f"{prefix}{key}"]
    return out


def _merge(schema, *sources) -> None:
    """Merge in place; frozen dataclasses make every node read-only, so lift that meanwhile."""
    from omegaconf import DictConfig, read_write

    with contextlib.ExitStack() as stack:
        stack.enter_context(read_write(schema))
        for key in schema:
            if isinstance(schema[key], DictConfig):
                stack.enter_context(read_write(schema[key]))
        schema.merge_with(*sources)


def load_decode_settings(preset: str = "default", overrides: list[str] | tuple = ()):
    """``preset`` (name or YAML path) + dotlist ``overrides`` (``tree.depth=6``) -> DecodeSettings."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    path = preset_path(preset)
    schema = OmegaConf.structured(DecodeSettings)
    known = ", ".join(_fields(schema))
    for item in overrides:
        if "=" not in item:
            raise LyannaError(f"decode override {item!r} is not key=value (keys: {known})")
    try:
        sources = [OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides))]
    except Exception as err:  # noqa: BLE001 - yaml and the dotlist parser raise several types
        raise LyannaError(f"cannot read decode settings {path} / {list(overrides)}: {err}") from None
    try:
        _merge(schema, *sources)
    except ConfigKeyError as err:
        raise LyannaError(f"unknown decode setting {err.full_key!r} (known: {known})") from None
    except OmegaConfBaseException as err:
        where = f" for {err.full_key}" if getattr(err, "full_key", None) else ""
        raise LyannaError(f"bad decode setting{where}: {str(err).splitlines()[0]}") from None
    check_values(schema, DecodeSettings, f"decode settings ({path.name} with {list(overrides)})")
    return OmegaConf.to_object(schema)
