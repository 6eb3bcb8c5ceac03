"""CPU tuning: forms chosen by the timings, the result cached on disk under the right key,
and nothing timed inside decoding."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from lyanna_train.runtime.cpu import small_linear, tuning as cpu_tuning

from lyanna_train.runtime.scheduling.scheduler import generate
from lyanna_train.runtime.pricing.cost import Costs, DraftCost, VerifyCost
from lyanna_train.runtime.cpu.tuning import choose_forms, tune, tuning_key, tuning_path
from lyanna_train.runtime.settings import DecodeSettings, LookupSettings, TreeShape
from lyanna_train.runtime.cpu.small_linear import LARGE, MAX_ROWS, small_batch_forms

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
    forms = [("linear", r) for r in range(MAX_ROWS + 1)] + [("linear", 0)]
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


def _choose_while(monkeypatch, costs: dict, speed, rounds: int):
    """choose_forms over two forms at 1-4 rows, the forward of call n (from 1) over ``rows``
    taking costs[form, rows] x speed(n, rows) -> (forms, the (form, rows) of each call, seconds)."""
    monkeypatch.setattr(cpu_tuning, "FORMS", {"linear": F.linear, "weight_stationary": F.linear})
    forms = [("linear", r) for r in range(MAX_ROWS + 1)] + [("linear", 0)]
    seen = []

    def time_forward(rows):
        seen.append((forms[rows][0], rows))
        return costs[forms[rows][0], rows] * speed(len(seen), rows)

    return forms, seen, choose_forms(forms, time_forward, (1, 2, 3, 4), rounds=rounds)


def test_a_busy_stretch_during_the_timing_does_not_choose_a_form(monkeypatch):
    """Every (form, count) is timed once per round, the order reversed every other round, and
    the best round counts: a stretch of a slowed machine in one round (here 1.5x, over the
    middle of the first round) changes neither the forms nor the prices. Timed once (one round,
    the old way's exposure to such a stretch), 2 and 3 rows were padded to the 4-row form and
    priced at 5.0 instead of 3.5 and 4.0."""
    costs = {("linear", 1): 3.0, ("weight_stationary", 1): 5.0, ("linear", 2): 3.5, ("weight_stationary", 2): 6.0,
             ("linear", 3): 4.0, ("weight_stationary", 3): 4.2, ("linear", 4): 6.0, ("weight_stationary", 4): 5.0}
    busy = lambda call, rows: 1.5 if 3 <= call <= 6 else 1.0  # noqa: E731  (the first round's middle)
    forms, seen, seconds = _choose_while(monkeypatch, costs, busy, rounds=3)
    first = seen[:len(costs)]
    assert sorted(first) == sorted(costs) and seen[len(costs):2 * len(costs)] == first[::-1]  # rounds, reversed
    assert len(seen) == 3 * len(costs)
    assert forms[1] == ("linear", 1) and forms[2] == ("linear", 2) and forms[3] == ("linear", 3)
    assert forms[4] == ("weight_stationary", 4)
    assert seconds == [3.0, 3.5, 4.0, 5.0]


def test_a_burst_of_speed_during_the_timing_does_not_price_a_count(monkeypatch):
    """The median of the rounds counts, not the best: a forward that ran in a fast burst once
    (here 4 rows at half their usual time, in the first round) neither chooses its form nor
    sets its price. With the best round, 4 rows would be priced at 2.0 and 3 rows padded
    to them, though 4 rows usually cost 4.0."""
    costs = {("linear", 1): 3.0, ("weight_stationary", 1): 5.0, ("linear", 2): 3.5, ("weight_stationary", 2): 6.0,
             ("linear", 3): 3.8, ("weight_stationary", 3): 4.2, ("linear", 4): 4.5, ("weight_stationary", 4): 4.0}
    burst = lambda call, rows: 0.5 if rows == 4 and call <= len(costs) else 1.0  # noqa: E731  (the first round only)
    forms, seen, seconds = _choose_while(monkeypatch, costs, burst, rounds=5)
    assert len(seen) == 5 * len(costs)
    assert forms[3] == ("linear", 3) and forms[4] == ("weight_stationary", 4)
    assert seconds == [3.0, 3.5, 3.8, 4.0]


def test_counts_past_max_rows_take_the_form_fastest_over_them(monkeypatch):
    big, bigger = MAX_ROWS + 16, MAX_ROWS + 96
    costs = {("linear", 1): 1.0, ("weight_stationary", 1): 2.0, ("linear", big): 9.0,
             ("weight_stationary", big): 5.0, ("linear", bigger): 20.0, ("weight_stationary", bigger): 19.0}
    monkeypatch.setattr(cpu_tuning, "FORMS", {"linear": F.linear, "weight_stationary": F.linear})
    forms = [("linear", r) for r in range(MAX_ROWS + 1)] + [("linear", 0)]
    seen = []

    def time_forward(rows):
        form, padded = forms[rows] if rows <= MAX_ROWS else forms[LARGE]
        seen.append((form, padded, rows))
        return costs[form, rows]

    seconds = choose_forms(forms, time_forward, (1, big, bigger))
    assert {(f, r) for f, _, r in seen} == set(costs) and all(p == 0 for _, p, r in seen if r > MAX_ROWS)
    assert forms[LARGE] == ("weight_stationary", 0)  # 24 in all against 29
    assert forms[1] == ("linear", 1)
    assert forms[2] == ("weight_stationary", 2) and forms[MAX_ROWS] == ("weight_stationary", MAX_ROWS)  # unmeasured: the large form
    assert seconds == [1.0, 5.0, 19.0]


@pytest.mark.slow
def test_tuning_is_cached_per_machine_torch_and_target(tiny_target, cache_home, monkeypatch):
    target, draft = copy.deepcopy(tiny_target), make_draft(tiny_target, pool=True)
    lines = []
    cost = tune(target, draft, say=lines.append)
    key = tuning_key(target, draft, True)
    path = tuning_path(key)
    assert path.parent == cache_home / "cpu_tuning" and path.is_file() and "timing" in lines[0]
    target_path = tuning_path(tuning_key(target, None, True))  # the target's part, apart from the draft's
    stored = json.loads(target_path.read_text())
    assert stored["key"]["torch"] == torch.__version__ and stored["key"]["threads"] == torch.get_num_threads()
    assert stored["key"]["target"]["fingerprint"].startswith("sha256:") and stored["seconds"] == cost.verify.seconds
    assert json.loads(path.read_text())["draft_forms"] is not None
    chosen = (list(small_batch_forms(target)), list(small_batch_forms(draft)))

    # a fresh copy of the same models: read back, nothing timed, the same forms and cost
    monkeypatch.setattr(cpu_tuning, "target_timer", _no_timing)
    monkeypatch.setattr(cpu_tuning, "draft_timer", _no_timing)
    again, again_draft = copy.deepcopy(tiny_target), make_draft(tiny_target, pool=True)
    lines.clear()
    cached = tune(again, again_draft, say=lines.append)
    assert cached.verify.seconds == cost.verify.seconds and "read from" in lines[0]
    assert (small_batch_forms(again), small_batch_forms(again_draft)) == chosen
    # without the draft (a --no-draft server beside a speculative one): the same target forms, read back
    alone = copy.deepcopy(tiny_target)
    lines.clear()
    assert tune(alone, say=lines.append).verify.seconds == cost.verify.seconds and "read from" in lines[0]
    assert small_batch_forms(alone) == chosen[0]

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


@pytest.mark.slow
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


@pytest.mark.slow
def test_decoding_times_nothing_and_weighs_the_given_cost(tiny_target, tiny_fitted, monkeypatch):
    """generate() takes its cost model as an argument: no hidden timing inside decoding."""
    target, draft = copy.deepcopy(tiny_target), tiny_fitted[True]
    expected = greedy_reference(target, [1, 17, 200, 5, 99], 20)
    monkeypatch.setattr(cpu_tuning, "target_timer", _no_timing)
    settings = DecodeSettings(TreeShape(2, 2, 2, 4), LookupSettings(4, pool_tokens=0))  # verify: auto
    flat = generate(target, draft, [1, 17, 200, 5, 99], 20, settings, eos_ids=(), layer_ids=LAYER_IDS)
    steep = Costs(VerifyCost([1, 2], [1.0, 100.0]), DraftCost.free())  # a second token costs 100x: never pays
    plain = generate(target, draft, [1, 17, 200, 5, 99], 20, settings, eos_ids=(), layer_ids=LAYER_IDS, cost=steep)
    assert flat.tokens == plain.tokens == expected
    assert max(flat.tree_sizes) > 1 and set(plain.tree_sizes) == {1}
    assert drafted_tokens(flat) >= 5 and drafted_tokens(plain) == 0  # the flat cost verifies, and keeps, draft nodes


@pytest.mark.slow
def test_the_draft_cost_is_timed_per_tree_shape_and_kept(tiny_target, cache_home, monkeypatch):
    """A drafting iteration is timed per row count for the decoding's tree shape, stored
    beside the verify cost; the same shape is read back, a new shape times only itself."""
    target, draft = copy.deepcopy(tiny_target), make_draft(tiny_target, pool=True)
    shape = TreeShape(2, 2, 2, 4)
    timed = []
    real = cpu_tuning.time_drafting
    monkeypatch.setattr(cpu_tuning, "time_drafting", lambda d, s, rows: timed.append((s, rows)) or real(d, s, rows))
    costs = tune(target, draft, shape=shape)
    assert [rows for _, rows in timed] == list(cpu_tuning.DRAFT_ROWS)
    assert costs.draft(0) == 0.0 and 0 < costs.draft(1) and costs.draft(16) >= costs.draft(1) * 0.5
    stored = json.loads(tuning_path(tuning_key(target, draft, True)).read_text())
    assert len(stored["draft_costs"]) == 1
    timed.clear()
    monkeypatch.setattr(cpu_tuning, "target_timer", _no_timing)
    again = tune(copy.deepcopy(tiny_target), make_draft(tiny_target, pool=True), shape=shape)
    assert timed == [] and again.draft(4) == costs.draft(4)
    tune(copy.deepcopy(tiny_target), make_draft(tiny_target, pool=True), shape=TreeShape(1, 3, 1, 3))
    assert {s for s, _ in timed} == {TreeShape(1, 3, 1, 3)}  # only the new shape was timed
    stored = json.loads(tuning_path(tuning_key(target, draft, True)).read_text())
    assert len(stored["draft_costs"]) == 2


def test_mkls_packed_form_is_timed_and_chosen_only_at_its_counts(monkeypatch):
    """MKL packs a weight per row count, a copy each: it is timed at the counts it may keep
    (cheapest everywhere here), other counts pad up to them, and it never serves the counts
    past MAX_ROWS, whose rows vary."""
    monkeypatch.setattr(cpu_tuning, "FORMS", {"linear": F.linear, "mkl_packed": F.linear})
    forms = [("linear", r) for r in range(MAX_ROWS + 1)] + [("linear", 0)]
    seen = []

    def time_forward(rows):
        seen.append((forms[min(rows, LARGE)][0], rows))
        return rows * (0.5 if forms[min(rows, LARGE)][0] == "mkl_packed" else 1.0)

    choose_forms(forms, time_forward, (1, 2, 4, 8, 48), mkl=(4, 8))
    assert {r for f, r in seen if f == "mkl_packed"} == {4, 8}
    assert forms[3] == forms[4] == ("mkl_packed", 4) and forms[5] == ("mkl_packed", 8)
    assert forms[LARGE] == ("linear", 0)


def test_mkl_keeps_only_the_copies_the_machines_memory_allows(monkeypatch):
    if "mkl_packed" not in small_linear.FORMS:
        pytest.skip("torch built without MKL")
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights
    pages = {"SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(small_linear.os, "sysconf", lambda name: pages.get(name, 0) or memory // 4096)
    memory = 64 * 2**20  # a quarter: 16 MiB, four copies
    assert small_linear.mkl_rows(model) == small_linear.MKL_ROWS[:4]
    memory = 40 * 2**20  # 10 MiB: two
    assert small_linear.mkl_rows(model) == small_linear.MKL_ROWS[:2]
    memory = 8 * 2**20  # 2 MiB: none
    assert small_linear.mkl_rows(model) == ()
