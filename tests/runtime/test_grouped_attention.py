"""Attention in runs of rows (each over its own keys): where the cuts fall, and decoding through it stays lossless."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.runtime.scheduling.scheduler import BatchDecoder
from lyanna_train.runtime.settings import DecodeSettings, LookupSettings, TreeShape
from lyanna_train.runtime.verification import grouped_attention, target_step
from lyanna_train.runtime.verification.grouped_attention import row_groups

from .conftest import LAYER_IDS, V, greedy_reference


def _check_cover(groups, keys):
    """Runs are contiguous, cover every row once, and each holds its longest row's keys."""
    assert groups[0][0] == 0 and groups[-1][1] == len(keys)
    for (_, end, _), (first, _, _) in zip(groups, groups[1:]):
        assert end == first
    for first, end, top in groups:
        assert end > first and top == max(keys[first:end])


def test_rows_of_one_length_stay_one_run():
    keys = [300] * 8
    assert row_groups(keys, 4) == [(0, 8, 300)]


def test_one_long_row_gets_its_own_run_when_the_saving_pays_for_a_call():
    keys = [40, 35, 1800, 38, 30, 36]
    groups = row_groups(keys, 1, call_pairs=300)
    _check_cover(groups, keys)
    assert (2, 3, 1800) in groups  # the long row alone: no short row reads its 1800 slots
    # the same cut saving fewer pairs than a call costs is not made
    assert row_groups([40, 35, 60, 38], 1, call_pairs=300) == [(0, 4, 60)]


def test_more_new_tokens_make_a_cut_pay_sooner():
    keys = [100, 100, 200, 200]  # a cut in the middle saves 2 x 100 pairs per new token
    assert len(row_groups(keys, 1, call_pairs=300)) == 1
    assert row_groups(keys, 2, call_pairs=300) == [(0, 2, 100), (2, 4, 200)]


def _attended(groups):
    return sum((end - first) * top for first, end, top in groups)


def test_cuts_stop_at_max_groups_and_take_the_largest_saving_first():
    keys = [10, 1000, 20, 2000, 30, 3000, 40, 4000]
    # the best single cut: 5 x 2000 + 3 x 4000 slots (a cut before the last row keeps 7 x 3000)
    assert row_groups(keys, 4, call_pairs=1, max_groups=2) == [(0, 5, 2000), (5, 8, 4000)]
    groups = row_groups(keys, 4, call_pairs=1, max_groups=3)
    _check_cover(groups, keys)
    assert len(groups) == 3 and 5 in {first for first, _, _ in groups}  # the first cut stays
    assert _attended(groups) < _attended(row_groups(keys, 4, call_pairs=1, max_groups=2))


# One long prompt among short ones: the short rows' attention runs over their own keys.
LONG = [1] + [int(t) for t in torch.randint(2, V, (180,), generator=torch.Generator().manual_seed(3))]
PROMPTS = [[1, 17, 200, 5, 99], LONG, [1, 250, 3, 3, 8], [1, 33, 34], [1, 5, 6, 7, 5, 6, 7]]
MAX_NEW = [20, 14, 24, 18, 16]


@pytest.mark.parametrize("shape", [pytest.param(TreeShape(0, 1, 1, 0), id="plain"),
                                   pytest.param(TreeShape(3, 2, 2, 6), id="tree", marks=pytest.mark.slow)])
def test_a_batch_with_a_long_row_decodes_in_runs_and_stays_lossless(tiny_target, request, monkeypatch, shape):
    assert tiny_target.config._attn_implementation == "sdpa"
    cuts, short_calls = [], []
    real_groups, real_sdpa = row_groups, grouped_attention.sdpa_attention_forward

    def spy_groups(keys, new_tokens, **kw):
        groups = real_groups(keys, new_tokens, **kw)
        cuts.append(len(groups))
        return groups

    def spy_sdpa(module, query, key, *args, **kwargs):
        short_calls.append(key.shape[-2])
        return real_sdpa(module, query, key, *args, **kwargs)

    monkeypatch.setattr(target_step, "row_groups", spy_groups)
    monkeypatch.setattr(grouped_attention, "sdpa_attention_forward", spy_sdpa)
    draft = request.getfixturevalue("tiny_fitted")[True] if shape.depth else None  # drafts the target accepts
    settings = DecodeSettings(shape, LookupSettings(4, pool_tokens=4), verify="all")
    decoder = BatchDecoder(tiny_target, draft, settings, 4, eos_ids=(), layer_ids=LAYER_IDS)
    requests = [decoder.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    with torch.inference_mode():
        while not decoder.idle:
            decoder.step()
        want = [greedy_reference(tiny_target, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    assert [r.tokens for r in requests] == want
    assert max(cuts) > 1 and short_calls  # runs were used...
    assert min(short_calls) < len(LONG)  # ...and a short run read fewer keys than the long row holds
    assert tiny_target.config._attn_implementation == "sdpa"  # the switch is undone after each forward
