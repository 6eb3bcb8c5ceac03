"""CPU tuning, in one place: each linear's GEMM form per row count (:mod:`.small_linear`),
the target's verify cost per token count and the head's draft cost per drafting row
count (:class:`..pricing.cost.Costs`), all found by timing whole forwards of the runtime's
own path, and kept on disk per machine, torch version, target and draft.

Timing one layer alone misleads (its weight stays in cache, unlike in a forward over the
whole model), so every choice times the model's own forward: the target's over N new
tokens after ``CONTEXT`` cached ones, the draft's step 0 over N anchors, and a whole
drafting iteration (candidate tree plus step 0) for R rows at once in the decoding's tree
shape. That takes about a minute on SmolLM2 and 2 cores; the result is written to
``$LYANNA_CACHE/cpu_tuning/<key>.json`` and read back by the next process with the same
key (CPU model, core and thread counts, torch version, target fingerprint and dtype), so
CLIs start in seconds after the first run. ``retune=True`` measures again (a machine that
was busy the first time).

The target's part (its forms and verify cost) is kept apart from the draft's (its forms,
drafting and catch-up costs, keyed by the draft too), so every process on one target
decodes with the same target forms, with a draft or without. When each kept its own, a
``--no-draft`` server and a speculative one decoded plainly with forms timed apart: at
16 rows one padded its linears to 20 rows, the other to 16, and the comparison read 0.84x
where it measured the noise of two tunings.

Nothing here runs inside decoding: :func:`tune` returns the costs, and the caller hands
them to the decoder (:class:`..scheduling.scheduler.BatchDecoder`). The draft cost is kept
per tree shape: a new shape times only that (a few seconds).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from ...atomic import write_json_atomic
from ...models.draft_head import DraftHead
from ..drafting.state import BatchDraftState, extend_rows
from ..drafting.tree import draft_trees
from ..pricing.cost import Costs, DraftCost, VerifyCost
from ..verification.ragged_cache import RaggedCache
from ..settings import TreeShape
from ..verification.masks import ragged_mask
from ..verification.target_step import ragged_forward
from ..token_tree import TokenTree
from .small_linear import FORMS, LARGE, MAX_ROWS, mkl_rows, settle_packing, small_batch_forms, use_small_batch_linears

SIZES = tuple(range(1, 17)) + (20, 24, 28, 32, 48, 64, 128)  # target tokens per verify forward (128: a prefill's form)
DRAFT_SIZES = tuple(range(1, 17)) + (64,)  # anchors accepted at once, or tree nodes of one level (64: a catch-up)
DRAFT_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)  # rows drafting at once (the draft cost's sizes)
ACCEPTED = 2  # anchors each drafting row extends by per timed iteration (a typical accepted run)
CONTEXT = 256  # cached tokens before the timed forward
REPEATS = 3  # best of: the run least disturbed by other work
ROUNDS = 5  # the forms' interleaved rounds, whose median counts (see choose_forms)
FORMAT = 7  # 4: the form list's LARGE entry; 5: forms timed in interleaved rounds; 6: MKL's packed form; 7: medians


def choose_forms(forms: list[tuple[str, int]], time_forward: Callable[[int], float], sizes,
                 rounds: int = ROUNDS, mkl: Sequence[int] = ()) -> list[float]:
    """Time a whole forward ``time_forward(rows)`` (seconds) in each form at each row count
    of ``sizes`` (increasing, from 1), the median of ``rounds`` rounds; then give every count up
    to MAX_ROWS the fastest (form, measured count >= it), and the counts past MAX_ROWS
    (``forms[LARGE]``) the form fastest over the measured ones there (``F.linear`` if none
    was) -> the resulting seconds at each of ``sizes``. MKL's packed form is timed only at
    the counts ``mkl`` (:func:`.small_linear.mkl_rows`: it keeps a copy of the weights per
    count), never past MAX_ROWS.

    Each round times every (form, count) once, in turn, the order reversed every other
    round: a stretch of a busy or slowing machine then falls on one round of every choice,
    which the median of the rounds leaves out. (Timed count by count, best of 3 in a row, a
    2-core VM that drifted by ~25 % within minutes priced a 4-token verify at 1.39x or 1.15x
    a 2-token one on two tunings and gave 4 tokens a form 16 % slower than F.linear there.)
    The median, not the best: the policy weighs these prices against each other, so they
    must be what a forward usually takes. On a 2-core Xeon whose forwards ran in bursts
    (one token: 38 ms at best, 47 in the median of 7 rounds), the best of 3 rounds priced
    16 tokens at 1.05x 8 tokens; the medians of 7 were 84 and 70 ms (1.21x), as in the
    decoder's own iterations, and the policy chose 16-token verifies that did not pay."""
    if sizes[0] != 1:
        raise ValueError("sizes must start at 1")
    cases = [(form, rows) for rows in sizes for form in FORMS if form != "mkl_packed" or rows in mkl]
    runs = {case: [] for case in cases}  # (form, rows) -> seconds of each round
    for turn in range(rounds):
        for form, rows in cases if turn % 2 == 0 else cases[::-1]:
            forms[min(rows, LARGE)] = (form, rows if rows <= MAX_ROWS else 0)
            runs[form, rows].append(time_forward(rows))
    timed = {case: statistics.median(seconds) for case, seconds in runs.items()}
    large = [rows for rows in sizes if rows > MAX_ROWS]
    everywhere = [f for f in FORMS if all((f, rows) in timed for rows in large)]  # MKL's packed form: a few counts
    forms[LARGE] = (min(everywhere, key=lambda f: sum(timed[f, rows] for rows in large)) if large else "linear", 0)
    best = None
    for rows in range(MAX_ROWS, 0, -1):  # the cheapest choice among counts >= rows
        here = [key for key in timed if key[1] == rows]
        if here:
            fastest = min(here, key=timed.get)
            best = fastest if best is None or timed[fastest] <= timed[best] else best
        forms[rows] = best or forms[LARGE][:1] + (rows,)  # past the largest measured count: the large form
    return [timed[forms[rows]] if rows <= MAX_ROWS else timed[forms[LARGE][0], rows] for rows in sizes]


