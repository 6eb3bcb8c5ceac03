"""``data.features=hybrid``: the first epoch runs the target inside the training steps, as
``online`` does, and writes what it computes to the feature cache; later epochs and a
resumed run read it from there.

The cache is the one ``cached`` mode builds, from the same code: the writer's planning pass
fixes its shards and manifest (:func:`~lyanna_train.data.feature_cache_writer.open_cache`),
the batch plan is cached mode's over those shards (an epoch goes shard by shard), and rows
are encoded and summarised by :class:`~lyanna_train.data.shard_features.ShardFeatures`. A
batch whose shard is on disk (index entry, size and checksum match) is read from there; any
other batch runs the target over its samples and stores their rows in the shard in memory,
which is written (file, then index entry, each renamed into place) once its last sample is
in. The step trains on the rows as stored, decoded, so the first epoch sees what every later
one reads. Rows no step computed (the plan's last batches, cut to a multiple of
``train.grad_accum``, and those of a shard a killed run left half-done) are computed when the
first epoch ends, in the writer's batches. A half-filled shard lives only in memory and a
shard file without its index entry is never read: a run killed at any point leaves nothing
that is taken for complete.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..data.batching import length_grouped_batches
from ..data.feature_cache import load_checked_shard, read_entry, shard_problem
from ..data.feature_cache_writer import OpenedCache, open_cache, write_shard
from ..data.samples import Sample
from ..data.shard_features import ShardFeatures
from ..errors import LyannaError
from ..locks import output_lock
from .batches import BatchRef, shard_batch


class HybridBatches:
    """BatchRef -> training batch, from the cache where the shard is written, else from the target."""

    def __init__(self, opened: OpenedCache, settings):
        self.opened, self.settings, self.root = opened, settings, Path(opened.out)
        self.groups = {g.shard: g for g in opened.groups}
        self.planned = {p["shard"]: p for p in opened.plan}
        self.entries: dict[int, dict] = {}  # shards known complete on disk
        self.pending: dict[int, ShardFeatures] = {}  # shards being filled
        self._loaded: tuple[int | None, dict | None] = (None, None)

    @property
    def lengths(self) -> list[list[int]]:
        """Per shard, the token count of each sample (what batch plans are made from)."""
        return [[len(ids) for ids in self.groups[k].input_ids] for k in sorted(self.groups)]

    def _entry(self, k: int) -> dict | None:
        if k not in self.entries and k not in self.pending:
            if shard_problem(self.root, self.planned[k], verify_checksum=False) is None:
                self.entries[k] = read_entry(self.root, k)  # the checksum is verified as it is loaded
        return self.entries.get(k)

    def _shard(self, k: int) -> ShardFeatures:
        if k not in self.pending:
            extractor = self.opened.extractor
            self.pending[k] = ShardFeatures(self.groups[k], extractor.aux_size, extractor.hidden_size,
                                            self.settings.feature_dtype, self.settings.teacher_summary)
        return self.pending[k]

    def __call__(self, ref: BatchRef) -> dict[str, torch.Tensor]:
        entry = self._entry(ref.shard)
        if entry is not None:
            if self._loaded[0] != ref.shard:
                self._loaded = (ref.shard, load_checked_shard(self.root, ref.shard, entry))
            return shard_batch(self._loaded[1], ref.rows)
        features = self._shard(ref.shard)
        todo = [j for j in ref.rows if not features.filled[j]]  # rows already in (the feature-scale pass's) stay
        if todo:
            features.fill(self.opened.extractor, todo)
        batch = shard_batch(features.tensors, ref.rows)
        if features.complete:
            self._write(ref.shard)
        return batch

    def _write(self, k: int) -> None:
        features = self.pending.pop(k)
        try:
            self.entries[k] = write_shard(self.root, self.planned[k], features.tensors, self.opened.shard_meta)
        except OSError as err:
            raise LyannaError(f"cannot write shard {k} of the feature cache {self.root}: {err}") from None
        self._loaded = (k, features.tensors)

    def finish(self, shards=None) -> int:
        """Compute and write every shard of ``shards`` (default: all) not on disk yet: the rows no
        step computed. Returns the tokens computed; after it no batch of those shards runs the target."""
        tokens = 0
        for k in sorted(self.planned) if shards is None else shards:
            if self._entry(k) is not None:
                continue
            features = self._shard(k)
            missing = [Sample(j, features.group.input_ids[j], features.group.loss_mask[j]) for j in features.missing()]
            for batch in length_grouped_batches(missing, self.settings.batch_tokens, seed=k, buffer_size=len(missing)):
                tokens += features.fill(self.opened.extractor, [s.index for s in batch])
            self._write(k)
        return tokens


def hybrid_batches(spec, target, tokenizer, layer_ids, stack, say=print) -> HybridBatches:
    """The hybrid source over the run's cache ``spec`` (:class:`~.setup.CacheSpec`); the cache's
    writer lock is entered on ``stack`` (held for the run: no build may write it meanwhile)."""
    stack.enter_context(output_lock(spec.root, tag=".shard-0of1"))
    opened = open_cache(spec.samples, target, tokenizer, spec.root, layer_ids, spec.settings,
                        max_samples=spec.max_samples, source=spec.source, keep_groups=True)
    source = HybridBatches(opened, spec.settings)
    done = sum(source._entry(k) is not None for k in source.planned)
    say(f"hybrid features: {done} of {len(source.planned)} shards of {spec.root} on disk; the others are computed "
        "in the training steps and written there")
    return source
