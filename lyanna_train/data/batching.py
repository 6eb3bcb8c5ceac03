"""Length-grouped, seeded batching of variable-length samples, and right padding (the one
place rows of different lengths become a batch: samples, cached features, online batches).

Samples are read into a bounded buffer, shuffled with a seeded RNG, sorted by length
within the buffer and cut into batches under a token budget (padding included), and the
batches are shuffled again, so the order is deterministic for a seed, padding is small,
and memory stays bounded by the buffer.
"""

from __future__ import annotations

import random
from typing import Iterable, Iterator, Sequence

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


def pad_right(rows: Sequence[torch.Tensor], value=0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows [T_i, ...] -> [B, max T_i, ...]: each row at the start of its line, ``value`` after it.

    Right padding with causal attention never lets a real token see the padding, so a
    mask-free forward stays exact for every real position."""
    first = rows[0]
    out = torch.full((len(rows), max(len(r) for r in rows), *first.shape[1:]), value, dtype=dtype or first.dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r)
    return out


def collate(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: input_ids [B, T], loss_mask / attention_mask [B, T] bool."""
    return {"input_ids": pad_right([torch.as_tensor(s.input_ids) for s in samples], pad_id, torch.int64),
            "loss_mask": pad_right([torch.as_tensor(s.loss_mask) for s in samples], False, torch.bool),
            "attention_mask": pad_right([torch.ones(len(s), dtype=torch.bool) for s in samples], False)}
