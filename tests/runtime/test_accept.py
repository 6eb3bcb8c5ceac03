"""accept_greedy on plain tensors: no model involved."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.runtime.accept import accept_greedy


def test_longest_agreeing_prefix_and_the_bonus_token_after_it():
    draft = torch.tensor([[5, 6, 7],    # all agree -> 3, bonus = the target's 4th token
                          [5, 6, 7],    # first disagrees -> 0, bonus = the target's own first token
                          [5, 9, 7],    # agreement after a mismatch does not count
                          [5, 6, 1]])
    target = torch.tensor([[5, 6, 7, 8],
                           [4, 6, 7, 8],
                           [5, 6, 7, 8],
                           [5, 6, 7, 3]])
    accepted, bonus = accept_greedy(draft, target)
    assert accepted.tolist() == [3, 0, 1, 2]
    assert bonus.tolist() == [8, 4, 6, 7]


def test_no_draft_is_plain_greedy_decoding():
    accepted, bonus = accept_greedy(torch.zeros(2, 0, dtype=torch.long), torch.tensor([[3], [4]]))
    assert accepted.tolist() == [0, 0] and bonus.tolist() == [3, 4]


def test_target_must_score_one_position_more_than_drafted():
    with pytest.raises(ValueError, match=r"\[B, d\+1\]"):
        accept_greedy(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
