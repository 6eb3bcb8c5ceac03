"""Speed and losslessness of decoding methods, measured side by side on the same prompts.

Every prompt is decoded by every method back to back, in one process with the same
torch threads (the order rotates from prompt to prompt), so machine noise hits all
methods alike; speedups are ratios of tokens/s measured in the same run. Results are
kept in Spec-Bench's layout (one record per question and method, lists over turns),
plus the token ids, so losslessness can be re-checked from the files alone.

Methods: ``target`` (``target.generate``, plain decoding), ``pld`` (transformers'
prompt-lookup decoding), ``lyanna`` (our runtime with the exported draft) and
``lookup`` (our runtime, prompt lookup only) all run the same target object, with the
measured linear forms of :mod:`lyanna_train.runtime.cpu.small_linear` when the CLI set
them up; ``stock`` is ``target.generate`` with torch's own ``nn.Linear`` (an unmodified
transformers), for reference: its output may differ from ``target``'s by float
summation order alone, so it is reported but not part of the lossless verdict.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from ..errors import LyannaError
from ..runtime.scheduling.requests import cut, stop_ids
from ..runtime.scheduling.scheduler import generate
from ..runtime.pricing.cost import Costs
from ..runtime.settings import DecodeSettings, LookupSettings, TreeShape
from ..runtime.cpu.small_linear import stock_linears
from .acceptance import accept_rates
from .prompts import Question, render_prompt

METHODS = ("target", "stock", "pld", "lyanna", "head", "lookup")
NEEDS_DRAFT = ("lyanna", "head")
NUMERICS_ONLY = ("stock",)  # same model, other GEMM forms: not held to token identity


@dataclass
class Run:
    """One method on one prompt."""

    tokens: list[int]  # new tokens, cut after the first EOS
    wall_time: float  # seconds, prefill included
    target_forwards: int
    accept_lengths: list[int] = field(default_factory=list)  # tokens per forward after the prefill
    tree_sizes: list[int] = field(default_factory=list)  # tokens verified per forward after the prefill


Method = Callable[[list[int], int], Run]  # (prompt ids, max_new_tokens) -> Run


class _Recorder:
    """A transformers streamer (put/end) and forward pre-hook that see each target forward."""

    def __init__(self):
        self.puts: list[int] = []  # tokens accepted per forward; the first put is the prompt
        self.inputs: list[int] = []  # tokens fed per forward

    def put(self, value):
        self.puts.append(int(value.shape[-1]))

    def end(self):
        pass

    def hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.inputs.append(int(ids.shape[-1]) if ids is not None else 0)


def generate_kwargs(target, settings: DecodeSettings) -> tuple[set[int], dict]:
    """(the stop ids our runtime uses, ``target.generate`` arguments that decode as ``settings``
    do: greedy or the same sampling, the same stop ids, a pad id)."""
    eos = stop_ids(target, None)  # the very set our runtime stops at
    pad = getattr(target.generation_config, "pad_token_id", None)
    params = settings.sampling
    extra = {"do_sample": False} if params.greedy else {
        "do_sample": True, "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}
    return eos, {"pad_token_id": pad if pad is not None else min(eos, default=0), **extra}


def hf_method(target, settings: DecodeSettings, prompt_lookup_tokens: int | None = None) -> Method:
    """``target.generate`` (greedy, or sampling as ``settings.sampling``), with transformers'
    prompt lookup when ``prompt_lookup_tokens`` is given."""
    eos, extra = generate_kwargs(target, settings)
    if prompt_lookup_tokens:
        extra["prompt_lookup_num_tokens"] = prompt_lookup_tokens

    def run(prompt: list[int], max_new_tokens: int) -> Run:
        ids = torch.tensor([prompt], device=target.device)
        recorder = _Recorder()
        handle = target.register_forward_pre_hook(recorder.hook, with_kwargs=True)
        torch.manual_seed(settings.seed)
        try:
            begin = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      streamer=recorder, **extra)
            wall = time.perf_counter() - begin
        finally:
            handle.remove()
        tokens, _ = cut(out[0, len(prompt):].tolist(), eos, max_new_tokens)
        return Run(tokens, wall, len(recorder.puts) - 1, recorder.puts[2:], recorder.inputs[1:])

    return run


def runtime_method(target, draft, settings: DecodeSettings, cost: Costs | None = None) -> Method:
    def run(prompt: list[int], max_new_tokens: int) -> Run:
        result = generate(target, draft, prompt, max_new_tokens, settings, cost=cost)
        return Run(result.tokens, result.wall_time, result.target_forwards, result.accept_lengths, result.tree_sizes)

    return run


def _stock(target, method: Method) -> Method:
    def run(prompt: list[int], max_new_tokens: int) -> Run:
        with stock_linears(target):
            return method(prompt, max_new_tokens)

    return run


def check_methods(names) -> None:
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names or len(set(names)) != len(names):
        raise LyannaError(f"bad methods {list(names)} (choose some of {', '.join(METHODS)}, each once)")


def fixed_settings(settings: DecodeSettings, name: str, pld_tokens: int = 10) -> DecodeSettings:
    """The decoding settings of a fixed method (``plain``, ``lookup``, ``head``, ``pool-off``)."""
    no_tree, off = TreeShape(depth=0, max_nodes=0), LookupSettings(max_tokens=0, pool_tokens=0)
    lookup = settings.lookup if settings.lookup.max_tokens else LookupSettings(max_tokens=pld_tokens)
    return {
        "plain": replace(settings, tree=no_tree, lookup=off),
        "lookup": replace(settings, tree=no_tree, lookup=replace(lookup, pool_tokens=0)),
        "head": replace(settings, lookup=off, verify="fit" if settings.verify == "auto" else settings.verify),
        "pool-off": replace(settings, lookup=replace(settings.lookup, pool_tokens=0)),
    }[name]


def make_methods(names, target, draft, settings: DecodeSettings, pld_tokens: int = 10,
                 cost: Costs | None = None) -> dict[str, Method]:
    """The named methods; ``lookup`` reuses the settings' lookup (or ``pld_tokens`` when it is off);
    ``head`` is ``lyanna`` with prompt-lookup and pool candidates off: what the trained head
    alone buys. Our runtime's methods weigh candidates against ``cost``
    (:func:`~lyanna_train.runtime.cpu.tuning.tune`)."""
    check_methods(names)
    make = {
        "target": lambda: hf_method(target, settings),
        "stock": lambda: _stock(target, hf_method(target, settings)),
        "pld": lambda: hf_method(target, settings, prompt_lookup_tokens=pld_tokens),
        "lyanna": lambda: runtime_method(target, draft, settings, cost),
        "head": lambda: runtime_method(target, draft, fixed_settings(settings, "head"), cost),
        "lookup": lambda: runtime_method(target, None, fixed_settings(settings, "lookup", pld_tokens), cost),
    }
    return {name: make[name]() for name in names}


def run_question(question: Question, methods: dict[str, Method], tokenizer, max_new_tokens: int,
                 turns: int = 2, chat: bool = True, rotate: int = 0) -> dict[str, dict]:
    """Every method on every turn (at most ``turns``) -> {method: Spec-Bench record}. Later turns
    follow the reference answer (``target``'s if it runs, else the first method's), so every
    method sees the same conversation. ``rotate`` shifts the method order."""
    names = list(methods)
    order = names[rotate % len(names):] + names[:rotate % len(names)]
    per_turn = ("turns", "new_tokens", "wall_time", "decoding_steps", "token_ids")
    records = {name: {"question_id": question.question_id, "category": question.category, "model_id": name,
                      "choices": [{"index": 0, **{k: [] for k in per_turn}, "accept_lengths": [], "tree_sizes": []}]}
               for name in names}
    messages: list[dict] = []
    for text in question.turns[:turns]:
        messages.append({"role": "user", "content": text})
        prompt = render_prompt(tokenizer, messages, chat)
        answers = {}
        for name in order:
            run = methods[name](prompt, max_new_tokens)
            answers[name] = tokenizer.decode(run.tokens, skip_special_tokens=True)
            c = records[name]["choices"][0]
            for key, value in zip(per_turn, (answers[name], len(run.tokens), run.wall_time, run.target_forwards,
                                             run.tokens)):
                c[key].append(value)
            c["accept_lengths"] += run.accept_lengths
            c["tree_sizes"] += run.tree_sizes
        messages.append({"role": "assistant", "content": answers["target" if "target" in answers else names[0]]})
    return records


def summarize(records: dict[str, list[dict]], reference: str = "target", depth: int = 5) -> dict:
    """Per method: tokens/s, speedup (ratio of tokens/s to ``reference``'s), τ (new tokens /
    target forwards), mean τ per verify, acceptance rate per depth k = 1..K (fraction of
    verify forwards accepting ≥ k drafted tokens; K ≥ ``depth``), mean tree size."""
    choices = {m: [r["choices"][0] for r in recs] for m, recs in records.items()}
    flat = {m: {k: [x for c in cs for x in c[k]]
                for k in ("new_tokens", "wall_time", "decoding_steps", "accept_lengths", "tree_sizes")}
            for m, cs in choices.items()}
    most = max([depth] + [max(f["accept_lengths"], default=1) - 1 for f in flat.values()])
    out = {}
    for m, f in flat.items():
        tokens, wall, forwards, taus = sum(f["new_tokens"]), sum(f["wall_time"]), sum(f["decoding_steps"]), \
            f["accept_lengths"]
        out[m] = {"prompts": len(f["new_tokens"]), "new_tokens": tokens, "wall_time": wall,
                  "tokens_per_s": tokens / wall if wall else 0.0, "target_forwards": forwards,
                  "tau": tokens / max(forwards, 1), "mean_accept_length": sum(taus) / max(len(taus), 1),
                  "accept_rate": accept_rates(taus, most),
                  "mean_tree_size": sum(f["tree_sizes"]) / max(len(f["tree_sizes"]), 1)}
    base = out.get(reference, {}).get("tokens_per_s")
    for m in out:
        out[m]["speedup"] = out[m]["tokens_per_s"] / base if base else None
    return out


def lossless_report(records: dict[str, list[dict]], reference: str = "target") -> dict:
    """Token ids of every method against ``reference``'s, prompt (question × turn) by prompt."""
    if reference not in records:
        return {"checked": False, "reason": f"{reference} is not among the methods", "methods": {}}
    ref = {(r["question_id"], t): ids for r in records[reference] for t, ids in enumerate(r["choices"][0]["token_ids"])}
    report = {"checked": True, "prompts": len(ref), "methods": {}}
    for method, recs in records.items():
        if method == reference:
            continue
        bad, first = 0, None
        for r in recs:
            for t, ids in enumerate(r["choices"][0]["token_ids"]):
                want = ref[(r["question_id"], t)]
                if ids != want:
                    bad += 1
                    pos = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
                    first = first or {"question_id": r["question_id"], "turn": t + 1, "position": pos,
                                      "lengths": [len(ids), len(want)]}
        report["methods"][method] = {"mismatches": bad, "first": first, "verdict": method not in NUMERICS_ONLY}
    report["identical"] = all(v["mismatches"] == 0 for v in report["methods"].values() if v["verdict"])
    return report


