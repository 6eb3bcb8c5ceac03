"""Benchmark: the library route (torch.compile, inductor CPU freezing + weight prepacking)
against the hand-written linear forms of ``lyanna_train/runtime/small_linear.py``, on the
target's verify forward.

One target forward over N new tokens (a chain tree: the verify step's mask and positions)
after ``--context`` cached tokens, for every variant, interleaved round by round so the
machine's noise hits all of them alike; best of ``--repeats`` per round, median over rounds.

    python bench/compiled_linears.py [--rounds 5] [--sizes 1,2,4,8,16] [--variants stock,forms,compiled]

Variants: ``stock`` (torch's own nn.Linear), ``forms`` (the measured small-batch forms,
as the CLIs set them up), ``compiled`` (``torch.compile`` with inductor's ``freezing``:
weights folded as constants and prepacked for oneDNN/MKL; one graph per token count, the
most it can do) and ``compiled_dynamic`` (the same with dynamic shapes: one graph for
every count, what a runtime could ship), and ``compiled_dynamic_unfrozen`` (one graph,
without freezing: the only form inductor's on-disk FX graph cache keeps — frozen graphs hold
oneDNN-packed weights, which it cannot pickle, so they compile again in every process). All
run the same forward over a transformers ``StaticCache`` (compile's cache), with the verify
step's tree mask. Each compiled variant reports its compile time and what the on-disk cache
did (hit, miss, bypass): run the script twice to see a restart.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def _verify_inputs(n: int, past: int, capacity: int, vocab: int):
    """A chain of n tokens after ``past`` cached ones: ids, positions, and the verify mask
    [1, 1, n, capacity] (the static cache's whole length; slots past past + n masked)."""
    from lyanna_train.runtime.verification.masks import ragged_mask

    ids = torch.randint(0, vocab, (1, n))
    positions = past + torch.arange(n)[None]
    mask = torch.zeros(1, 1, n, capacity, dtype=torch.bool)
    mask[..., :past + n] = ragged_mask(torch.tensor([past]), torch.arange(-1, n - 1)[None], past + n)
    return ids, positions, mask


def _timer(model, forward, context: int, sizes, repeats: int):
    """-> time(n): best-of-``repeats`` seconds of ``forward`` over n tokens after ``context``.

    A transformers ``StaticCache`` (what ``torch.compile`` of a decoder needs: fixed shapes
    and addresses) is filled once by an eager prefill; each timed forward is cropped away."""
    from transformers import StaticCache

    from lyanna_train.runtime.verification.target_step import cache_kwarg

    torch.manual_seed(0)  # every variant: the same prefill and the same timed tokens (the logits check compares them)
    vocab = model.config.vocab_size
    capacity = context + max(*sizes, 4)  # 4: the logits check
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    kwarg = cache_kwarg(model)
    with torch.no_grad():
        model.forward(input_ids=torch.randint(0, vocab, (1, context)), use_cache=True, logits_to_keep=1,
                      **{kwarg: cache})
    inputs = {n: _verify_inputs(n, context, capacity, vocab) for n in sorted(set(sizes) | {4})}

    def run(n: int) -> torch.Tensor:
        ids, positions, mask = inputs[n]
        logits = forward(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                         **{kwarg: cache}).logits
        cache.crop(-n)
        return logits

    def time_n(n: int) -> float:
        best = float("inf")
        with torch.no_grad():
            for _ in range(repeats):
                start = time.perf_counter()
                run(n)
                best = min(best, time.perf_counter() - start)
        return best

    time_n.logits = lambda n: run(n).clone()
    return time_n


# variant -> (dynamic shapes, freezing)
COMPILED = {"compiled": (False, True), "compiled_dynamic": (True, True), "compiled_dynamic_unfrozen": (True, False)}


def _cache_events() -> dict:
    """Inductor's FX graph cache counters so far in this process (hits, misses, bypasses)."""
    from torch._dynamo.utils import counters

    return {k.removeprefix("fxgraph_cache_"): v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}


def build_variants(names, target, context: int, repeats: int, sizes, retune: bool = False) -> dict:
    import torch._dynamo
    import torch._inductor.config as inductor

    from lyanna_train.runtime.cpu.tuning import tune

    torch._dynamo.config.recompile_limit = 64  # a graph per token count and variant (one code object for all)
    torch._dynamo.config.accumulated_recompile_limit = 1024
    out = {}
    for name in names:
        model = copy.deepcopy(target)
        start = time.perf_counter()
        if name == "stock":
            forward = model.forward
        elif name == "forms":
            tune(model, retune=retune)  # as the CLIs do: the on-disk tuning when this machine has one
            forward = model.forward
        elif name in COMPILED:
            forward = torch.compile(model.forward, dynamic=COMPILED[name][0])
        else:
            raise SystemExit(f"unknown variant {name}")
        before = _cache_events()
        timer = _timer(model, forward, context, sizes, repeats)
        # compile (or warm) every size before any clock counts; freezing: weights as constants,
        # folded and prepacked for the CPU GEMM (oneDNN / MKL); read when a graph is compiled
        with inductor.patch(freezing=name in COMPILED and COMPILED[name][1]):
            for n in sorted(set(sizes) | {4}):  # 4: the logits check below
                timer(n)
        events = {k: v - before.get(k, 0) for k, v in _cache_events().items() if v != before.get(k, 0)}
        print(f"{name}: set up and warmed in {time.perf_counter() - start:.0f} s"
              + (f" (FX graph cache: {events})" if events else ""), flush=True)
        out[name] = timer
    # every variant computes the same logits (a fast wrong graph would be no result)
    reference = out[names[0]].logits(4)
    for name in names[1:]:
        diff = (out[name].logits(4) - reference).abs().max().item()
        print(f"{name}: max |logit - {names[0]}'s| = {diff:.2e} over 4 tokens", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--variants", default="stock,forms,compiled,compiled_dynamic")
    p.add_argument("--sizes", default="1,2,4,8,16")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice); a busy machine is "
                   "measured more steadily on 1")
    p.add_argument("--retune", action="store_true", help="measure the forms' CPU tuning again (as lyanna-generate "
                   "--retune) instead of reading it from the on-disk cache")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from lyanna_train.target.model import load_target_model

    sizes = [int(s) for s in args.sizes.split(",")]
    names = [v.strip() for v in args.variants.split(",")]
    target = load_target_model(args.target)
    timers = build_variants(names, target, args.context, args.repeats, sizes, args.retune)
    times = {(name, n): [] for name in names for n in sizes}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in sizes:
            for name in order:
                times[name, n].append(timers[name](n))
    print(f"\nms per verify forward after {args.context} cached tokens, median of {args.rounds} interleaved rounds "
          f"(best of {args.repeats} each), torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| variant | " + " | ".join(f"{n} tok" for n in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{1e3 * statistics.median(times[name, n]):.1f}" for n in sizes) + " |")
    if "forms" in names:
        for name in names:
            if name != "forms":
                ratios = [statistics.median(times[name, n]) / statistics.median(times["forms", n]) for n in sizes]
                print(f"{name} / forms: " + ", ".join(f"{r:.2f}" for r in ratios))


if __name__ == "__main__":
    main()
