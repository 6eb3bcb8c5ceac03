"""Layer ids of the target's hooks: validation and parsing."""

from __future__ import annotations

import pytest

from lyanna_train.errors import LyannaError
from lyanna_train.target.capture import check_layer_ids, parse_layer_ids


def test_layer_ids_are_validated():
    assert check_layer_ids([2, 0, 1], 4) == (2, 0, 1)
    assert parse_layer_ids("1, 14,26") == (1, 14, 26)
    for bad, match in (([0, 3], "out of range"), ([-1], "out of range"), ([1, 1], "distinct"), ([], "at least one")):
        with pytest.raises(LyannaError, match=match):
            check_layer_ids(bad, 4)
    with pytest.raises(LyannaError, match="comma-separated"):
        parse_layer_ids("1,x")
