"""Batched decoding measured side by side: total tokens/s and per-request latency per batch size.

For each batch size B one workload — ``max(N, B)`` prompts, all submitted at once — is
decoded by every method back to back in one process (the order rotates from one batch
size to the next), or, with ``interleave="steps"``, by our decoders a step each in turn
(:func:`run_interleaved`), so machine noise hits every method alike and the ratios hold:

* ``target``: transformers ``generate`` over the prompts B at a time, left padded (static
  batching, as ``generate`` serves a batch), with the same linear forms as our runtime;
* ``lyanna``: :class:`~lyanna_train.runtime.scheduling.scheduler.BatchDecoder` with at
  most B rows (continuous batching), the exported head, the decoding settings given: each
  row's speculation chosen per iteration (``verify: auto``);
* the fixed choices, each on the same scheduler: ``plain`` (no speculation at all),
  ``lookup`` (prompt lookup only, no draft), ``head`` (the head drafting for every row,
  no lookup or pool candidates; widths fitted to the verify cost), ``pool-off`` (the
  settings given with the head's state pool, α-gate and pool candidates off: the
  design's EAGLE baseline);
* ``lyanna-holdK``: ``lyanna`` with verification held until K micro-batches are drafted
  (:class:`~lyanna_train.runtime.settings.FusionSettings`).

A request's latency runs from the workload's start to its last token (waiting for a slot
included). Beside wall time, each run's CPU time (this process, all threads) is kept: on
a shared machine tokens per CPU-second move less than tokens per second. Greedy outputs are checked token for token against the target decoding each
prompt alone.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..errors import LyannaError
from ..runtime.served_models import without_pool
from ..runtime.pricing.cost import Costs
from ..runtime.scheduling.requests import Status, cut
from ..runtime.scheduling.scheduler import BatchDecoder
from ..runtime.settings import DecodeSettings, FusionSettings, LookupSettings, TreeShape
from .benchmark import fixed_settings, generate_kwargs

BATCH_METHODS = ("target", "plain", "lookup", "head", "pool-off", "lyanna")
FIXED = ("plain", "lookup", "head")  # the fixed choices Lyanna's per-row choice must never lose to
NUMERICS_ONLY = ("target",)  # left padding and B-row GEMMs may change float summation order: reported, not judged


@dataclass
class BatchRun:
    """One method on one workload."""

    tokens: list[list[int]]  # per request, in submission order, cut after EOS
    latencies: list[float]  # per request: seconds from the workload's start to its last token
    wall_time: float
    target_forwards: int = 0  # summed over requests (a fused forward counts once per row in it)
    accept_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    cpu_time: float = 0.0  # this process's CPU seconds (all threads): steadier than wall time on a shared machine


BatchMethod = Callable[[list[list[int]], int, int], BatchRun]  # (prompts, max_new_tokens, batch size) -> run


class _Clock:
    """A transformers streamer that notes when each decoding step's tokens arrive."""

    def __init__(self):
        self.times: list[float] = []  # [0]: the prompt; [k]: after the k-th new token

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def hf_batched(target, settings: DecodeSettings) -> BatchMethod:
    """``target.generate`` over ``batch`` prompts at a time, left padded."""
    eos, extra = generate_kwargs(target, settings)
    pad = extra["pad_token_id"]

    def run(prompts: list[list[int]], max_new_tokens: int, batch: int) -> BatchRun:
        tokens, latencies = [], []
        torch.manual_seed(settings.seed)
        begin, cpu = time.perf_counter(), time.process_time()
        for start in range(0, len(prompts), batch):
            chunk = prompts[start:start + batch]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(chunk):
                ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
            clock = _Clock()
            with torch.inference_mode():
                out = target.generate(ids.to(target.device), attention_mask=mask.to(target.device),
                                      max_new_tokens=max_new_tokens, streamer=clock, **extra)
            for row in out[:, width:].tolist():
                new, _ = cut(row, eos, max_new_tokens)
                tokens.append(new)
                latencies.append(clock.times[min(len(new), len(clock.times) - 1)] - begin)
        wall = time.perf_counter() - begin
        return BatchRun(tokens, latencies, wall, sum(len(t) for t in tokens), cpu_time=time.process_time() - cpu)

    return run


