"""Batched speculative decoding on a tiny random Llama: every row gets exactly what
target.generate gives that prompt alone -- ragged prompts, every tree shape, lookup and
pool candidates on and off, rows finishing at different steps, joining mid-run, reusing
freed slots, cancelled, refused -- and the speculation policy's choices per row, all lossless."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.runtime.drafting import propose
from lyanna_train.runtime.pricing.cost import Costs, DraftCost, VerifyCost, best_count, best_width
from lyanna_train.runtime.scheduling.requests import Status
from lyanna_train.runtime.scheduling.scheduler import BatchDecoder, generate_batch
from lyanna_train.runtime.settings import DecodeSettings, FusionSettings, LookupSettings, TreeShape

from .conftest import LAYER_IDS, V, greedy_reference, make_draft, oracle_trees

PROMPTS = [[1, 17, 200, 5, 99, 42, 7, 130, 64], [1], [1, 250, 3, 3, 3, 3, 8, 160, 77, 21, 90, 45, 12, 199, 31, 2],
           [1, 5, 6, 7, 5, 6, 7, 5, 6], [1, 33, 34]]
MAX_NEW = [24, 17, 30, 9, 21]  # rows finish at different steps, and later prompts join as slots free
SHAPES = {"plain": TreeShape(0, 1, 1, 0), "chain1": TreeShape(1, 1, 1, 1), "chain5": TreeShape(5, 1, 1, 5),
          "tree": TreeShape(4, 3, 2, 10), "wide": TreeShape(3, 4, 4, 30)}
NO_LOOKUP = LookupSettings(max_tokens=0, pool_tokens=0)  # the defaults propose lookup and pool candidates


@pytest.fixture(scope="module")
def references(tiny_target):
    return [greedy_reference(tiny_target, p, n) for p, n in zip(PROMPTS, MAX_NEW)]


def _decode(target, draft, settings, max_batch=3, fusion=FusionSettings(), cost=None):
    """Every prompt with its own max_new_tokens through one scheduler -> requests."""
    decoder = BatchDecoder(target, draft, settings, max_batch, cost=cost, eos_ids=(), layer_ids=LAYER_IDS,
                           fusion=fusion)
    requests = [decoder.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    steps = 0
    while not decoder.idle:
        decoder.step()
        assert len(decoder.rows) <= max_batch
        steps += 1
    assert decoder.batch.cache.lengths == [0] * max_batch  # every slot freed
    return requests


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("lookup", [0, 4], ids=["draft", "draft+lookup"])
@pytest.mark.slow
def test_every_row_is_lossless(tiny_target, references, pool, shape, lookup):
    settings = DecodeSettings(SHAPES[shape], LookupSettings(lookup, branches=2, pool_tokens=lookup), verify="all")
    for request, want in zip(_decode(tiny_target, make_draft(tiny_target, pool), settings), references):
        assert request.status is Status.FINISHED and request.finish_reason == "length"
        assert request.tokens == want
        assert request.target_forwards == 1 + len(request.accept_lengths) == 1 + len(request.tree_sizes)
        assert all(1 <= tau <= size for tau, size in zip(request.accept_lengths, request.tree_sizes))


def test_lookup_alone_and_plain_decoding_are_lossless(tiny_target, references):
    for lookup in (NO_LOOKUP, LookupSettings(6, branches=2, pool_tokens=0)):
        requests = _decode(tiny_target, None, DecodeSettings(TreeShape(0, 1, 1, 0), lookup, verify="all"), max_batch=4)
        assert [r.tokens for r in requests] == references


@pytest.mark.parametrize("fusion", [FusionSettings(2), FusionSettings(3, shallow_first=True)], ids=["hold2", "hold3"])
@pytest.mark.slow
def test_held_verification_is_lossless(tiny_target, references, fusion):
    settings = DecodeSettings(TreeShape(3, 2, 2, 6), LookupSettings(4, pool_tokens=4), verify="auto")
    steep = VerifyCost([1, 8, 64], [1.0, 1.6, 9.0])  # widths vary with the rows' confidence and count
    requests = _decode(tiny_target, make_draft(tiny_target, True), settings, max_batch=4, fusion=fusion, cost=Costs(steep, DraftCost.free()))
    assert [r.tokens for r in requests] == references


@pytest.mark.slow
def test_auto_widths_stay_lossless_and_follow_the_batch(tiny_target, references):
    """verify: auto with a cost that grows with the batch's total tokens: the width changes
    from iteration to iteration, outputs do not."""
    steep = VerifyCost([1, 4, 16, 64], [1.0, 1.1, 2.0, 8.0])
    settings = DecodeSettings(TreeShape(3, 3, 2, 8), LookupSettings(6, pool_tokens=6), verify="auto")
    requests = _decode(tiny_target, make_draft(tiny_target, True), settings, max_batch=3, cost=Costs(steep, DraftCost.free()))
    assert [r.tokens for r in requests] == references
    assert len({size for r in requests for size in r.tree_sizes}) > 2


def test_best_width_weighs_the_batchs_total_tokens():
    cost = VerifyCost([1, 2, 4, 8, 16, 32, 64], [20, 24, 25, 30, 37, 60, 110])
    probs = [0.7, 0.4, 0.2, 0.1]
    assert best_width([probs], cost) == best_count(probs, cost) + 1  # one row: the batch-1 rule
    widths = [best_width([probs] * rows, cost) for rows in (1, 2, 4, 8, 16)]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]  # more rows: fewer tokens each
    assert best_width([[], []], cost) == 1
    assert best_width([probs], VerifyCost.flat()) == 5  # free tokens: everything
    assert best_width([probs], VerifyCost.flat(), limit=3) == 3


def _batch_oracle(decoder, fulls: dict, good=None, decoys: int = 2):
    """The oracle drafting each row's true continuation (``good(request id, i)`` right
    tokens at its i-th drafting), every chain node behind ``decoys`` wrong siblings."""
    def full_for(slot):
        row = decoder.rows[slot]
        return fulls[tuple(row.request.prompt)], row.request.id

    return oracle_trees(full_for, good, decoys)


@pytest.mark.slow
def test_rows_accepting_different_counts_roll_back_each_to_its_own_cut(tiny_target, monkeypatch):
    depth = 4
    fulls = {tuple(p): p + greedy_reference(tiny_target, p, n + depth + 1) for p, n in zip(PROMPTS, MAX_NEW)}
    schedules = {rid: [(rid * 3 + i) % (depth + 1) for i in range(40)] for rid in range(1, 6)}
    decoder = BatchDecoder(tiny_target, make_draft(tiny_target, True), DecodeSettings(TreeShape(depth, 1, 1, depth),
                           NO_LOOKUP, verify="all"), max_batch=3, eos_ids=(), layer_ids=LAYER_IDS)
    monkeypatch.setattr(propose, "draft_trees", _batch_oracle(decoder, fulls, lambda rid, i: schedules[rid][i]))
    requests = [decoder.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    for _ in decoder.run():
        pass
    for r, p, n in zip(requests, PROMPTS, MAX_NEW):
        assert r.tokens == fulls[tuple(p)][len(p):len(p) + n]
        full_runs = r.accept_lengths[:-1]  # the last may be cut
        assert full_runs == [schedules[r.id][i] + 1 for i in range(len(full_runs))]


def test_rows_stop_at_their_own_eos_and_free_their_slots(tiny_target, references):
    """Each prompt stops at a different EOS id, mid accepted run; the freed slots take the
    waiting prompts."""
    stops = [ref[min(5 + 2 * i, len(ref) - 1)] for i, ref in enumerate(references)]
    expected = [greedy_reference(tiny_target, p, n, eos=s) for p, n, s in zip(PROMPTS, MAX_NEW, stops)]
    decoder = BatchDecoder(tiny_target, make_draft(tiny_target, True), DecodeSettings(TreeShape(3, 2, 2, 6),
                           LookupSettings(4, pool_tokens=0), verify="all"), max_batch=2, layer_ids=LAYER_IDS)
    requests = [decoder.submit(p, n, eos_ids=[s]) for p, n, s in zip(PROMPTS, MAX_NEW, stops)]
    for _ in decoder.run():
        pass
    assert [r.tokens for r in requests] == expected
    assert all(r.finish_reason == "eos" for r in requests if r.tokens[-1] in (stops[r.id - 1],))


def test_requests_join_a_running_batch(tiny_target, references):
    """Submitted while others decode, new requests take free slots at the next step."""
    decoder = BatchDecoder(tiny_target, make_draft(tiny_target, True), DecodeSettings(TreeShape(2, 2, 2, 4),
                           LookupSettings(3, pool_tokens=3), verify="all"), max_batch=4, eos_ids=(), layer_ids=LAYER_IDS)
    first = [decoder.submit(PROMPTS[0], MAX_NEW[0]), decoder.submit(PROMPTS[2], MAX_NEW[2])]
    later = []
    for step in range(200):
        if decoder.idle:
            break
        if step in (2, 3):  # mid-run, at different steps
            later.append(decoder.submit(PROMPTS[step - 1], MAX_NEW[step - 1]))
        updates = decoder.step()
        if step == 3:
            assert len(decoder.rows) == 4 and all(r.status is Status.RUNNING for r in first)
            assert {u.request.id for u in updates} >= {r.id for r in first + later}
    assert [r.tokens for r in first] == [references[0], references[2]]
    assert [r.tokens for r in later] == [references[1], references[2]]


def test_requests_admitted_together_are_prefilled_in_one_padded_forward(tiny_target, tiny_fitted, references,
                                                                       monkeypatch):
    """Prompts of 1 to 16 tokens admitted in one step share ONE prefill forward (each padded
    at its end to the longest); every row still gets what the target gives it alone, and
    the head, drafting from that forward's features, gets each row's drafts accepted as
    when every prompt had a forward of its own (``prefill_tokens`` 0)."""
    from lyanna_train.runtime.scheduling import batch

    monkeypatch.setattr(batch, "PREFILL_PADDING", 100.0)  # these short prompts differ by far more than a CPU pads
    accepted = {}
    for budget in (2048, 0):
        decoder = BatchDecoder(tiny_target, tiny_fitted[True], DecodeSettings(TreeShape(2, 2, 2, 4), NO_LOOKUP,
                               verify="all"), max_batch=5, eos_ids=(), layer_ids=LAYER_IDS,
                               fusion=FusionSettings(prefill_tokens=budget))
        requests = [decoder.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
        widths = []
        handle = tiny_target.register_forward_pre_hook(lambda _m, _a, kw: widths.append(kw["input_ids"].shape),
                                                       with_kwargs=True)
        try:
            decoder.step()
        finally:
            handle.remove()
        *prefills, verify = widths  # the prefills, then the first verify forward over every row
        assert prefills == ([(5, max(map(len, PROMPTS)))] if budget else [(1, len(p)) for p in sorted(PROMPTS, key=len)])
        assert verify[0] == 5
        for _ in decoder.run():
            pass
        assert [r.tokens for r in requests] == references
        accepted[budget] = [r.accept_lengths for r in requests]
    assert accepted[2048] == accepted[0] and sum(a - 1 for r in accepted[0] for a in r) > 20


@pytest.mark.parametrize("wait", [2, 0])
def test_a_freed_slot_waits_for_a_row_about_to_finish_so_their_next_requests_share_a_prefill(
        tiny_target, monkeypatch, wait):
    """Two rows of 5 and 6 tokens decode plainly, two requests wait. When the first row
    finishes, the second has 1 token left: with ``admit_wait`` 2 the freed slot waits one
    iteration and both waiting requests are prefilled in ONE forward; with 0 each is
    prefilled alone as its slot frees. Every row is the target's own either way."""
    from lyanna_train.runtime.scheduling import batch, scheduler

    monkeypatch.setattr(batch, "PREFILL_PADDING", 100.0)  # these short prompts differ by far more than a CPU pads
    prefills = []

    def counted(batch, rows):
        prefills.append(rows.stop - rows.start)
        return prefill_rows(batch, rows)

    prefill_rows = scheduler.prefill_rows
    monkeypatch.setattr(scheduler, "prefill_rows", counted)
    settings = DecodeSettings(SHAPES["plain"], NO_LOOKUP, verify="all", fusion=FusionSettings(admit_wait=wait))
    decoder = BatchDecoder(tiny_target, None, settings, max_batch=2, eos_ids=(), layer_ids=LAYER_IDS)
    budgets = [5, 6, 4, 4]
    requests = [decoder.submit(p, n) for p, n in zip(PROMPTS, budgets)]
    for _ in decoder.run():
        pass
    assert prefills == ([2, 2] if wait else [2, 1, 1])
    assert [r.tokens for r in requests] == [greedy_reference(tiny_target, p, n) for p, n in zip(PROMPTS, budgets)]
    with pytest.raises(ValueError, match="admit_wait"):
        FusionSettings(admit_wait=-1)


