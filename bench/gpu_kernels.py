"""Benchmark: the runtime's Triton kernels vs their torch references, at serving shapes.

For each kernel, per shape, in µs (``triton.testing.do_bench``, median):

* hot head (H=4096, V=1600 hot tokens = 5% of 32000, k=10, N=1..64 tree nodes):
  ``triton`` (fused norm + LM head + top-k + logsumexp), ``ref`` (the torch reference:
  norm, F.linear, topk, logsumexp) and ``eager`` (what the draft does without the
  kernel: ``lm_head(norm(h))`` -> softmax -> topk, probabilities materialised);
* pool fusion (H=4096, S=512 slots, gate width 64, B=1..32 sequences): ``triton`` (one
  kernel), ``ref`` (the torch reference) and ``eager`` (``best_match`` + ``AlphaGate``
  module + ``fuse``, the model code);

with the ratios ref/triton and eager/triton (> 1: the kernel is faster), after checking
that the kernel agrees with the reference. ``--compile`` adds ``torch.compile(ref)``.
Needs a CUDA device; says so and exits otherwise.

Usage: python bench/gpu_kernels.py [--dtype bf16] [--block-v 32,64,128] [--compile]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

DEVICE = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def bench_us(fn) -> float:
    from triton.testing import do_bench

    return 1000.0 * do_bench(fn, warmup=25, rep=200, return_mode="median")


def row(cells, ratios: int = 0) -> str:
    """Right-aligned cells; floats as µs with one decimal, the last ``ratios`` as ×."""
    out = [f"{c:>10.1f}" if isinstance(c, float) else f"{c:>10}" for c in cells[:len(cells) - ratios]]
    return " ".join(out + [f"{c:>9.2f}x" for c in cells[len(cells) - ratios:]])


def hot_head_table(dtype, block_vs: list[int], compile_ref: bool) -> None:
    from lyanna_train.runtime.kernels import hot_head_topk_reference, hot_head_topk_triton, rms_norm

    h, v, k, eps = 4096, 1600, 10, 1e-5
    torch.manual_seed(0)
    norm = (1 + 0.1 * torch.randn(h, device=DEVICE)).to(dtype)
    weight = (torch.randn(v, h, device=DEVICE) / h**0.5).to(dtype)
    ref = torch.compile(hot_head_topk_reference) if compile_ref else None

    def eager(x):
        probs = F.linear(rms_norm(x, norm, eps), weight).float().softmax(-1)
        return probs.topk(k, dim=-1)

    print(f"\nhot head: H={h} V={v} k={k} {dtype}")
    heads = ["N", *(f"triton/{b}" for b in block_vs), "ref", "eager"] + (["compiled"] if ref else [])
    print(row(heads + ["ref/tri", "eager/tri"]))
    for n in (1, 4, 16, 64):
        x = torch.randn(n, h, device=DEVICE).to(dtype)
        want = hot_head_topk_reference(x, norm, eps, weight, k)
        times = []
        for b in block_vs:
            got = hot_head_topk_triton(x, norm, eps, weight, k, block_v=b)
            err = (got[0] - want[0]).abs().max().item()
            if err > 0.1:
                print(f"  block_v={b}: top-k values off by {err:.3g}", file=sys.stderr)
            times.append(bench_us(lambda b=b: hot_head_topk_triton(x, norm, eps, weight, k, block_v=b)))
        t_ref = bench_us(lambda: hot_head_topk_reference(x, norm, eps, weight, k))
        t_eager = bench_us(lambda: eager(x))
        extra = [bench_us(lambda: ref(x, norm, eps, weight, k))] if ref else []
        best = min(times)
        print(row([n, *times, t_ref, t_eager, *extra, t_ref / best, t_eager / best], ratios=2))


def pool_table(dtype, compile_ref: bool) -> None:
    from lyanna_train.models.alpha_gate import AlphaGate, fuse
    from lyanna_train.models.state_pool import best_match
    from lyanna_train.runtime.kernels import pool_fusion_reference, pool_fusion_triton

    h, s, width, threshold, alpha_max = 4096, 512, 64, 0.85, 0.3
    torch.manual_seed(0)
    gate = AlphaGate(h, width, alpha_max).to(device=DEVICE, dtype=dtype).requires_grad_(False)
    weights = (gate.proj.weight, gate.proj.bias, gate.out.weight, gate.out.bias)
    ref = torch.compile(pool_fusion_reference) if compile_ref else None

    def eager(cur, pool, allowed):
        sim, ret = best_match(cur[:, None], pool, allowed[:, None])
        hit = sim >= threshold
        alpha = gate(cur[:, None], ret, sim.clamp(min=-1.0)) * hit
        return fuse(cur[:, None], ret, alpha)

    print(f"\npool fusion: H={h} S={s} W={width} {dtype}")
    print(row(["B", "triton", "ref", "eager"] + (["compiled"] if ref else []) + ["ref/tri", "eager/tri"]))
    for b in (1, 4, 8, 32):
        cur = torch.randn(b, h, device=DEVICE).to(dtype)
        pool = torch.randn(b, s, h, device=DEVICE).to(dtype)
        pool[:, 7] = (1.5 * cur).to(dtype)  # one hit per sequence
        allowed = torch.rand(b, s, device=DEVICE) < 0.9
        allowed[:, 7] = True
        args = (cur, pool, allowed, threshold, *weights, alpha_max)
        got, want = pool_fusion_triton(*args), pool_fusion_reference(*args)
        if not torch.equal(got[3], want[3]) or (got[0].float() - want[0].float()).abs().max().item() > 0.1:
            print("  pool fusion disagrees with its reference", file=sys.stderr)
        t_tri = bench_us(lambda: pool_fusion_triton(*args))
        t_ref = bench_us(lambda: pool_fusion_reference(*args))
        t_eager = bench_us(lambda: eager(cur, pool, allowed))
        extra = [bench_us(lambda: ref(*args))] if ref else []
        print(row([b, t_tri, t_ref, t_eager, *extra, t_ref / t_tri, t_eager / t_tri], ratios=2))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--block-v", default="32,64", help="hot-head vocabulary block widths to try")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(reference)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_kernels.py: no CUDA device, nothing to time (the kernels' CPU checks are "
                 "tests/runtime/test_kernels.py under the Triton interpreter)")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("gpu_kernels.py: triton is not installed")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; times in µs")
    with torch.inference_mode():
        hot_head_table(DTYPES[args.dtype], [int(b) for b in args.block_v.split(",")], args.compile)
        pool_table(DTYPES[args.dtype], args.compile)


if __name__ == "__main__":
    main()
