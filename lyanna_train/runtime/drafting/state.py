"""The draft's caches for many sequences at once: per-row lengths, pools and anchors, and step 0.

Anchor *t* of a row is the last position whose target features are known (the last
accepted token is x_{t+1}). The serving schedule is the one ``DraftHead.forward_unrolled``
trains on (``tests/runtime/test_draft_state.py`` checks the two agree):

* :func:`extend_rows` runs step 0 for newly accepted anchors of a run of rows, in one
  forward, each row with its own count: input ``fc(aux[a])`` with token x_{a+1} at
  position a. Its keys join the row's draft KV cache for good, its states (before
  fusion) join the row's pool, and the fused state of the last anchor is where the next
  tree starts (:mod:`.tree`).
* The pool must offer anchor t exactly the training window [t - size, t - 1]: the
  anchor's own step-0 state is therefore held back (``pending``) and pushed with the next
  chunk, so it never evicts position t - size while t is still drafting.

:class:`BatchDraftState` holds a row per sequence (a slot): the draft KV cache is
preallocated and written in place at each row's own length, every row has its own state
pool (a row of one :class:`StatePool`, never read by another row) and its own anchor. A
row that is not drafting keeps its new anchors in a backlog, caught up in one forward
when it drafts again (:func:`catch_up_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models.draft_head import DraftHead
from ...models.state_pool import EMPTY, StatePool


def grow_kv(keys: torch.Tensor, values: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, heads, slots, dim]`` buffers with room for ``total`` slots, grown by doubling
    (amortised: decoding reserves a few slots at a time)."""
    if total <= keys.shape[2]:
        return keys, values
    size = max(total, 2 * keys.shape[2])
    grow = keys.new_zeros(*keys.shape[:2], size - keys.shape[2], keys.shape[3])
    return torch.cat([keys, grow], dim=2), torch.cat([values, torch.zeros_like(grow)], dim=2)


def chunk_mask(starts: torch.Tensor, width: int, kv_length: int) -> torch.Tensor:
    """[rows, 1, width, kv_length] bool: row i's entry j (at slot starts[i] + j) sees the
    row's slots 0..starts[i] + j (its cache, then causal inside the chunk)."""
    last = starts[:, None, None] + torch.arange(width, device=starts.device)[None, :, None]
    return (torch.arange(kv_length, device=starts.device)[None, None, :] <= last)[:, None]


