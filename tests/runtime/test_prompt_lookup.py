"""Prompt-lookup candidates on plain id sequences."""

from __future__ import annotations

import torch

from lyanna_train.runtime.drafting.prompt_lookup import lookup_continuations


def ids(*xs):
    return torch.tensor(xs)


def test_longest_suffix_match_wins_and_recent_occurrences_come_first():
    context = ids(5, 6, 7, 1, 2, 9, 9, 6, 7, 3, 4, 8, 6, 7)
    # suffix (6, 7) occurred twice: after it came 1, 2, ... and, more recently, 3, 4, ...
    assert lookup_continuations(context, 3, max_ngram=3, branches=2) == (2, [[3, 4, 8], [1, 2, 9]])
    assert lookup_continuations(context, 2, max_ngram=3) == (2, [[3, 4]])
    # limited to 1-grams: the last occurrence of 7 before the end was followed by 3
    assert lookup_continuations(context, 1, max_ngram=1) == (1, [[3]])


def test_nothing_to_find():
    assert lookup_continuations(ids(1, 2, 3, 4), 5) == (0, [])
    assert lookup_continuations(ids(1), 5) == (0, [])
    assert lookup_continuations(ids(1, 1), 0) == (0, [])


def test_continuation_may_run_into_the_suffix_itself():
    # a loop: the most recent match of (1, 2) is the one right before the suffix
    assert lookup_continuations(ids(1, 2, 1, 2, 1, 2), 4, max_ngram=2) == (2, [[1, 2]])