class DecoderMethod:
    """Our scheduler with at most ``batch`` running rows, every prompt submitted at once: run
    whole (``method(prompts, max_new_tokens, batch)``) or a step at a time beside other
    methods' decoders (:func:`run_interleaved`)."""

    def __init__(self, target, draft, settings: DecodeSettings, cost: Costs | None):
        self.target, self.draft, self.settings, self.cost = target, draft, settings, cost

    def decoder(self, batch: int) -> BatchDecoder:
        return BatchDecoder(self.target, self.draft, self.settings, batch, self.cost)

    def __call__(self, prompts: list[list[int]], max_new_tokens: int, batch: int) -> BatchRun:
        return run_interleaved({"run": self.decoder(batch)}, prompts, max_new_tokens)["run"]


def run_interleaved(decoders: dict[str, BatchDecoder], prompts: list[list[int]],
                    max_new_tokens: int) -> dict[str, BatchRun]:
    """Every decoder decodes all ``prompts``, their steps taken in turn (in ``decoders``'
    order) until all are done -> each one's run, timed by its own steps only: its wall and
    CPU time are the sums over its steps, a request's latency the decoder's own time when
    its last token came.

    Drift of the machine then hits every method alike, step by step. Runs one after the
    other are at its mercy: on a shared 2-core Xeon the same run of plain decoding (48
    MT-Bench prompts x 64 tokens, 16 rows) took 23.1 to 32.1 s within half an hour, while
    Lyanna / plain measured with interleaved steps read 0.954, 0.968 and 0.975 in three
    repetitions."""
    requests = {name: [d.submit(p, max_new_tokens) for p in prompts] for name, d in decoders.items()}
    own = dict.fromkeys(decoders, 0.0)
    cpu = dict.fromkeys(decoders, 0.0)
    finished: dict[str, dict[int, float]] = {name: {} for name in decoders}
    while any(not d.idle for d in decoders.values()):
        for name, decoder in decoders.items():
            if decoder.idle:
                continue
            begin, begin_cpu = time.perf_counter(), time.process_time()
            updates = decoder.step(closed=True)
            own[name] += time.perf_counter() - begin
            cpu[name] += time.process_time() - begin_cpu
            for update in updates:
                if update.finished:
                    finished[name].setdefault(update.request.id, own[name])
    runs = {}
    for name, reqs in requests.items():
        failed = next((r for r in reqs if r.status is Status.FAILED), None)
        if failed is not None:
            raise LyannaError(f"prompt {failed.id} was refused: {failed.error}")
        runs[name] = BatchRun([r.tokens for r in reqs], [finished[name].get(r.id, own[name]) for r in reqs], own[name],
                              sum(r.target_forwards for r in reqs), [t for r in reqs for t in r.accept_lengths],
                              [s for r in reqs for s in r.tree_sizes], cpu[name])
    return runs


def check_batch_methods(names, draft_given: bool) -> None:
    unknown = [n for n in names if n not in BATCH_METHODS]
    if unknown or not names or len(set(names)) != len(names):
        raise LyannaError(f"bad methods {list(names)} for --batch-size (choose some of {', '.join(BATCH_METHODS)}, "
                          f"each once)")
    if not draft_given and any(n in ("lyanna", "pool-off", "head") for n in names):
        raise LyannaError("the lyanna, pool-off and head methods need --draft EXPORT_DIR")


