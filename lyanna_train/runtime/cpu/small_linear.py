"""Linear layers that use, per number of rows, the fastest of equivalent CPU GEMM forms.

Decoding multiplies a few rows (1 token, or the handful of a draft tree) by each weight.
On CPU, ``F.linear`` computes ``x @ W.T``; for 2..~16 rows MKL then packs the whole
weight on every call (SmolLM2's 49,152-word LM head: 7 ms for 1 row, 13-16 ms for 2-8),
and for 1 row it takes a matrix-vector path that, on weights streamed from memory, is
slower than its GEMM. The same product written ``(W @ x.T).T`` packs only the small
operand (the LM head: 2.5 ms for 2 or 4 rows), and 1 row padded to 2 takes that path too.
oneDNN's GEMM (the op inductor's CPU linear fusion calls) grows slowest with the rows, and
fastest of all when the weight is reordered once into its blocked layout ("packed", kept
beside the module: the state dict does not change, the memory for weights doubles).
Measured on SmolLM2, 2 cores (Zen 4), one target forward after 256 cached tokens, ms:

    tokens                 1     2     4     8    16
    F.linear              40    71    63    71    84
    (W @ x.T).T           42    27    31    53    71
    oneDNN                31    37    39    44    50
    oneDNN, packed        20    24    25    32    37
    best form per count   20    24    25    30    37   (padding: 7 and 8 run as 9)

MKL's own packed GEMM (``cblas_sgemm_pack``, what inductor's CPU freezing calls for fp32)
packs the weight for one row count, so it keeps a copy of the weights per count and runs
only at a few (:data:`MKL_ROWS`, rows padded up to them). On a 2-core Sapphire Rapids Xeon
(AVX512, AMX) it took SmolLM2's linears, ms, against oneDNN's packed form:

    rows                   4     8    16    24    32
    oneDNN, packed        38    48    58    61    69
    MKL, packed           32    40    49    51    58

and in whole decoding, alternated in one process (16 MT-Bench prompts x 64 tokens), plain
decoding ran 1.29x and 1.18x as fast at batch 4 and 8, Lyanna 1.13x and 1.09x.

Which form wins depends on the machine, so :mod:`.cpu_tuning` chooses them by timing whole
forwards. All forms compute the same product, up to float summation order.

The forms are set on a model in place: each ``nn.Linear``'s class becomes
:class:`SmallBatchLinear` (same object, parameters, hooks and state dict; tied weights stay
tied), which ``use_small_batch_linears(model, False)`` undoes. ``torch.compile`` with
inductor's CPU freezing (weights prepacked for oneDNN/MKL) is the library route to the
same end; ``bench/compiled_linears.py`` measures both on the target's verify forward (see
``bench/results/compiled-zen1/`` for the figures and why these forms are kept).

Applied to the target by the CLIs and the benchmark *for every method*, the plain
``target.generate`` baseline included, so speedups compare like with like. CUDA models are
left alone (cuBLAS has no such cliff).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

MAX_ROWS = 32  # row counts with a form (and padding) of their own
LARGE = MAX_ROWS + 1  # the form list's last entry: one form, unpadded, for every count past MAX_ROWS


def _linear(x2: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return F.linear(x2, layer.weight)


def _weight_stationary(x2: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return torch.mm(layer.weight, x2.T).T


def _onednn(x2: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x2, layer.weight, None, "none", [], "")


PACKED = "_packed_weight"  # attribute: (weight version, the weight in oneDNN's blocked layout)


def packed_weight(layer: torch.nn.Linear) -> torch.Tensor:
    """The layer's weight reordered once into oneDNN's blocked layout (redone if the weight
    changed in place): no per-call reorder, so few rows stream it at full memory speed.
    Kept on the module as a plain attribute: not in the state dict, and dropped when the
    module is copied or pickled (an opaque oneDNN tensor can be neither; it is re-made)."""
    version = layer.weight._version
    entry = layer.__dict__.get(PACKED)
    if entry is None or entry[0] != version:
        with torch.inference_mode(False), torch.no_grad():
            entry = version, torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 4)
        layer.__dict__[PACKED] = entry
    return entry[1]


def _onednn_packed(x2: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x2, packed_weight(layer), None, "none", [], "")


MKL_PACKED = "_mkl_packed_weights"  # attribute: {rows: (weight version, MKL's packed weight for that many rows)}
MKL_ROWS = (4, 8, 16, 32)  # the only row counts MKL's packed form runs at (padded to): a copy of the weights each
MKL_MEMORY = 0.25  # the most of the machine's memory those copies may take


def mkl_rows(model: torch.nn.Module) -> tuple[int, ...]:
    """The counts of :data:`MKL_ROWS` MKL's packed form may run at for ``model``, smallest
    first: as many as copies of its linear weights fit in ``MKL_MEMORY`` of the machine's
    memory (SmolLM2's 0.54 GB, four; a 7B target's 28 GB, none). () without MKL."""
    if "mkl_packed" not in FORMS:
        return ()
    weights = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, torch.nn.Linear))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return MKL_ROWS[:int(MKL_MEMORY * memory // max(weights, 1))]


def mkl_packed_weight(layer: torch.nn.Linear, rows: int) -> torch.Tensor:
    """The layer's weight packed by MKL (``cblas_sgemm_pack``) for products of ``rows`` rows,
    made once per count (redone if the weight changed in place). MKL packs for one row
    count: another count would fall back to the plain weight, so each count kept costs a
    copy of the weights; :data:`MKL_ROWS` bounds them. Kept like :func:`packed_weight`'s."""
    version = layer.weight._version
    packs = layer.__dict__.setdefault(MKL_PACKED, {})
    entry = packs.get(rows)
    if entry is None or entry[0] != version:
        with torch.inference_mode(False), torch.no_grad():
            entry = version, torch.ops.mkl._mkl_reorder_linear_weight(layer.weight.detach(), rows)
        packs[rows] = entry
    return entry[1]