def forward_rows(draft: DraftHead, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
                 input_ids: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """The draft's serving forward for rows with their own write offsets: hidden [R, N, H],
    input_ids / positions [R, N], keys / values [R, nkv, capacity, d] (the rows' cache),
    row i's N new keys written in place at slots starts[i]..starts[i]+N-1, mask [R, 1, N, S]
    -> state before pool fusion [R, N, H]."""
    q, k, v = draft.midlayer.qkv(draft.embed(input_ids), hidden, positions)
    rows = torch.arange(k.shape[0], device=k.device)[:, None]
    columns = starts[:, None] + torch.arange(k.shape[2], device=k.device)
    keys[rows, :, columns] = k.transpose(1, 2).to(keys.dtype)
    values[rows, :, columns] = v.transpose(1, 2).to(values.dtype)
    s = mask.shape[-1]
    attn = draft.midlayer.self_attn.attend_cached(q, keys[:, :, :s], values[:, :, :s], mask)
    return draft.midlayer.finish(hidden, attn)


@dataclass
class RowView:
    """One row of a :class:`BatchDraftState` (what :func:`.pool_lookup.pool_continuation` reads)."""

    pool: StatePool | None
    pending: torch.Tensor | None  # [1, 1, H]
    anchor_pos: int


class BatchDraftState:
    """Draft KV cache, state pools and anchors of ``slots`` sequences, each with its own length."""

    def __init__(self, draft: DraftHead, slots: int, capacity: int = 256):
        cfg, weight = draft.cfg, draft.fc.weight
        self.keys = weight.new_zeros(slots, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.values = torch.zeros_like(self.keys)
        self.lengths = [0] * slots  # slots 0..length-1 of a row hold its accepted anchors' step-0 keys
        self.pool = (StatePool(slots, cfg.pool_size, cfg.hidden_size, dtype=weight.dtype, device=weight.device)
                     if draft.gate is not None else None)
        self.pending = weight.new_zeros(slots, 1, cfg.hidden_size)  # each row's anchor step-0 state, not pooled yet
        self.anchor_state = weight.new_zeros(slots, 1, cfg.hidden_size)  # its fused state: drafting's input
        self.anchor_pos = [-1] * slots
        # step-0 inputs not run yet, per row: (aux [n, k·H], next tokens [n]) chunks in order
        self.backlog: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(slots)]

    def defer(self, rows: slice, aux: torch.Tensor, next_tokens: torch.Tensor, counts: list[int]) -> None:
        """Keep rows' new anchors (as :func:`extend_rows` takes them) for a later catch-up
        (a count of 0 keeps nothing)."""
        for i, c in enumerate(counts):
            if c:
                self.backlog[rows.start + i].append((aux[i, :c], next_tokens[i, :c]))

    def behind(self, slot: int) -> bool:
        """Whether the row has anchors its caches do not hold yet."""
        return bool(self.backlog[slot])

    def waiting(self, slot: int) -> int:
        """How many anchors the row has waiting for their step 0."""
        return sum(int(t.shape[0]) for _, t in self.backlog[slot])

    def reserve(self, total: int) -> None:
        """Room for ``total`` slots per row (accepted plus scratch)."""
        self.keys, self.values = grow_kv(self.keys, self.values, total)

    def row(self, slot: int) -> RowView:
        pool = self.pool.rows(slice(slot, slot + 1)) if self.pool is not None else None
        pending = self.pending[slot:slot + 1] if self.anchor_pos[slot] >= 0 else None
        return RowView(pool, pending, self.anchor_pos[slot])

    def reset_row(self, slot: int) -> None:
        self.lengths[slot], self.anchor_pos[slot] = 0, -1
        self.backlog[slot] = []
        if self.pool is not None:
            self.pool.rows(slice(slot, slot + 1)).clear()

    def move_row(self, src: int, dst: int) -> None:
        """Slot ``src``'s cache, pool and anchor to slot ``dst`` (active rows stay contiguous)."""
        n = self.lengths[src]
        self.keys[dst, :, :n] = self.keys[src, :, :n]
        self.values[dst, :, :n] = self.values[src, :, :n]
        for t in (self.pending, self.anchor_state) + (self.pool.tensors() if self.pool is not None else ()):
            t[dst] = t[src]
        self.lengths[dst], self.anchor_pos[dst] = n, self.anchor_pos[src]
        self.backlog[dst] = self.backlog[src]
        self.reset_row(src)


def extend_rows(draft: DraftHead, state: BatchDraftState, rows: slice, aux: torch.Tensor, next_tokens: torch.Tensor,
                counts: list[int]) -> None:
    """Step 0 for the new anchors of rows ``rows``: row i has ``counts[i]`` of them (the rest
    of its N entries is padding), at positions from its length on.

    aux [R, N, k·H]: the target's features at those positions; next_tokens [R, N]: the
    token after each (already accepted). A row with no anchor yet (just admitted) starts
    its pool with this chunk; the others offer their held-back anchor to it first. A row
    may have 0 new anchors (it is left as it was)."""
    n = next_tokens.shape[1]
    device = next_tokens.device
    starts = torch.tensor(state.lengths[rows], device=device)
    count = torch.tensor(counts, device=device)
    valid = torch.arange(n, device=device)[None] < count[:, None]
    positions = starts[:, None] + torch.arange(n, device=device)
    state.reserve(int(starts.max()) + n)
    hidden = draft.fuse_features(aux)
    current = forward_rows(draft, state.keys[rows], state.values[rows], hidden, next_tokens, positions, starts,
                           chunk_mask(starts, n, int(starts.max()) + n))
    fused = current
    if state.pool is not None:
        fused = _pool_step(draft, state, rows, current, positions, valid, count)
    grown = (count > 0)[:, None, None]
    last = fused[torch.arange(len(counts), device=device), (count - 1).clamp(min=0)][:, None]
    state.anchor_state[rows] = torch.where(grown, last, state.anchor_state[rows])
    for i, c in enumerate(counts):
        if c:
            state.lengths[rows.start + i] += c
            state.anchor_pos[rows.start + i] = state.lengths[rows.start + i] - 1


ALONE = 16  # a backlog longer than this is caught up in a forward of its own row (no padding)


def catch_up_rows(draft: DraftHead, state: BatchDraftState, rows: slice, only: list[bool] | None = None) -> None:
    """Step 0 over every deferred anchor of rows ``rows`` (``only``: of the rows flagged).

    Short backlogs (a few iterations') run in one forward over the run of rows, every row
    padded to the longest (the other rows take part with 0 anchors and keep their backlog).
    A backlog past ``ALONE`` anchors (a prompt, a long plain stretch) runs in a forward of
    its row alone: padded beside it, 16 rows' prompts of 50-300 tokens cost ~20x their
    anchors and took ~0.5 s of a 64-token batch on 2 CPU cores."""
    flagged = [only is None or only[i] for i in range(rows.stop - rows.start)]
    counts = [state.waiting(rows.start + i) if f else 0 for i, f in enumerate(flagged)]
    for i, c in enumerate(counts):
        if c > ALONE:
            _catch_up_run(draft, state, slice(rows.start + i, rows.start + i + 1), [True])
            flagged[i] = False
    if any(f and c for f, c in zip(flagged, counts)):
        _catch_up_run(draft, state, rows, flagged)


def _catch_up_run(draft: DraftHead, state: BatchDraftState, rows: slice, flagged: list[bool]) -> None:
    backlogs = [b if f else [] for f, b in zip(flagged, state.backlog[rows])]
    chunks = [(torch.cat([a for a, _ in b]), torch.cat([t for _, t in b])) if b else None for b in backlogs]
    counts = [0 if c is None else c[1].shape[0] for c in chunks]
    first = next(c for c in chunks if c is not None)
    aux = first[0].new_zeros(len(chunks), max(counts), first[0].shape[-1])
    following = first[1].new_zeros(len(chunks), max(counts))
    for i, c in enumerate(chunks):
        if c is not None:
            aux[i, :counts[i]], following[i, :counts[i]] = c
    extend_rows(draft, state, rows, aux, following, counts)
    for i, f in enumerate(flagged):
        if f:
            state.backlog[rows.start + i] = []


def _pool_step(draft: DraftHead, state: BatchDraftState, rows: slice, current: torch.Tensor, positions: torch.Tensor,
               valid: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Retrieve and fuse for every new anchor (candidates: the row's pool, its held-back
    anchor and the chunk), then pool all but the chunk's last anchor, which is held back.
    A row with no anchor yet (joining) has no held-back one: its slot is empty."""
    pool = state.pool.rows(rows)
    started = torch.tensor([state.anchor_pos[r] >= 0 for r in range(rows.start, rows.stop)], device=count.device)
    push = valid & (torch.arange(valid.shape[1], device=valid.device)[None] < count[:, None] - 1)
    grown = count > 0
    extra = torch.cat([state.pending[rows], current], dim=1)
    held = torch.where(started, positions[:, 0] - 1, torch.full_like(positions[:, 0], EMPTY))
    extra_pos = torch.cat([held[:, None], positions.masked_fill(~valid, EMPTY)], dim=1)
    push = torch.cat([(grown & started)[:, None], push], dim=1)
    sim, retrieved = pool.retrieve(current, positions, extra, extra_pos)
    fused, _, _ = draft.pool_fuse(current, sim, retrieved)
    pool.push(extra, extra_pos, push)
    last = current[torch.arange(len(count), device=count.device), (count - 1).clamp(min=0)][:, None]
    state.pending[rows] = torch.where(grown[:, None, None], last, state.pending[rows])
    return fused
