"""``lyanna-generate``: speculative decoding with an exported draft, streamed as it is accepted.

    lyanna-generate --draft exports/smollm2-lyanna "Write a haiku about tea."
    lyanna-generate --draft exports/smollm2-lyanna --decode chain --set tree.depth=6 --file prompts.jsonl
    echo "def fib(n):" | lyanna-generate --draft exports/smollm2-lyanna --no-chat --show-acceptance

The text goes to stdout; each prompt's summary (tokens/s, τ, acceptance histogram) to stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from transformers import TextStreamer

from ..runtime.served_models import load_models
from .common import entry_point


def load_and_tune(args, need_draft: bool, shape=None):
    """(target, tokenizer, draft or None, the measured costs): the models of
    ``--draft``/``--target``, tuned for this machine and for drafting trees of ``shape``
    (read from the on-disk cache after the first run)."""
    from ..runtime.cpu.tuning import tune

    target, tokenizer, draft = load_models(args.draft, args.target, need_draft, args.threads)
    cost = tune(target, draft, shape=shape, linear_forms=not args.stock_linears, retune=args.retune,
                say=lambda line: print(line, file=sys.stderr, flush=True))
    return target, tokenizer, draft, cost


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags lyanna-generate and lyanna-bench share: draft, target, decoding settings."""
    p.add_argument("--draft", metavar="EXPORT_DIR", help="exported draft directory (lyanna-export)")
    p.add_argument("--target", metavar="SPEC", help="target model: embedded name, directory or GGUF file "
                   "(default: the one the draft's manifest names)")
    p.add_argument("--decode", default="default", metavar="PRESET",
                   help="decoding settings: conf/decode/<PRESET>.yaml (default, chain, lookup_only) or a YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one decoding setting, e.g. tree.depth=6 or sampling.temperature=0.7 (repeatable)")
    p.add_argument("--stock-linears", action="store_true",
                   help="keep torch's nn.Linear forms (default: the fastest measured GEMM form per token count on "
                   "CPU, for every method; see lyanna_train/runtime/small_linear.py)")
    p.add_argument("--retune", action="store_true", help="measure the CPU tuning again instead of reading it from "
                   "the cache (~/.cache/lyanna_train/cpu_tuning; e.g. after timing on a busy machine)")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's choice); a busy "
                   "machine is faster with fewer threads than cores")


class RunStreamer(TextStreamer):
    """transformers' TextStreamer (word-buffered, safe on multi-byte pieces) writing to ``out``.

    With ``mark`` ("colour" or "brackets") each iteration's accepted run is printed as soon
    as it decodes, wrapped in alternating ANSI colours or in brackets; only a trailing
    incomplete character (U+FFFD) waits for the next run."""

    COLOURS = ("\x1b[36m", "\x1b[33m")
    RESET = "\x1b[0m"

    def __init__(self, tokenizer, out, mark: str | None = None):
        super().__init__(tokenizer, skip_prompt=False, skip_special_tokens=True)
        self.out, self.mark, self.runs = out, mark, 0

    def put_tokens(self, tokens: list[int]) -> None:
        import torch

        if self.mark is None:
            self.put(torch.tensor(tokens))
            return
        self.token_cache.extend(tokens)
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
        printable = text[self.print_len:].rstrip("\ufffd")
        self.print_len += len(printable)
        if text.endswith("\n") and len(text) == self.print_len:  # as TextStreamer: keep one token of context
            self.token_cache = self.token_cache[-1:]
            self.print_len = len(self.tokenizer.decode(self.token_cache, **self.decode_kwargs))
        if printable:
            colour = self.COLOURS[self.runs % 2]
            self.runs += 1
            self.on_finalized_text(f"{colour}{printable}{self.RESET}" if self.mark == "colour" else f"[{printable}]")

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.out.write(text + ("\n" if stream_end else ""))
        self.out.flush()


def summary_line(result) -> str:
    """New tokens, tok/s, τ and the histogram of drafted tokens accepted per verify."""
    n, wall = len(result.tokens), result.wall_time
    hist = Counter(t - 1 for t in result.accept_lengths)
    accepted = " ".join(f"{k}:{hist[k]}" for k in sorted(hist)) or "-"
    return (f"{n} new tokens in {wall:.2f} s = {n / wall if wall else 0:.1f} tok/s | τ {result.mean_acceptance:.2f} "
            f"({result.target_forwards} target forwards) | accepted per verify (drafted:count) {accepted}")


