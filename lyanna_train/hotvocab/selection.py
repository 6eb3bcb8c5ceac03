"""Choose hot vocabularies from token counts and describe them as draft<->target maps.

Ranking is deterministic: forced tokens (end-of-sequence / end-of-turn) first, then
higher train count first, then lower id. A selection of size *k* is the first *k*
ranked ids, so ids that never occur pad the set in ascending id order. The maps
follow the EAGLE-3 convention read by SGLang and vLLM: draft id *i* is ``hot_ids[i]``
and ``d2t[i] = hot_ids[i] - i`` (``target = draft + d2t[draft]``); ``t2d`` is a bool
mask over the target vocabulary.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..errors import LyannaError


def rank_tokens(counts: np.ndarray, forced: Sequence[int] = ()) -> np.ndarray:
    """All ids, best first: forced ids, then by (count desc, id asc)."""
    ids = np.arange(len(counts))
    order = np.lexsort((ids, -counts))  # last key is primary
    if len(forced):
        forced_set = np.zeros(len(counts), bool)
        forced_set[list(forced)] = True
        order = np.concatenate([order[forced_set[order]], order[~forced_set[order]]])
    return order


def coverage_curve(ranking: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``curve[k-1]`` = fraction of ``counts`` covered by the first *k* ranked ids."""
    total = counts.sum()
    if total == 0:
        return np.full(len(ranking), np.nan)
    return np.cumsum(counts[ranking]) / total


def size_for_ratio(ratio: float, vocab: int) -> int:
    """The hot-vocabulary size a ratio asks for: the nearest whole token count, at least one.
    The one rule the CLI, the trainer and the plan share, so they never build different sizes."""
    return max(1, int(math.floor(ratio * vocab + 0.5)))


@dataclass(frozen=True)
class SelectionRequest:
    """One requested selection: exactly one of ratio, size or coverage goal."""

    ratio: Optional[float] = None
    size: Optional[int] = None
    coverage: Optional[float] = None

    def resolve_size(self, vocab: int, heldout_curve: np.ndarray, n_forced: int) -> int:
        if self.size is not None:
            size = self.size
        elif self.ratio is not None:
            size = size_for_ratio(self.ratio, vocab)
        else:  # smallest size whose held-out coverage reaches the goal
            if np.isnan(heldout_curve).all():
                raise LyannaError("--coverage needs held-out text, but the held-out split is empty")
            reached = np.nonzero(heldout_curve >= self.coverage - 1e-12)[0]
            size = int(reached[0]) + 1 if len(reached) else vocab
        size = max(size, n_forced, 1)
        if size > vocab:
            raise LyannaError(f"hot-vocabulary size {size} exceeds the vocabulary size {vocab}")
        return size

    @property
    def label(self) -> str:
        if self.ratio is not None:
            return f"ratio {self.ratio:g}"
        if self.coverage is not None:
            return f"coverage {self.coverage:g}"
        return f"size {self.size}"


def check_sizes(requests: list[SelectionRequest], vocab: int) -> None:
    """Refuse a ``--sizes`` past the vocabulary as soon as the tokenizer is known, before counting."""
    for request in requests:
        if request.size is not None and request.size > vocab:
            raise LyannaError(f"--sizes: hot-vocabulary size {request.size} exceeds the vocabulary size {vocab}")


def parse_requests(ratios: str | None, sizes: str | None, coverage: str | None) -> list[SelectionRequest]:
    """Parse the CLI's comma-separated lists; ratios and goals must lie in (0, 1]."""
    requests: list[SelectionRequest] = []

    def numbers(text: str, flag: str, cast):
        try:
            return [cast(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise LyannaError(f"{flag} expects comma-separated numbers, got {text!r}") from None

    for r in numbers(ratios or "", "--ratios", float):
        if not 0 < r <= 1:
            raise LyannaError(f"--ratios: {r} is outside (0, 1]")
        requests.append(SelectionRequest(ratio=r))
    for s in numbers(sizes or "", "--sizes", int):
        if s < 1:
            raise LyannaError(f"--sizes: {s} must be a positive integer")
        requests.append(SelectionRequest(size=s))
    for c in numbers(coverage or "", "--coverage", float):
        if not 0 < c <= 1:
            raise LyannaError(f"--coverage: {c} is outside (0, 1]")
        requests.append(SelectionRequest(coverage=c))
    return requests


@dataclass(frozen=True)
class HotVocab:
    """A hot vocabulary and its draft<->target maps (int64 / bool tensors)."""

    hot_ids: torch.Tensor  # [size] target ids, by descending frequency
    d2t: torch.Tensor  # [size] offsets: target = draft + d2t[draft]
    t2d: torch.Tensor  # [vocab] bool: is this target id in the hot set?

    @classmethod
    def from_ids(cls, hot_ids, vocab: int) -> "HotVocab":
        hot = torch.as_tensor(np.asarray(hot_ids), dtype=torch.int64)
        if len(torch.unique(hot)) != len(hot):
            raise ValueError("hot ids must be unique")
        d2t = hot - torch.arange(len(hot), dtype=torch.int64)
        t2d = torch.zeros(vocab, dtype=torch.bool).scatter_(0, hot, True)
        return cls(hot, d2t, t2d)

    @property
    def size(self) -> int:
        return len(self.hot_ids)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def select(counts: np.ndarray, size: int, forced: Sequence[int] = ()) -> HotVocab:
    """The hot vocabulary of exactly ``size`` ids (warns when the corpus is too small)."""
    distinct = int(np.count_nonzero(counts | np.isin(np.arange(len(counts)), list(forced))))
    if distinct < size:
        warnings.warn(
            f"the corpus has only {distinct} distinct tokens; hot-vocabulary size {size} is "
            f"padded with the {size - distinct} lowest unused ids",
            stacklevel=2,
        )
    return HotVocab.from_ids(rank_tokens(counts, forced)[:size], len(counts))
