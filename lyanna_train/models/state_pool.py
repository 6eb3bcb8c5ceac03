"""The hidden-state pool and its retrieval, shared by training and serving.

The pool holds the draft's step-0 states (computed from the target's own features) of
the most recent ``pool_size`` positions before the current anchor. Retrieval returns,
for each query state, the pooled state with the highest cosine similarity; it is used
only when that similarity reaches the threshold (0.85 by default).

Training retrieves for a whole sequence at once (:func:`retrieve_causal`: anchor *t*
sees positions ``[t - pool_size, t - 1]``); serving keeps a :class:`StatePool` ring
buffer per sequence. Both reduce to :func:`best_match`, so they agree exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EMPTY = -(2**62)  # the position of an empty slot: outside every anchor's window


def unit(states: torch.Tensor) -> torch.Tensor:
    """The states as fp32 unit vectors: what cosine similarity compares."""
    return F.normalize(states.float(), dim=-1)


def best_match(queries: torch.Tensor, pool: torch.Tensor, allowed: torch.Tensor, pool_units: torch.Tensor | None = None):
    """queries [B, Q, H], pool [B, S, H], allowed [B|1, Q, S] bool ->
    (similarity [B, Q], retrieved [B, Q, H]); similarity is -inf where nothing is allowed.
    ``pool_units``: ``unit(pool)`` when the caller keeps it (a serving pool does)."""
    sims = unit(queries) @ (unit(pool) if pool_units is None else pool_units).transpose(1, 2)
    sims = sims.masked_fill(~allowed, float("-inf"))
    best, index = sims.max(dim=-1)
    retrieved = torch.gather(pool, 1, index.unsqueeze(-1).expand(-1, -1, pool.shape[-1]))
    return best, retrieved


def window_mask(length: int, window: int, device=None) -> torch.Tensor:
    """[T, T] bool: anchor t may retrieve position s iff t - window <= s < t."""
    t = torch.arange(length, device=device)
    delta = t[:, None] - t[None, :]
    return (delta >= 1) & (delta <= window)


def retrieve_causal(queries: torch.Tensor, step0: torch.Tensor, window: int, valid: torch.Tensor | None = None):
    """Training retrieval: queries [B, T, H] (any unroll step, anchors aligned with ``step0``)
    against the step-0 states [B, T, H] of earlier positions within ``window``.
    ``valid`` [B, T] masks padding out of the pool."""
    allowed = window_mask(queries.shape[1], window, queries.device).unsqueeze(0)
    if valid is not None:
        allowed = allowed & valid[:, None, :]
    return best_match(queries, step0, allowed)


class StatePool:
    """Serving-side ring buffer of step-0 states (and their positions) for ``batch`` sequences.

    Retrieval for an anchor at position *p* sees pooled positions ``[p - size, p - 1]``,
    exactly the training window; new states can be offered alongside the pool (a chunk of
    just-accepted positions) so every anchor in the chunk sees its full window before the
    chunk is pushed and evicts the oldest entries.
    """

    def __init__(self, batch: int, size: int, hidden: int, dtype=torch.float32, device=None):
        self.size = size
        self.states = torch.zeros(batch, size, hidden, dtype=dtype, device=device)
        # unit(states), kept up to date on push: every retrieval compares against the whole
        # pool, and normalising it each time cost more than the comparison itself
        self.units = torch.zeros(batch, size, hidden, dtype=torch.float32, device=device)
        self.positions = torch.full((batch, size), EMPTY, dtype=torch.int64, device=device)  # empty slots
        self.count = torch.zeros(batch, dtype=torch.int64, device=device)  # states ever pushed

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Everything indexed by sequence (what moving a sequence to another slot copies)."""
        return self.states, self.units, self.positions, self.count

    def rows(self, index: slice) -> "StatePool":
        """The pool of sequences ``index`` (a slice): a view, so pushes write through."""
        view = object.__new__(StatePool)
        view.size = self.size
        view.states, view.units, view.positions, view.count = (t[index] for t in self.tensors())
        return view

    def clear(self) -> None:
        """Forget every state (a sequence's slot is being reused)."""
        self.positions.fill_(EMPTY)
        self.count.zero_()

    def push(self, states: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Append states [B, N, H] at positions [B, N] (``valid`` [B, N] bool), oldest evicted."""
        valid = torch.ones(positions.shape, dtype=torch.bool, device=positions.device) if valid is None else valid
        offsets = torch.cumsum(valid.long(), dim=1) - 1  # rank of each valid entry in its row
        slots = (self.count[:, None] + offsets) % self.size
        rows = torch.arange(states.shape[0], device=states.device)[:, None].expand_as(slots)
        keep = valid & (offsets >= valid.long().sum(1, keepdim=True) - self.size)  # last `size` of the chunk
        self.states[rows[keep], slots[keep]] = states[keep].to(self.states.dtype)
        self.units[rows[keep], slots[keep]] = unit(self.states[rows[keep], slots[keep]])
        self.positions[rows[keep], slots[keep]] = positions[keep]
        self.count += valid.long().sum(1)

    def retrieve(self, queries: torch.Tensor, anchors: torch.Tensor,
                 extra_states: torch.Tensor | None = None, extra_positions: torch.Tensor | None = None):
        """queries [B, Q, H] at anchor positions [B, Q] -> (similarity [B, Q], retrieved [B, Q, H]).

        ``extra_*`` [B, N, ...] are candidates not pushed yet (the current chunk)."""
        if extra_states is None:
            return best_match(queries, self.states, self.window(anchors), self.units)
        extra_states = extra_states.to(self.states.dtype)
        sim, retrieved = best_match(queries, self.states, self.window(anchors), self.units)
        sim_x, retrieved_x = best_match(queries, extra_states, self.window(anchors, extra_positions))
        take = sim_x > sim  # strict: the pool's slot wins a tie, as it comes first in the concatenation
        return torch.where(take, sim_x, sim), torch.where(take[..., None], retrieved_x, retrieved)

    def most_similar(self, query: torch.Tensor, anchor: int) -> tuple[float, int]:
        """query [H] at position ``anchor`` of sequence 0 -> (cosine similarity, position) of
        its most similar pooled state in the window; (-inf, EMPTY) when the window is empty."""
        allowed = self.window(torch.tensor([[anchor]], device=self.positions.device))[0, 0]
        sims = (self.units[0] @ unit(query)).masked_fill(~allowed, float("-inf"))
        best = int(sims.argmax())
        sim = float(sims[best])
        return sim, int(self.positions[0, best]) if sim > float("-inf") else EMPTY

    def window(self, anchors: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """anchors [B, Q] -> [B, Q, S] bool: the slots each anchor may retrieve from,
        positions [anchor - size, anchor - 1] (``positions`` [B, S]: the pool's own by default)."""
        positions = self.positions if positions is None else positions
        delta = anchors[:, :, None] - positions[:, None, :]
        return (delta >= 1) & (delta <= self.size)
