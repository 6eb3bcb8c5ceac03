"""Regenerate a corpus's assistant turns with the target itself (self-distillation data).

    python data_tools/self_distill.py --corpus sharegpt --target smollm2 --limit 500 \
        --max-turns 4 --out checkpoints/selfdistill-smollm2.jsonl [--draft EXPORT_DIR]

Decodes on the serving runtime (continuous batching, speculation on: lossless), with an
exported draft head when --draft is given, else prompt lookup. Every assistant turn up to
--max-turns is regenerated from the conversation so far. Greedy by default (--temperature
> 0 samples, with --top-p; each turn's seed comes from --seed and the conversation's id).
Resumable: kill it at any point and re-run with the same --out; nothing is written twice.
Output is ShareGPT-format JSONL, readable by every corpus loader of this project.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from lyanna_train.atomic import check_apart
from lyanna_train.cli.common import entry_point
from lyanna_train.data.conversations import Document
from lyanna_train.data.corpus import Corpus, ReadNotes, iter_documents
from lyanna_train.data.samples import refuse_evaluation_sets
from lyanna_train.data.self_distill import (GenerationSettings, SelfDistiller, append_jsonl, check_output_path,
                                            done_ids, to_sharegpt)
from lyanna_train.errors import LyannaError
from lyanna_train.locks import output_lock


@entry_point("self_distill")
def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", nargs="+", default=["sharegpt"])
    ap.add_argument("--target", default=None, help="target model (default: the --draft export's, else smollm2)")
    ap.add_argument("--draft", metavar="EXPORT_DIR", help="exported draft head to speculate with (default: prompt lookup)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--limit", type=int, default=None, help="conversations to regenerate (default: all)")
    ap.add_argument("--batch-size", type=int, default=8, help="conversations decoded side by side")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="cap per assistant turn")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-turns", type=int, default=1, help="assistant turns regenerated per conversation")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        raise LyannaError(f"--limit must be at least 1, got {args.limit}")
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                  max_prompt_tokens=args.max_prompt_tokens, max_turns=args.max_turns,
                                  batch_size=args.batch_size, seed=args.seed)
    check_output_path(args.out)
    corpus = Corpus.resolve(args.corpus)
    check_apart(args.out, [*args.corpus, *(s.path for s in corpus.sources), *(x for x in (args.target, args.draft) if x)])
    with output_lock(args.out):  # one writer per output file
        return _run(args, corpus, settings)


def _run(args, corpus: Corpus, settings: GenerationSettings) -> int:
    from tqdm.auto import tqdm

    from lyanna_train.runtime.cpu.tuning import tune
    from lyanna_train.runtime.loading import load_models
    from lyanna_train.runtime.scheduling.scheduler import BatchDecoder
    from lyanna_train.runtime.settings import DecodeSettings, SamplingParams

    refuse_evaluation_sets(corpus)
    done = done_ids(args.out)
    target, tokenizer, draft = load_models(args.draft, args.target or (None if args.draft else "smollm2"),
                                           args.draft is not None, args.threads)
    decode = DecodeSettings()
    cost = tune(target, draft, shape=decode.tree, say=lambda line: print(line, file=sys.stderr, flush=True))
    decoder = BatchDecoder(target, draft, decode, max_batch=settings.batch_size, cost=cost)
    sampling = SamplingParams(temperature=settings.temperature, top_p=settings.top_p)
    distiller = SelfDistiller(decoder, tokenizer, settings, sampling)
    if done:
        print(f"resuming: {len(done)} conversations already in {args.out}")

    resumed = [0]

    def todo():
        taken = 0
        for doc in iter_documents(corpus, ReadNotes()):
            if not (isinstance(doc, Document) and doc.is_conversation):
                continue
            if args.limit is not None and taken >= args.limit:
                return
            taken += 1
            if str(doc.index) in done:
                resumed[0] += 1
            else:
                yield str(doc.index), doc.messages

    bar = tqdm(total=args.limit, unit="conv", desc="regenerating")
    written, tokens, start = 0, 0, time.perf_counter()
    for result in distiller.regenerate(todo()):
        append_jsonl(args.out, [to_sharegpt(result.cid, result.messages)])
        written += 1
        tokens += result.new_tokens
        bar.update(resumed[0] + written + sum(distiller.skipped.values()) - bar.n)
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}", refresh=False)
    bar.close()
    seconds = max(time.perf_counter() - start, 1e-9)
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(distiller.skipped.items())) or "none"
    cut = ", ".join(f"{n} {why}" for why, n in sorted(distiller.cut.items()))
    print(f"wrote {written} conversations ({tokens} generated tokens, {tokens / seconds:.1f} tok/s) to {args.out}; "
          f"skipped: {skipped}" + (f"; ended early (earlier turns kept): {cut}" if cut else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
