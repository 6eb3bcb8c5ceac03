"""One iteration of batched speculative decoding, in small named steps over a run of rows.

Rows are the slots of the runtime's caches (:class:`.ragged_cache.RaggedCache` for the
target, :class:`.batch_draft_step.BatchDraftState` for the draft), one sequence each:

* :func:`prefill_row` — a joining sequence: the target over its prompt into its slot,
  its first token, the draft's step 0 over the prompt (its pool starts empty);
* :func:`propose_rows` — every row's candidate tree: the draft's (one draft forward per
  level for all rows), prompt lookup's and the row's own pool's continuations;
* :func:`fit_trees` — ``verify: auto`` picks the tokens per row of the fused forward
  knowing how many rows share it (:func:`.cost.best_width`), and no node passes the
  target's context;
* :func:`verify_rows` — every row's tree in ONE target forward (rows padded to the same
  width, a ragged 4D mask, per-row position ids);
* :func:`accept_rows` — each row its own path (greedy or rejection sampling with its own
  parameters and generator), then both caches rolled to it, the draft's step 0 for all
  rows in one forward (deferred while drafting is backed off).

Each row's output is what the row decoded alone would give: the same acceptance rules
(:mod:`.tree`, :mod:`.sampling`) applied to its own logits, which a row's padding and the
other rows never touch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.draft_head import DraftHead
from .batch_draft_step import BatchDraftState, catch_up_rows, chunk_mask, extend_rows
from .batch_draft_tree import draft_trees
from .cost import AcceptanceEstimates, VerifyCost, best_width
from .decode import DecodeSettings, add_free_candidates
from .masks import ragged_mask
from .ragged_cache import RaggedCache
from .requests import Request
from .sampling import accept_tree_sampling, warp_probs
from .target_step import ragged_forward
from .tree import TokenTree, accept_greedy_tree


@dataclass(eq=False)
class Row:
    """A running request's decoding state outside the shared caches."""

    request: Request
    context: torch.Tensor  # [capacity] ids x_0..x_{n-1} (prompt included) in the first n slots
    length: int  # n
    generator: torch.Generator
    estimates: AcceptanceEstimates = field(default_factory=AcceptanceEstimates)

    @property
    def last_token(self) -> int:
        return int(self.context[self.length - 1])

    def append(self, tokens: list[int]) -> None:
        end = self.length + len(tokens)
        if end > self.context.shape[0]:
            self.context = torch.cat([self.context, self.context.new_zeros(end)])
        self.context[self.length:end] = torch.tensor(tokens, dtype=torch.long)
        self.length = end


@dataclass
class DraftBackoff:
    """Stop drafting while it does not pay. Under ``verify: auto`` a fused forward over many
    rows can price every extra token above what the head's candidates are worth (on 2 CPU
    cores at batch 8 the fitted width was 1 in every iteration): the draft tree is then pure
    overhead. After a verify that took nothing but the roots of drafted trees, the next
    ``wait`` iterations propose without the draft tree (lookup and pool candidates still
    come: they are free), then it drafts again; ``wait`` doubles up to ``most`` while drafting
    keeps not paying and drops to 0 once it does. Meanwhile the draft's step 0 over accepted
    tokens waits in each row's backlog and runs as one forward when it drafts again (on 2
    CPU cores at batch 8 a step 0 per iteration cost ~15 % of the throughput); the rows'
    pool candidates pause with it."""

    most: int  # 0: draft every iteration
    wait: int = 0
    skip: int = 0  # iterations left without the draft tree
    drafted: bool = False  # whether the trees being verified hold draft candidates

    @property
    def deferring(self) -> bool:
        """Whether the next proposal skips the draft tree."""
        return self.skip > 0

    def draft_now(self) -> bool:
        self.drafted = self.skip == 0
        self.skip = max(self.skip - 1, 0)
        return self.drafted

    def observe(self, fitted: list[TokenTree]) -> None:
        """After fitting drafted trees to the verify budget: did any row verify a candidate?"""
        if not self.drafted or not fitted:
            return
        if max(len(tree) for tree in fitted) > 1:
            self.wait = 0
        elif self.most:
            self.wait = min(max(1, 2 * self.wait), self.most)
            self.skip = self.wait


@dataclass(eq=False)
class Batch:
    """The models and caches every row shares; row i of ``rows`` lives in slot i."""

    target: torch.nn.Module
    draft: DraftHead | None
    capture: object  # LayerCapture, None without a draft
    cache: RaggedCache
    draft_state: BatchDraftState | None
    settings: DecodeSettings
    cost: VerifyCost
    max_positions: int | None  # the target's context (None: unbounded)
    rows: list[Row] = field(default_factory=list)
    backoff: DraftBackoff = field(default_factory=lambda: DraftBackoff(0))


def _next_token(logits: torch.Tensor, row: Row) -> int:
    params = row.request.sampling
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(warp_probs(logits, params), 1, generator=row.generator))


