"""Draft a token tree with the draft head (EAGLE-2's expand-then-rerank, static widths).

Level 1 scores the anchor's fused state: its top-``branch`` tokens are the root's
children. Each further level runs the draft once over the ``beam`` best nodes of the
previous level (best = highest cumulative draft log-probability), each attending to the
accepted cache and to its own ancestors' scratch keys, fuses with the pool, and scores
all of them in one matrix product over the hot vocabulary. Finally the ``max_nodes``
best candidates of all levels form the tree; a node's ancestors always score at least as
well, so the selection is a tree. With ``branch = beam = 1`` this is chain drafting.
Each node carries its cumulative draft probability, the runtime's estimate of its
chance to be accepted (EAGLE-2's observation: a draft's confidence tracks acceptance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..models.draft_head import DraftHead
from .draft_step import DraftState
from .kernels import hot_head_topk, pool_fusion
from .tree import TokenTree


@dataclass(frozen=True)
class TreeShape:
    depth: int = 5  # levels below the root
    branch: int = 1  # children scored per expanded node (top-k)
    beam: int = 1  # nodes expanded per level
    max_nodes: int = 5  # drafted nodes kept (the root excluded)
    min_prob: float = 0.0  # stop drafting deeper once no node of a level is this likely

    def __post_init__(self):
        if self.depth < 0 or self.branch < 1 or self.beam < 1 or self.max_nodes < 0 or not 0 <= self.min_prob < 1:
            raise ValueError(f"need depth >= 0, branch >= 1, beam >= 1, max_nodes >= 0, min_prob in [0, 1), got {self}")


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


def pool_fuse_serving(draft: DraftHead, state: DraftState, current: torch.Tensor) -> torch.Tensor:
    """current [N, H] (tree nodes of one sequence, all drafting from the anchor) -> fused
    [N, H]: retrieval from the anchor's pool window and α-fusion in one kernel on a GPU."""
    pool, gate = state.pool, draft.gate
    allowed = pool.window(torch.full((1, 1), state.anchor_pos, device=current.device))[:, 0]  # [1, S]
    fused, _, _, _ = pool_fusion(current[None], pool.states, allowed, draft.cfg.pool_threshold, gate.proj.weight,
                                 gate.proj.bias, gate.out.weight, gate.out.bias, gate.alpha_max, pool_units=pool.units)
    return fused[0]


def _expand(draft: DraftHead, state: DraftState, parent_states: torch.Tensor, tokens: list[int], depths: list[int],
            ancestor_slots: list[list[int]]) -> torch.Tensor:
    """Run the draft over N tree nodes (one level) -> their fused states [N, H].

    Their keys go to scratch slots after everything cached so far, which the cache length
    does not cover: the next extension overwrites them."""
    n, first = len(tokens), state.scratch
    device = parent_states.device
    ids = torch.tensor([tokens], device=device)
    positions = state.anchor_pos + torch.tensor([depths], device=device)
    mask = torch.zeros(1, 1, n, first + n, dtype=torch.bool, device=device)
    mask[..., : state.length] = True
    for i, slots in enumerate(ancestor_slots):
        mask[0, 0, i, slots] = True
        mask[0, 0, i, first + i] = True
    state.reserve(first + n)
    current = draft.forward_cached(draft.carry(parent_states[None]), ids, positions, state.keys, state.values, first,
                                   mask)
    state.scratch = first + n
    if state.pool is None:
        return current[0]
    return pool_fuse_serving(draft, state, current[0])  # retrieval by anchor position, as in training


def draft_tree(draft: DraftHead, state: DraftState, tree: TokenTree, shape: TreeShape) -> list[int]:
    """Add the draft's best ``shape.max_nodes`` candidates below the root of ``tree``.

    Leaves the draft's cache and pool as they were. Returns the new nodes."""
    if shape.depth == 0 or shape.max_nodes == 0:
        return []
    state.scratch = state.length
    state.reserve(state.length + shape.beam * shape.depth)
    root_state = state.anchor_state[0, 0]
    cands: list[Candidate] = []
    slot_of: dict[int, int] = {}  # expanded candidate -> its scratch slot
    fused_of: dict[int, torch.Tensor] = {}  # expanded candidate -> its fused state [H]
    logp, ids = score_top(draft, state.anchor_state[0], shape.branch)
    level = add_children(cands, [-1], [0.0], [0], logp.tolist(), ids.tolist())
    floor = math.log(shape.min_prob) if shape.min_prob > 0 else -math.inf
    for _ in range(2, shape.depth + 1):
        chosen = expandable(cands, level, shape.beam, floor)
        if not chosen:  # nothing this unlikely is worth a draft forward, let alone verifying
            break
        parents = [cands[c].parent for c in chosen]
        first = state.scratch
        fused = _expand(draft, state, torch.stack([root_state if p < 0 else fused_of[p] for p in parents]),
                        [cands[c].token for c in chosen], [cands[c].depth for c in chosen],
                        [[slot_of[a] for a in lineage(cands, p)] for p in parents])
        for i, c in enumerate(chosen):
            slot_of[c], fused_of[c] = first + i, fused[i]
        logp, ids = score_top(draft, fused, shape.branch)
        level = add_children(cands, chosen, [cands[c].score for c in chosen], [cands[c].depth for c in chosen],
                             logp.tolist(), ids.tolist())
    return add_best(tree, cands, shape.max_nodes)


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
