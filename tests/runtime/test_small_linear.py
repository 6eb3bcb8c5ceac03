"""Small-batch linears: every form and padding computes F.linear's product, the choice
follows the timings, the swap is reversible, and decoding through them stays lossless."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lyanna_train.runtime.scheduling.scheduler import generate
from lyanna_train.runtime.cpu.tuning import tune
from lyanna_train.runtime.settings import DecodeSettings, LookupSettings, TreeShape
from lyanna_train.runtime.cpu.small_linear import (FORMS, LARGE, MAX_ROWS, MKL_PACKED, PACKED, SmallBatchLinear,
                                                   settle_packing, small_batch_forms, use_small_batch_linears)

from .conftest import LAYER_IDS, drafted_tokens, greedy_reference


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows,padded", [(1, 1), (1, 2), (3, 4), (5, 8), (7, 7)])
def test_every_form_and_padding_computes_the_linear_product(form, bias, rows, padded):
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(37, 53, bias=bias))
    forms = use_small_batch_linears(layer)
    forms[rows] = (form, padded)
    x = torch.randn(1, rows, 37)
    with torch.inference_mode():
        got = layer(x)
    assert type(layer[0]) is SmallBatchLinear and got.shape == (1, rows, 53)
    torch.testing.assert_close(got, F.linear(x, layer[0].weight, layer[0].bias), rtol=1e-5, atol=1e-5)


def test_training_takes_plain_linear_and_large_batches_the_large_form(monkeypatch):
    layer = torch.nn.Sequential(torch.nn.Linear(8, 4))
    forms = use_small_batch_linears(layer)
    assert len(forms) == LARGE + 1 and forms[LARGE] == ("linear", 0)  # untuned: F.linear everywhere
    forms[:] = [("weight_stationary", MAX_ROWS)] * (MAX_ROWS + 1) + [("onednn_like", 0)]
    monkeypatch.setitem(FORMS, "weight_stationary", lambda *a: pytest.fail("the tuned form ran"))
    calls = []
    monkeypatch.setitem(FORMS, "onednn_like", lambda x2, lin: calls.append(x2.shape[0]) or F.linear(x2, lin.weight))
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()  # gradients on: F.linear
    assert x.grad is not None and not calls
    x = torch.randn(MAX_ROWS + 5, 8)
    with torch.inference_mode():
        got = layer(x)  # past MAX_ROWS: the large form, unpadded
    assert calls == [MAX_ROWS + 5]
    torch.testing.assert_close(got, F.linear(x, layer[0].weight, layer[0].bias))


def test_the_swap_keeps_the_weights_and_is_reversible(tiny_target):
    model = copy.deepcopy(tiny_target)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forms = use_small_batch_linears(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is SmallBatchLinear and m.forms is forms for m in linears)
    assert small_batch_forms(model) is forms and use_small_batch_linears(model) is forms  # set up twice: one list
    assert model.state_dict().keys() == before.keys()
    use_small_batch_linears(model, enabled=False)
    assert all(type(m) is torch.nn.Linear and not hasattr(m, "forms") for m in linears)
    assert small_batch_forms(model) is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("form", [f for f in FORMS if f != "linear"])
@pytest.mark.slow
def test_decoding_through_measured_linears_is_lossless(tiny_target, tiny_fitted, form):
    target = copy.deepcopy(tiny_target)
    draft = copy.deepcopy(tiny_fitted[True])  # fitted: its nodes are accepted; a copy: the forms change it
    expected = greedy_reference(target, [1, 17, 200, 5, 99], 24)
    cost = tune(target, draft, cache=False)
    assert cost.verify.sizes[0] == 1 and small_batch_forms(target) is not None
    assert small_batch_forms(draft) is not None and small_batch_forms(draft) is not small_batch_forms(target)
    # whatever this machine chose, run the tuned forms (padded where it can) in both models
    for forms in (small_batch_forms(target), small_batch_forms(draft)):
        forms[1:] = [(form, max(2, r + r % 2)) for r in range(1, MAX_ROWS + 1)] + [(form, 0)]
    assert greedy_reference(target, [1, 17, 200, 5, 99], 24) == expected  # the baseline sees them too
    settings = DecodeSettings(TreeShape(3, 2, 2, 6), LookupSettings(4, pool_tokens=0), verify="all")
    out = generate(target, draft, [1, 17, 200, 5, 99], 24, settings, eos_ids=(), layer_ids=LAYER_IDS)
    assert out.tokens == expected and drafted_tokens(out) >= 6  # draft nodes verified through the forms, kept


@pytest.mark.skipif("onednn_packed" not in FORMS, reason="torch built without oneDNN")
def test_packed_weights_follow_the_weight_are_made_up_front_and_released():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(16, 8))
    forms = use_small_batch_linears(layer)
    forms[2] = ("onednn_packed", 2)
    settle_packing(layer)  # packed before the first forward that needs it
    assert PACKED in vars(layer[0])
    x = torch.randn(2, 16)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer[0].weight, layer[0].bias), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer[0].weight.mul_(2)  # an in-place change re-packs
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer[0].weight, layer[0].bias), rtol=1e-5, atol=1e-5)
    settle_packing(layer)
    assert PACKED in vars(layer[0])  # still chosen for 2 rows: kept
    twin = copy.deepcopy(layer)  # the opaque packed copy is not copied (it could not be), but re-made
    assert PACKED not in vars(twin[0]) and twin[0].state_dict().keys() == {"weight", "bias"}
    with torch.inference_mode():
        torch.testing.assert_close(twin(x), layer(x), rtol=0, atol=0)
    forms[2] = ("linear", 2)
    settle_packing(layer)
    assert PACKED not in vars(layer[0])


@pytest.mark.skipif("mkl_packed" not in FORMS, reason="torch built without MKL")
def test_mkl_packs_are_one_per_chosen_count_made_up_front_and_released():
    """MKL packs a weight for one row count: a copy per count the forms use, none other."""
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(16, 8))
    forms = use_small_batch_linears(layer)
    forms[3], forms[4], forms[7] = ("mkl_packed", 4), ("mkl_packed", 4), ("mkl_packed", 8)
    settle_packing(layer)
    assert set(vars(layer[0])[MKL_PACKED]) == {4, 8}
    for rows in (3, 4, 7):
        x = torch.randn(rows, 16)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), F.linear(x, layer[0].weight, layer[0].bias), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer[0].weight.mul_(2)  # an in-place change re-packs
    x = torch.randn(4, 16)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer[0].weight, layer[0].bias), rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(layer)  # opaque packs are not copied, but re-made
    assert MKL_PACKED not in vars(twin[0])
    with torch.inference_mode():
        torch.testing.assert_close(twin(x), layer(x), rtol=0, atol=0)
    forms[7] = ("linear", 7)
    settle_packing(layer)
    assert set(vars(layer[0])[MKL_PACKED]) == {4}
    use_small_batch_linears(layer, False)
    assert MKL_PACKED not in vars(layer[0])
