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


def best_match(queries: torch.Tensor, pool: torch.Tensor, allowed: torch.Tensor):
    """queries [B, Q, H], pool [B, S, H], allowed [B|1, Q, S] bool ->
    (similarity [B, Q], retrieved [B, Q, H]); similarity is -inf where nothing is allowed."""
    sims = F.normalize(queries.float(), dim=-1) @ F.normalize(pool.float(), dim=-1).transpose(1, 2)
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
        self.positions = torch.full((batch, size), EMPTY, dtype=torch.int64, device=device)  # empty slots
        self.count = torch.zeros(batch, dtype=torch.int64, device=device)  # states ever pushed

    def rows(self, index: slice) -> "StatePool":
        """The pool of sequences ``index`` (a slice): a view, so pushes write through."""
        view = object.__new__(StatePool)
        view.size, view.states, view.positions, view.count = \
            self.size, self.states[index], self.positions[index], self.count[index]
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
        self.positions[rows[keep], slots[keep]] = positions[keep]
        self.count += valid.long().sum(1)

    def retrieve(self, queries: torch.Tensor, anchors: torch.Tensor,
                 extra_states: torch.Tensor | None = None, extra_positions: torch.Tensor | None = None):
        """queries [B, Q, H] at anchor positions [B, Q] -> (similarity [B, Q], retrieved [B, Q, H]).

        ``extra_*`` [B, N, ...] are candidates not pushed yet (the current chunk)."""
        states, positions = self.states, self.positions
        if extra_states is not None:
            states = torch.cat([states, extra_states.to(states.dtype)], dim=1)
            positions = torch.cat([positions, extra_positions], dim=1)
        return best_match(queries, states, self.window(anchors, positions))

    def window(self, anchors: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """anchors [B, Q] -> [B, Q, S] bool: the slots each anchor may retrieve from,
        positions [anchor - size, anchor - 1] (``positions`` [B, S]: the pool's own by default)."""
        positions = self.positions if positions is None else positions
        delta = anchors[:, :, None] - positions[:, None, :]
        return (delta >= 1) & (delta <= self.size)
