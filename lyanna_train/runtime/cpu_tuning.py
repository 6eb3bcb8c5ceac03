"""CPU tuning, in one place: each linear's GEMM form per row count (:mod:`.small_linear`)
and the target's verify cost per token count (:class:`.cost.VerifyCost`), both found by
timing whole forwards, and kept on disk per machine, torch version and target.

Timing one layer alone misleads (its weight stays in cache, unlike in a forward over the
whole model), so every choice times the model's own forward: the target's over N new
tokens after ``CONTEXT`` cached ones, the draft's step 0 over N anchors. That takes
~15 s on SmolLM2 and 2 cores; the result is written to
``$LYANNA_CACHE/cpu_tuning/<key>.json`` and read back by the next process with the same
key (CPU model, core and thread counts, torch version, target fingerprint and dtype, the
draft's shape), so CLIs start in seconds after the first run. ``retune=True`` measures
again (a machine that was busy the first time).

Nothing here runs inside decoding: :func:`tune` returns the cost model, and the caller
hands it to :func:`.decode.generate`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import DynamicCache

from ..atomic import write_json_atomic
from ..models.draft_head import DraftHead
from .cost import VerifyCost
from .draft_step import DraftState, draft_extend
from .small_linear import FORMS, MAX_ROWS, settle_packing, small_batch_forms, use_small_batch_linears
from .target_step import crop_cache, target_forward

SIZES = tuple(range(1, 17)) + (20, 24, 28, 32, 48, 64)  # target tokens per verify forward
DRAFT_SIZES = tuple(range(1, 17))  # anchors accepted at once, or tree nodes of one level
CONTEXT = 256  # cached tokens before the timed forward
REPEATS = 3  # best of: the run least disturbed by other work
FORMAT = 1


def choose_forms(forms: list[tuple[str, int]], time_forward: Callable[[int], float], sizes) -> list[float]:
    """Time a whole forward ``time_forward(rows)`` (seconds) in each form at each row count
    of ``sizes`` (increasing, from 1); then give every count up to MAX_ROWS the fastest
    (form, measured count >= it) -> the resulting seconds at each of ``sizes``. Counts past
    the largest measured one keep ``F.linear``."""
    if sizes[0] != 1:
        raise ValueError("sizes must start at 1")
    timed = {}  # (form, rows) -> seconds
    for rows in sizes:
        for form in FORMS if rows <= MAX_ROWS else ("linear",):
            if rows <= MAX_ROWS:
                forms[rows] = (form, rows)
            timed[form, rows] = time_forward(rows)
    best = None
    for rows in range(MAX_ROWS, 0, -1):  # the cheapest choice among counts >= rows
        here = [key for key in timed if key[1] == rows]
        if here:
            fastest = min(here, key=timed.get)
            best = fastest if best is None or timed[fastest] <= timed[best] else best
        forms[rows] = best or ("linear", rows)  # past the largest measured count: untouched
    return [timed[forms[rows]] if rows <= MAX_ROWS else timed["linear", rows] for rows in sizes]


def target_timer(target, context: int = CONTEXT, repeats: int = REPEATS) -> Callable[[int], float]:
    """-> time(n): seconds of one target forward over n new tokens after ``context`` cached ones."""
    vocab = target.config.vocab_size
    cache = DynamicCache(config=target.config)
    with torch.inference_mode():
        target_forward(target, None, cache, torch.randint(0, vocab, (1, context), device=target.device), 1)

    def time_forward(n: int) -> float:
        ids = torch.randint(0, vocab, (1, n), device=target.device)
        best = float("inf")
        with torch.inference_mode():
            for _ in range(repeats):
                start = time.perf_counter()
                target_forward(target, None, cache, ids)
                if target.device.type == "cuda":
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - start)
                crop_cache(cache, context)
        return best

    return time_forward


def draft_timer(draft: DraftHead, context: int = CONTEXT, repeats: int = REPEATS) -> Callable[[int], float]:
    """-> time(n): seconds of the draft's step 0 over n anchors after ``context`` cached ones,
    on random features (what decides the draft's GEMM forms)."""
    state = DraftState(draft, capacity=context + 128)
    weight = draft.fc.weight
    aux = torch.randn(1, context + 64, draft.fc.in_features, dtype=weight.dtype, device=weight.device)
    ids = torch.randint(0, draft.cfg.vocab_size, (1, context + 64), device=weight.device)
    with torch.inference_mode():
        draft_extend(draft, state, aux[:, :context], ids[:, :context], 0)

    def time_extend(n: int) -> float:
        best = float("inf")
        with torch.inference_mode():
            for _ in range(repeats):
                start = time.perf_counter()
                draft_extend(draft, state, aux[:, context:context + n], ids[:, context:context + n], context)
                best = min(best, time.perf_counter() - start)
                state.length = context  # forget the timed anchors
        return best

    return time_extend


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
    from ..target.model import target_fingerprint

    return {
        "format": FORMAT, "cpu": _cpu_model(), "cores": os.cpu_count(), "arch": platform.machine(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "linear_forms": linear_forms,
        "target": {"fingerprint": target_fingerprint(target), "dtype": str(target.dtype), "device": str(target.device)},
        "draft": None if draft is None else {"config": draft.cfg.to_dict(), "dtype": str(draft.fc.weight.dtype)},
        "sizes": list(SIZES), "draft_sizes": list(DRAFT_SIZES), "context": CONTEXT,
    }


def tuning_path(key: dict) -> Path:
    from ..target.loading import cache_root

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


def tune(target, draft: DraftHead | None = None, *, linear_forms: bool = True, cache: bool = True,
         retune: bool = False, say: Callable[[str], None] | None = None) -> VerifyCost:
    """Tune ``target`` (and ``draft``) for this machine -> the target's verify cost.

    With ``linear_forms`` (and a CPU model) every ``nn.Linear`` gets its fastest GEMM form
    per row count. The result is read from the on-disk cache when one matches (``cache``),
    else measured (~15 s) and stored; ``retune`` measures again. ``say`` hears one line
    about which of the two happened."""
    say = say or (lambda _: None)
    cpu = target.device.type == "cpu"
    target_forms = use_small_batch_linears(target) if linear_forms and cpu else None
    draft_forms = use_small_batch_linears(draft) if linear_forms and draft is not None and cpu else None
    key = tuning_key(target, draft if draft_forms is not None else None, target_forms is not None)
    path = tuning_path(key)
    stored = _read(path, key) if cache and not retune else None
    if stored is not None:
        say(f"CPU tuning read from {path} (pass --retune to measure again)")
        _apply(target_forms, stored["target_forms"])
        _apply(draft_forms, stored["draft_forms"])
    else:
        say("timing the target's (and the draft's) forwards per token count (~15 s, once per machine and model; "
            "--stock-linears skips the linear forms)")
        seconds = choose_forms(target_forms, target_timer(target), SIZES) if target_forms is not None else \
            [target_timer(target)(n) for n in SIZES]
        if draft_forms is not None:
            choose_forms(draft_forms, draft_timer(draft), DRAFT_SIZES)
        stored = {"key": key, "seconds": seconds, "target_forms": target_forms, "draft_forms": draft_forms,
                  "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, stored)
    for model in (target, draft):
        if model is not None and small_batch_forms(model) is not None:
            settle_packing(model)
    return VerifyCost(SIZES, stored["seconds"])