def _wait(device: torch.device) -> None:
    """Until the work queued on ``device`` is done: a GPU returns before its kernels have run."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def target_timer(target, context: int = CONTEXT, repeats: int = REPEATS) -> Callable[[int], float]:
    """-> time(n): seconds of one target forward over n new tokens after ``context`` cached
    ones, through the runtime's ragged cache and masks (what a verify runs)."""
    vocab, device = target.config.vocab_size, target.device
    cache = RaggedCache.for_model(target, 1, capacity=context + max(SIZES))

    def forward(n: int) -> None:
        offsets = cache.begin(slice(0, 1), n)
        chain = torch.arange(-1, n - 1)[None]
        ragged_forward(target, None, cache, torch.randint(0, vocab, (1, n), device=device),
                       offsets[:, None] + torch.arange(n, device=device), ragged_mask(offsets, chain, cache.plan.kv_length))

    with torch.inference_mode():
        forward(context)
        cache.advance(0, context)

    def time_forward(n: int) -> float:
        best = float("inf")
        with torch.inference_mode():
            for _ in range(repeats):
                start = time.perf_counter()
                forward(n)
                _wait(device)
                best = min(best, time.perf_counter() - start)
        return best

    return time_forward


def _filled_draft_state(draft: DraftHead, rows: int, context: int) -> BatchDraftState:
    """``rows`` rows of ``context`` random anchors each (what decides the timings is the shape)."""
    weight = draft.fc.weight
    state = BatchDraftState(draft, rows, capacity=context + 64)
    aux = torch.randn(rows, context, draft.fc.in_features, dtype=weight.dtype, device=weight.device)
    ids = torch.randint(0, draft.cfg.vocab_size, (rows, context), device=weight.device)
    with torch.inference_mode():
        extend_rows(draft, state, slice(0, rows), aux, ids, [context] * rows)
    return state


