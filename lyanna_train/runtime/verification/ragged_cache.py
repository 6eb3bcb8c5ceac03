"""The target's KV cache for batched decoding: one row per sequence, each with its own length.

transformers' ``DynamicCache`` keeps one length for the whole batch (``crop`` cuts every
row alike), but in speculative decoding every row accepts its own number of tokens per
iteration. :class:`RaggedCache` is a ``Cache`` whose rows (slots) keep their own lengths:
the keys and values of every layer live in ONE preallocated buffer, written in place at
each row's own offset (gpt-fast's ``KVCache``, with per-row offsets), and any transformers
causal LM that reads its cache through ``cache.update`` decodes with it unchanged, given
the explicit position ids and 4D masks the runtime builds (:func:`.masks.ragged_mask`).

A forward covers a contiguous run of slots (``begin(rows, new_tokens)``): row r's T new
entries go to slots ``length[r] .. length[r] + T - 1`` and attention sees the buffer up to
the longest row, the mask hiding what a row must not read (other rows' padding, stale
entries past its length). Afterwards :meth:`keep` moves the entries a row accepts right
after its cached ones and advances its length: only those move, never the whole cache.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .masks import layer_windows

EMPTY = 0


class _Plan:
    """What the current forward writes: rows ``rows`` (a slice of slots), row i at offset
    ``offsets[i]``, attention over ``kv_length`` slots."""

    def __init__(self):
        self.rows = slice(0, 0)
        self.offsets = torch.zeros(0, dtype=torch.long)
        self.lengths: list[int] = []  # the same, as host ints
        self.single: int | None = None  # all offsets equal (one row, or a prefill): plain slicing
        self.kv_length = 0


class RaggedLayer(CacheLayerMixin):
    """One decoder layer's view of the shared buffer; ``update`` writes at the planned offsets."""

    def __init__(self, owner: "RaggedCache", index: int):
        super().__init__()
        # a weak reference: the cache owns its layers, and a cycle back to it would keep its
        # buffer (hundreds of MB at 16 rows) alive after the decoder is gone, until the collector runs
        self.owner, self.index = weakref.proxy(owner), index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner._allocate(key_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states [rows, nkv, T, d] -> the layer's keys and values [rows, nkv, kv_length, d]."""
        owner, plan = self.owner, self.owner.plan
        if owner.buffer is None:
            self.lazy_initialization(key_states, value_states)
        kv = owner.buffer[self.index]  # [2, slots, nkv, capacity, d]
        if key_states.shape[1:2] + key_states.shape[3:] != kv.shape[2:3] + kv.shape[4:]:
            raise ValueError(f"layer {self.index} gives keys {tuple(key_states.shape)}; the cache holds "
                             f"{tuple(kv.shape[2:3] + kv.shape[4:])} (nkv, d) per entry: every layer must agree")
        rows, t = kv[:, plan.rows], key_states.shape[2]
        if plan.single is not None:
            rows[0, :, :, plan.single:plan.single + t] = key_states
            rows[1, :, :, plan.single:plan.single + t] = value_states
        else:
            index = torch.arange(rows.shape[1], device=rows.device)[:, None]
            columns = plan.offsets[:, None] + torch.arange(t, device=rows.device)
            rows[0, index, :, columns] = key_states.transpose(1, 2).to(rows.dtype)
            rows[1, index, :, columns] = value_states.transpose(1, 2).to(rows.dtype)
        return rows[0, :, :, :plan.kv_length], rows[1, :, :, :plan.kv_length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.plan.kv_length, 0

    def get_seq_length(self) -> int:
        return self.owner.plan.kv_length

    def get_max_length(self) -> int:
        return -1


class RaggedCache(Cache):
    """KV cache of ``slots`` sequences with per-row lengths (``lengths``, host ints).

    Usage per forward: ``begin(rows, T)`` -> offsets; run the model with position ids
    ``offsets[:, None] + depth`` and a mask from :func:`ragged_mask`; then ``keep`` per row
    (or ``advance`` for a prefill). Rows are slots; a slot is freed by ``reset_row`` and
    reused, and ``move_row`` keeps the active rows contiguous."""

    def __init__(self, num_layers: int, slots: int, capacity: int = 256, device=None):
        self.plan = _Plan()
        super().__init__(layers=[RaggedLayer(self, i) for i in range(num_layers)])
        self.slots, self.capacity, self.device = slots, capacity, device
        self.lengths = [EMPTY] * slots
        self.buffer: torch.Tensor | None = None  # [layers, 2, slots, nkv, capacity, d]

    @classmethod
    def for_model(cls, model, slots: int, capacity: int = 256) -> "RaggedCache":
        """Every layer keeps every entry, sliding-window layers included: the window is the
        mask's to apply (:class:`.masks.MaskForm`), so entries never shift under the mask."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        layer_windows(config)  # refuses layer kinds a mask cannot express (recurrent, chunked)
        return cls(config.num_hidden_layers, slots, capacity, model.device)

    def _allocate(self, like: torch.Tensor) -> None:
        _, nkv, _, d = like.shape
        self.buffer = like.new_zeros(len(self.layers), 2, self.slots, nkv, self.capacity, d)

    def reserve(self, total: int) -> None:
        """Room for ``total`` entries per row (grown by doubling: amortised copies)."""
        if total <= self.capacity:
            return
        size = max(total, 2 * self.capacity)
        if self.buffer is not None:  # the old entries copied, only the new room zeroed: each page written once
            grown = self.buffer.new_empty(*self.buffer.shape[:4], size, self.buffer.shape[5])
            grown[..., :self.capacity, :] = self.buffer
            grown[..., self.capacity:, :].zero_()  # read under the mask: finite, never garbage
            self.buffer = grown
        self.capacity = size

    def begin(self, rows: slice, new_tokens: int) -> torch.Tensor:
        """Plan a forward of ``new_tokens`` per row over slots ``rows`` -> offsets [rows] (the
        row lengths: where the new entries go, and the first new position of each row)."""
        lengths = self.lengths[rows]
        longest = max(lengths) + new_tokens
        self.reserve(longest)
        plan = self.plan
        plan.rows, plan.kv_length = rows, longest
        plan.offsets = torch.tensor(lengths, dtype=torch.long, device=self.device)
        plan.lengths = list(lengths)
        plan.single = lengths[0] if len(set(lengths)) == 1 else None
        return plan.offsets

    def advance(self, row: int, count: int) -> None:
        """Row ``row`` keeps the first ``count`` entries it was just given."""
        self.lengths[row] += count

    def keep(self, rows: slice, kept: list[list[int]]) -> None:
        """After a tree forward over ``rows``: row i keeps the new entries ``kept[i]`` (offsets
        from its length, increasing), moved to follow its cached entries in order."""
        lengths = self.lengths[rows]
        if any(k != list(range(len(k))) for k in kept):  # not a prefix of the node order: gather
            width = max(len(k) for k in kept)
            device = self.device
            dst = torch.tensor([[n + j for j in range(width)] for n in lengths], device=device)
            src = torch.tensor([[n + (k[j] if j < len(k) else j) for j in range(width)]
                                for n, k in zip(lengths, kept)], device=device)
            index = torch.arange(len(kept), device=device)[:, None] + rows.start
            self.buffer[:, :, index, :, dst] = self.buffer[:, :, index, :, src]
        for i, k in enumerate(kept):
            self.lengths[rows.start + i] += len(k)

    def reset_row(self, row: int) -> None:
        self.lengths[row] = EMPTY

    def move_row(self, src: int, dst: int) -> None:
        """Slot ``src``'s entries to slot ``dst`` (to keep the active rows contiguous)."""
        n = self.lengths[src]
        if self.buffer is not None and n:
            self.buffer[:, :, dst, :, :n] = self.buffer[:, :, src, :, :n]
        self.lengths[dst], self.lengths[src] = n, EMPTY

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.plan.kv_length
