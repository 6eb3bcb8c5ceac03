"""Selection sizes, deterministic ties, forced tokens, padding, coverage goals and the d2t/t2d maps."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from lyanna_train.errors import LyannaError
from lyanna_train.hotvocab.artifact import load_hot_vocab, save_hot_vocab
from lyanna_train.hotvocab.selection import (HotVocab, SelectionRequest, coverage_curve, parse_requests, rank_tokens,
                                             select)


def test_ties_break_by_lower_id_and_forced_come_first():
    counts = np.array([5, 9, 5, 0, 9, 1, 5, 0], dtype=np.int64)
    assert rank_tokens(counts).tolist() == [1, 4, 0, 2, 6, 5, 3, 7]
    assert rank_tokens(counts, forced=[7]).tolist() == [7, 1, 4, 0, 2, 6, 5, 3]
    hot = select(counts, 4, forced=[7])
    assert hot.hot_ids.tolist() == [7, 1, 4, 0]


@pytest.mark.parametrize("size", [1, 3, 5])
def test_exact_size_and_maps_round_trip(size):
    counts = np.array([3, 0, 7, 7, 1, 2], dtype=np.int64)
    hot = select(counts, size)
    assert hot.size == size and len(hot.d2t) == size
    draft = torch.arange(size)
    assert torch.equal(hot.draft_to_target(draft), hot.hot_ids)  # target = draft + d2t[draft]
    assert hot.t2d.dtype == torch.bool and int(hot.t2d.sum()) == size
    assert hot.t2d[hot.hot_ids].all()
    assert torch.equal(torch.nonzero(hot.t2d).flatten(), torch.sort(hot.hot_ids).values)


def test_small_corpus_pads_with_lowest_unused_ids_and_warns():
    counts = np.zeros(10, dtype=np.int64)
    counts[[7, 3]] = [4, 2]
    with pytest.warns(UserWarning, match="only 2 distinct tokens"):
        hot = select(counts, 5)
    assert hot.hot_ids.tolist() == [7, 3, 0, 1, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select(counts, 2)  # enough distinct tokens: no warning


def test_ratio_and_coverage_goal_resolve_to_sizes():
    counts = np.array([50, 30, 10, 5, 5, 0, 0, 0, 0, 0], dtype=np.int64)
    ranking = rank_tokens(counts)
    curve = coverage_curve(ranking, counts)
    assert SelectionRequest(ratio=0.3).resolve_size(10, curve, 0) == 3
    assert SelectionRequest(size=4).resolve_size(10, curve, 0) == 4
    goal = SelectionRequest(coverage=0.9)
    size = goal.resolve_size(10, curve, 0)
    assert curve[size - 1] >= 0.9 and curve[size - 2] < 0.9  # the smallest set reaching the goal
    assert size == 3
    assert SelectionRequest(coverage=1.0).resolve_size(10, curve, 0) == 5


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.1", "0.05,2"])
def test_ratio_outside_unit_interval_is_refused(bad):
    with pytest.raises(LyannaError, match=r"outside \(0, 1\]"):
        parse_requests(bad, None, None)


def test_non_numeric_request_is_refused():
    with pytest.raises(LyannaError, match="comma-separated numbers"):
        parse_requests("five", None, None)


def test_hot_file_round_trip_and_fingerprint_check(tmp_path):
    hot = HotVocab.from_ids([5, 2, 9], vocab=12)
    name = save_hot_vocab(tmp_path, hot, "sha256:abc")
    loaded = load_hot_vocab(tmp_path / name, expect_fingerprint="sha256:abc")
    for a, b in ((hot.hot_ids, loaded.hot_ids), (hot.d2t, loaded.d2t), (hot.t2d, loaded.t2d)):
        assert torch.equal(a, b) and a.dtype == b.dtype
    with pytest.raises(LyannaError, match="another tokenizer"):
        load_hot_vocab(tmp_path / name, expect_fingerprint="sha256:other")


def test_one_ratio_rule_for_the_cli_the_trainer_and_the_plan():
    """A ratio gives the same size wherever it is read, and never zero tokens."""
    from types import SimpleNamespace

    import numpy as np

    from lyanna_train.hotvocab.selection import SelectionRequest, size_for_ratio
    from lyanna_train.training.plan import hot_vocab_size

    for ratio, vocab in [(0.05, 49152), (0.08, 32000), (0.1, 151936), (1e-9, 1000), (0.5, 3)]:
        cfg = SimpleNamespace(hotvocab=SimpleNamespace(full_vocab=False, size=None, ratio=ratio))
        cli = SelectionRequest(ratio=ratio).resolve_size(vocab, np.full(vocab, np.nan), n_forced=0)
        assert cli == hot_vocab_size(cfg, vocab) == size_for_ratio(ratio, vocab) >= 1
    assert size_for_ratio(1e-9, 1000) == 1 and size_for_ratio(0.05, 49152) == 2458