def lossless_lines(report: dict) -> list[str]:
    """Human-readable verdict: one line when identical, one per failing method otherwise;
    a method outside the verdict (``stock``) gets a line when it differs."""
    if not report["checked"]:
        return [f"lossless: not checked ({report['reason']})"]
    n = report["prompts"]
    lines = [f"lossless: yes ({n}/{n} prompts identical)" if report["identical"] else "lossless: NO"]
    for method, v in report["methods"].items():
        if not v["verdict"]:
            if v["mismatches"]:
                lines.append(f"  {method}: {n - v['mismatches']}/{n} prompts identical to target (other GEMM "
                             f"forms, float summation order: not part of the verdict)")
        elif report["identical"]:
            continue
        elif v["mismatches"]:
            f = v["first"]
            lines.append(f"  {method}: {v['mismatches']}/{n} prompts differ from target; first: question "
                         f"{f['question_id']} turn {f['turn']} at token {f['position']} "
                         f"(lengths {f['lengths'][0]} vs {f['lengths'][1]})")
        else:
            lines.append(f"  {method}: {n}/{n} prompts identical")
    return lines


def write_records(out_dir: Path, records: dict[str, list[dict]]) -> None:
    """``<method>.jsonl``, one Spec-Bench record per question."""
    for method, recs in records.items():
        (out_dir / f"{method}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs),
                                                 encoding="utf-8")
