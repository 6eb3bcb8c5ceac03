"""``lyanna-bench``: speed of the target alone, transformers' prompt lookup and Lyanna, side by side.

    lyanna-bench --draft exports/smollm2-lyanna --num-prompts 8 --max-new-tokens 128
    lyanna-bench --draft exports/smollm2-lyanna --prompts humaneval --turns 1 --methods target,pld,lyanna,lookup
    lyanna-bench --draft exports/smollm2-lyanna --decode chain --set tree.depth=6 --out checkpoints/bench-chain6
    lyanna-bench --draft exports/smollm2-lyanna --batch-size 1,2,4,8,16 --num-prompts 8 --max-new-tokens 64

Writes OUT/<method>.jsonl (Spec-Bench layout), summary.json, summary.md and bench.png; prints
the table and the lossless verdict (exit status 1 when a greedy method differs from the target).
With --batch-size: batched decoding (:mod:`lyanna_train.evaluation.batched`), first turns only,
total tokens/s and per-request latency per batch size; summary.json, summary.md, batched.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import entry_point
from .generate import add_model_args, load_and_tune


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lyanna-bench", description="Measure decoding methods on the same prompts, "
                                "back to back in one process, and check that greedy output is lossless.")
    add_model_args(p)
    p.add_argument("--prompts", default="mtbench", help="mtbench, humaneval, tasks (embedded) or a JSONL file")
    p.add_argument("--num-prompts", type=int, default=0, help="N questions spread evenly over the set (default: all)")
    p.add_argument("--categories", default="", help="only these question categories, comma-separated "
                   "(e.g. writing,roleplay,humanities for MT-Bench)")
    p.add_argument("--turns", type=int, choices=(1, 2), default=2, help="turns per question (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per turn (default 128)")
    p.add_argument("--methods", default=None,
                   help="comma-separated, default target,pld,lyanna; also stock (target.generate with torch's own "
                   "nn.Linear: an unmodified transformers, the slowest), lookup (our runtime, prompt lookup only) and head "
                   "(our runtime, the draft tree only: lookup and pool candidates off)")
    p.add_argument("--pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens for pld (default 10)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="render prompts with the tokenizer's chat template (default on)")
    p.add_argument("--batch-size", metavar="B,B,...",
                   help="batched decoding at these batch sizes (e.g. 1,2,4,8,16): each size decodes max(N, B) first "
                   "turns, all submitted at once; methods then default to target,plain,lookup,head,pool-off,lyanna "
                   "(target: generate with left padding; plain: our runtime without speculation; lookup / head: "
                   "that source alone for every row; pool-off: the head without pool and α-gate)")
    p.add_argument("--passes", type=int, default=1, metavar="N",
                   help="with --batch-size: run every method N times, interleaved, and report each one's median pass "
                   "(a shared or throttled machine drifts by more than the ratios tell apart; default 1)")
    p.add_argument("--interleave", choices=("runs", "steps"), default="runs",
                   help="with --batch-size: how methods take turns within a pass: runs (each method's run whole, the "
                   "default) or steps (our decoders' steps in turn, each timed by its own steps; target runs whole "
                   "first): drift of the machine then hits every method alike")
    p.add_argument("--hold", default="", metavar="K,K,...",
                   help="with --batch-size: also lyanna with verification held for K micro-batches (e.g. 2,3)")
    p.add_argument("--out", help="output directory (default checkpoints/bench-<draft>-<prompts>); replaced at the end")
    return p


def _int_list(text: str, flag: str, least: int) -> list[int]:
    from ..errors import LyannaError

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values and text.strip() or any(v < least for v in values):
        raise LyannaError(f"{flag} takes comma-separated integers of at least {least}, got {text!r}")
    return values


def _running(records: dict) -> dict:
    from ..evaluation.benchmark import summarize

    return {m: f"{s['speedup']:.2f}x" for m, s in summarize(records).items() if m != "target" and s["speedup"]}


def _environment(target) -> dict:
    import platform

    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "device": str(target.device), "dtype": str(target.dtype).removeprefix("torch."),
            "machine": platform.machine(), "python": platform.python_version()}


@entry_point("lyanna-bench")
def main(argv: list[str]) -> int:
    from ..atomic import check_apart
    from ..errors import LyannaError
    from ..evaluation import benchmark as B
    from ..evaluation.prompts import Question, read_questions
    from ..locks import output_lock
    from ..runtime.settings import load_decode_settings

    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1 or args.num_prompts < 0 or args.pld_tokens < 1:
        raise LyannaError("--max-new-tokens and --pld-tokens must be at least 1, --num-prompts at least 0")
    if args.batch_size is not None:
        return _batched_main(args)
    names = [m.strip() for m in (args.methods or "target,pld,lyanna").split(",") if m.strip()]
    if any(n in B.NEEDS_DRAFT for n in names) and args.draft is None:
        raise LyannaError(f"the {', '.join(n for n in names if n in B.NEEDS_DRAFT)} method(s) need --draft EXPORT_DIR")
    B.check_methods(names)  # before anything loads
    settings = load_decode_settings(args.decode, args.overrides)
    questions = read_questions(args.prompts, args.num_prompts or None,
                               tuple(c.strip() for c in args.categories.split(",") if c.strip()))
    out = Path(args.out or f"checkpoints/bench-{Path(args.draft or args.target).name}-{Path(args.prompts).stem}")
    check_apart(out, (args.draft, args.target, args.prompts))  # the results replace --out whatever it holds
    with output_lock(out):  # checks --out can be written now, not after the whole benchmark; one writer
        return _run(args, names, settings, questions, out)


def _run(args, names: list[str], settings, questions: list, out: Path) -> int:
    import dataclasses

    from tqdm import tqdm

    from ..atomic import atomic_directory
    from ..evaluation import benchmark as B
    from ..evaluation import report as R
    from ..evaluation.prompts import Question

    target, tokenizer, draft, cost = load_and_tune(args, any(n in B.NEEDS_DRAFT for n in names), settings.tree)
    methods = B.make_methods(names, target, draft, settings, args.pld_tokens, cost)

    warm = Question("warm-up", "", questions[0].turns[:1])
    B.run_question(warm, methods, tokenizer, min(args.max_new_tokens, 16), 1, args.chat)  # not counted
    records: dict[str, list] = {m: [] for m in names}
    bar = tqdm(questions, desc="bench", unit="question")
    for i, q in enumerate(bar):
        for m, rec in B.run_question(q, methods, tokenizer, args.max_new_tokens, args.turns, args.chat, i).items():
            records[m].append(rec)
        bar.set_postfix(_running(records))
    bar.close()

    summary = B.summarize(records, depth=max(settings.tree.depth, 1))
    lossless = B.lossless_report(records) if settings.sampling.greedy else \
        {"checked": False, "reason": "sampling: outputs differ by design", "methods": {}}
    table = R.method_table(summary, lossless, max(3, max(len(s["accept_rate"]) for s in summary.values())))
    verdict = B.lossless_lines(lossless)
    meta = {"draft": args.draft, "target": args.target, "prompts": args.prompts, "questions": len(questions),
            "turns": args.turns, "max_new_tokens": args.max_new_tokens, "methods": names,
            "pld_tokens": args.pld_tokens, "decode": {"preset": args.decode, "overrides": args.overrides,
                                                      **dataclasses.asdict(settings)},
            "chat": args.chat, "environment": _environment(target)}
    print(table)  # before writing: a disk that fills up now loses no result
    print("\n".join(verdict))
    with atomic_directory(out, overwrite=True) as tmp:
        B.write_records(tmp, records)
        (tmp / "summary.json").write_text(json.dumps({**meta, "lossless": lossless, "methods": summary}, indent=2)
                                          + "\n", encoding="utf-8")
        (tmp / "summary.md").write_text(R.summary_page(
            f"lyanna-bench: {args.prompts}, {len(questions)} questions × {args.turns} turn(s), "
            f"{args.max_new_tokens} new tokens", table, verdict), encoding="utf-8")
        R.method_plot(summary, tmp / "bench.png")
    print(f"wrote {out}")
    return 1 if lossless["checked"] and not lossless["identical"] else 0


def _batched_main(args) -> int:
    from ..atomic import check_apart
    from ..errors import LyannaError
    from ..evaluation import batched as BB
    from ..evaluation.prompts import read_questions
    from ..locks import output_lock
    from ..runtime.settings import load_decode_settings

    sizes = _int_list(args.batch_size, "--batch-size", 1)
    holds = _int_list(args.hold, "--hold", 2)
    if not sizes:
        raise LyannaError("--batch-size needs at least one size")
    if args.passes < 1:
        raise LyannaError(f"--passes must be at least 1, got {args.passes}")
    names = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods is not None else \
        [m for m in BB.BATCH_METHODS if args.draft is not None or m in ("target", "plain", "lookup")]
    BB.check_batch_methods(names, args.draft is not None)
    if holds and args.draft is None:
        raise LyannaError("--hold measures the lyanna method: it needs --draft EXPORT_DIR")
    settings = load_decode_settings(args.decode, args.overrides)
    questions = read_questions(args.prompts, max(args.num_prompts, max(sizes)) if args.num_prompts else None,
                               tuple(c.strip() for c in args.categories.split(",") if c.strip()))
    if len(questions) < max(sizes):
        raise LyannaError(f"batch size {max(sizes)} needs {max(sizes)} prompts; {args.prompts} gives {len(questions)}")
    out = Path(args.out or f"checkpoints/bench-batched-{Path(args.draft or args.target).name}-{Path(args.prompts).stem}")
    check_apart(out, (args.draft, args.target, args.prompts))
    with output_lock(out):
        return _run_batched(args, names, holds, sizes, settings, questions, out)


def _run_batched(args, names, holds, sizes, settings, questions, out: Path) -> int:
    import dataclasses

    from ..atomic import atomic_directory
    from ..evaluation import batched as BB
    from ..evaluation import report as R
    from ..evaluation.benchmark import hf_method
    from ..evaluation.prompts import render_prompt

    target, tokenizer, draft, cost = load_and_tune(args, any(n not in ("target", "plain", "lookup") for n in names)
                                                   or holds, settings.tree)
    methods = BB.make_batch_methods(names, target, draft, settings, cost, holds, args.pld_tokens)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": q.turns[0]}], args.chat) for q in questions]
    warm = prompts[:2]
    for name, method in methods.items():  # not counted: first calls allocate and fill caches
        method(warm, min(args.max_new_tokens, 8), 2)
    reference = None
    if settings.sampling.greedy:
        alone = hf_method(target, settings)
        reference = lambda p: alone(p, args.max_new_tokens).tokens  # noqa: E731
    results = BB.measure(methods, prompts, sizes, args.max_new_tokens, args.num_prompts, reference,
                         progress=lambda line: print(line, file=sys.stderr, flush=True), passes=args.passes,
                         interleave=args.interleave)
    table = R.batch_table(results)
    ratios = BB.ratio_lines(results)
    verdict, ok = BB.lossless_lines(results)
    print(table)
    print("\n".join(ratios + verdict))
    meta = {"draft": args.draft, "target": args.target, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
            "num_prompts": args.num_prompts, "batch_sizes": sizes, "passes": args.passes, "interleave": args.interleave,
            "methods": list(methods),
            "holds": holds,
            "decode": {"preset": args.decode, "overrides": args.overrides, **dataclasses.asdict(settings)},
            "chat": args.chat, "environment": _environment(target)}
    with atomic_directory(out, overwrite=True) as tmp:
        (tmp / "summary.json").write_text(json.dumps({**meta, "results": {str(b): r for b, r in results.items()},
                                                      "ratios": ratios, "lossless": verdict}, indent=2) + "\n",
                                          encoding="utf-8")
        (tmp / "summary.md").write_text(R.summary_page(
            f"lyanna-bench --batch-size {args.batch_size}: {args.prompts}, first turns, "
            f"{args.max_new_tokens} new tokens", table, ratios + verdict), encoding="utf-8")
        R.batch_plot(results, tmp / "batched.png")
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
