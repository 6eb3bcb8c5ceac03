"""Verify-size choice: measured cost curve, expected tokens per second."""

from __future__ import annotations

import pytest

from lyanna_train.runtime.pricing.cost import VerifyCost, best_count

CPU_LIKE = VerifyCost([1, 2, 8, 16, 32], [0.039, 0.057, 0.059, 0.069, 0.094])


def test_interpolates_between_and_extends_past_the_measured_sizes():
    assert CPU_LIKE(1) == 0.039 and CPU_LIKE(16) == 0.069
    assert CPU_LIKE(12) == pytest.approx(0.064)
    assert CPU_LIKE(48) == pytest.approx(0.094 + (0.094 - 0.069) / 16 * 16)
    assert VerifyCost.flat()(1) == VerifyCost.flat()(64)


def test_speculates_only_when_it_pays():
    # one candidate at 40 %: 1.4 tokens in 57 ms is worse than 1 token in 39 ms
    assert best_count([0.4], CPU_LIKE) == 0
    assert best_count([0.6], CPU_LIKE) == 1  # 1.6 / 57 ms beats 1 / 39 ms
    # many likely candidates: the flat part of the curve is worth filling
    assert best_count([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.01, 0.01], CPU_LIKE) == 8
    assert best_count([0.01] * 5, VerifyCost.flat()) == 5  # free verification: take everything
    assert best_count([], CPU_LIKE) == 0


def test_acceptance_estimates_learn_from_what_the_target_confirms():
    from lyanna_train.runtime.pricing.estimates import AcceptanceEstimates, POOL
    from lyanna_train.runtime.token_tree import TokenTree

    est = AcceptanceEstimates()
    assert est.lookup_probs(2, 3) == [0.5, 0.25, 0.125]  # prior 1/2 per token
    # a 2-gram lookup of 4 tokens, the target confirms 3 and then differs: 3 right, 1 break
    est.proposed_lookup(2, [5, 6, 7, 8])
    est.update(TokenTree.rooted_at(1), [5, 6, 7, 9])
    assert est.lookup_rate(2) == (1 + 3) / (1 + 3 + 1 + 1) and est.lookup_rate(3) == 0.5
    # lookup and pool proposals in the same iteration are counted apart
    est.proposed_lookup(3, [5, 0])
    est.proposed_lookup(POOL, [5, 6])
    est.proposed_lookup(1, [])  # nothing proposed: nothing counted
    est.update(TokenTree.rooted_at(1), [5, 6, 7])
    assert est.lookup_rate(3) == (1 + 1) / (1 + 1 + 1 + 1) and est.lookup_rate(POOL) == (1 + 2) / (1 + 2 + 1)
    assert 1 not in est.lookup and est.proposals == []
    # draft candidates 0.9 (right) and 0.8 (wrong): confirmed 1 of 1.7 predicted
    tree = TokenTree.rooted_at(1)
    nodes = [tree.add(0, 5, 0.9), tree.add(0, 4, 0.8)]
    est.calibrate_draft(tree, nodes)
    est.update(tree, [5, 2])
    assert est.draft == [2.0, 2.7] and est.draft_scale() == pytest.approx(2 / 2.7)
    tree = TokenTree.rooted_at(1)
    est.calibrate_draft(tree, [tree.add(0, 3, 0.9)])
    assert tree.probs[1] == pytest.approx(0.9 * 2 / 2.7)