def make_batch_methods(names, target, draft, settings: DecodeSettings, cost: Costs | None,
                       holds=(), pld_tokens: int = 10) -> dict[str, BatchMethod]:
    """The named methods, plus ``lyanna-hold<K>`` for every K in ``holds`` (K ≥ 2)."""
    make = {
        "target": lambda: hf_batched(target, settings),
        "lyanna": lambda: DecoderMethod(target, draft, settings, cost),
        "plain": lambda: DecoderMethod(target, None, fixed_settings(settings, "plain"), cost),
        "lookup": lambda: DecoderMethod(target, None, fixed_settings(settings, "lookup", pld_tokens), cost),
        "head": lambda: DecoderMethod(target, draft, fixed_settings(settings, "head"), cost),
        "pool-off": lambda: DecoderMethod(target, without_pool(draft), fixed_settings(settings, "pool-off"), cost),
    }
    methods = {name: make[name]() for name in names}
    for k in holds:
        methods[f"lyanna-hold{k}"] = DecoderMethod(target, draft, replace(settings, fusion=FusionSettings(k, True)), cost)
    return methods


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between order statistics (numpy's default)."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def summarize_run(run: BatchRun, reference: list[list[int]] | None) -> dict:
    tokens = sum(len(t) for t in run.tokens)
    out = {"requests": len(run.tokens), "new_tokens": tokens, "wall_time": run.wall_time,
           "tokens_per_s": tokens / run.wall_time if run.wall_time else 0.0, "cpu_time": run.cpu_time,
           "tokens_per_cpu_s": tokens / run.cpu_time if run.cpu_time else 0.0,
           "latency_mean": statistics.fmean(run.latencies), "latency_p50": percentile(run.latencies, 50),
           "latency_p95": percentile(run.latencies, 95), "tau": tokens / max(run.target_forwards, 1),
           "mean_tree_size": statistics.fmean(run.tree_sizes) if run.tree_sizes else 1.0}
    if reference is not None:
        out["identical"] = sum(a == b for a, b in zip(run.tokens, reference))
    return out


def summarize_passes(runs: list[BatchRun], reference: list[list[int]] | None) -> dict:
    """The pass with the median throughput (its latencies, τ, ... with it), every pass's
    tokens/s beside it, and the fewest identical outputs of any pass."""
    summaries = sorted((summarize_run(run, reference) for run in runs), key=lambda s: s["tokens_per_s"])
    out = dict(summaries[(len(summaries) - 1) // 2])
    out["tokens_per_s_passes"] = [s["tokens_per_s"] for s in summaries]
    if reference is not None:
        out["identical"] = min(s["identical"] for s in summaries)
    return out


def measure(methods: dict[str, BatchMethod], prompts: list[list[int]], batch_sizes: list[int], max_new_tokens: int,
            num_prompts: int, reference: Callable[[list[int]], list[int]] | None = None,
            progress: Callable[[str], None] = lambda line: None, passes: int = 1,
            interleave: str = "runs") -> dict[int, dict[str, dict]]:
    """{batch size: {method: summary}}. ``reference`` gives a prompt's greedy tokens decoded
    alone (None: not checked).

    Each batch size runs every method ``passes`` times, interleaved: the order rotates with
    the batch size and every other pass runs it backwards, so no method always follows the
    same one. A summary is its method's median pass (:func:`summarize_passes`): on a shared
    2-core VM one pass of the same method read 67-93 tok/s within two minutes, more than
    the differences a ratio must tell apart. ``interleave``: "runs", each method's run whole
    in that order; "steps", our decoders' steps in turn (:func:`run_interleaved`), in that
    order, after the methods that cannot step (``target``) have run whole."""
    if passes < 1:
        raise LyannaError(f"passes must be at least 1, got {passes}")
    if interleave not in ("runs", "steps"):
        raise LyannaError(f"interleave is runs or steps, got {interleave!r}")
    results: dict[int, dict[str, dict]] = {}
    refs: dict[int, list[int]] = {}
    for turn, batch in enumerate(batch_sizes):
        work = prompts[:max(num_prompts, batch)]
        if len(work) < batch:
            raise LyannaError(f"batch size {batch} needs {batch} prompts; the set gives {len(prompts)}")
        names = list(methods)
        runs: dict[str, list[BatchRun]] = {name: [] for name in names}
        for rep in range(passes):
            order = names[turn % len(names):] + names[:turn % len(names)]
            order = order if rep % 2 == 0 else order[::-1]
            stepped = [n for n in order if interleave == "steps" and isinstance(methods[n], DecoderMethod)]
            for name in [n for n in order if n not in stepped] + ([tuple(stepped)] if stepped else []):
                # the previous run's decoder freed first: otherwise its caches (hundreds of MB at 16
                # rows), held in a reference cycle until the collector runs, leave the next run to
                # fault in fresh pages (0.25-0.55 s of a ~6.5 s run, whichever method came next)
                gc.collect()
                done = run_interleaved({n: methods[n].decoder(batch) for n in name}, work, max_new_tokens) \
                    if isinstance(name, tuple) else {name: methods[name](work, max_new_tokens, batch)}
                for n, run in done.items():
                    runs[n].append(run)
                    progress(f"batch {batch} {n}{f' (pass {rep + 1}/{passes})' if passes > 1 else ''}: "
                             f"{sum(map(len, run.tokens)) / run.wall_time:.1f} tok/s")
        want = None
        if reference is not None:
            if batch == 1 and "target" in runs:  # target.generate of one prompt, unpadded: the reference itself
                refs.update((i, t) for i, t in enumerate(runs["target"][0].tokens) if i not in refs)
            for i, p in enumerate(work):  # after the timed runs: not measured
                if i not in refs:
                    refs[i] = reference(p)
            want = [refs[i] for i in range(len(work))]
        results[batch] = {name: summarize_passes(runs[name], want) for name in names}
        base = results[batch].get("target", {})
        for s in results[batch].values():
            s["vs_target"] = s["tokens_per_s"] / base["tokens_per_s"] if base.get("tokens_per_s") else None
            s["vs_target_cpu"] = s["tokens_per_cpu_s"] / base["tokens_per_cpu_s"] if base.get("tokens_per_cpu_s") \
                else None
    return results


def ratio_lines(results: dict[int, dict[str, dict]]) -> list[str]:
    """Per batch size: Lyanna against target-only, against each fixed choice and against
    the best of them (its target: never below 0.98 of the best fixed choice)."""
    lines = []
    for batch, rows in results.items():
        lyanna = rows.get("lyanna", {}).get("tokens_per_s")
        parts = []
        if lyanna:
            for other in ("target",) + FIXED + ("pool-off",):
                if rows.get(other, {}).get("tokens_per_s"):
                    parts.append(f"lyanna/{other} {lyanna / rows[other]['tokens_per_s']:.2f}×")
            fixed = {n: rows[n]["tokens_per_s"] for n in FIXED if rows.get(n, {}).get("tokens_per_s")}
            if fixed:
                best = max(fixed, key=fixed.get)
                r = lyanna / fixed[best]
                parts.append(f"lyanna/best fixed ({best}) {r:.2f}× (target ≥ 0.98: {'met' if r >= 0.98 else 'MISSED'})")
        for name, s in rows.items():
            if name.startswith("lyanna-hold") and lyanna:
                parts.append(f"{name}/lyanna {s['tokens_per_s'] / lyanna:.2f}×")
        lines.append(f"batch {batch}: " + "; ".join(parts))
    return lines


def lossless_lines(results: dict[int, dict[str, dict]]) -> tuple[list[str], bool]:
    """-> (one line per differing method and batch size, whether every judged method is identical)."""
    lines, ok = [], True
    for batch, rows in results.items():
        for name, s in rows.items():
            if "identical" in s and s["identical"] < s["requests"]:
                judged = name not in NUMERICS_ONLY
                ok &= not judged
                lines.append(f"  batch {batch} {name}: {s['identical']}/{s['requests']} identical to the target alone"
                             + ("" if judged else " (left padding / batched GEMMs: float order, not judged)"))
    checked = any("identical" in s for rows in results.values() for s in rows.values())
    head = "lossless: not checked" if not checked else "lossless: yes" if ok else "lossless: NO"
    return [head] + lines, ok