def _mkl_packed(x2: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    rows = x2.shape[0]
    return torch.ops.mkl._mkl_linear(x2, mkl_packed_weight(layer, rows), layer.weight, None, rows)


FORMS: dict[str, Callable[[torch.Tensor, torch.nn.Linear], torch.Tensor]] = {
    "linear": _linear, "weight_stationary": _weight_stationary}
if torch.backends.mkldnn.is_available():  # torch built without oneDNN: the two MKL forms only
    FORMS["onednn"] = _onednn
    FORMS["onednn_packed"] = _onednn_packed
if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
    FORMS["mkl_packed"] = _mkl_packed


class SmallBatchLinear(torch.nn.Linear):
    """``nn.Linear`` whose forward, for a few rows, uses ``forms[rows] = (form, padded)``:
    the rows are padded (with copies of the first) to ``padded`` and multiplied in that form,
    because MKL is faster on some counts (2, 4, 8, 16) than on smaller ones; past MAX_ROWS
    (a prefill, a wide verify) every count takes ``forms[LARGE]``'s form, unpadded: on a
    Zen 4, oneDNN's packed weights run a SmolLM2 forward over 48-256 tokens in about half
    F.linear's time (56 / 97 / 244 ms against 112 / 212 / 448 at 48 / 96 / 256,
    ``bench/linear_forms.py``). Same weights, same state dict; set on an existing module by
    :func:`use_small_batch_linears`. ``forms`` is one list shared by every linear of a
    model. Gradients on (training): F.linear."""

    forms: list[tuple[str, int]]

    def __getstate__(self):
        state = dict(super().__getstate__())  # a copy: the default hands out the live __dict__
        state.pop(PACKED, None)
        state.pop(MKL_PACKED, None)
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        form, padded = self.forms[rows] if rows <= MAX_ROWS else (self.forms[LARGE][0], rows)
        if (form == "linear" and padded == rows) or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, x.shape[-1])
        if padded > rows:
            x2 = torch.cat([x2, x2[:1].expand(padded - rows, -1)])
        y = FORMS[form](x2, self)[:rows].contiguous()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def use_small_batch_linears(model: torch.nn.Module, enabled: bool = True) -> list[tuple[str, int]] | None:
    """Turn every ``nn.Linear`` of a CPU ``model`` into a :class:`SmallBatchLinear` (plain
    ``F.linear`` until the forms are chosen) -> the form list they share; ``enabled=False``
    turns them back. None for a model not on the CPU. Called again, it keeps the list."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        return None
    forms = small_batch_forms(model) or [("linear", rows) for rows in range(MAX_ROWS + 1)] + [("linear", 0)]
    for module in model.modules():
        if enabled and type(module) is torch.nn.Linear:
            module.__class__ = SmallBatchLinear
            module.forms = forms
        elif not enabled and type(module) is SmallBatchLinear:
            module.__class__ = torch.nn.Linear
            del module.forms
            module.__dict__.pop(PACKED, None)
            module.__dict__.pop(MKL_PACKED, None)
    return forms if enabled else None


@contextmanager
def stock_linears(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` with torch's own ``nn.Linear`` inside the block (the forms are kept)."""
    swapped = [m for m in model.modules() if type(m) is SmallBatchLinear]
    for m in swapped:
        m.__class__ = torch.nn.Linear
    try:
        yield
    finally:
        for m in swapped:
            m.__class__ = SmallBatchLinear


def small_batch_forms(model: torch.nn.Module) -> list[tuple[str, int]] | None:
    """The form list of a model set up by :func:`use_small_batch_linears` (None otherwise)."""
    return next((m.forms for m in model.modules() if type(m) is SmallBatchLinear), None)


def settle_packing(model: torch.nn.Module) -> None:
    """Once the forms are chosen: pack every weight now for each packed form some row count
    uses (oneDNN's; MKL's, per padded count) — else the first forward at that count pays the
    reorders (~2 s for SmolLM2's 210 linears on 2 cores), charged to whichever request or
    benchmarked method comes first; drop the packed copies no count uses."""
    forms = small_batch_forms(model)
    if forms is None:
        return
    packed = any(form == "onednn_packed" for form, _ in forms)
    mkl_counts = {rows for form, rows in forms if form == "mkl_packed"}
    for module in model.modules():
        if packed and type(module) is SmallBatchLinear:
            packed_weight(module)
        elif not packed:
            module.__dict__.pop(PACKED, None)
        packs = module.__dict__.get(MKL_PACKED, {})
        for rows in set(packs) - mkl_counts:
            del packs[rows]
        if type(module) is SmallBatchLinear:
            for rows in mkl_counts:
                mkl_packed_weight(module, rows)