def draft_timer(draft: DraftHead, context: int = CONTEXT, repeats: int = REPEATS) -> Callable[[int], float]:
    """-> time(n): seconds of the draft's step 0 over n anchors of one row after ``context``
    cached ones, on random features (what decides the draft's GEMM forms)."""
    state = _filled_draft_state(draft, 1, context)
    weight = draft.fc.weight

    def time_extend(n: int) -> float:
        aux = torch.randn(1, n, draft.fc.in_features, dtype=weight.dtype, device=weight.device)
        ids = torch.randint(0, draft.cfg.vocab_size, (1, n), device=weight.device)
        best = float("inf")
        with torch.inference_mode():
            for _ in range(repeats):
                start = time.perf_counter()
                extend_rows(draft, state, slice(0, 1), aux, ids, [n])
                _wait(weight.device)
                best = min(best, time.perf_counter() - start)
        return best

    return time_extend


def time_catch_up(draft: DraftHead, anchors: int = 64, context: int = CONTEXT, repeats: int = REPEATS) -> float:
    """Seconds per anchor of one row's step 0 over ``anchors`` waiting ones (a catch-up)."""
    return draft_timer(draft, context, repeats)(anchors) / anchors


def time_drafting(draft: DraftHead, shape: TreeShape, rows: int, context: int = CONTEXT,
                  repeats: int = REPEATS) -> float:
    """Seconds of one drafting iteration for ``rows`` rows at once: their candidate trees in
    ``shape`` and their step 0 over ``ACCEPTED`` accepted anchors each."""
    state = _filled_draft_state(draft, rows, context)
    weight = draft.fc.weight
    aux = torch.randn(rows, ACCEPTED, draft.fc.in_features, dtype=weight.dtype, device=weight.device)
    ids = torch.randint(0, draft.cfg.vocab_size, (rows, ACCEPTED), device=weight.device)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            trees = [TokenTree.rooted_at(0) for _ in range(rows)]
            start = time.perf_counter()
            draft_trees(draft, state, slice(0, rows), trees, shape)
            extend_rows(draft, state, slice(0, rows), aux, ids, [ACCEPTED] * rows)
            _wait(weight.device)
            best = min(best, time.perf_counter() - start)
    return best


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def tuning_key(target, draft: DraftHead | None, linear_forms: bool) -> dict:
    """What the timings depend on: the machine, torch, the target and the draft's shapes."""
    from ...target.model import target_fingerprint

    return {
        "format": FORMAT, "cpu": _cpu_model(), "cores": os.cpu_count(), "arch": platform.machine(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "linear_forms": linear_forms,
        "target": {"fingerprint": target_fingerprint(target), "dtype": str(target.dtype), "device": str(target.device)},
        "draft": None if draft is None else {"config": draft.cfg.to_dict(), "dtype": str(draft.fc.weight.dtype)},
        "sizes": list(SIZES), "draft_sizes": list(DRAFT_SIZES), "context": CONTEXT,
    }


def tuning_path(key: dict) -> Path:
    from ...target.source import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_root() / "cpu_tuning" / f"{digest}.json"


def _read(path: Path, key: dict) -> dict | None:
    """The stored tuning for ``key``, or None when absent, unreadable or not for this key."""
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or json.loads(json.dumps(key, default=str)) != stored.get("key"):
        return None
    forms = [f for name in ("target_forms", "draft_forms") for f in stored.get(name) or []]
    if any(form not in FORMS for form, _ in forms):  # a form this torch build lacks
        return None
    return stored


def _apply(forms: list | None, stored: list | None) -> None:
    if forms is not None and stored is not None:
        forms[:] = [(form, int(padded)) for form, padded in stored]


def tune(target, draft: DraftHead | None = None, *, shape: TreeShape | None = None, linear_forms: bool = True,
         cache: bool = True, retune: bool = False, say: Callable[[str], None] | None = None) -> Costs:
    """Tune ``target`` (and ``draft``) for this machine -> the costs the speculation policy weighs.

    With ``linear_forms`` (and a CPU model) every ``nn.Linear`` gets its fastest GEMM form
    per row count. The target's verify cost is timed per token count; with a ``draft``
    and the decoding's tree ``shape``, a drafting iteration is timed per drafting row
    count. Each part is read from the on-disk cache when one matches (``cache``), else
    measured (about a minute) and stored; ``retune`` measures again. ``say`` hears one line about
    which of the two happened."""
    say = say or (lambda _: None)
    cpu = target.device.type == "cpu"
    target_forms = use_small_batch_linears(target) if linear_forms and cpu else None
    draft_forms = use_small_batch_linears(draft) if linear_forms and draft is not None and cpu else None
    target_key = tuning_key(target, None, target_forms is not None)
    target_path = tuning_path(target_key)
    stored = _read(target_path, target_key) if cache and not retune else None
    if stored is not None:
        say(f"CPU tuning read from {target_path} (pass --retune to measure again)")
        _apply(target_forms, stored["target_forms"])
    else:
        say("timing the target's forwards per token count (about a minute, once per machine and model; "
            "--stock-linears skips the linear forms)")
        seconds = choose_forms(target_forms, target_timer(target, repeats=1), SIZES, mkl=mkl_rows(target)) \
            if target_forms is not None else \
            [target_timer(target)(n) for n in SIZES]
        stored = {"key": target_key, "seconds": seconds, "target_forms": target_forms,
                  "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if cache:
            _write(target_path, stored)
    if small_batch_forms(target) is not None:
        settle_packing(target)
    verify = VerifyCost(SIZES, stored["seconds"])
    if draft is None:
        return Costs(verify, DraftCost.free(), 0.0)
    return Costs(verify, *_tune_draft(target, draft, draft_forms, shape, cache, retune, say))


def _tune_draft(target, draft: DraftHead, draft_forms, shape: TreeShape | None, cache: bool, retune: bool,
                say: Callable[[str], None]) -> tuple[DraftCost, float]:
    """The draft's part of :func:`tune`: its forms, its drafting cost for ``shape`` and its
    catch-up cost per anchor, kept in a file of their own."""
    key = tuning_key(target, draft, draft_forms is not None)
    path = tuning_path(key)
    stored = _read(path, key) if cache and not retune else None
    changed = stored is None
    if stored is not None:
        _apply(draft_forms, stored["draft_forms"])
    else:
        say("timing the draft's forwards per anchor count (a few seconds, once per machine and draft)")
        if draft_forms is not None:
            choose_forms(draft_forms, draft_timer(draft, repeats=1), DRAFT_SIZES, mkl=mkl_rows(draft))
        stored = {"key": key, "draft_forms": draft_forms, "draft_costs": {},
                  "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if small_batch_forms(draft) is not None:
        settle_packing(draft)
    draft_cost = DraftCost.free()
    if shape is not None and shape.depth and shape.max_nodes:
        name = json.dumps(dataclasses.asdict(shape), sort_keys=True)
        timings = stored.setdefault("draft_costs", {}).get(name)
        if timings is None:
            say(f"timing a drafting iteration per row count for tree {name} (a few seconds, once per shape)")
            timings = stored["draft_costs"][name] = [time_drafting(draft, shape, rows) for rows in DRAFT_ROWS]
            changed = True
        draft_cost = DraftCost(DRAFT_ROWS, timings)
    anchor = stored.get("catch_up_per_anchor")
    if anchor is None:
        anchor = stored["catch_up_per_anchor"] = time_catch_up(draft)
        changed = True
    if cache and changed:
        _write(path, stored)
    return draft_cost, anchor


def _write(path: Path, stored: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, stored)
