"""fp8 feature storage: the per-token, per-layer scaled e4m3 round trip against its error bound."""

from __future__ import annotations

import pytest
import torch

from lyanna_train.data.feature_dtype import (
    FP8_MAX, dequantize, empty_rows, quantize, read_rows, storage_dtype, store_rows,
)
from lyanna_train.errors import LyannaError

E4M3_REL = 2 ** -4  # half the spacing of 3 mantissa bits, relative to the value
E4M3_SUB = 2 ** -10  # half the subnormal spacing (2^-9), in units of the scale
BF16_REL = 2 ** -8  # decoded rows come back in bf16


def _features(n: int, groups: int, width: int) -> torch.Tensor:
    """Hidden-state-like rows: each layer its own magnitude, a few outlier dimensions, and an
    attention-sink first row ~1000x the others."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, groups, width, generator=g) * torch.tensor([0.5, 3.0, 20.0][:groups]).view(1, -1, 1)
    x[:, :, :3] *= 30
    x[0] *= 1000
    return x.reshape(n, groups * width)


@pytest.mark.parametrize("n,groups,width", [(1, 1, 7), (37, 3, 64), (5, 2, 33)])
def test_round_trip_is_within_e4m3_rounding_of_each_value(n, groups, width):
    x = _features(n, groups, width)
    values, scale = quantize(x, groups)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (n, groups)
    # each (token, layer) uses e4m3's whole range: its largest value lands on 448
    assert torch.equal(values.float().reshape(n, groups, -1).abs().amax(-1), torch.full((n, groups), FP8_MAX))
    back = dequantize(values, scale)
    assert back.dtype == torch.bfloat16
    bound = (E4M3_REL + BF16_REL) * x.abs() + E4M3_SUB * scale.repeat_interleave(width, dim=1)
    assert bool(((back.float() - x).abs() <= bound * 1.001).all())


def test_the_sink_token_does_not_cost_the_others_precision():
    """Per token, the other rows' error is what it is without the sink; one scale per tensor
    (set by the sink) would round them far more coarsely."""
    x = _features(64, 3, 64)
    per_token = dequantize(*quantize(x, 3)).float()
    tensor_scale = x.abs().amax() / FP8_MAX
    per_tensor = (x / tensor_scale).to(torch.float8_e4m3fn).float() * tensor_scale
    rel = lambda y: ((y[1:] - x[1:]).norm(dim=-1) / x[1:].norm(dim=-1)).mean()  # noqa: E731
    assert rel(per_token) < 0.03
    assert rel(per_tensor) > 2 * rel(per_token)


def test_zero_rows_stay_zero_and_bf16_is_stored_as_is():
    values, scale = quantize(torch.zeros(3, 8), 2)
    assert not dequantize(values, scale).any() and bool((scale == 1).all())
    t = empty_rows("bfloat16", 4, {"aux": 6}, {"aux": 2})
    assert set(t) == {"aux"} and t["aux"].dtype == torch.bfloat16
    x = torch.randn(2, 6)
    store_rows(t, "aux", 1, 3, x)
    assert torch.equal(read_rows(t, "aux", 1, 3), x.bfloat16())
    t = empty_rows("float8_e4m3fn", 4, {"aux": 6, "last": 3}, {"aux": 2, "last": 1})
    assert t["aux_scale"].shape == (4, 2) and t["last_scale"].shape == (4, 1)
    store_rows(t, "aux", 1, 3, x)
    torch.testing.assert_close(read_rows(t, "aux", 1, 3).float(), x, rtol=E4M3_REL + BF16_REL, atol=1e-6)
    with pytest.raises(LyannaError, match="unknown feature dtype 'int8'"):
        storage_dtype("int8")
