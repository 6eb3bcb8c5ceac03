"""Runtime kernels: Triton on CUDA, the pure-torch reference everywhere else.

Each public function takes ``backend``:

* ``"auto"`` (default): the compiled Triton kernel when every tensor is on CUDA, triton
  imports and ``TRITON_INTERPRET`` is off, otherwise the torch reference (so CPU serving
  needs no triton);
* ``"triton"``: the Triton kernel, or an error; CPU tensors need the Triton interpreter,
  i.e. ``TRITON_INTERPRET=1`` set before triton is first imported in the process (triton
  jits its own library -- ``tl.zeros``, ``tl.max``... -- at import; note that importing
  transformers imports triton);
* ``"torch"``: the reference (the specification the kernels are tested against).

Importing this package never imports triton.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .hot_head import hot_head_topk_reference, hot_head_topk_triton, rms_norm
from .pool_fusion import pool_fusion_reference, pool_fusion_triton

__all__ = ["hot_head_topk", "pool_fusion", "hot_head_topk_reference", "pool_fusion_reference",
           "hot_head_topk_triton", "pool_fusion_triton", "rms_norm", "triton_available", "interpreter_ready",
           "use_triton"]

BACKENDS = ("auto", "triton", "torch")
_JITTED: dict = {}


def triton_available() -> bool:
    """Whether triton can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken install, or sys.modules["triton"] = None
        return False


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def interpreter_ready() -> bool:
    """Whether Triton kernels can run on CPU tensors in this process (imports triton)."""
    if not _interpreting() or not triton_available():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def lazy_jit(fn):
    """(``triton.jit(fn)``, interpreted?) made on first use, so the kernel modules import
    without triton: binds ``tl`` in fn's module, and jits once per TRITON_INTERPRET mode
    (triton picks interpreted or compiled when it jits)."""
    import triton
    import triton.language

    fn.__globals__["tl"] = triton.language
    key = (fn, bool(triton.knobs.runtime.interpret))
    if key not in _JITTED:
        _JITTED[key] = triton.jit(fn)
    return _JITTED[key], key[1]


def use_triton(backend: str, *tensors: torch.Tensor) -> bool:
    """Resolve ``backend`` for these tensors; raises when ``"triton"`` cannot run them."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    if backend == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":  # compiled kernels only: the interpreter is for tests, forced with "triton"
        return on_cuda and triton_available() and not _interpreting()
    if not triton_available():
        raise RuntimeError("backend='triton' but triton is not installed")
    if not on_cuda and not interpreter_ready():
        raise RuntimeError("backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
                           "before triton is first imported (importing transformers imports it)")
    return True


def hot_head_topk(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, lm_head_weight: torch.Tensor,
                  k: int, *, backend: str = "auto"):
    """Top-k of the hot-vocabulary logits ``lm_head(rms_norm(hidden))`` without materialising them.

    hidden [..., H], norm_weight [H], lm_head_weight [V, H], 1 <= k <= V ->
    (values [..., k] fp32 descending, indices [..., k] int64 into the hot vocabulary,
    logsumexp [...] fp32 over all V logits: ``probs = exp(values - lse[..., None])``)."""
    if use_triton(backend, hidden, norm_weight, lm_head_weight):
        return hot_head_topk_triton(hidden, norm_weight, eps, lm_head_weight, k)
    return hot_head_topk_reference(hidden, norm_weight, eps, lm_head_weight, k)


def pool_fusion(current: torch.Tensor, pool: torch.Tensor, allowed: torch.Tensor, threshold: float,
                proj_weight: torch.Tensor, proj_bias: torch.Tensor, out_weight: torch.Tensor,
                out_bias: torch.Tensor, alpha_max: float, *, pool_units: torch.Tensor | None = None,
                backend: str = "auto"):
    """Retrieve each sequence's most similar allowed pooled state and α-fuse it (serving).

    current [B, H] or [B, Q, H] (Q queries of sequence b: the nodes of its tree level, one
    pool and window), pool [B, S, H], allowed [B, S] bool (from the pool's positions), the
    AlphaGate's proj [W, 2H+1] + [W] and out [1, W] + [1] ->
    (fused like current, alpha fp32 (0 below ``threshold``), similarity fp32 (-inf where
    nothing is allowed), index int64 slot (-1 where nothing is allowed); each [B] or [B, Q]).
    ``pool_units``: unit(pool) if the caller keeps it (used by the torch reference only)."""
    args = (current, pool, allowed, threshold, proj_weight, proj_bias, out_weight, out_bias, alpha_max)
    if use_triton(backend, current, pool, allowed, proj_weight, proj_bias, out_weight, out_bias):
        return pool_fusion_triton(*args)  # norms on the fly: cheaper than reading kept unit vectors
    return pool_fusion_reference(*args, pool_units)
