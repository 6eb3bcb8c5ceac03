"""Benchmark: do the free candidates (prompt lookup, pool states) raise τ per target forward?

Decodes the same prompts with the exported draft under each candidate mix, every
candidate verified (``verify: all``, so the tree does not depend on this machine's
timings), and prints τ per target forward, the share of iterations a source proposed
something, and how many of its tokens the target confirmed; then the same mixes with
``verify: auto`` for tokens/s (interleaved per prompt, ratios against plain decoding in
the same run).

    python bench/free_candidates.py --draft checkpoints/smollm2_135m-export [--num-prompts 8]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import replace

from lyanna_train.evaluation.prompts import read_questions, render_prompt
from lyanna_train.runtime.cpu.tuning import tune
from lyanna_train.runtime.served_models import load_models
from lyanna_train.runtime.pricing.estimates import POOL, AcceptanceEstimates
from lyanna_train.runtime.scheduling.scheduler import generate
from lyanna_train.runtime.settings import LookupSettings, TreeShape, load_decode_settings

MIXES = {
    "draft": LookupSettings(max_tokens=0, pool_tokens=0),
    "draft + lookup": LookupSettings(max_tokens=10, pool_tokens=0),
    "draft + pool": LookupSettings(max_tokens=0, pool_tokens=10),
    "draft + lookup + pool": LookupSettings(max_tokens=10, pool_tokens=10),
}


@contextlib.contextmanager
def _counting(proposed: dict):
    """Every row's estimates made meanwhile (yielded), each proposal counted per source."""
    made, init, propose = [], AcceptanceEstimates.__init__, AcceptanceEstimates.proposed_lookup

    def counted_init(self):
        init(self)
        made.append(self)

    def counted_propose(self, n, continuation):
        if continuation:
            proposed["pool" if n == POOL else "lookup"] += 1
        propose(self, n, continuation)

    AcceptanceEstimates.__init__, AcceptanceEstimates.proposed_lookup = counted_init, counted_propose
    try:
        yield made
    finally:
        AcceptanceEstimates.__init__, AcceptanceEstimates.proposed_lookup = init, propose


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", default="checkpoints/smollm2_135m-export")
    p.add_argument("--prompts", default="mtbench")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--decode", default="default", help="the base preset (its tree shape is kept)")
    args = p.parse_args()

    target, tokenizer, draft = load_models(args.draft, None)
    base = load_decode_settings(args.decode)
    cost = tune(target, draft, shape=base.tree, say=print)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": q.turns[0]}])
               for q in read_questions(args.prompts, args.num_prompts)]
    print(f"{len(prompts)} prompts from {args.prompts}, {args.max_new_tokens} new tokens, tree {base.tree}\n")

    rows, seconds, tokens = {}, {name: 0.0 for name in ["plain", *MIXES]}, {name: 0 for name in ["plain", *MIXES]}
    for name, lookup in MIXES.items():
        settings = replace(base, lookup=lookup, verify="all")
        new = forwards = 0
        proposed = {n: 0 for n in ("lookup", "pool")}
        confirmed = {n: [0, 0] for n in ("lookup", "pool")}
        for prompt in prompts:
            with _counting(proposed) as row_estimates:  # what each source proposed and the target kept
                out = generate(target, draft, prompt, args.max_new_tokens, settings, cost=cost)
            new, forwards = new + len(out.tokens), forwards + out.target_forwards - 1
            for est in row_estimates:
                for n, (right, broken) in est.lookup.items():
                    c = confirmed["pool" if n == POOL else "lookup"]
                    c[0], c[1] = c[0] + right - 1, c[1] + broken - 1
        rows[name] = (new / max(forwards + len(prompts), 1), proposed, confirmed, forwards)

    for i, prompt in enumerate(prompts):  # speed, interleaved: verify auto as served
        names = ["plain", *MIXES]
        for name in names[i % len(names):] + names[:i % len(names)]:
            settings = replace(base, tree=TreeShape(0, 1, 1, 0), lookup=LookupSettings(0, pool_tokens=0),
                               verify="auto") if name == "plain" else replace(base, lookup=MIXES[name], verify="auto")
            out = generate(target, draft, prompt, args.max_new_tokens, settings, cost=cost)
            seconds[name] += out.wall_time
            tokens[name] += len(out.tokens)

    plain = tokens["plain"] / seconds["plain"]
    print("| candidates | τ per forward (verify all) | lookup proposed / tokens kept | pool proposed / tokens kept "
          "| tok/s (verify auto) | vs plain |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| plain decoding | 1.00 | – | – | {plain:.1f} | 1.00× |")
    for name, (tau, proposed, confirmed, forwards) in rows.items():
        rate = tokens[name] / seconds[name]
        cells = [f"{proposed[s] / max(forwards, 1):.2f} / {confirmed[s][0]}" if proposed[s] else "–"
                 for s in ("lookup", "pool")]
        print(f"| {name} | {tau:.2f} | {cells[0]} | {cells[1]} | {rate:.1f} | {rate / plain:.2f}× |")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"\n({time.perf_counter() - start:.0f} s)")
