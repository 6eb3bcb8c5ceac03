"""Token trees, their verify mask and greedy acceptance: plain lists, no model."""

from __future__ import annotations

import torch

from lyanna_train.runtime.verification.masks import ragged_mask
from lyanna_train.runtime.token_tree import TokenTree, accept_greedy_tree


def sample_tree() -> TokenTree:
    tree = TokenTree.rooted_at(9)
    tree.add_path([1, 2, 3], [0.9, 0.5, 0.2])  # nodes 1, 2, 3
    tree.add_path([4, 5], [0.3, 0.1])  # nodes 4, 5
    tree.add_path([1, 6], [0.8, 0.6])  # shares node 1 (keeps 0.9), new node 6
    return tree


def test_shared_prefixes_merge_and_keep_the_higher_estimate():
    tree = sample_tree()
    assert tree.tokens == [9, 1, 2, 3, 4, 5, 6]
    assert tree.parents == [-1, 0, 1, 2, 0, 4, 1]
    assert tree.depths == [0, 1, 2, 3, 1, 2, 2]
    assert tree.probs[1] == 0.9 and tree.children[1] == {2: 2, 6: 6}
    assert tree.ancestors(6) == [0, 1, 6]


def test_mask_lets_each_node_see_the_cache_and_its_own_path():
    tree = sample_tree()
    mask = ragged_mask(torch.tensor([3]), torch.tensor([tree.parents]), 3 + len(tree))
    assert mask.shape == (1, 1, 7, 10) and mask[0, 0, :, :3].all()
    for i in range(len(tree)):
        assert set(torch.nonzero(mask[0, 0, i, 3:]).flatten().tolist()) == set(tree.ancestors(i))


def test_greedy_follows_the_target_and_ends_with_its_own_token():
    tree = sample_tree()
    # after root: 1 (node 1), then 6 (node 6), then the target says 7: not drafted
    argmax = {0: 1, 1: 6, 6: 7}
    path, bonus = accept_greedy_tree(tree, [argmax.get(i, 0) for i in range(len(tree))])
    assert path == [0, 1, 6] and bonus == 7
    path, bonus = accept_greedy_tree(tree, [8] * len(tree))  # nothing agrees: plain decoding
    assert path == [0] and bonus == 8


def test_best_keeps_the_most_probable_nodes_as_a_tree():
    tree = sample_tree()
    best = tree.best(3)  # 0.9 (1), 0.6 (6), 0.5 (2)
    assert best.tokens == [9, 1, 2, 6] and best.parents == [-1, 0, 1, 1]
    assert best.probs == [1.0, 0.9, 0.5, 0.6]
    assert tree.best(0).tokens == [9] and len(tree.best(100)) == len(tree)
