"""Regenerate a corpus's assistant turns with the target itself (self-distillation data).

    python data_tools/self_distill.py --corpus sharegpt --target smollm2 --limit 500 \
        --out checkpoints/selfdistill-smollm2.jsonl

Resumable: re-running with the same --out skips the conversations already written.
Greedy by default (--temperature > 0 samples, with --top-p). Output is ShareGPT-format
JSONL, readable by every corpus loader of this project.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lyanna_train.atomic import check_apart
from lyanna_train.cli.common import entry_point
from lyanna_train.data.conversations import Document
from lyanna_train.data.corpus import Corpus, ReadNotes, iter_documents
from lyanna_train.data.samples import refuse_evaluation_sets
from lyanna_train.data.self_distill import (GenerationSettings, SelfDistiller, append_jsonl, check_output_path,
                                            done_ids, to_sharegpt)
from lyanna_train.locks import output_lock
from lyanna_train.target.loading import load_tokenizer
from lyanna_train.target.model import load_target_model


@entry_point("self_distill")
def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", nargs="+", default=["sharegpt"])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--limit", type=int, default=None, help="conversations to regenerate (default: all)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-turns", type=int, default=1, help="assistant turns regenerated per conversation")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    check_output_path(args.out)
    check_apart(args.out, [*args.corpus, *(s.path for s in Corpus.resolve(args.corpus).sources), args.target])  # it appends to --out
    with output_lock(args.out):  # one writer per output file
        return _run(args)


def _run(args) -> int:
    import torch
    from tqdm.auto import tqdm

    torch.manual_seed(args.seed)
    corpus = Corpus.resolve(args.corpus)
    refuse_evaluation_sets(corpus)
    done = done_ids(args.out)
    tokenizer = load_tokenizer(args.target)
    model = load_target_model(args.target)
    distiller = SelfDistiller(model, tokenizer, GenerationSettings(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        max_prompt_tokens=args.max_prompt_tokens, max_turns=args.max_turns, batch_size=args.batch_size))
    if done:
        print(f"resuming: {len(done)} conversations already in {args.out}")
    todo = (d for d in iter_documents(corpus, ReadNotes()) if isinstance(d, Document) and d.is_conversation)
    bar = tqdm(total=args.limit, unit="conv", desc="self-distilling")
    taken, attempted, written, tokens, start = 0, 0, 0, 0, time.perf_counter()
    batch: list = []

    def flush():
        nonlocal attempted, written, tokens
        attempted += len(batch)
        rows = list(distiller.regenerate(batch))
        append_jsonl(args.out, (to_sharegpt(cid, msgs) for cid, msgs, _ in rows))
        written += len(rows)
        tokens += sum(n for _, _, n in rows)
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}", refresh=False)
        batch.clear()

    for doc in todo:
        if args.limit is not None and taken >= args.limit:
            break
        taken += 1
        cid = str(doc.index)
        if cid in done:
            bar.update(1)
            continue
        batch.append((cid, doc.messages))
        if len(batch) >= args.batch_size:
            flush()
    if batch:
        flush()
    bar.close()
    print(f"wrote {written} conversations ({tokens} generated tokens, "
          f"{tokens / max(time.perf_counter() - start, 1e-9):.1f} tok/s) to {args.out}; {attempted - written} "
          "skipped (prompt over --max-prompt-tokens, template error, or no assistant turn)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
