"""Benchmark: decoding settings side by side, against target-only decoding in the same run.

Each variant is the default preset with some ``--set``-style overrides (comma-separated).
Every prompt is decoded by target-only ``generate`` and by every variant back to back
(order rotated per prompt), so the ratios share the machine's noise.

    python bench/decode_settings.py "tree.depth=2,tree.branch=2" "tree.branch=4" [--num-prompts 8]
"""

from __future__ import annotations

import argparse

from lyanna_train.evaluation.benchmark import hf_method
from lyanna_train.evaluation.prompts import read_questions, render_prompt
from lyanna_train.runtime.scheduling.scheduler import generate
from lyanna_train.runtime.cpu.tuning import tune
from lyanna_train.runtime.served_models import load_models
from lyanna_train.runtime.settings import load_decode_settings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="*", help="overrides of the default preset, e.g. tree.depth=2,tree.branch=2")
    p.add_argument("--draft", default="checkpoints/smollm2_135m-export")
    p.add_argument("--prompts", default="mtbench")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    args = p.parse_args()

    target, tokenizer, draft = load_models(args.draft, None)
    cost = tune(target, draft, say=print)
    default = load_decode_settings("default")
    variants = {"default": default, **{v: load_decode_settings("default", v.split(",")) for v in args.variants}}
    target_only = hf_method(target, default)
    names = ["target", *variants]
    seconds, tokens, forwards = ({n: 0.0 for n in names} for _ in range(3))
    for i, q in enumerate(read_questions(args.prompts, args.num_prompts)):
        prompt = render_prompt(tokenizer, [{"role": "user", "content": q.turns[0]}])
        for name in names[i % len(names):] + names[:i % len(names)]:
            run = target_only(prompt, args.max_new_tokens) if name == "target" else \
                generate(target, draft, prompt, args.max_new_tokens, variants[name], cost=cost)
            seconds[name] += run.wall_time
            tokens[name] += len(run.tokens)
            forwards[name] += run.target_forwards
    base = tokens["target"] / seconds["target"]
    print("| settings | tok/s | vs target-only | τ |\n|---|---:|---:|---:|")
    for name in names:
        rate = tokens[name] / seconds[name]
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}× | {tokens[name] / forwards[name]:.2f} |")


if __name__ == "__main__":
    main()
