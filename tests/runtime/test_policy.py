"""The speculation policy: which rows draft, from synthetic costs and estimates, and decoding
that stays lossless whatever it chooses, rows switching between drafting and not mid-row;
each row's estimates learned from its own acceptance only."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lyanna_train.runtime.drafting import propose
from lyanna_train.runtime.pricing import cost as cost_module
from lyanna_train.runtime.pricing.cost import Costs, DraftCost, MeasuredCosts, VerifyCost
from lyanna_train.runtime.pricing.estimates import AcceptanceEstimates
from lyanna_train.runtime.pricing.policy import Drain, choose_drafting, fit_trees
from lyanna_train.runtime.token_tree import TokenTree
from lyanna_train.runtime.scheduling.scheduler import BatchDecoder
from lyanna_train.runtime.settings import DecodeSettings, LookupSettings, TreeShape

from .conftest import FIT_PROMPTS, LAYER_IDS, greedy_reference, make_draft

CPU_LIKE = VerifyCost([1, 2, 4, 8, 16, 32, 64], [20, 24, 25, 30, 37, 60, 110])  # ms per fused forward
GOOD_HEAD = [[0.8, 0.6, 0.4]]  # one kept tree: the chances of the head's best candidates


def test_nobody_drafts_where_the_draft_costs_more_than_it_can_return():
    """Even a perfect head adds at most 3 tokens per forward; a draft step of 500 ms
    against a 20-37 ms verify never pays: plain (or free) decoding for every row."""
    costs = Costs(CPU_LIKE, DraftCost([1, 16], [500.0, 520.0]))
    assert choose_drafting([[]] * 4, [[[1.0, 1.0, 1.0]]] * 4, costs) == [False] * 4


def test_every_row_drafts_where_verify_is_flat_and_drafting_free():
    """An accelerator's regime: even an unlikely head candidate is worth its slot."""
    assert choose_drafting([[]] * 8, [[[0.05, 0.01]]] * 8, Costs.flat()) == [True] * 8


def test_only_the_rows_the_head_helps_draft():
    """A moderate draft cost: rows whose head profile is good draft; rows whose head is
    poor, or whose free candidates (lookup) already fill what a verify can afford, do not;
    rows that cannot draft never do."""
    costs = Costs(CPU_LIKE, DraftCost([1, 2, 4, 8, 16], [6.0, 6.5, 7.0, 8.0, 10.0]))
    free = [[], [], [0.95, 0.9, 0.85, 0.8, 0.75, 0.7], [], []]
    head = [GOOD_HEAD, [[0.02, 0.01, 0.0]], GOOD_HEAD, None, GOOD_HEAD]
    assert choose_drafting(free, head, costs) == [True, False, False, False, True]


def test_a_batch_that_makes_the_verify_dear_stops_drafting():
    """One row: a good head pays. Sixteen rows at a verify cost that grows steeply with the
    batch's tokens: no extra token per row pays, so neither does the draft step."""
    steep = VerifyCost([1, 16, 32, 64], [20.0, 37.0, 200.0, 800.0])
    costs = Costs(steep, DraftCost([1, 16], [3.0, 8.0]))
    assert choose_drafting([[]], [GOOD_HEAD], costs) == [True]
    assert choose_drafting([[]] * 16, [GOOD_HEAD] * 16, costs) == [False] * 16


def test_drafting_is_worth_the_best_choice_per_tree_not_the_choice_for_the_mean_tree():
    """Half of a row's trees are good (0.4), half useless (0.0): their mean (0.2) does not pay
    for a 35 -> 41 ms wider verify plus the draft, but drafting does — after a good tree the
    verify takes its node, after a useless one it verifies the root alone."""
    costs = Costs(VerifyCost([1, 2, 4], [35.0, 41.0, 54.0]), DraftCost([1], [2.6]))
    assert choose_drafting([[]], [[[0.2, 0.0]]], costs) == [False]
    assert choose_drafting([[]], [[[0.4, 0.0], [0.0, 0.0]] * 2], costs) == [True]


