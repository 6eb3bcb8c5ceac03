"""How the feature cache stores the target's hidden states: bf16, or fp8 with a scale per token.

``data.feature_dtype`` picks one; the cache writer encodes with :func:`store_rows` and
every reader decodes with :func:`read_rows`, so a shard means the same thing to the
writer, to training and to the hybrid mode that fills shards inside training steps.

fp8 is ``float8_e4m3fn`` (3 mantissa bits: at most 6.25 % rounding per value, finite up to
448) with one fp32 scale per token and per captured layer (``aux_scale`` [N, k],
``last_scale`` [N, 1]): each token's largest value in a layer maps to 448. Why per token
and not one scale per tensor: a shard's few attention-sink positions carry activations
~100x the others (SmolLM2's first token: norm 25,000 against ~150 at layer 14), so a
tensor-wide scale pushes every ordinary token down e4m3's exponent range, toward its
subnormals; per token, each keeps the full relative precision (measured on SmolLM2
ShareGPT features: relative error 0.020 per token, 0.024 per tensor; bf16's is 0.0016).
Per layer as well, because the residual stream grows with depth (layer norms ~66, ~150,
~550 at SmolLM2's captured layers 1, 14, 26), and a row scale also streams: a batch of
rows is encoded alone, with no shard-wide maximum to wait for. The scales cost 4 bytes
per (token, layer): 16 of SmolLM2's 2,333 bytes per token, against 4,621 in bf16.
"""

from __future__ import annotations

import torch

from ..errors import LyannaError

FEATURE_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
DEFAULT = "bfloat16"
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SCALED = ("aux", "last")  # the hidden-state tensors; the others (ids, mask, teacher summary) are stored as they are
READ_DTYPE = torch.bfloat16  # what readers get back either way: what training has always read


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``data.feature_dtype`` ``name`` (one line naming the choices otherwise)."""
    if name not in FEATURE_DTYPES:
        raise LyannaError(f"unknown feature dtype {name!r} (choose from {', '.join(FEATURE_DTYPES)})")
    return FEATURE_DTYPES[name]


def scaled(name: str) -> bool:
    return storage_dtype(name) != READ_DTYPE


def scale_description(name: str) -> str | None:
    """What the manifest records about the scales (None for bf16: there are none)."""
    if not scaled(name):
        return None
    return "fp32 per token and per captured layer (aux_scale [N, k], last_scale [N, 1]): amax / 448"


def bytes_per_value(name: str) -> int:
    return storage_dtype(name).itemsize


def scale_bytes_per_token(name: str, layers: int) -> int:
    """Bytes of the scales per token: one fp32 per captured layer (aux) and one for last."""
    return 4 * (layers + 1) if scaled(name) else 0


def empty_rows(name: str, tokens: int, widths: dict[str, int], groups: dict[str, int]) -> dict[str, torch.Tensor]:
    """Uninitialised storage for ``tokens`` rows of each ``widths`` key (and its scales)."""
    dtype = storage_dtype(name)
    out = {key: torch.empty(tokens, width, dtype=dtype) for key, width in widths.items()}
    if scaled(name):
        out.update({f"{key}_scale": torch.empty(tokens, groups[key], dtype=torch.float32) for key in widths})
    return out


def quantize(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, G*W] -> (fp8 values [n, G*W], fp32 scales [n, G]); x ~= values * scale per group."""
    n = x.shape[0]
    grouped = x.float().reshape(n, groups, -1)
    amax = grouped.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # an all-zero row stays zero
    values = (grouped / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.reshape(n, -1), scale.reshape(n, groups)


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = READ_DTYPE) -> torch.Tensor:
    """Inverse of :func:`quantize`: values [n, G*W], scale [n, G] -> [n, G*W] in ``dtype``."""
    n, groups = scale.shape
    return (values.float().reshape(n, groups, -1) * scale[:, :, None]).reshape(n, -1).to(dtype)


def store_rows(tensors: dict[str, torch.Tensor], key: str, a: int, b: int, x: torch.Tensor) -> None:
    """Write x [b - a, W] into rows ``a:b`` of ``tensors[key]``, encoded as that storage holds it."""
    scale = tensors.get(f"{key}_scale")
    if scale is None:
        tensors[key][a:b] = x
        return
    tensors[key][a:b], scale[a:b] = quantize(x, scale.shape[1])


def read_rows(tensors: dict[str, torch.Tensor], key: str, a: int, b: int) -> torch.Tensor:
    """Rows ``a:b`` of feature ``key`` decoded (bf16); other per-token tensors as stored."""
    scale = tensors.get(f"{key}_scale")
    if scale is None:
        return tensors[key][a:b]
    return dequantize(tensors[key][a:b], scale[a:b])
