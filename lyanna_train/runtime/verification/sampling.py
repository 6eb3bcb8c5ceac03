"""Sampling that stays lossless: the output distribution is exactly the target's.

The target's distribution is its logits warped as transformers' ``generate`` warps them
(temperature, then top-k, then top-p). Tree candidates are chosen deterministically (the
draft's top-k, prompt-lookup continuations), so each is treated as a point mass: at a
node with target distribution p, the children are tried in order, child c accepted with
probability p(c) / (mass left), else removed from p. When every child is rejected, the
next token is sampled from what is left. Token x is therefore emitted with probability
p(x) whatever the candidates were (the multi-candidate rejection of SpecInfer with
one-hot drafts), and a wrong candidate costs acceptance, never correctness.
"""

from __future__ import annotations

import torch

from ..settings import SamplingParams
from ..token_tree import TokenTree


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> the target's sampling distribution [..., V] (float64)."""
    scores = logits.double() / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        # As transformers' TopPLogitsWarper: drop the low tail whose total stays within 1 - top_p.
        ordered, order = torch.sort(scores, dim=-1)
        tail = ordered.softmax(-1).cumsum(-1) <= 1 - params.top_p
        tail[..., -1] = False  # keep at least one token
        scores = scores.masked_fill(tail.scatter(-1, order, tail), float("-inf"))
    return scores.softmax(-1)


def accept_tree_sampling(tree: TokenTree, probs: torch.Tensor, generator: torch.Generator | None = None):
    """Walk the tree by sequential rejection of point-mass candidates.

    probs [N, V]: the target's warped distribution after the path to each node. Returns the
    accepted path (node indices, root first) and the token sampled after it. ``generator``
    is on the device of ``probs`` (torch samples on a device with that device's generators).
    """
    node, path = 0, [0]
    while True:
        left = probs[node].clone()
        for token, child in tree.children[node].items():
            mass = left.sum()
            if torch.rand((), generator=generator, dtype=torch.float64, device=probs.device) * mass < left[token]:
                node = child
                path.append(child)
                break
            left[token] = 0.0
        else:
            return path, int(torch.multinomial(left / left.sum(), 1, generator=generator))
