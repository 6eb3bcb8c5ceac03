"""Deterministic batch plans over cached or online features, shared by every rank.

Every rank builds the same plan for an epoch (a list of batches, each a list of sample
references) from the seed and the epoch number; rank *r* takes batches ``r, r + W, ...``.
The data position saved in a checkpoint is just (epoch, batches done), so a resumed run
sees exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from safetensors import safe_open

from ..data.batching import collate, length_grouped_batches, pad_right
from ..data.feature_cache import FEATURE_KEYS, FeatureCache, shard_path
from ..data.feature_dtype import read_rows


@dataclass(frozen=True)
class BatchRef:
    shard: int  # cache shard (-1 for online samples)
    rows: tuple  # sample positions within the shard (or in the online sample list)


class _Sized:
    """A sample position standing in for a sample: only its length matters to batching."""

    __slots__ = ("position", "length")

    def __init__(self, position: int, length: int):
        self.position, self.length = position, length

    def __len__(self) -> int:
        return self.length


def group_by_length(lengths: list[int], max_tokens: int, seed: int) -> list[list[int]]:
    """Positions cut into length-grouped batches (the data stage's batching, whole shard at once)."""
    items = [_Sized(i, n) for i, n in enumerate(lengths)]
    return [[x.position for x in batch]
            for batch in length_grouped_batches(items, max_tokens, seed=seed, buffer_size=max(len(items), 1))]


def plan_epoch(shard_lengths: list[list[int]], max_tokens: int, seed: int, epoch: int,
               world_size: int, multiple: int = 1) -> list[BatchRef]:
    """The epoch's batches, shard by shard in a seeded order, truncated so that every
    rank gets the same number, a multiple of ``multiple`` (the gradient accumulation)."""
    base = seed * 1_000_003 + epoch * 7_919
    shards = list(range(len(shard_lengths)))
    random.Random(base).shuffle(shards)
    plan = [BatchRef(k, tuple(rows))
            for k in shards for rows in group_by_length(shard_lengths[k], max_tokens, base + 1 + k)]
    keep = len(plan) // (world_size * multiple) * world_size * multiple
    return plan[:keep]


def cache_lengths(cache: FeatureCache) -> list[list[int]]:
    """Per shard, the token count of each sample (reads only the small offsets tensors)."""
    out = []
    for k in range(len(cache)):
        with safe_open(str(shard_path(cache.root, k)), "pt") as fh:
            offsets = fh.get_tensor("offsets")
        out.append((offsets[1:] - offsets[:-1]).tolist())
    return out


def first_tokens(shard_lengths: list[list[int]], max_tokens: int | None) -> list[list[int]]:
    """Keep the first shards up to ``max_tokens`` tokens (at least one); later shards become
    empty, so one cache serves runs of several sizes (scaling curves)."""
    if max_tokens is None:
        return shard_lengths
    out, total, full = [], 0, False
    for lengths in shard_lengths:
        full = full or (bool(out) and total + sum(lengths) > max_tokens)
        out.append([] if full else lengths)
        total += 0 if full else sum(lengths)
    return out


class CachedBatches:
    """Materialises :class:`BatchRef` batches from a feature cache, one shard in memory."""

    def __init__(self, cache: FeatureCache):
        self.cache = cache
        self._shard, self._tensors = None, None

    def __call__(self, ref: BatchRef) -> dict[str, torch.Tensor]:
        if ref.shard != self._shard:
            self._shard, self._tensors = ref.shard, self.cache.load_shard(ref.shard)
        return shard_batch(self._tensors, ref.rows)


def shard_batch(t: dict[str, torch.Tensor], rows) -> dict[str, torch.Tensor]:
    """Samples ``rows`` of a shard's tensors (as stored: features decoded here) as one
    right-padded training batch."""
    spans = [(int(t["offsets"][j]), int(t["offsets"][j + 1])) for j in rows]
    batch = {key: pad_right([read_rows(t, key, a, b) for a, b in spans]) for key in FEATURE_KEYS if key in t}
    batch["input_ids"] = pad_right([t["input_ids"][a:b] for a, b in spans], dtype=torch.int64)
    batch["valid"] = pad_right([torch.ones(b - a, dtype=torch.bool) for a, b in spans])
    return batch


class OnlineBatches:
    """Runs the target inside the step: batches of tokenized samples -> features."""

    def __init__(self, samples: list, extractor, pad_id: int):
        self.samples, self.extractor, self.pad_id = samples, extractor, pad_id

    def __call__(self, ref: BatchRef) -> dict[str, torch.Tensor]:
        batch = collate([self.samples[i] for i in ref.rows], self.pad_id)
        feats = self.extractor(batch["input_ids"], batch["attention_mask"].long())
        # inference-mode tensors cannot enter autograd: clone them into ordinary ones
        return {"aux": feats.aux.clone(), "last": feats.last.clone(), "input_ids": batch["input_ids"],
                "loss_mask": batch["loss_mask"], "valid": batch["attention_mask"]}
