"""Benchmark: one batch holding requests that favour different speculation sources.

Half the requests repeat their prompt (summaries of a given text: prompt lookup finds
their continuations), half are open-ended (MT-Bench writing and roleplay: the head's
ground, lookup finds little). They are interleaved, so every batch mixes both kinds, and
decoded by ``lyanna-bench --batch-size`` side by side: the fixed choices (plain, lookup,
head) against Lyanna choosing per row and per iteration.

    python bench/mixed_workload.py --draft checkpoints/smollm2_135m-export --out bench/results/mixed \\
        [--batch-size 4,8] [--max-new-tokens 64] [--passes 3] [--interleave steps]

Writes OUT/summary.json, summary.md and batched.png (lyanna-bench's files) and OUT/prompts.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from lyanna_train.cli.bench import main as bench_main
from lyanna_train.evaluation.prompts import read_questions


def mixed_prompts(per_kind: int) -> list[dict]:
    """``per_kind`` summaries of given texts and ``per_kind`` open-ended first turns, alternating."""
    repeat = read_questions("tasks", None, ("summarization",))[:per_kind]
    open_ended = read_questions("mtbench", None, ("writing", "roleplay"))[:per_kind]
    out = []
    for a, b in zip(repeat, open_ended):
        out += [{"question_id": f"repeat-{a.question_id}", "category": "repeat", "turns": [a.turns[0]]},
                {"question_id": f"open-{b.question_id}", "category": "open", "turns": [b.turns[0]]}]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", default="4,8")
    p.add_argument("--per-kind", type=int, default=8, help="requests of each kind (default 8: 16 in all)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--methods", default="plain,lookup,head,lyanna")
    p.add_argument("--passes", type=int, default=1, help="interleaved passes per method (median reported)")
    p.add_argument("--interleave", choices=("runs", "steps"), default="runs",
                   help="lyanna-bench's: each method's run whole, or the decoders' steps in turn")
    args = p.parse_args()
    prompts = mixed_prompts(args.per_kind)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mixed.jsonl"
        path.write_text("".join(json.dumps(q) + "\n" for q in prompts), encoding="utf-8")
        code = bench_main(["--draft", args.draft, "--prompts", str(path), "--num-prompts", str(len(prompts)),
                           "--max-new-tokens", str(args.max_new_tokens), "--batch-size", args.batch_size,
                           "--methods", args.methods, "--passes", str(args.passes), "--interleave", args.interleave,
                           "--out", args.out])
    if code == 0:
        (Path(args.out) / "prompts.jsonl").write_text("".join(json.dumps(q) + "\n" for q in prompts), encoding="utf-8")
    return code


if __name__ == "__main__":
    sys.exit(main())
