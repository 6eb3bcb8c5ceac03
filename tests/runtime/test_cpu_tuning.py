"""CPU tuning: forms chosen by the timings, the result cached on disk under the right key,
and nothing timed inside decoding."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from lyanna_train.runtime import cpu_tuning, decode
from lyanna_train.runtime.cost import VerifyCost
from lyanna_train.runtime.cpu_tuning import choose_forms, tune, tuning_key, tuning_path
from lyanna_train.runtime.decode import DecodeSettings, LookupSettings
from lyanna_train.runtime.draft_tree import TreeShape
from lyanna_train.runtime.small_linear import MAX_ROWS, small_batch_forms

from .conftest import LAYER_IDS, drafted_tokens, greedy_reference, make_draft


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LYANNA_CACHE", str(tmp_path))
    return tmp_path


def _no_timing(*args, **kwargs):
    raise AssertionError("timed although a tuning was cached")


def test_choice_follows_the_timings_and_pads_to_cheaper_counts(monkeypatch):
    # "linear" is fast at 1 row only; weight_stationary is cheapest at 2, 4 and 8 rows
    costs = {("linear", 1): 3.0, ("weight_stationary", 1): 5.0, ("linear", 2): 6.0, ("weight_stationary", 2): 2.0,
             ("linear", 3): 6.0, ("weight_stationary", 3): 4.0, ("linear", 4): 7.0, ("weight_stationary", 4): 2.5,
             ("linear", 8): 9.0, ("weight_stationary", 8): 4.5}
    monkeypatch.setattr(cpu_tuning, "FORMS", {"linear": F.linear, "weight_stationary": F.linear})
    forms = [("linear", r) for r in range(MAX_ROWS + 1)]
    seen = []

    def time_forward(rows):
        seen.append((forms[rows], rows))
        return costs[forms[rows][0], rows]

    seconds = choose_forms(forms, time_forward, (1, 2, 3, 4, 8))
    assert {(f, r) for (f, _), r in seen} == set(costs)  # each form timed at each count, unpadded
    assert forms[1] == ("weight_stationary", 2)  # 1 row padded to 2 beats both 1-row forms
    assert forms[3] == ("weight_stationary", 4)  # 3 rows: padding to 4 (2.5) beats 4.0
    assert forms[5] == forms[8] == ("weight_stationary", 8)  # unmeasured counts pad up
    assert forms[9] == ("linear", 9)  # past the largest measured count: untouched
    assert seconds == [2.0, 2.0, 2.5, 2.5, 4.5]
    with pytest.raises(ValueError, match="start at 1"):
        choose_forms(forms, time_forward, (2, 4))


def test_tuning_is_cached_per_machine_torch_and_target(tiny_target, cache_home, monkeypatch):
    target, draft = copy.deepcopy(tiny_target), make_draft(tiny_target, pool=True)
    lines = []
    cost = tune(target, draft, say=lines.append)
    key = tuning_key(target, draft, True)
    path = tuning_path(key)
    assert path.parent == cache_home / "cpu_tuning" and path.is_file() and "timing" in lines[0]
    stored = json.loads(path.read_text())
    assert stored["key"]["torch"] == torch.__version__ and stored["key"]["threads"] == torch.get_num_threads()
    assert stored["key"]["target"]["fingerprint"].startswith("sha256:") and stored["seconds"] == cost.seconds
    chosen = (list(small_batch_forms(target)), list(small_batch_forms(draft)))

    # a fresh copy of the same models: read back, nothing timed, the same forms and cost
    monkeypatch.setattr(cpu_tuning, "target_timer", _no_timing)
    monkeypatch.setattr(cpu_tuning, "draft_timer", _no_timing)
    again, again_draft = copy.deepcopy(tiny_target), make_draft(tiny_target, pool=True)
    lines.clear()
    cached = tune(again, again_draft, say=lines.append)
    assert cached.seconds == cost.seconds and "read from" in lines[0]
    assert (small_batch_forms(again), small_batch_forms(again_draft)) == chosen

    # another thread count, another target or a stock-linear run is another key
    assert tuning_path(tuning_key(again, None, True)) != path
    assert tuning_path(tuning_key(again, draft, False)) != path
    other = copy.deepcopy(tiny_target)
    with torch.no_grad():
        other.lm_head.weight.mul_(2)
    assert tuning_path(tuning_key(other, draft, True)) != path
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    try:
        assert tuning_path(tuning_key(again, draft, True)) != path
    finally:
        torch.set_num_threads(before)


def test_retune_and_a_broken_cache_file_measure_again(tiny_target, cache_home, monkeypatch):
    target = copy.deepcopy(tiny_target)
    tune(target)
    path = tuning_path(tuning_key(target, None, True))
    calls = []
    real = cpu_tuning.target_timer
    monkeypatch.setattr(cpu_tuning, "target_timer", lambda *a, **k: calls.append(1) or real(*a, **k))
    tune(target, retune=True)
    assert calls
    calls.clear()
    path.write_text('{"key": ')  # cut short
    tune(target)
    assert calls and json.loads(path.read_text())["key"]["format"] == cpu_tuning.FORMAT  # rewritten whole


def test_decoding_times_nothing_and_weighs_the_given_cost(tiny_target, tiny_fitted, monkeypatch):
    """generate() takes its cost model as an argument: no hidden timing inside decoding."""
    target, draft = copy.deepcopy(tiny_target), tiny_fitted[True]
    expected = greedy_reference(target, [1, 17, 200, 5, 99], 20)
    monkeypatch.setattr(cpu_tuning, "target_timer", _no_timing)
    settings = DecodeSettings(TreeShape(2, 2, 2, 4), LookupSettings(4))  # verify: auto
    flat = decode.generate(target, draft, [1, 17, 200, 5, 99], 20, settings, eos_ids=(), layer_ids=LAYER_IDS)
    steep = VerifyCost([1, 2], [1.0, 100.0])  # any second token costs 100x: never worth verifying
    plain = decode.generate(target, draft, [1, 17, 200, 5, 99], 20, settings, eos_ids=(), layer_ids=LAYER_IDS,
                            cost=steep)
    assert flat.tokens == plain.tokens == expected
    assert max(flat.tree_sizes) > 1 and set(plain.tree_sizes) == {1}
    assert drafted_tokens(flat) >= 5 and drafted_tokens(plain) == 0  # the flat cost verifies, and keeps, draft nodes