def test_prefill_groups_pad_little_and_keep_to_the_budget(monkeypatch):
    from lyanna_train.runtime.scheduling import batch

    assert batch.prefill_groups([100, 10, 104, 96, 12], 2048) == [[1, 4], [3, 0, 2]]  # shortest first, like with like
    assert batch.prefill_groups([100] * 5, 250) == [[0, 1], [2, 3], [4]]  # at most 250 padded tokens a forward
    assert batch.prefill_groups([3000, 10], 2048) == [[1], [0]]  # a prompt past the budget goes alone
    assert batch.prefill_groups([100] * 3, 0) == [[0], [1], [2]]
    monkeypatch.setattr(batch, "PREFILL_PADDING", 2.0)
    assert batch.prefill_groups([10, 31, 5], 2048) == [[2, 0], [1]]  # 2 x 10 <= 2 x 15; 3 x 31 > 2 x 46


@pytest.mark.slow
def test_a_single_slot_is_reused_request_after_request(tiny_target, references):
    requests = _decode(tiny_target, make_draft(tiny_target, True),
                       DecodeSettings(TreeShape(3, 2, 2, 6), LookupSettings(4, pool_tokens=4), verify="all"), max_batch=1)
    assert [r.tokens for r in requests] == references
    finished = sorted(requests, key=lambda r: r.finished_at)
    assert [r.id for r in finished] == [1, 2, 3, 4, 5]  # one at a time, in order


