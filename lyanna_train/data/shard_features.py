"""One shard's per-token tensors, as the feature cache stores them, filled one forward batch at a time.

The cache writer fills a shard batch after batch and writes it; ``data.features=hybrid``
fills it from the training steps' own forward passes and writes it once its last sample
is in; regeneration (:mod:`.distilled_output`) puts in what the decoder recorded. Both go through :class:`ShardFeatures`, so the rows are encoded
(:mod:`.feature_dtype`) and summarised (the teacher's top-1 and logsumexp) in one place
and a shard means the same thing whoever made it.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from .batching import pad_right
from .feature_dtype import empty_rows, store_rows
from .features import teacher_summary as summarise


class ShardFeatures:
    """The tensors of one shard (``group``: a :class:`~.feature_cache_writer.ShardSamples`),
    laid out as :mod:`.feature_cache` describes; features are filled by :meth:`fill`."""

    def __init__(self, group, aux_size: int, hidden_size: int, feature_dtype: str, teacher_summary: bool = True):
        self.group = group
        n = group.tokens
        offsets = torch.tensor([0, *itertools.accumulate(len(t) for t in group.input_ids)], dtype=torch.int64)
        self.tensors = empty_rows(feature_dtype, n, {"aux": aux_size, "last": hidden_size},
                                  {"aux": aux_size // hidden_size, "last": 1})
        if teacher_summary:
            self.tensors.update(teacher_top1=torch.empty(n, dtype=torch.int32),
                                teacher_lse=torch.empty(n, dtype=torch.float32))
        self.tensors.update(input_ids=torch.cat(group.input_ids), loss_mask=torch.cat(group.loss_mask),
                            offsets=offsets, sample_index=torch.tensor(group.index, dtype=torch.int64))
        self.filled = torch.zeros(len(group.index), dtype=torch.bool)

    def span(self, row: int) -> tuple[int, int]:
        offsets = self.tensors["offsets"]
        return int(offsets[row]), int(offsets[row + 1])

    def fill(self, extractor, rows: Sequence[int]) -> int:
        """Run the target over samples ``rows`` (positions in the shard) as one batch and store
        their features; returns the tokens computed."""
        # pad id 0 on the right: causal attention keeps real tokens from ever reading it
        feats = extractor(pad_right([self.group.input_ids[j] for j in rows], 0, torch.int64))
        spans = [self.span(j) for j in rows]
        for i, (a, b) in enumerate(spans):
            store_rows(self.tensors, "aux", a, b, feats.aux[i, : b - a])
            store_rows(self.tensors, "last", a, b, feats.last[i, : b - a])
        if "teacher_top1" in self.tensors:  # one LM-head pass over the batch's real tokens
            lm_weight = extractor.model.get_output_embeddings().weight
            with torch.inference_mode():
                top1, lse = summarise(torch.cat([feats.last[i, : b - a] for i, (a, b) in enumerate(spans)]), lm_weight)
            start = 0
            for a, b in spans:
                self.tensors["teacher_top1"][a:b] = top1[start:start + b - a]
                self.tensors["teacher_lse"][a:b] = lse[start:start + b - a]
                start += b - a
        self.filled[list(rows)] = True
        return sum(b - a for a, b in spans)

    def put(self, row: int, aux: torch.Tensor, last: torch.Tensor, top1: torch.Tensor, lse: torch.Tensor) -> None:
        """Store sample ``row``'s features as another forward computed them (regeneration's
        recording): aux [T, k·H], last [T, H], the full-vocabulary top-1 and logsumexp [T]."""
        a, b = self.span(row)
        store_rows(self.tensors, "aux", a, b, aux[: b - a])
        store_rows(self.tensors, "last", a, b, last[: b - a])
        if "teacher_top1" in self.tensors:
            self.tensors["teacher_top1"][a:b] = top1[: b - a]
            self.tensors["teacher_lse"][a:b] = lse[: b - a]
        self.filled[row] = True

    @property
    def complete(self) -> bool:
        return bool(self.filled.all())

    def missing(self) -> list[int]:
        """Positions of the samples not filled yet."""
        return (~self.filled).nonzero().flatten().tolist()
