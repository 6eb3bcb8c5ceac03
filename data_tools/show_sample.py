"""Print one rendered training sample with its loss mask highlighted, to debug a chat template.

    python data_tools/show_sample.py --corpus sharegpt --tokenizer smollm2 --index 3

Masked (learned) tokens are shown in green on a terminal, or between ⟦ ⟧ otherwise; the
token count, the assistant-token count and the truncation policy are printed below.
"""

from __future__ import annotations

import argparse
import sys

from lyanna_train.cli.common import entry_point
from lyanna_train.data.corpus import Corpus
from lyanna_train.data.samples import SampleSettings, SampleStats, iter_samples
from lyanna_train.errors import LyannaError
from lyanna_train.target.source import load_tokenizer


def highlight(tokenizer, sample, color: bool) -> str:
    on, off = ("\033[42;30m", "\033[0m") if color else ("⟦", "⟧")
    pieces, run, masked = [], [], None
    for tid, m in zip(sample.input_ids.tolist() + [None], sample.loss_mask.tolist() + [None]):
        if m != masked and run:
            text = tokenizer.decode(run)
            pieces.append(f"{on}{text}{off}" if masked else text)
            run = []
        masked = m
        if tid is not None:
            run.append(tid)
    return "".join(pieces)


@entry_point("show_sample")
def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", nargs="+", default=["sharegpt"])
    ap.add_argument("--tokenizer", default="smollm2")
    ap.add_argument("--index", type=int, default=0, help="which sample (0-based, in corpus order)")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    stats = SampleStats()
    for k, sample in enumerate(iter_samples(Corpus.resolve(args.corpus), tokenizer,
                                            SampleSettings(max_length=args.max_length), stats)):
        if k == args.index:
            color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
            print(highlight(tokenizer, sample, color))
            print(f"\n-- document {sample.index}: {len(sample)} tokens, {int(sample.loss_mask.sum())} learned "
                  f"(max_length {args.max_length}, longer samples are truncated)")
            return 0
    raise LyannaError(f"the corpus has only {stats.samples} samples; --index {args.index} is out of range")


if __name__ == "__main__":
    raise SystemExit(main())
