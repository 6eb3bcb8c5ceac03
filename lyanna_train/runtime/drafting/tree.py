"""Draft a token tree per row for a set of rows, each level of every row in one draft forward.

EAGLE-2's expand-then-rerank with static widths (:class:`..settings.TreeShape`): level 1
scores each row's anchor state (its fused step-0 state): its top-``branch`` tokens are
the root's children. Each further level runs the draft once over the ``beam`` best nodes
of every row (best = highest cumulative draft log-probability; a row with fewer worth
expanding is padded), node i of level l of row r writing its keys to the row's scratch
slot ``length[r] + (l - 2)·beam + i`` and seeing the row's cache and its own ancestors
only; its state is fused with the row's own pool (retrieval by the row's anchor window, as
in training), and all nodes are scored in one matrix product over the hot vocabulary.
Finally the ``max_nodes`` best candidates of all levels form each row's tree; a node's
ancestors always score at least as well, so the selection is a tree. With ``branch = beam
= 1`` this is chain drafting. Each node carries its cumulative draft probability, the
runtime's estimate of its chance to be accepted (EAGLE-2's observation: a draft's
confidence tracks acceptance). Scratch keys are forgotten by not advancing the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...models.draft_head import DraftHead
from ..kernels import hot_head_topk, pool_fusion
from ..settings import TreeShape
from ..token_tree import TokenTree
from .state import BatchDraftState, forward_rows


@dataclass
class Candidate:
    parent: int  # index into the candidate list, -1 for the root
    token: int  # target id
    score: float  # cumulative draft log-probability
    depth: int


def score_top(draft: DraftHead, fused: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fused [N, H] -> top-k (draft log-probabilities [N, k], target ids [N, k]) over the
    hot vocabulary: one fused norm + matrix product + top-k for every node of a level
    (the Triton kernel on a GPU, its torch reference elsewhere). The optional "other"
    bucket is not a token: it is neither proposed nor part of the normaliser."""
    vocab = draft.cfg.draft_vocab_size
    top, index, lse = hot_head_topk(fused, draft.norm.weight, draft.norm.variance_epsilon,
                                    draft.lm_head.weight[:vocab], min(k, vocab))
    return top - lse[:, None], draft.draft_to_target(index)


def expandable(cands: list[Candidate], level: list[int], beam: int, floor: float) -> list[int]:
    """The ``beam`` best candidates of a level worth a draft forward (score >= ``floor``)."""
    return [c for c in sorted(level, key=lambda c: -cands[c].score)[:beam] if cands[c].score >= floor]


def add_best(tree: TokenTree, cands: list[Candidate], max_nodes: int) -> list[int]:
    """Add the ``max_nodes`` best candidates (by cumulative draft log-probability) below the
    root of ``tree``, each with its probability -> the new nodes."""
    best = sorted(range(len(cands)), key=lambda c: -cands[c].score)[:max_nodes]
    keep = {a for c in best for a in lineage(cands, c)}  # ties could leave out an ancestor: put it back
    node_of: dict[int, int] = {}
    for c in sorted(keep, key=lambda c: (cands[c].depth, -cands[c].score)):
        parent = cands[c].parent
        node_of[c] = tree.add(0 if parent < 0 else node_of[parent], cands[c].token, math.exp(cands[c].score))
    return list(node_of.values())


def lineage(cands: list[Candidate], c: int) -> list[int]:
    """Candidates from the top level down to ``c`` (empty for the root, -1)."""
    out = []
    while c >= 0:
        out.append(c)
        c = cands[c].parent
    return out[::-1]


def add_children(cands: list[Candidate], parents: list[int], scores: list[float], depths: list[int],
                 logp: list[list[float]], ids: list[list[int]]) -> list[int]:
    """Append the scored children [P][k] of each parent -> their candidate indices."""
    added = []
    for row, (parent, score, depth) in enumerate(zip(parents, scores, depths)):
        for lp, token in zip(logp[row], ids[row]):
            cands.append(Candidate(parent, token, score + lp, depth + 1))
            added.append(len(cands) - 1)
    return added