def test_a_draining_batch_charges_a_catch_up_whole_but_a_lone_row_spreads_it():
    """Two rows, each 400 anchors behind (0.06 ms each: 24 ms to catch up). Spread over the
    8 iterations it is expected to serve, drafting pays; in a draining batch of several rows
    it is charged whole and does not; a lone row draining spreads it as if not draining."""
    costs = Costs(CPU_LIKE, DraftCost([1, 16], [3.0, 8.0]), anchor=0.06)
    assert choose_drafting([[]] * 2, [GOOD_HEAD] * 2, costs, behind=[400] * 2) == [True, True]
    assert choose_drafting([[]] * 2, [GOOD_HEAD] * 2, costs, behind=[400] * 2, left=[60, 60]) == [False, False]
    assert choose_drafting([[]] * 2, [GOOD_HEAD] * 2, costs, behind=[50] * 2, left=[60, 60]) == [True, True]
    assert choose_drafting([[]], [GOOD_HEAD], costs, behind=[400], left=[60]) == [True]


def test_a_row_that_stops_drafting_drifts_back_to_try_again():
    est = AcceptanceEstimates()
    assert est.expected_head(3, 5) == [[1.0, 1.0, 1.0, 0.0, 0.0]]  # cold, nothing measured: a perfect chain
    measured = AcceptanceEstimates((0.5, 0.4))  # the head's held-out top-1 per unroll step
    assert measured.expected_head(3, 4)[0] == pytest.approx([0.5, 0.2, 0.08, 0.0])
    est.observe_head([0.05, 0.1])
    assert est.expected_head(3, 3) == [[0.1, 0.05, 0.0]]
    for i in range(12):
        est.observe_head([0.01 * i])
    assert len(est.head_samples) == 8 and est.head_samples[-1] == [0.11]  # the last trees, kept one by one
    before = [list(t) for t in est.head_samples]
    for _ in range(40):
        est.idle_head(depth=3)
    assert all(b[0] < a[0] <= 1.0 for a, b in zip(est.head_samples, before))


PROMPTS = list(FIT_PROMPTS)
MAX_NEW = [30, 20, 26, 14]


