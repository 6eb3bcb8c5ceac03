"""Hot-vocabulary LM head fused with top-k: the draft's last step without its logits.

A draft step only needs the k best hot tokens and their probabilities, so the Triton
kernel never writes the [N, V] logits: each program scores a (row block, vocabulary
block) tile, keeps its local top-k and logsumexp, and a small torch stage merges them.
:func:`hot_head_topk_reference` is the specification and the CPU fallback; it is what
``DraftHead.score`` computes (``lm_head(norm(h))``) followed by ``topk``/``logsumexp``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

tl = None  # triton.language, bound by lazy_jit() on first use: triton stays optional


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalise in fp32, round back to x's dtype, scale. x [..., H], weight [H]."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def hot_head_topk_reference(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            lm_head_weight: torch.Tensor, k: int):
    """hidden [..., H], norm_weight [H], lm_head_weight [V, H] ->
    (values [..., k] fp32 descending, indices [..., k] int64 into the hot vocabulary,
    logsumexp [...] fp32 of all V logits)."""
    logits = F.linear(rms_norm(hidden, norm_weight, eps), lm_head_weight).float()
    values, indices = torch.topk(logits, k, dim=-1)
    return values, indices, torch.logsumexp(logits, dim=-1)


def _hot_head_kernel(h_ptr, g_ptr, w_ptr, val_ptr, idx_ptr, lse_ptr,
                     N, V, H, NUM_VB, stride_hn, stride_wv, eps,
                     K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                     DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    # For rows n of this block and hot tokens v of this block:
    #   y[n, :]   = g * round_x(h[n, :] * rsqrt(mean_j h[n, j]^2 + eps))      (LlamaRMSNorm, fp32)
    #   z[n, v]   = round_w(sum_j y[n, j] * W[v, j])                          (fp32 accumulation)
    #   lse[n, b] = log sum_{v in block b} exp z[n, v]                        (partial logsumexp)
    #   top-k of z[n, block b] by K max-extraction passes -> values, global indices.
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    local = tl.arange(0, BLOCK_V)
    cols = pid_v * BLOCK_V + local
    row_ok = rows < N
    col_ok = cols < V

    sumsq = tl.zeros([BLOCK_N], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(h_ptr + rows[:, None] * stride_hn + hh[None, :],
                    mask=row_ok[:, None] & (hh < H)[None, :], other=0.0).to(tl.float32)
        sumsq += tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt(sumsq / H + eps)

    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        h_ok = hh < H
        x = tl.load(h_ptr + rows[:, None] * stride_hn + hh[None, :],
                    mask=row_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + hh, mask=h_ok, other=0.0).to(tl.float32)
        xn = (x * rstd[:, None]).to(h_ptr.dtype.element_ty).to(tl.float32)
        y = (g[None, :] * xn).to(w_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols[None, :] * stride_wv + hh[:, None], mask=col_ok[None, :] & h_ok[:, None], other=0.0)
        acc = tl.dot(y.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=PRECISION)

    z = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
    z = tl.where(col_ok[None, :], z, float("-inf"))
    zmax = tl.max(z, axis=1)
    lse = zmax + tl.log(tl.sum(tl.exp(z - zmax[:, None]), axis=1))
    tl.store(lse_ptr + rows * NUM_VB + pid_v, lse, mask=row_ok)

    out = (rows * NUM_VB + pid_v) * K
    for i in tl.static_range(K):
        best = tl.max(z, axis=1)
        arg = tl.argmax(z, axis=1, tie_break_left=True)
        tl.store(val_ptr + out + i, best, mask=row_ok)
        tl.store(idx_ptr + out + i, (pid_v * BLOCK_V + arg).to(tl.int64), mask=row_ok)
        z = tl.where(local[None, :] == arg[:, None], float("-inf"), z)


def hot_head_topk_triton(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         lm_head_weight: torch.Tensor, k: int, block_v: int = 64, block_h: int = 128):
    """Same contract as :func:`hot_head_topk_reference`; hidden [..., H] in any float dtype,
    lm_head_weight [V, H] (its dtype is the matmul's, as in ``F.linear``)."""
    import triton

    from . import lazy_jit

    kernel, interpreted = lazy_jit(_hot_head_kernel)
    lead, hdim = hidden.shape[:-1], hidden.shape[-1]
    v = lm_head_weight.shape[0]
    if lm_head_weight.shape[1] != hdim or norm_weight.shape != (hdim,):
        raise ValueError(f"shapes: hidden {tuple(hidden.shape)}, norm {tuple(norm_weight.shape)}, "
                         f"lm_head {tuple(lm_head_weight.shape)}")
    if not 1 <= k <= v:
        raise ValueError(f"k={k} must be in 1..{v}")
    h = hidden.reshape(-1, hdim)
    h = h if h.stride(-1) == 1 else h.contiguous()
    w = lm_head_weight if lm_head_weight.stride(-1) == 1 else lm_head_weight.contiguous()
    n = h.shape[0]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_h = min(block_h, max(16, triton.next_power_of_2(hdim)))
    num_vb = triton.cdiv(v, block_v)
    dev = h.device
    vals = torch.empty(n, num_vb, k, dtype=torch.float32, device=dev)
    idx = torch.empty(n, num_vb, k, dtype=torch.int64, device=dev)
    lse = torch.empty(n, num_vb, dtype=torch.float32, device=dev)
    if n:
        tl_dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(w.dtype)
        if tl_dtype is None:
            raise ValueError(f"lm_head weight dtype {w.dtype}: fp32, bf16 or fp16 only")
        # The interpreter multiplies bf16 tiles as raw uint16: upcast its exact values instead.
        dot_dtype = tl.float32 if interpreted and w.dtype == torch.bfloat16 else tl_dtype
        kernel[(triton.cdiv(n, block_n), num_vb)](
            h, norm_weight.contiguous(), w, vals, idx, lse, n, v, hdim, num_vb, h.stride(0), w.stride(0), float(eps),
            K=k, BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h, DOT_DTYPE=dot_dtype,
            PRECISION="ieee" if dot_dtype == tl.float32 else "tf32")
    top, pos = vals.reshape(n, num_vb * k).topk(k, dim=-1)
    indices = idx.reshape(n, num_vb * k).gather(1, pos)
    return top.reshape(*lead, k), indices.reshape(*lead, k), torch.logsumexp(lse, dim=-1).reshape(lead)
