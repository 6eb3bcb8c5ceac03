"""Verify and accept, for a run of rows: ONE fused target forward, then each row its own path.

* :func:`verify_rows` — every row's tree in one target forward (rows padded to the same
  width, a ragged 4D mask, per-row position ids);
* :func:`accept_rows` — each row its own path (greedy, or rejection sampling with its own
  parameters and generator, :mod:`.sampling`), then both caches rolled to it and the
  draft's step 0 over the accepted tokens, in one forward, for the rows that drafted (the
  others keep them in their backlog until they draft again). A closing row (a recording
  decoder's finished answer, :attr:`..scheduling.batch.Row.closing`) keeps its root and
  takes the next forced token instead.

Each row's output is what the row decoded alone would give: the same acceptance rules
applied to its own logits, which a row's padding and the other rows never touch.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..drafting.state import extend_rows
from .masks import ragged_mask
from .sampling import accept_tree_sampling, warp_probs
from .target_step import ragged_forward
from ..token_tree import TokenTree, accept_greedy_tree


def verify_rows(batch, rows: slice, trees: list[TokenTree]) -> tuple[torch.Tensor, torch.Tensor]:
    """Score every row's tree in ONE target forward -> (logits [R, W, V], aux [R, W, k·H] or
    None); row i's node j at [i, j], padding after its last node."""
    device = batch.target.device
    width = max(len(tree) for tree in trees)
    tokens = torch.zeros(len(trees), width, dtype=torch.long)
    depths = torch.zeros(len(trees), width, dtype=torch.long)
    parents = torch.full((len(trees), width), -1, dtype=torch.long)
    for i, tree in enumerate(trees):
        tokens[i, :len(tree)] = torch.tensor(tree.tokens)
        depths[i, :len(tree)] = torch.tensor(tree.depths)
        parents[i, :len(tree)] = torch.tensor(tree.parents)
    offsets = batch.cache.begin(rows, width)
    mask = ragged_mask(offsets, parents, batch.cache.plan.kv_length)
    with batch.recorder.watching() if batch.recorder is not None else contextlib.nullcontext():
        return ragged_forward(batch.target, batch.capture, batch.cache, tokens.to(device), offsets[:, None] +
                              depths.to(device), mask)


def accept_rows(batch, rows: slice, trees: list[TokenTree], logits: torch.Tensor,
                aux: torch.Tensor | None) -> list[list[int]]:
    """Each row's accepted path and next token; both caches rolled to them -> new tokens per row."""
    active = batch.rows[rows]
    greedy = logits.argmax(-1).tolist() if any(row.request.sampling.greedy for row in active) else None
    paths, news = [], []
    for i, (row, tree) in enumerate(zip(active, trees)):
        params = row.request.sampling
        if row.closing is not None:  # a finished answer's closing: its root scored, the next token forced
            path, new = [0], row.closing[:1]
            del row.closing[:1]
        else:
            if params.greedy:
                path, bonus = accept_greedy_tree(tree, greedy[i])
            else:
                path, bonus = accept_tree_sampling(tree, warp_probs(logits[i, :len(tree)], params), row.generator)
            new = tree.path_tokens(path[1:]) + [bonus]
            row.estimates.update(tree, new)
        paths.append(path)
        news.append(new)
        if batch.recorder is not None:  # the accepted nodes' features (the root's token first)
            batch.recorder.keep(row.request, aux[i, path], batch.recorder.last[i, path], logits[i, path])
    batch.cache.keep(rows, paths)
    if batch.draft is not None:
        _extend_drafts(batch, rows, paths, news, aux)
    for row, new in zip(active, news):
        row.append(new)
    return news


def _extend_drafts(batch, rows: slice, paths: list[list[int]], news: list[list[int]], aux: torch.Tensor) -> None:
    """The draft's step 0 over every drafting row's accepted run (features at the path's
    nodes, each followed by the next accepted token), in one forward; the rows that did not
    draft keep theirs in their backlog."""
    width = max(len(p) for p in paths)
    index = torch.tensor([p + [0] * (width - len(p)) for p in paths], device=aux.device)
    following = torch.tensor([n + [0] * (width - len(n)) for n in news], device=aux.device)
    chosen = aux.gather(1, index[..., None].expand(-1, -1, aux.shape[-1]))
    state, active = batch.draft_state, batch.rows[rows]
    now = [row.drafted and not state.behind(slot) for slot, row in zip(range(rows.start, rows.stop), active)]
    state.defer(rows, chosen, following, [0 if n else len(p) for p, n in zip(paths, now)])
    if any(now):  # the forward spans the first to the last extending row only
        begin = time.perf_counter()
        first, last = now.index(True), len(now) - now[::-1].index(True)
        extend_rows(batch.draft, state, slice(rows.start + first, rows.start + last), chosen[first:last],
                    following[first:last], [len(p) if n else 0 for p, n in zip(paths[first:last], now[first:last])])
        batch.draft_seconds += time.perf_counter() - begin
