"""``lyanna-hotvocab``: count token frequencies and select hot vocabularies.

    lyanna-hotvocab --corpus sharegpt --tokenizer smollm2 [--ratios 0.05,0.08,0.10]
    lyanna-hotvocab --corpus data/ --tokenizer path/to/model --shard 0/4 --out counts-0
    lyanna-hotvocab merge counts-0 counts-1 counts-2 counts-3 --out hot
"""

from __future__ import annotations

import argparse
import os

from ..errors import LyannaError
from .common import entry_point, parse_shard

DEFAULT_RATIOS = "0.05,0.08,0.10"


def _add_selection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("selection (any combination; default --ratios 0.05,0.08,0.10)")
    g.add_argument("--ratios", help="comma-separated fractions of the vocabulary, each in (0, 1]")
    g.add_argument("--sizes", help="comma-separated hot-vocabulary sizes")
    g.add_argument("--coverage", help="comma-separated held-out coverage goals: the smallest set reaching each")
    p.add_argument("--out", help="output directory (written atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lyanna-hotvocab",
        description="Count how often the target's tokenizer emits each token over a corpus and select the "
        "hot vocabulary the draft head scores. Use 'lyanna-hotvocab merge DIR... --out OUT' to sum shards.",
    )
    p.add_argument("--corpus", nargs="+", action="extend", required=True, metavar="PATH",
                   help="files (.json/.jsonl/.txt[.gz]/.parquet), directories, globs, saved datasets, or an "
                   "embedded name (sharegpt, humaneval)")
    p.add_argument("--tokenizer", default="smollm2", help="tokenizer/model directory, GGUF file, or embedded name (smollm2)")
    p.add_argument("--count", choices=["assistant", "all"], default="assistant",
                   help="assistant: assistant-turn tokens as the chat template renders them (default); all: every token")
    p.add_argument("--heldout", type=float, default=0.05, help="fraction of documents held out for coverage (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
    p.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N", help="count only documents with index %% N == I")
    p.add_argument("--num-proc", type=int, default=1,
                   help="worker processes (default 1: one process already tokenizes on every core, overlapped "
                   "with parsing; more help only when many cores leave that process short of work)")
    p.add_argument("--strict", action="store_true", help="malformed JSON records are an error instead of skipped")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_selection_args(p)
    return p


def build_merge_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lyanna-hotvocab merge",
                                description="Sum count directories made with the same tokenizer and re-select.")
    p.add_argument("dirs", nargs="+", help="count directories (outputs of lyanna-hotvocab)")
    _add_selection_args(p)
    return p


def _requests(args):
    from ..hotvocab.selection import parse_requests

    ratios = args.ratios if (args.ratios or args.sizes or args.coverage) else DEFAULT_RATIOS
    return parse_requests(ratios, args.sizes, args.coverage)


def _default_out(args) -> str:
    corpus = "+".join(os.path.basename(c.rstrip("/")).split(".")[0] or "corpus" for c in args.corpus[:2])
    tok = os.path.basename(args.tokenizer.rstrip("/")).split(".")[0]
    shard = "" if args.shard == (0, 1) else f"-shard{args.shard[0]}of{args.shard[1]}"
    return os.path.join("checkpoints", f"hotvocab-{tok}-{corpus}{shard}")


@entry_point("lyanna-hotvocab")
def main(argv: list[str]) -> int:
    from ..hotvocab import build as builder

    if argv[:1] == ["merge"]:
        args = build_merge_parser().parse_args(argv[1:])
        if not args.out:
            raise LyannaError("merge needs --out")
        builder.merge(args.dirs, args.out, _requests(args), overwrite=args.overwrite)
        return 0
    args = build_parser().parse_args(argv)
    from ..hotvocab.counting import CountSettings

    settings = CountSettings(mode=args.count, heldout=args.heldout, seed=args.seed, shard=args.shard, strict=args.strict)
    if args.num_proc < 1:
        raise LyannaError("--num-proc must be at least 1")
    builder.build(args.corpus, args.tokenizer, args.out or _default_out(args), _requests(args), settings,
                  num_proc=args.num_proc, overwrite=args.overwrite,
                  progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