def prefill_row(batch: Batch, slot: int, row: Row) -> int:
    """Fill slot ``slot`` with ``row``'s prompt (x_0..x_{P-1}) -> its first new token x_P."""
    device = batch.target.device
    prompt = row.context[:row.length].to(device)[None]
    p = prompt.shape[1]
    batch.cache.reset_row(slot)
    offsets = batch.cache.begin(slice(slot, slot + 1), p)
    logits, aux = ragged_forward(batch.target, batch.capture, batch.cache, prompt, torch.arange(p, device=device)[None],
                                 chunk_mask(offsets, p, p), logits_to_keep=1)
    batch.cache.advance(slot, p)
    first = _next_token(logits[0, -1], row)
    if batch.draft is not None:
        batch.draft_state.reset_row(slot)
        following = torch.cat([prompt[:, 1:], torch.tensor([[first]], device=device)], dim=1)
        extend_rows(batch.draft, batch.draft_state, slice(slot, slot + 1), aux, following, [p])
    return first


def propose_rows(batch: Batch, rows: slice) -> list[TokenTree]:
    """Every row's candidates, as a tree below its last accepted token (the draft's part
    unless :class:`DraftBackoff` says it has not been paying)."""
    active = batch.rows[rows]
    trees = [TokenTree.rooted_at(row.last_token) for row in active]
    settings, draft = batch.settings, batch.draft
    if draft is not None and batch.backoff.draft_now():
        catch_up_rows(draft, batch.draft_state, rows)
        drafted = draft_trees(draft, batch.draft_state, rows, trees, settings.tree)
        for row, tree, nodes in zip(active, trees, drafted):
            row.estimates.calibrate_draft(tree, nodes)
    for slot, row, tree in zip(range(rows.start, rows.stop), active, trees):
        current = draft is not None and not batch.draft_state.behind(slot)  # a pool behind its row has no candidates
        add_free_candidates(tree, row.context, row.length, settings.lookup, row.estimates,
                            batch.draft_state.row(slot) if current else None,
                            draft.cfg.pool_threshold if draft is not None else 0.0)
    return trees


def fit_trees(batch: Batch, rows: list[Row], trees: list[TokenTree], shallow_first: bool = False) -> list[TokenTree]:
    """The nodes each row verifies: under ``verify: auto`` the best W - 1 of every row, W
    chosen for the whole fused forward; never a node past the target's context."""
    if batch.max_positions is not None:  # node at depth d sits at position length - 1 + d
        trees = [_within_depth(tree, batch.max_positions - row.length) for row, tree in zip(rows, trees)]
    if batch.settings.verify != "auto":
        return trees
    ranked = [tree.ranked(shallow_first) for tree in trees]
    width = best_width([[tree.probs[n] for n in order] for tree, order in zip(trees, ranked)], batch.cost)
    return [tree.best(width - 1, shallow_first) for tree in trees]


def _within_depth(tree: TokenTree, depth: int) -> TokenTree:
    if max(tree.depths) <= depth:
        return tree
    out = TokenTree.rooted_at(tree.tokens[0])
    new = {0: 0}
    for n in range(1, len(tree)):  # parents come first
        if tree.depths[n] <= depth:
            new[n] = out.add(new[tree.parents[n]], tree.tokens[n], tree.probs[n])
    return out


def verify_rows(batch: Batch, rows: slice, trees: list[TokenTree]) -> tuple[torch.Tensor, torch.Tensor]:
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
    return ragged_forward(batch.target, batch.capture, batch.cache, tokens.to(device), offsets[:, None] +
                          depths.to(device), mask)


def accept_rows(batch: Batch, rows: slice, trees: list[TokenTree], logits: torch.Tensor,
                aux: torch.Tensor | None) -> list[list[int]]:
    """Each row's accepted path and next token; both caches rolled to them -> new tokens per row."""
    active = batch.rows[rows]
    greedy = logits.argmax(-1).tolist() if any(row.request.sampling.greedy for row in active) else None
    paths, news = [], []
    for i, (row, tree) in enumerate(zip(active, trees)):
        params = row.request.sampling
        if params.greedy:
            path, bonus = accept_greedy_tree(tree, greedy[i])
        else:
            path, bonus = accept_tree_sampling(tree, warp_probs(logits[i, :len(tree)], params), row.generator)
        new = tree.path_tokens(path[1:]) + [bonus]
        row.estimates.update(tree, new)
        paths.append(path)
        news.append(new)
    batch.cache.keep(rows, paths)
    if batch.draft is not None:
        _extend_drafts(batch, rows, paths, news, aux)
    for row, new in zip(active, news):
        row.append(new)
    return news


def _extend_drafts(batch: Batch, rows: slice, paths: list[list[int]], news: list[list[int]], aux: torch.Tensor) -> None:
    """The draft's step 0 over every row's accepted run (features at the path's nodes,
    each followed by the next accepted token), in one forward; kept in the rows' backlog
    instead while the next proposal will not draft."""
    width = max(len(p) for p in paths)
    index = torch.tensor([p + [0] * (width - len(p)) for p in paths], device=aux.device)
    following = torch.tensor([n + [0] * (width - len(n)) for n in news], device=aux.device)
    chosen = aux.gather(1, index[..., None].expand(-1, -1, aux.shape[-1]))
    counts, state = [len(p) for p in paths], batch.draft_state
    if batch.backoff.deferring or any(state.behind(slot) for slot in range(rows.start, rows.stop)):
        state.defer(rows, chosen, following, counts)
        if not batch.backoff.deferring:
            catch_up_rows(batch.draft, state, rows)
    else:
        extend_rows(batch.draft, state, rows, chosen, following, counts)