def _run(target, draft, settings, max_batch=4, cost=None):
    decoder = BatchDecoder(target, draft, settings, max_batch, cost=cost, eos_ids=(), layer_ids=LAYER_IDS)
    requests = [decoder.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    for _ in decoder.run():
        pass
    return decoder, requests


def test_rows_switching_between_drafting_and_not_stay_lossless(tiny_target, tiny_fitted, monkeypatch):
    """Each row drafts on its own schedule (on, off for a few iterations, on again), its
    step 0 waiting in its backlog meanwhile: every row's tokens are its greedy reference,
    drafted tokens were accepted, and rows really went plain and came back."""
    pattern = {}  # request id -> the choices it got

    def scheduled(free, head, costs, **_):
        rows = decoder.rows[:len(free)]
        out = []
        for row in rows:
            seen = pattern.setdefault(row.request.id, [])
            choice = (len(seen) + row.request.id) % 4 != 0 and (len(seen) // 3 + row.request.id) % 2 == 0
            seen.append(choice)
            out.append(choice)
        return out

    settings = DecodeSettings(TreeShape(3, 2, 2, 6), LookupSettings(4, pool_tokens=4), verify="auto")
    decoder = BatchDecoder(tiny_target, tiny_fitted[True], settings, 3, eos_ids=(), layer_ids=LAYER_IDS)
    monkeypatch.setattr(propose, "choose_drafting", scheduled)
    requests = [decoder.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    for _ in decoder.run():
        pass
    assert [r.tokens for r in requests] == [greedy_reference(tiny_target, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    for choices in pattern.values():
        assert True in choices and False in choices
        assert any(a and not b for a, b in zip(choices, choices[1:])) and any(b and not a for a, b in
                                                                             zip(choices, choices[1:]))
    assert sum(a - 1 for r in requests for a in r.accept_lengths) > 20


def test_the_policy_decodes_losslessly_under_measured_like_costs(tiny_target, tiny_fitted):
    """No patching: the policy itself chooses, from a CPU-like verify cost and a draft cost
    that makes drafting pay for some iterations and not others."""
    costs = Costs(CPU_LIKE, DraftCost([1, 4], [4.0, 6.0]))
    settings = DecodeSettings(TreeShape(3, 2, 2, 6), LookupSettings(4, pool_tokens=4), verify="auto")
    _, requests = _run(tiny_target, tiny_fitted[True], settings, cost=costs)
    assert [r.tokens for r in requests] == [greedy_reference(tiny_target, p, n) for p, n in zip(PROMPTS, MAX_NEW)]


def test_a_rows_estimates_never_read_another_rows_acceptance(tiny_target, tiny_fitted):
    """Row 0 decoded beside a row whose head is always wrong (a random draft's prompt) ends
    with the same estimates as decoded alone: nothing of the other row leaks into them."""
    settings = DecodeSettings(TreeShape(3, 2, 2, 6), LookupSettings(4, pool_tokens=4), verify="all")
    draft = tiny_fitted[True]

    def estimates_of(prompts):
        decoder = BatchDecoder(tiny_target, draft, settings, len(prompts), eos_ids=(), layer_ids=LAYER_IDS)
        requests = [decoder.submit(p, 20) for p in prompts]
        seen = {}
        for _ in range(40):
            if decoder.idle:
                break
            for row in decoder.rows:
                seen[row.request.id] = row.estimates
            decoder.step()
        return requests, seen

    stranger = [1, 3, 9, 27, 81, 243 % 256, 217, 139, 161]  # not a prompt the draft was fitted on
    alone, est_alone = estimates_of([PROMPTS[0]])
    mixed, est_mixed = estimates_of([PROMPTS[0], stranger])
    assert alone[0].tokens == mixed[0].tokens
    a, b = est_alone[alone[0].id], est_mixed[mixed[0].id]
    assert a.draft == pytest.approx(b.draft, rel=1e-5) and a.lookup == b.lookup  # batched GEMMs: float order only
    assert [t == pytest.approx(u, rel=1e-5) for t, u in zip(a.head_samples, b.head_samples)] == [True] * len(a.head_samples)
    other = est_mixed[mixed[1].id]
    assert other.draft != pytest.approx(b.draft, rel=1e-2)  # the other row learned something else: this can fail


def test_whole_iterations_rescale_plain_and_speculative_costs_apart_per_row_count():
    """What iterations take, whole, moves the plain level and the speculative one apart,
    each per row count (a row count not measured takes the nearest one's)."""
    costs = MeasuredCosts(Costs(CPU_LIKE, DraftCost([1, 16], [4.0, 8.0])), memory=0.5)
    assert costs.plain(16) == costs.verify_at(16)(16) == 37.0  # nothing measured: the tuned curve
    costs.observe_iteration(16, 1, 0, seconds=44.4, draft_seconds=0.0)  # plain: 1.2x its tuned 37
    costs.observe_iteration(16, 2, 16, seconds=90.0 + 8.0, draft_seconds=8.0)  # 32 tokens: 90 (1.5x 60) + 8 beside
    assert costs.plain(16) == pytest.approx(44.4) and costs.verify_at(16)(32) == pytest.approx(90.0)
    assert costs.plain(15) == pytest.approx(1.2 * costs.tuned.verify(15))  # the nearest row count's level
    assert costs.draft(16) == pytest.approx(8.0)
    costs.observe_iteration(4, 1, 0, seconds=25.0, draft_seconds=0.0)  # 4 rows: their own level
    assert costs.plain(4) == pytest.approx(25.0) and costs.plain(16) == pytest.approx(44.4)
    costs.observe_iteration(16, 1, 0, seconds=37.0, draft_seconds=0.0)  # a later plain one moves it by ``memory``
    assert costs.plain(16) == pytest.approx(0.5 * 44.4 + 0.5 * 37.0)


def test_a_speculative_level_measured_below_the_plain_one_is_read_as_the_plain_one():
    """Iterations at 16 rows: plain ones 1.35x their tuned cost, a speculative one (one row
    drafted, nothing more verified) 1.25x, since a forward's time wanders by ~10 %. Read as
    measured, drafting one row made the iteration cheaper than plain decoding, and a head
    that adds nothing drafted; floored at the plain level it does not."""
    costs = MeasuredCosts(Costs(CPU_LIKE, DraftCost([1, 16], [1.0, 2.0])), memory=1.0)
    costs.observe_iteration(16, 1, 0, seconds=1.35 * 37.0, draft_seconds=0.0)
    costs.observe_iteration(16, 1, 1, seconds=1.25 * 37.0 + 1.0, draft_seconds=1.0)
    assert costs.verify_at(16)(16) == pytest.approx(costs.plain(16))
    assert costs.verify_at(16)(32) == pytest.approx(1.35 * 60.0)
    assert choose_drafting([[]] * 16, [[[0.02]]] * 16, costs) == [False] * 16


def test_speculation_stops_where_its_whole_iterations_cost_more_than_they_return():
    """Bare forwards promise a gain (tokens 16 -> 32: 37 -> 45 ms for 1.8x the tokens);
    measured whole iterations do not (a speculative one 2.2x its tuned cost, a plain one
    as tuned): no row drafts, and candidates already proposed are not verified."""
    tuned = Costs(VerifyCost([1, 16, 32, 64], [20.0, 37.0, 45.0, 80.0]), DraftCost([1, 16], [3.0, 8.0]))
    good = [[[0.8]]] * 16
    assert choose_drafting([[]] * 16, good, tuned) == [True] * 16
    costs = MeasuredCosts(tuned, memory=1.0)
    costs.observe_iteration(16, 1, 0, seconds=37.0, draft_seconds=0.0)
    costs.observe_iteration(16, 2, 16, seconds=2.2 * 45.0 + 8.0, draft_seconds=8.0)
    assert choose_drafting([[]] * 16, good, costs) == [False] * 16
    trees = []
    for _ in range(16):
        tree = TokenTree.rooted_at(1)
        tree.add_path([2], [0.8])
        trees.append(tree)
    assert [len(t) for t in fit_trees(trees, [None] * 16, tuned)] == [2] * 16
    assert [len(t) for t in fit_trees(trees, [None] * 16, costs)] == [1] * 16


def test_a_plain_iteration_is_measured_when_the_policy_stopped_choosing_one(tiny_target, tiny_fitted, monkeypatch):
    """Where speculation always pays, every (PROBE_EVERY + 1)-th iteration is still plain (the
    root alone): what plain decoding costs now is measured, not remembered. Lossless."""
    monkeypatch.setattr(cost_module, "PROBE_EVERY", 5)  # the decode is ~18 iterations long
    cheap = Costs(VerifyCost([1, 64], [10.0, 10.0]), DraftCost([1, 16], [0.001, 0.001]))
    settings = DecodeSettings(TreeShape(3, 2, 2, 6), LookupSettings(4, pool_tokens=4), verify="auto")
    decoder = BatchDecoder(tiny_target, tiny_fitted[True], settings, 1, cost=cheap, eos_ids=(), layer_ids=LAYER_IDS)
    assert isinstance(decoder.batch.costs, MeasuredCosts)
    decoder.batch.costs.plain_scales[1] = 100.0  # plain measured dear once: the policy would never choose it again
    request = decoder.submit(PROMPTS[2], 60)
    for _ in decoder.run():
        pass
    assert request.tokens == greedy_reference(tiny_target, PROMPTS[2], 60)
    sizes = request.tree_sizes
    assert len(sizes) > 12 and sizes[5] == sizes[11] == 1
    assert all(size > 1 for i, size in enumerate(sizes[:11]) if i != 5)
    fit = BatchDecoder(tiny_target, tiny_fitted[True], replace(settings, verify="fit"), 1, cost=cheap, eos_ids=(),
                       layer_ids=LAYER_IDS)  # "fit" drafts for every row, always: no plain iteration is due
    request = fit.submit(PROMPTS[2], 60)
    for _ in fit.run():
        pass
    assert all(size > 1 for size in request.tree_sizes[:11])


def test_speculation_that_delivered_less_than_plain_decoding_is_held_with_retries():
    """The model may be wrong; what iterations delivered decides. At a row count where the
    last speculative iterations delivered fewer tokens/s than plain ones (a catch-up
    spread over its horizon, charged whole in a draining batch but for a retry's),
    iterations are plain but for retries: the first after RETRY_EVERY, each next one after
    twice as many while speculation stays behind (up to RETRY_EVERY_MOST); a retry drops
    the old speculative iterations, so the policy chooses freely until enough new ones
    judge it; where it delivered more, the policy chooses freely and the retries'
    pace starts again; a row count with too few measured takes the nearest one's."""
    costs = MeasuredCosts(Costs(CPU_LIKE, DraftCost([1, 16], [3.0, 8.0])))
    for _ in range(2):
        costs.observe_iteration(16, 1, 0, seconds=0.050, draft_seconds=0.0, tokens=16)  # 320 tokens/s
    for _ in range(3):
        costs.observe_iteration(16, 2, 16, seconds=0.070, draft_seconds=0.010, tokens=20)  # 286 tokens/s
    assert not costs.speculation_lost(16) and not costs.plain_due(16)  # three are too few to judge
    costs.observe_iteration(16, 2, 16, seconds=0.070, draft_seconds=0.010, tokens=20)
    assert costs.speculation_lost(16) and costs.speculation_lost(12)  # 12 rows: 16's verdict, the nearest
    every, most = cost_module.RETRY_EVERY, cost_module.RETRY_EVERY_MOST
    paces = [min(every << k, most) for k in range((most // every).bit_length() + 1)]  # 8, 16, ..., 128, 128
    due = []  # each iteration as the decoder runs it: plain when held, else speculative, losing again
    while len(due) < sum(paces) + 3 * len(paces):
        due.append(costs.plain_due(16))
        if due[-1]:
            costs.observe_iteration(16, 1, 0, seconds=0.050, draft_seconds=0.0, tokens=16)
        else:
            costs.observe_iteration(16, 2, 16, seconds=0.070, draft_seconds=0.010, tokens=20)
    runs = "".join("h" if held else "s" for held in due).split("s")
    held_runs = [len(run) for run in runs if run]
    assert held_runs == [pace - 1 for pace in paces]  # 7, 15, 31, ... held between retries
    assert "".join("h" if held else "s" for held in due).count("ssss") == len(paces)  # each retry: a burst of 4
    assert costs.speculation_lost(16)  # judged on its own iterations (the old ones dropped), lost again
    assert costs.speculation_lost(12) and [costs.plain_due(12) for _ in range(every)][-1] is False  # its own pace
    for _ in range(cost_module.RATE_WINDOW):  # speculation now delivers 400 tokens/s: the last window's verdict
        costs.observe_iteration(16, 2, 16, seconds=0.050, draft_seconds=0.010, tokens=20)
    assert not costs.speculation_lost(16) and not costs.plain_due(16)
    for _ in range(cost_module.RATE_WINDOW):  # behind again: the retries start at their first pace
        costs.observe_iteration(16, 2, 16, seconds=0.070, draft_seconds=0.010, tokens=20)
    due = [costs.plain_due(16) for _ in range(every)]
    assert due == [True] * (every - 1) + [False]
    for _ in range(cost_module.RATE_WINDOW):
        costs.observe_iteration(16, 2, 16, seconds=0.050, draft_seconds=0.010, tokens=20)
    for _ in range(cost_module.RATE_WINDOW):  # as fast after a catch-up of 0.02 s each, spread over 8: 381 tokens/s
        costs.observe_iteration(16, 2, 16, seconds=0.050, draft_seconds=0.010, tokens=20, catch_up=0.02)
    assert not costs.speculation_lost(16)
    for _ in range(cost_module.RATE_WINDOW):  # the same in a draining batch, charged whole: 286 tokens/s
        costs.observe_iteration(16, 2, 16, seconds=0.050, draft_seconds=0.010, tokens=20, catch_up=0.02, draining=True)
    assert costs.speculation_lost(16)
    costs.observe_iteration(16, 1, 0, seconds=0.050, draft_seconds=0.0, tokens=16)  # the due plain one
    assert not all(costs.plain_due(16) for _ in range(most))  # a retry comes: it catches up a hold's backlog
    costs.observe_iteration(16, 2, 16, seconds=0.050, draft_seconds=0.010, tokens=20, catch_up=0.4, draining=True)
    assert costs.delivered[(True, 16)][-1] == (20, pytest.approx(0.05 + 0.4 / cost_module.CATCH_UP_HORIZON))


def test_speculation_is_judged_against_held_iterations_with_the_consultations_counted():
    """What the policy costs is part of what speculating costs: the iterations it was
    consulted for, plain ones included, are judged together against held ones (plain,
    nothing proposed). Speculative iterations at 330 tokens/s beside consulted plain ones
    at 290 lose to held ones at 320; compared with all plain iterations (305 tokens/s on
    average) they would have won."""
    costs = MeasuredCosts(Costs(CPU_LIKE, DraftCost([1, 16], [3.0, 8.0])))
    for _ in range(2):
        costs.observe_iteration(16, 1, 0, seconds=0.050, draft_seconds=0.0, tokens=16, consulted=False)  # 320
    for _ in range(2):
        costs.observe_iteration(16, 2, 16, seconds=0.060, draft_seconds=0.010, tokens=20)  # 333 tokens/s
        costs.observe_iteration(16, 1, 0, seconds=16 / 290, draft_seconds=0.0, tokens=16, consulted=True)
    assert costs.delivered_rate(False, 16) == pytest.approx(320)
    assert costs.delivered_rate(True, 16) < 320 and costs.speculation_lost(16)
    costs = MeasuredCosts(Costs(CPU_LIKE, DraftCost([1, 16], [3.0, 8.0])))
    for _ in range(4):  # the policy consulted, speculating every time: only held iterations are plain
        costs.observe_iteration(16, 2, 16, seconds=0.060, draft_seconds=0.010, tokens=20)
    costs.observe_iteration(16, 1, 0, seconds=0.050, draft_seconds=0.0, tokens=16, consulted=False)
    assert costs.speculation_verdict(16) is None  # one held iteration is too few
    costs.observe_iteration(16, 1, 0, seconds=0.050, draft_seconds=0.0, tokens=16, consulted=False)
    assert costs.speculation_verdict(16) == "won"


def test_a_policy_that_keeps_choosing_plain_decoding_is_consulted_less_until_it_speculates():
    """Consulting the policy costs an iteration's proposals: after QUIET_AFTER plain
    iterations it chose itself, it is consulted one iteration in CONSULT_EVERY; the first
    speculative iteration ends that. Plain iterations forced on it do not count."""
    costs = MeasuredCosts(Costs(CPU_LIKE, DraftCost([1, 16], [3.0, 8.0])))
    for _ in range(cost_module.QUIET_AFTER):
        assert not costs.plain_due(16)
        costs.observe_iteration(16, 1, 0, seconds=0.05, draft_seconds=0.0, tokens=16)  # the policy chose plain
    due = []
    for _ in range(2 * cost_module.CONSULT_EVERY):
        due.append(costs.plain_due(16))
        costs.observe_iteration(16, 1, 0, seconds=0.05, draft_seconds=0.0, tokens=16)
    assert due == ([True] * (cost_module.CONSULT_EVERY - 1) + [False]) * 2
    costs.observe_iteration(16, 2, 4, seconds=0.06, draft_seconds=0.01, tokens=24)  # the last consultation speculated
    assert [costs.plain_due(16) for _ in range(3)] == [False] * 3


def test_a_row_held_plain_by_what_speculation_delivered_is_lossless_and_retried(tiny_target, tiny_fitted):
    """A decoder whose speculative iterations delivered less than its plain ones decodes
    plainly (the root alone) until a retry, which the policy speculates in; greedy output
    is the target's own."""
    cheap = Costs(VerifyCost([1, 64], [10.0, 10.0]), DraftCost([1, 16], [0.001, 0.001]))
    settings = DecodeSettings(TreeShape(3, 2, 2, 6), LookupSettings(4, pool_tokens=4), verify="auto")
    decoder = BatchDecoder(tiny_target, tiny_fitted[True], settings, 1, cost=cheap, eos_ids=(), layer_ids=LAYER_IDS)
    costs = decoder.batch.costs
    for _ in range(cost_module.RATE_WINDOW):  # measured once: speculation slower than plain decoding at 1 row
        costs.observe_iteration(1, 1, 0, seconds=0.01, draft_seconds=0.0, tokens=1)
        costs.observe_iteration(1, 3, 1, seconds=1.0, draft_seconds=0.5, tokens=2)
    request = decoder.submit(PROMPTS[2], 40)
    for _ in decoder.run():
        pass
    assert request.tokens == greedy_reference(tiny_target, PROMPTS[2], 40)
    held = cost_module.RETRY_EVERY - 1
    assert request.tree_sizes[:held] == [1] * held and request.tree_sizes[held] > 1


def test_a_draining_batch_values_an_iteration_by_the_time_it_takes_off_the_last_rows():
    """Nothing waits: the batch's time left is the plain iterations its rows still need, the
    k rows with most left running at plain(k) each. A plain iteration takes off one
    iteration of the rows still running; tokens for a row ahead take off only what its slot
    adds to the rows behind; tokens for one of two rows tied behind take off nothing more."""
    drain = Drain([16, 4, 16, 0], plain=lambda k: 10.0 + k)
    saved = lambda *e: float(drain.saved(torch.tensor(e, dtype=torch.float64)))
    assert saved(1, 1, 1, 1) == pytest.approx(13.0)  # plain(3): three rows still run
    assert saved(1, 3, 1, 0) == pytest.approx(13.0 + 2 * (13.0 - 12.0))  # the row ahead: its slot's cost
    assert saved(3, 1, 1, 0) == pytest.approx(13.0 + 2 * (12.0 - 11.0))  # one of two tied: still one behind
    assert saved(3, 1, 3, 0) == pytest.approx(13.0 + 2 * 12.0)  # both behind: two iterations of plain(2)
    assert saved(1, 9, 1, 0) == saved(1, 5, 1, 0)  # nothing past a row's budget
    one = Drain([40], plain=lambda k: 20.0)  # one row: its tokens (up to its budget) at plain(1) each
    assert float(one.saved(torch.tensor([2.5], dtype=torch.float64))) == pytest.approx(50.0)
    assert choose_drafting([[]], [[[0.9, 0.8]]], Costs(CPU_LIKE, DraftCost([1, 4], [2.0, 14.0])), left=[40]) \
        == choose_drafting([[]], [[[0.9, 0.8]]], Costs(CPU_LIKE, DraftCost([1, 4], [2.0, 14.0])))
    costs = Costs(CPU_LIKE, DraftCost([1, 4], [2.0, 14.0]))
    head = [[[0.9, 0.8]]] * 4
    assert choose_drafting([[]] * 4, head, costs) == [True] * 4
    assert choose_drafting([[]] * 4, head, costs, left=[16, 2, 2, 2]) == [True, False, False, False]
    cheap_second = Costs(VerifyCost([1, 4, 8], [20.0, 20.0, 26.0]), DraftCost.free())
    trees = [TokenTree.rooted_at(1) for _ in range(4)]
    for tree in trees[1:]:  # the row behind (0) got no candidate
        tree.add(0, 2, 0.5)
    assert [len(t) for t in fit_trees(trees, [None] * 4, cheap_second, drafted=True)] == [1, 2, 2, 2]
    assert [len(t) for t in fit_trees(trees, [None] * 4, cheap_second, drafted=True, left=[16, 1, 1, 1])] == [1] * 4


def test_a_closed_batch_prices_by_what_each_slot_has_left_and_stays_lossless(tiny_target, tiny_fitted, monkeypatch):
    """When none will come (``run``), the policy is given what each slot still has to
    decode: its row's tokens left plus the budgets of the waiting requests it will take,
    each placed in the slot that frees first (the first two per slot; the rest add about
    the same to every slot). A server's steps never drain. Greedy output stays the
    target's own."""
    seen = []
    choose = propose.choose_drafting

    def spy(*args, left=None, **kwargs):
        own = [decoder._left(row) for row in decoder.rows]
        queued = [request.max_new_tokens for request in decoder.waiting][decoder.max_batch - len(decoder.rows):]
        seen.append((None if left is None else list(left), own, queued))
        return choose(*args, left=left, **kwargs)

    def placed(own, queued):  # each waiting budget to the slot with the least so far (the first of equals)
        slots = list(own)
        for budget in queued[:2 * len(own)]:
            first = min(range(len(slots)), key=lambda i: (slots[i], i))
            slots[first] += budget
        return slots

    monkeypatch.setattr(propose, "choose_drafting", spy)
    cheap = Costs(VerifyCost([1, 64], [10.0, 10.0]), DraftCost([1, 16], [0.001, 0.001]))
    settings = DecodeSettings(TreeShape(3, 2, 2, 6), LookupSettings(4, pool_tokens=4), verify="auto")
    decoder = BatchDecoder(tiny_target, tiny_fitted[True], settings, 2, cost=cheap, eos_ids=(), layer_ids=LAYER_IDS)
    budgets, prompts = [24, 8, 16, 6, 10], PROMPTS + PROMPTS[:1]
    requests = [decoder.submit(p, n) for p, n in zip(prompts, budgets)]
    for _ in decoder.run():
        pass
    for request, prompt, n in zip(requests, prompts, budgets):
        assert request.tokens == greedy_reference(tiny_target, prompt, n)
    assert len(seen[0][2]) == 3 and seen[0][0] == placed(seen[0][1], seen[0][2])  # three waited for two slots
    first = min(range(2), key=seen[0][1].__getitem__)
    assert seen[0][0][first] - seen[0][1][first] in (16 + 6, 16 + 10)  # the slot ending first takes two of them
    assert all(left == placed(own, queued) for left, own, queued in seen)
    assert any(len(left) == 2 and left[0] != left[1] for left, own, queued in seen if not queued)
    seen.clear()  # a server's steps: more requests may come, so a batch never drains
    served = BatchDecoder(tiny_target, tiny_fitted[True], settings, 2, cost=cheap, eos_ids=(), layer_ids=LAYER_IDS)
    requests = [served.submit(p, n) for p, n in zip(PROMPTS[:2], budgets[:2])]
    while not served.idle:
        served.step()
    assert requests[1].tokens == greedy_reference(tiny_target, PROMPTS[1], budgets[1])
    assert seen and all(left is None for left, _, _ in seen)


def test_warm_up_decodes_a_full_batch_then_forgets_what_it_measured(tiny_target, tiny_fitted):
    """A server warms its decoder before the first request: every slot decodes a synthetic
    request; afterwards the decoder is idle, its measured costs start afresh (the synthetic
    requests' rates would mislead the policy), and a real request is still lossless."""
    cheap = Costs(VerifyCost([1, 64], [10.0, 10.0]), DraftCost([1, 16], [0.001, 0.001]))
    settings = DecodeSettings(TreeShape(3, 2, 2, 6), LookupSettings(4, pool_tokens=4), verify="auto")
    decoder = BatchDecoder(tiny_target, tiny_fitted[True], settings, 3, cost=cheap, eos_ids=(), layer_ids=LAYER_IDS)
    before = decoder.batch.costs
    assert decoder.warm_up(prompt_tokens=12, new_tokens=6) > 0
    assert decoder.idle and decoder.batch.costs is not before and not decoder.batch.costs.delivered
    assert before.delivered  # the warm-up did decode and measure
    request = decoder.submit(PROMPTS[2], 30)
    for _ in decoder.run():
        pass
    assert request.tokens == greedy_reference(tiny_target, PROMPTS[2], 30)
    decoder.submit(PROMPTS[0], 4)
    with pytest.raises(RuntimeError, match="idle decoder"):
        decoder.warm_up()
