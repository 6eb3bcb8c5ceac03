"""Token trees: what one verify forward checks, built from draft and prompt-lookup candidates.

Node 0 is the root: the last accepted token, not yet run through the target. Every other
node is a candidate for the position after its parent. Parents come before children, and
siblings carry distinct tokens (a candidate proposed twice is one node), so a path through
the tree is identified by its tokens. The target scores all nodes in one forward under
:func:`.verification.masks.ragged_mask`, where each node sees the cache and its own ancestors only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenTree:
    tokens: list[int] = field(default_factory=list)  # target ids; tokens[0] is the root
    parents: list[int] = field(default_factory=list)  # parents[0] = -1
    depths: list[int] = field(default_factory=list)  # root 0, its children 1, ...
    children: list[dict[int, int]] = field(default_factory=list)  # token -> node, in insertion order
    probs: list[float] = field(default_factory=list)  # estimated chance the node is accepted (root 1)

    @classmethod
    def rooted_at(cls, token: int) -> "TokenTree":
        return cls([int(token)], [-1], [0], [{}], [1.0])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, prob: float = 0.0) -> int:
        """The child of ``parent`` with ``token`` (created unless it exists; a node proposed
        twice keeps the higher ``prob``) -> its node index."""
        token = int(token)
        found = self.children[parent].get(token)
        if found is not None:
            self.probs[found] = max(self.probs[found], prob)
            return found
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.children.append({})
        self.probs.append(prob)
        self.children[parent][token] = node
        return node

    def add_path(self, tokens, probs=None, parent: int = 0) -> list[int]:
        """Insert a chain of candidates below ``parent`` (shared prefixes merge) -> its nodes."""
        nodes = []
        for i, token in enumerate(tokens):
            parent = self.add(parent, token, 0.0 if probs is None else probs[i])
            nodes.append(parent)
        return nodes

    def best(self, count: int, shallow_first: bool = False) -> "TokenTree":
        """The root and the ``count`` most probable other nodes, as a tree of their own
        (``shallow_first``: the shallowest, most probable first among equal depths).

        Acceptance estimates never grow down a path, so the best nodes (ties broken by
        node order) keep their parents; parents are added back should they not."""
        ranked = self.ranked(shallow_first)[:count]
        keep = sorted({a for n in ranked for a in self.ancestors(n)})
        out = TokenTree.rooted_at(self.tokens[0])
        new = {0: 0}
        for n in keep[1:]:
            new[n] = out.add(new[self.parents[n]], self.tokens[n], self.probs[n])
        return out

    def ranked(self, shallow_first: bool = False) -> list[int]:
        """The non-root nodes in the order :meth:`best` takes them."""
        if shallow_first:
            return sorted(range(1, len(self)), key=lambda n: (self.depths[n], -self.probs[n], n))
        return sorted(range(1, len(self)), key=lambda n: (-self.probs[n], n))

    def ancestors(self, node: int) -> list[int]:
        """Nodes from the root down to ``node``, both included."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def path_tokens(self, path: list[int]) -> list[int]:
        return [self.tokens[n] for n in path]


def accept_greedy_tree(tree: TokenTree, target_argmax: list[int]) -> tuple[list[int], int]:
    """Follow the target's greedy choice down the tree.

    target_argmax[i]: the target's next token after the path to node i. Returns the
    accepted path (node indices, root first) and the target's token after it (the bonus):
    exactly what plain greedy decoding emits, so the result is lossless.
    """
    node = 0
    path = [0]
    while (child := tree.children[node].get(int(target_argmax[node]))) is not None:
        node = child
        path.append(node)
    return path, int(target_argmax[node])
