"""State-pool retrieval fused with the α-gate, for serving (Q queries per sequence).

At serving time each sequence asks its pool once per drafted node: the most similar
allowed state, the α-gate on it and the fusion. Every node of a sequence's tree level
drafts from the same anchor, so they share its pool and window: ``current`` holds Q
queries per sequence and the pool is read in place, never copied once per query (on CPU
that copy cost more than the retrieval itself). The Triton kernel does all of it in one
program per query, never writing the [B, Q, S] similarities.
:func:`pool_fusion_reference` is the specification and the CPU fallback: it computes
what ``best_match`` (``models/state_pool.py``) then ``DraftHead.pool_fuse`` (``AlphaGate``
+ ``fuse``) compute, from plain weight tensors so the runtime needs no nn.Module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...models.state_pool import unit

tl = None  # triton.language, bound by lazy_jit() on first use: triton stays optional

_RMS_EPS = 1e-6  # alpha_gate._rms
_NORM_EPS = 1e-12  # F.normalize


def pool_fusion_reference(current: torch.Tensor, pool: torch.Tensor, allowed: torch.Tensor, threshold: float,
                          proj_weight: torch.Tensor, proj_bias: torch.Tensor, out_weight: torch.Tensor,
                          out_bias: torch.Tensor, alpha_max: float, pool_units: torch.Tensor | None = None):
    """current [B, H] or [B, Q, H] (Q queries sharing sequence b's pool and window), pool
    [B, S, H], allowed [B, S] bool, proj [W, 2H+1] + [W], out [1, W] + [1] -> (fused like
    current, in its dtype; alpha, similarity (-inf where no slot is allowed) fp32 and index
    int64 (-1 where no slot is allowed), each [B] or [B, Q]). ``pool_units``: the pool as
    fp32 unit vectors when the caller keeps them (``StatePool.units``), else computed here."""
    single = current.dim() == 2
    queries = current[:, None] if single else current
    sims = unit(queries) @ (unit(pool) if pool_units is None else pool_units).transpose(1, 2)  # [B, Q, S]
    sims = sims.masked_fill(~allowed[:, None], float("-inf"))
    best, index = sims.max(dim=-1)
    retrieved = torch.gather(pool, 1, index[..., None].expand(-1, -1, pool.shape[-1]))
    hit = best >= threshold
    x = torch.cat([_rms(queries), _rms(retrieved), best.clamp(min=-1.0)[..., None].to(queries.dtype)], dim=-1)
    gate = F.linear(F.silu(F.linear(x, proj_weight, proj_bias)), out_weight, out_bias)
    alpha = alpha_max * torch.sigmoid(gate).squeeze(-1) * hit
    a = alpha[..., None].to(queries.dtype)
    fused = a * retrieved + (1 - a) * queries
    out = fused, alpha.float(), best, index.masked_fill(best == float("-inf"), -1)
    return tuple(t[:, 0] for t in out) if single else out


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _RMS_EPS)


def _pool_fusion_kernel(cur_ptr, pool_ptr, ok_ptr, pw_ptr, pb_ptr, ow_ptr, ob_ptr,
                        fused_ptr, alpha_ptr, sim_ptr, idx_ptr,
                        Q, S, H, W, threshold, alpha_max,
                        stride_cb, stride_cq, stride_pb, stride_ps, stride_ob, stride_pw, stride_fb, stride_fq,
                        BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):
    # One program per query: query q of sequence b, c = cur[b, q], pool P = pool[b] (slots s with ok[b, s]):
    #   sim_s = <c, P_s> / (max(|c|, 1e-12) · max(|P_s|, 1e-12)),  i = argmax_s sim_s (first on ties),
    #   sim = sim_i (-inf and i = -1 if no slot is allowed),  r = P_i,
    #   rms(x) = x · rsqrt(mean(x²) + 1e-6),
    #   u = silu(Wp · [rms(c); rms(r); max(sim, -1)] + bp),
    #   α = alpha_max · sigmoid(wo · u + bo) if sim >= threshold else 0,
    #   fused = α · r + (1 − α) · c.
    # The pool is scanned block by block with a per-lane running max; the gate's matvec
    # factors the rms scales out: Wp[:, :H] · rms(c) = rsqrt(mean(c²) + 1e-6) · (Wp[:, :H] · c).
    pid = tl.program_id(0).to(tl.int64)  # b · stride_pb can pass 2³¹
    b = pid // Q
    q = pid % Q
    cur = cur_ptr + b * stride_cb + q * stride_cq
    base = pool_ptr + b * stride_pb

    cc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        c = tl.load(cur + hh, mask=hh < H, other=0.0).to(tl.float32)
        cc += c * c
    c_sq = tl.sum(cc, axis=0)
    c_norm = tl.maximum(tl.sqrt(c_sq), 1e-12)

    lanes = tl.arange(0, BLOCK_S)
    best = tl.full([BLOCK_S], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK_S], -1, tl.int32)
    for s0 in range(0, S, BLOCK_S):
        ss = s0 + lanes
        s_ok = ss < S
        dot = tl.zeros([BLOCK_S], dtype=tl.float32)
        pp = tl.zeros([BLOCK_S], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            c = tl.load(cur + hh, mask=hh < H, other=0.0).to(tl.float32)
            p = tl.load(base + ss[:, None] * stride_ps + hh[None, :],
                        mask=s_ok[:, None] & (hh < H)[None, :], other=0.0).to(tl.float32)
            dot += tl.sum(p * c[None, :], axis=1)
            pp += tl.sum(p * p, axis=1)
        allowed = tl.load(ok_ptr + b * stride_ob + ss, mask=s_ok, other=0) != 0
        sim = tl.where(allowed, dot / (c_norm * tl.maximum(tl.sqrt(pp), 1e-12)), float("-inf"))
        take = sim > best  # strict: each lane keeps its first (smallest) slot on ties
        best_i = tl.where(take, ss, best_i)
        best = tl.where(take, sim, best)
    sim = tl.max(best, axis=0)
    index = tl.min(tl.where(best == sim, best_i, 2147483647), axis=0)  # -1 when nothing is allowed
    ret = base + tl.maximum(index, 0) * stride_ps

    ww = tl.arange(0, BLOCK_W)
    w_ok = ww < W
    zc = tl.zeros([BLOCK_W], dtype=tl.float32)
    zr = tl.zeros([BLOCK_W], dtype=tl.float32)
    rr = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        h_ok = hh < H
        c = tl.load(cur + hh, mask=h_ok, other=0.0).to(tl.float32)
        r = tl.load(ret + hh, mask=h_ok, other=0.0).to(tl.float32)
        m = w_ok[:, None] & h_ok[None, :]
        p1 = tl.load(pw_ptr + ww[:, None] * stride_pw + hh[None, :], mask=m, other=0.0).to(tl.float32)
        p2 = tl.load(pw_ptr + ww[:, None] * stride_pw + H + hh[None, :], mask=m, other=0.0).to(tl.float32)
        zc += tl.sum(p1 * c[None, :], axis=1)
        zr += tl.sum(p2 * r[None, :], axis=1)
        rr += r * r
    r_sq = tl.sum(rr, axis=0)
    p3 = tl.load(pw_ptr + ww * stride_pw + 2 * H, mask=w_ok, other=0.0).to(tl.float32)
    z = (tl.load(pb_ptr + ww, mask=w_ok, other=0.0).to(tl.float32)
         + zc / tl.sqrt(c_sq / H + 1e-6) + zr / tl.sqrt(r_sq / H + 1e-6) + p3 * tl.maximum(sim, -1.0))
    u = z * tl.sigmoid(z)
    o = tl.sum(tl.load(ow_ptr + ww, mask=w_ok, other=0.0).to(tl.float32) * u, axis=0)
    o += tl.load(ob_ptr).to(tl.float32)
    alpha = tl.where(sim >= threshold, alpha_max * tl.sigmoid(o), 0.0)

    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        h_ok = hh < H
        c = tl.load(cur + hh, mask=h_ok, other=0.0).to(tl.float32)
        r = tl.load(ret + hh, mask=h_ok, other=0.0).to(tl.float32)
        f = alpha * r + (1.0 - alpha) * c
        tl.store(fused_ptr + b * stride_fb + q * stride_fq + hh, f.to(fused_ptr.dtype.element_ty), mask=h_ok)
    tl.store(alpha_ptr + pid, alpha)  # [B, Q] outputs, contiguous
    tl.store(sim_ptr + pid, sim)
    tl.store(idx_ptr + pid, index.to(tl.int64))


def _rowmajor(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def pool_fusion_triton(current: torch.Tensor, pool: torch.Tensor, allowed: torch.Tensor, threshold: float,
                       proj_weight: torch.Tensor, proj_bias: torch.Tensor, out_weight: torch.Tensor,
                       out_bias: torch.Tensor, alpha_max: float, block_s: int = 32, block_h: int = 128):
    """Same contract as :func:`pool_fusion_reference`; the gate runs in fp32 whatever the
    weights' dtype (the reference runs it in the model's dtype)."""
    import triton

    from . import lazy_jit

    kernel, _ = lazy_jit(_pool_fusion_kernel)
    b, s, h = pool.shape
    single = current.dim() == 2
    queries = current[:, None] if single else current
    width = proj_weight.shape[0]
    if queries.dim() != 3 or queries.shape[0] != b or queries.shape[2] != h or allowed.shape != (b, s) \
            or proj_weight.shape != (width, 2 * h + 1):
        raise ValueError(f"shapes: current {tuple(current.shape)}, pool {tuple(pool.shape)}, "
                         f"allowed {tuple(allowed.shape)}, proj {tuple(proj_weight.shape)}")
    if s == 0:
        raise ValueError("the pool has no slots")
    queries, pool, proj_weight = _rowmajor(queries), _rowmajor(pool), _rowmajor(proj_weight)
    ok = _rowmajor(allowed).view(torch.uint8)
    n = queries.shape[1]
    fused = torch.empty(b, n, h, dtype=queries.dtype, device=queries.device)
    alpha = torch.empty(b, n, dtype=torch.float32, device=queries.device)
    sim = torch.empty(b, n, dtype=torch.float32, device=queries.device)
    index = torch.empty(b, n, dtype=torch.int64, device=queries.device)
    if b * n:
        kernel[(b * n,)](queries, pool, ok, proj_weight, proj_bias.contiguous(), out_weight.reshape(-1).contiguous(),
                         out_bias, fused, alpha, sim, index, n, s, h, width, float(threshold), float(alpha_max),
                         queries.stride(0), queries.stride(1), pool.stride(0), pool.stride(1), ok.stride(0),
                         proj_weight.stride(0), fused.stride(0), fused.stride(1),
                         BLOCK_S=min(block_s, max(16, triton.next_power_of_2(s))),
                         BLOCK_H=min(block_h, max(16, triton.next_power_of_2(h))),
                         BLOCK_W=max(16, triton.next_power_of_2(width)))
    out = fused, alpha, sim, index
    return tuple(t[:, 0] for t in out) if single else out