def test_bad_requests_fail_alone_with_a_clear_error(tiny_target, references):
    settings = DecodeSettings(TreeShape(2, 2, 1, 3), LookupSettings(3, pool_tokens=0), verify="all")
    decoder = BatchDecoder(tiny_target, make_draft(tiny_target, True), settings, max_batch=3, eos_ids=(),
                           layer_ids=LAYER_IDS)
    limit = tiny_target.config.max_position_embeddings
    good = [decoder.submit(PROMPTS[0], MAX_NEW[0]), decoder.submit(PROMPTS[2], MAX_NEW[2])]
    empty = decoder.submit([], 8)
    long = decoder.submit([1] * limit, 8)
    unknown = decoder.submit([1, V + 3], 8)
    none = decoder.submit(PROMPTS[1], 0)
    assert empty.status is Status.FAILED and "empty prompt" in empty.error
    assert long.status is Status.FAILED and f"{limit} tokens does not fit the target's context of {limit}" in long.error
    assert unknown.status is Status.FAILED and f"token id {V + 3}" in unknown.error
    assert none.status is Status.FAILED and "max_new_tokens" in none.error
    reported = {u.request.id for u in decoder.step()}
    assert {empty.id, long.id, unknown.id, none.id} <= reported
    for _ in decoder.run():
        pass
    assert [r.tokens for r in good] == [references[0], references[2]]


