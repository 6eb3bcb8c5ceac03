"""Held-out samples and the agreement figures measured on them during training, and the
head's evaluation (:func:`head_metrics`: those figures and τ under chain drafting).

The training accuracy the loop logs is a running average over batches the head is
fitting, so it flatters the head. The samples that follow the training range in the
corpus stream are never trained on: their features are cached once (small) and the
head's teacher-forced top-1 agreement is measured there and, the same way, on as many
training samples; the difference is the over-fit gap.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from ..data.feature_cache import FeatureCache
from ..evaluation.agreement import top1_agreement
from .batches import BatchRef, CachedBatches, cache_lengths, group_by_length


class StreamSlice:
    """Samples ``start .. start + count - 1`` of a re-iterable sample stream, re-iterable."""

    def __init__(self, samples, start: int, count: int):
        self.samples, self.start, self.count = samples, start, count

    def __iter__(self):
        return itertools.islice(iter(self.samples), self.start, self.start + self.count)


def heldout_start(cfg, samples, trained: int | None, say=print) -> int | None:
    """Where the held-out samples start in the stream (by default after the ``trained`` first
    ones), or None when nothing is held out (switched off, the whole corpus is trained on, or
    the corpus ends before that point)."""
    if cfg.eval.heldout_samples <= 0:
        return None
    start = cfg.eval.heldout_from if cfg.eval.heldout_from is not None else trained
    if start is None:
        say("no held-out agreement: data.max_samples is null (every sample trains); set eval.heldout_from")
        return None
    if next(iter(StreamSlice(samples, start, 1)), None) is None:
        say(f"no held-out agreement: the corpus has no sample after position {start}")
        return None
    return start


def first_samples(shard_lengths: list[list[int]], count: int, max_tokens: int) -> list[BatchRef]:
    """Batches over the first ``count`` samples of a cache whose shards hold samples of
    ``shard_lengths`` tokens (length-grouped, fixed order)."""
    refs, left = [], count
    for shard, lengths in enumerate(shard_lengths):
        rows = list(range(min(left, len(lengths))))
        for group in group_by_length([lengths[r] for r in rows], max_tokens, seed=shard):
            refs.append(BatchRef(shard, tuple(rows[i] for i in group)))
        left -= len(rows)
        if left <= 0:
            break
    return refs


@dataclass
class AgreementSets:
    """Where the agreement is measured: batches of the held-out cache and of as many training
    samples (from the training cache, or from a callable BatchRef -> batch: the hybrid source)."""

    heldout: FeatureCache
    train: FeatureCache | Callable
    heldout_refs: list[BatchRef]
    train_refs: list[BatchRef]

    @classmethod
    def of(cls, heldout: FeatureCache, train: FeatureCache, max_tokens: int) -> "AgreementSets":
        return cls.over(heldout, train, cache_lengths(train), max_tokens)

    @classmethod
    def over(cls, heldout: FeatureCache, train: FeatureCache | Callable, train_lengths: list[list[int]],
             max_tokens: int) -> "AgreementSets":
        n = heldout.num_samples
        return cls(heldout, train, first_samples(cache_lengths(heldout), n, max_tokens),
                   first_samples(train_lengths, n, max_tokens))

    def metrics(self, draft, steps: int) -> dict:
        """eval/heldout_top1_step{j}, eval/train_top1_step{j}, eval/top1_gap, eval/heldout_in_hot."""
        # readers made per call: a shard loaded here is not kept beside the training's own
        train = CachedBatches(self.train) if isinstance(self.train, FeatureCache) else self.train
        held = top1_agreement(draft, map(CachedBatches(self.heldout), self.heldout_refs), steps)
        seen = top1_agreement(draft, map(train, self.train_refs), steps)
        out = {f"eval/heldout_top1_step{j}": held[f"top1_step{j}"] for j in range(steps)}
        out.update({f"eval/train_top1_step{j}": seen[f"top1_step{j}"] for j in range(steps)})
        out["eval/top1_gap"] = seen["top1_step0"] - held["top1_step0"]
        out["eval/heldout_in_hot"] = held["in_hot"]
        out["eval/heldout_positions"] = held["positions"]
        return out


def head_metrics(cfg, parts, draft, agreement=None) -> dict:
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
