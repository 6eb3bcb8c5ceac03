"""The draft's cache, pool and step 0 (:func:`draft_extend`); drafting is in :mod:`.draft_tree`.

Anchor *t* is the last position whose target features are known (the last accepted token
is x_{t+1}). The serving schedule is the one ``DraftHead.forward_unrolled`` trains on
(``tests/models/test_draft_head.py`` checks the two agree):

* :func:`draft_extend` runs step 0 for newly accepted anchors, in one chunk: input
  ``fc(aux[a])`` with token x_{a+1} at position a. Its keys join the draft KV cache for
  good, its states (before fusion) join the pool, and the fused state of the last anchor
  is where the next chain starts.
* :func:`.draft_tree.draft_tree` scores that state (-> x_{t+2}), then runs step j with
  the fused state of step j-1 and the drafted token at position t+j. Tree keys go to
  scratch slots after the cache and are forgotten by not advancing its length.

The pool must offer anchor t exactly the training window [t - size, t - 1]: the anchor's
own step-0 state is therefore held back (``pending``) and pushed with the next chunk, so
it never evicts position t - size while t is still drafting.
"""

from __future__ import annotations

import torch

from ..models.draft_head import DraftHead
from ..models.state_pool import StatePool


class DraftState:
    """Draft KV cache (step-0 keys of accepted anchors), state pool and current anchor.

    The cache is preallocated and grown by doubling; rows are sequences, but positions are
    shared, so only batch 1 is decoded today (accepted lengths differ between rows)."""

    def __init__(self, draft: DraftHead, batch: int = 1, capacity: int = 256):
        cfg = draft.cfg
        weight = draft.fc.weight
        self.keys = weight.new_zeros(batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.values = torch.zeros_like(self.keys)
        self.length = 0  # positions 0..length-1 hold step-0 keys of accepted anchors
        self.scratch = 0  # slots length..scratch-1 hold the keys of the tree being drafted
        self.pool = (StatePool(batch, cfg.pool_size, cfg.hidden_size, dtype=weight.dtype, device=weight.device)
                     if draft.gate is not None else None)
        self.pending: torch.Tensor | None = None  # [B, 1, H] step-0 state of the anchor, not pooled yet
        self.anchor_state: torch.Tensor | None = None  # [B, 1, H] its fused state: drafting's input
        self.anchor_pos = -1

    def reserve(self, total: int) -> None:
        """Make room for ``total`` positions (accepted plus scratch)."""
        self.keys, self.values = grow_kv(self.keys, self.values, total)



def grow_kv(keys: torch.Tensor, values: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, heads, slots, dim]`` buffers with room for ``total`` slots, grown by doubling
    (amortised: decoding reserves a few slots at a time)."""
    if total <= keys.shape[2]:
        return keys, values
    size = max(total, 2 * keys.shape[2])
    grow = keys.new_zeros(*keys.shape[:2], size - keys.shape[2], keys.shape[3])
    return torch.cat([keys, grow], dim=2), torch.cat([values, torch.zeros_like(grow)], dim=2)


def _chunk_mask(past: int, n: int, device) -> torch.Tensor:
    """[1, 1, n, past + n] bool: all cached positions, causal inside the chunk."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(n, past, dtype=torch.bool, device=device), causal], dim=1)[None, None]


def draft_extend(draft: DraftHead, state: DraftState, aux: torch.Tensor, next_tokens: torch.Tensor, start: int) -> None:
    """Step 0 for N new anchors at positions start..start+N-1 (right after the cached ones).

    aux [B, N, k·H]: the target's features at those positions; next_tokens [B, N]: the
    token after each (x_{a+1}, already accepted). Advances the cache and the anchor."""
    if start != state.length:
        raise ValueError(f"new anchors must start at {state.length}, not {start}")
    b, n = next_tokens.shape
    positions = torch.arange(start, start + n, device=next_tokens.device).expand(b, n)
    hidden = draft.fuse_features(aux)
    state.reserve(start + n)
    current = draft.forward_cached(hidden, next_tokens, positions, state.keys, state.values, start,
                                   _chunk_mask(start, n, hidden.device))
    state.length = start + n
    fused = current
    if state.pool is not None:
        # Candidates not pooled yet: the previous anchor (held back) and this chunk.
        extra, extra_pos = current, positions
        if state.pending is not None:
            extra = torch.cat([state.pending, current], dim=1)
            extra_pos = torch.cat([positions[:, :1] - 1, positions], dim=1)
        sim, retrieved = state.pool.retrieve(current, positions, extra, extra_pos)
        fused, _, _ = draft.pool_fuse(current, sim, retrieved)
        state.pool.push(extra[:, :-1], extra_pos[:, :-1])
        state.pending = current[:, -1:]
    state.anchor_state, state.anchor_pos = fused[:, -1:], start + n - 1