def read_prompts(args) -> list:
    from ..errors import LyannaError
    from ..evaluation.prompts import Question, read_questions

    if args.prompt and args.file:
        raise LyannaError("give prompts as arguments or with --file, not both")
    if args.file:
        return read_questions(args.file)
    if args.prompt:
        return [Question(i + 1, "cli", (p,)) for i, p in enumerate(args.prompt)]
    if sys.stdin.isatty():
        raise LyannaError("no prompt: give PROMPT..., --file FILE, or pipe text on stdin")
    text = sys.stdin.read().strip()
    if not text:
        raise LyannaError("the prompt read from stdin is empty")
    return [Question(1, "stdin", (text,))]


def turn_budget(asked: int, prompt_tokens: int, context: int | None, where: str) -> int:
    """New tokens for one turn: ``asked``, cut to the room the prompt leaves in the target's
    context (said on stderr); a prompt that leaves none is one line."""
    if context is None:
        return asked
    room = context - prompt_tokens
    if room < 1:
        from ..errors import LyannaError

        raise LyannaError(f"{where}: the prompt has {prompt_tokens} tokens; the target's context is {context} "
                          f"(at most {context - 1} in the prompt, to leave room for one new token)")
    if asked > room:
        print(f"warning: {where}: {prompt_tokens} prompt tokens leave room for {room} of the "
              f"{asked} --max-new-tokens in the target's context of {context}: it stops there", file=sys.stderr)
    return min(asked, room)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lyanna-generate", description="Generate with the target model, "
                                "speculatively decoded with an exported Lyanna draft head (greedy output is "
                                "token for token the target's own).")
    p.add_argument("prompt", nargs="*", metavar="PROMPT", help="prompt text(s); none: --file or stdin")
    p.add_argument("--file", help="prompts: JSONL (turns / prompt / text / instruction) or .txt (blank-line-separated)")
    add_model_args(p)
    p.add_argument("--max-new-tokens", type=int, default=256, help="per turn (default 256); must fit the target's "
                   "context, and a turn whose prompt leaves less room stops at the context's end")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="render prompts with the tokenizer's chat template (default on)")
    p.add_argument("--show-acceptance", action="store_true",
                   help="mark each verify step's accepted run (colours on a terminal, [brackets] otherwise)")
    return p


@entry_point("lyanna-generate")
def main(argv: list[str]) -> int:
    from ..errors import LyannaError
    from ..evaluation.prompts import render_prompt
    from ..runtime.scheduling.scheduler import generate
    from ..runtime.settings import load_decode_settings

    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        raise LyannaError("--max-new-tokens must be at least 1")
    settings = load_decode_settings(args.decode, args.overrides)
    questions = read_prompts(args)
    target, tokenizer, draft, cost = load_and_tune(args, settings.tree.depth > 0, settings.tree)
    context = getattr(target.config, "max_position_embeddings", None)
    if context is not None and args.max_new_tokens >= context:  # before any turn allocates for it
        raise LyannaError(f"--max-new-tokens {args.max_new_tokens} does not fit the target's context of {context} "
                          f"positions (at most {context - 1}, after a one-token prompt)")
    mark = ("colour" if sys.stdout.isatty() else "brackets") if args.show_acceptance else None
    total = sum(len(q.turns) for q in questions)
    done = 0
    for q in questions:
        messages: list[dict] = []
        for turn in q.turns:
            done += 1
            if total > 1:
                print(f">>> [{done}/{total}] {turn.splitlines()[0][:70]}", file=sys.stderr)
            messages.append({"role": "user", "content": turn})
            streamer = RunStreamer(tokenizer, sys.stdout, mark)
            prompt = render_prompt(tokenizer, messages, args.chat)
            budget = turn_budget(args.max_new_tokens, len(prompt), context, f"prompt {q.question_id} turn {len(messages) // 2 + 1}")
            result = generate(target, draft, prompt, budget, settings, on_tokens=streamer.put_tokens, cost=cost)
            streamer.end()
            messages.append({"role": "assistant", "content": tokenizer.decode(result.tokens, skip_special_tokens=True)})
            print(summary_line(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
