"""Length-grouped, seeded batching of variable-length samples, and padding collation.

Samples are read into a bounded buffer, shuffled with a seeded RNG, sorted by length
within the buffer and cut into batches under a token budget (padding included), and the
batches are shuffled again, so the order is deterministic for a seed, padding is small,
and memory stays bounded by the buffer.
"""

from __future__ import annotations

import random
from typing import Iterable, Iterator

import torch

from .samples import Sample


def length_grouped_batches(samples: Iterable[Sample], max_tokens: int, seed: int = 0,
                           buffer_size: int = 1024, max_batch: int = 64) -> Iterator[list[Sample]]:
    """Batches whose padded size ``len(batch) * longest`` stays within ``max_tokens``."""
    rng = random.Random(seed)
    buffer: list[Sample] = []

    def drain() -> Iterator[list[Sample]]:
        rng.shuffle(buffer)
        buffer.sort(key=len)
        batches, batch = [], []
        for sample in buffer:
            longest = max(len(sample), max((len(s) for s in batch), default=0))
            if batch and (longest * (len(batch) + 1) > max_tokens or len(batch) >= max_batch):
                batches.append(batch)
                batch = []
            batch.append(sample)
        if batch:
            batches.append(batch)
        rng.shuffle(batches)
        buffer.clear()
        yield from batches

    for sample in samples:
        buffer.append(sample)
        if len(buffer) >= buffer_size:
            yield from drain()
    yield from drain()


def collate(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: input_ids [B, T], loss_mask / attention_mask [B, T] bool."""
    longest = max(len(s) for s in samples)
    input_ids = torch.full((len(samples), longest), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros((len(samples), longest), dtype=torch.bool)
    attention_mask = torch.zeros((len(samples), longest), dtype=torch.bool)
    for row, s in enumerate(samples):
        input_ids[row, : len(s)] = s.input_ids
        loss_mask[row, : len(s)] = s.loss_mask
        attention_mask[row, : len(s)] = True
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}