def draft_trees(draft: DraftHead, state: BatchDraftState, rows: slice, trees: list[TokenTree | None],
                shape: TreeShape) -> list[list[int]]:
    """Add each row's best ``shape.max_nodes`` candidates below the root of its tree in
    ``trees`` (one per row of ``rows``; None: a row between drafting rows that does not
    draft, carried through the forwards as padding and left untouched); leaves the caches
    and pools as they were -> each row's new nodes."""
    if shape.depth == 0 or shape.max_nodes == 0:
        return [[] for _ in trees]
    n_rows = len(trees)
    state.reserve(max(state.lengths[rows]) + shape.beam * max(shape.depth - 1, 0))
    roots = state.anchor_state[rows][:, 0]  # [R, H]
    cands: list[list[Candidate]] = [[] for _ in trees]
    fused_of: list[dict[int, torch.Tensor]] = [{} for _ in trees]  # expanded candidate -> fused state [H]
    slot_of: list[dict[int, int]] = [{} for _ in trees]  # expanded candidate -> its scratch slot
    logp, ids = score_top(draft, roots, shape.branch)
    logp, ids = logp.tolist(), ids.tolist()
    levels = [add_children(cands[r], [-1], [0.0], [0], logp[r:r + 1], ids[r:r + 1]) if trees[r] is not None else []
              for r in range(n_rows)]
    floor = math.log(shape.min_prob) if shape.min_prob > 0 else -math.inf
    for level in range(2, shape.depth + 1):
        chosen = [expandable(cands[r], levels[r], shape.beam, floor) for r in range(n_rows)]
        if not any(chosen):  # nothing this unlikely is worth a draft forward, let alone verifying
            break
        fused = _expand(draft, state, rows, roots, cands, chosen, fused_of, slot_of, shape.beam, level)
        logp, ids = score_top(draft, fused.reshape(-1, fused.shape[-1]), shape.branch)
        logp, ids = logp.view(n_rows, shape.beam, -1).tolist(), ids.view(n_rows, shape.beam, -1).tolist()
        levels = [add_children(cands[r], chosen[r], [cands[r][c].score for c in chosen[r]],
                               [cands[r][c].depth for c in chosen[r]], logp[r], ids[r]) for r in range(n_rows)]
    return [add_best(tree, cands[r], shape.max_nodes) if tree is not None else [] for r, tree in enumerate(trees)]


def _expand(draft: DraftHead, state: BatchDraftState, rows: slice, roots: torch.Tensor,
            cands: list[list[Candidate]], chosen: list[list[int]], fused_of: list[dict], slot_of: list[dict],
            beam: int, level: int) -> torch.Tensor:
    """Run the draft over every row's chosen nodes of one level (padded to ``beam``) -> their
    fused states [R, beam, H]; records each node's fused state and scratch slot."""
    n_rows, device = len(chosen), roots.device
    lengths = state.lengths[rows]
    first = [n + (level - 2) * beam for n in lengths]  # this level's scratch slots in each row
    parents, tokens, depths = [], [], []
    mask = torch.zeros(n_rows, 1, beam, max(first) + beam, dtype=torch.bool)
    for r in range(n_rows):
        mask[r, 0, :, :lengths[r]] = True
        for i in range(beam):
            mask[r, 0, i, first[r] + i] = True
            if i >= len(chosen[r]):  # padding: the row's anchor state, token 0, seen by nobody
                parents.append(roots[r])
                tokens.append(0)
                depths.append(1)
                continue
            c = chosen[r][i]
            p = cands[r][c].parent
            parents.append(roots[r] if p < 0 else fused_of[r][p])
            tokens.append(cands[r][c].token)
            depths.append(cands[r][c].depth)
            mask[r, 0, i, [slot_of[r][a] for a in lineage(cands[r], p)]] = True
    ids = torch.tensor(tokens, device=device).view(n_rows, beam)
    anchors = torch.tensor(state.anchor_pos[rows], device=device)
    positions = anchors[:, None] + torch.tensor(depths, device=device).view(n_rows, beam)
    current = forward_rows(draft, state.keys[rows], state.values[rows], draft.carry(torch.stack(parents)).view(
        n_rows, beam, -1), ids, positions, torch.tensor(first, device=device), mask.to(device))
    fused = current if state.pool is None else _pool_fuse_rows(draft, state, rows, current, anchors)
    for r in range(n_rows):
        for i, c in enumerate(chosen[r]):
            slot_of[r][c], fused_of[r][c] = first[r] + i, fused[r, i]
    return fused


def _pool_fuse_rows(draft: DraftHead, state: BatchDraftState, rows: slice, current: torch.Tensor,
                    anchors: torch.Tensor) -> torch.Tensor:
    """current [R, N, H] -> fused [R, N, H]: each node against its own row's pool, in the
    window of the row's anchor (one kernel call for all nodes on a GPU; each row's pool read in place)."""
    pool, gate = state.pool.rows(rows), draft.gate
    allowed = pool.window(anchors[:, None])[:, 0]  # [R, S]
    fused, _, _, _ = pool_fusion(current, pool.states, allowed, draft.cfg.pool_threshold, gate.proj.weight,
                                 gate.proj.bias, gate.out.weight, gate.out.bias, gate.alpha_max, pool_units=pool.units)
    return fused