def test_a_prompt_near_the_context_end_stops_there(tiny_target):
    limit = tiny_target.config.max_position_embeddings
    prompt = (PROMPTS[0] * limit)[:limit - 5]
    settings = DecodeSettings(TreeShape(4, 2, 2, 8), LookupSettings(6, pool_tokens=0), verify="all")
    [request] = generate_batch(tiny_target, make_draft(tiny_target, True), [prompt], 20, settings, eos_ids=(),
                               layer_ids=LAYER_IDS)
    assert request.finish_reason == "context" and len(request.tokens) == 5
    assert request.tokens == greedy_reference(tiny_target, prompt, 5)


def test_a_cancelled_request_frees_its_slot_and_leaves_the_others_untouched(tiny_target, references):
    decoder = BatchDecoder(tiny_target, make_draft(tiny_target, True), DecodeSettings(TreeShape(2, 2, 2, 4),
                           LookupSettings(3, pool_tokens=3), verify="all"), max_batch=3, eos_ids=(), layer_ids=LAYER_IDS)
    requests = [decoder.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    decoder.step()
    decoder.step()
    victim = requests[1]
    assert victim.status is Status.RUNNING and len(decoder.rows) == 3
    assert decoder.cancel(victim) and victim.status is Status.CANCELLED and victim.finish_reason == "cancelled"
    assert len(decoder.rows) == 2 and victim not in [row.request for row in decoder.rows]
    assert not decoder.cancel(victim)
    waiting = requests[4]
    assert decoder.cancel(waiting) and waiting not in decoder.waiting
    seen = len(victim.tokens)
    for _ in decoder.run():
        pass
    assert len(victim.tokens) == seen
    assert victim.tokens == references[1][:seen]
    assert [requests[i].tokens for i in (0, 2, 3)] == [references[i] for i in (0, 2, 3)]


def test_bad_requests_joining_a_running_batch_fail_alone(tiny_target, references):
    """Refused mid-run (empty, longer than the context) and through generate_batch: the
    running rows never notice."""
    settings = DecodeSettings(TreeShape(2, 2, 2, 4), LookupSettings(3, pool_tokens=3), verify="all")
    decoder = BatchDecoder(tiny_target, make_draft(tiny_target, True), settings, max_batch=2, eos_ids=(),
                           layer_ids=LAYER_IDS)
    good = [decoder.submit(PROMPTS[0], MAX_NEW[0]), decoder.submit(PROMPTS[3], MAX_NEW[3])]
    decoder.step()
    decoder.step()
    limit = tiny_target.config.max_position_embeddings
    bad = [decoder.submit([], 4), decoder.submit(PROMPTS[2] * limit, 4)]
    assert [len(decoder.rows), len(decoder.waiting)] == [2, 0]  # refused at once: never queued for a slot
    updates = decoder.step()
    assert {u.request.id for u in updates if u.finished} >= {r.id for r in bad}
    assert all(r.status is Status.FAILED and r.finish_reason == "error" and not r.tokens for r in bad)
    for _ in decoder.run():
        pass
    assert [r.tokens for r in good] == [references[0], references[3]]
    requests = generate_batch(tiny_target, make_draft(tiny_target, True), [PROMPTS[1], [], PROMPTS[4]], 12, settings,
                              max_batch=2, eos_ids=(), layer_ids=LAYER_IDS)
    assert [r.status for r in requests] == [Status.FINISHED, Status.FAILED, Status.FINISHED]
    assert "empty prompt" in requests[1].error
    assert [requests[0].tokens, requests[2].tokens] == [references[1][:12], references[4][:12]]


def test_a_request_cancelled_mid_hold_cycle_frees_its_slot_after_the_cycle(tiny_target, references):
    """With verification held over micro-batches, a cancelled row stays in place until its
    cycle is verified (nothing more is delivered to it), then its slot is freed."""
    settings = DecodeSettings(TreeShape(2, 2, 2, 4), LookupSettings(3, pool_tokens=3), verify="all")
    decoder = BatchDecoder(tiny_target, make_draft(tiny_target, True), settings, max_batch=3, eos_ids=(),
                           layer_ids=LAYER_IDS, fusion=FusionSettings(2))
    requests = [decoder.submit(p, n) for p, n in zip(PROMPTS[:4], MAX_NEW[:4])]
    decoder.step()  # admits three rows, drafts the first micro-batch
    assert decoder._blocks  # mid-cycle
    victim = requests[1]
    seen = len(victim.tokens)
    assert decoder.cancel(victim) and victim.status is Status.CANCELLED
    assert len(decoder.rows) == 3  # still in place: its tree is held with the others
    decoder.step()  # the cycle ends: verified, nothing delivered to the victim, its slot freed and taken
    assert len(victim.tokens) == seen and victim not in [row.request for row in decoder.rows]
    for _ in decoder.run():
        pass
    assert victim.tokens == references[1][:seen]
    assert [requests[i].tokens for i in (0, 2, 3)] == [references[i] for i in (0, 2, 3)]
    assert decoder.batch.cache.lengths == [0, 0, 0]
