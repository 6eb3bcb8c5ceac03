"""Regenerate a corpus's assistant turns with the target itself (self-distillation data).

    python data_tools/self_distill.py --corpus sharegpt --target smollm2 --limit 500 \
        --max-turns 4 --out checkpoints/selfdistill-smollm2.jsonl [--draft EXPORT_DIR]

Decodes on the serving runtime (continuous batching, speculation on: lossless), with an
exported draft head when --draft is given, else prompt lookup. Every assistant turn up to
--max-turns is regenerated from the conversation so far. Greedy by default (--temperature
> 0 samples, with --top-p; each turn's seed comes from --seed and the conversation's id).
Resumable: kill it at any point and re-run with the same --out; nothing is written twice.
Output is ShareGPT-format JSONL, readable by every corpus loader of this project.

With --features DIR the same pass writes the target's features of every conversation as a
feature cache (the decoder computes them anyway): train on both with
`lyanna-train +recipe=... data.corpus=[OUT] data.cache_dir=DIR` (same --max-length and
--shard-tokens as the run's data.max_length and data.shard_tokens), and the run computes no
feature. Conversations then reach OUT a shard at a time, after their features.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from lyanna_train.atomic import check_apart
from lyanna_train.cli.common import entry_point
from lyanna_train.data.conversations import Document
from lyanna_train.data.corpus import Corpus, ReadNotes, iter_documents
from lyanna_train.data.feature_cache_writer import CacheSettings
from lyanna_train.data.samples import refuse_evaluation_sets
from lyanna_train.data.self_distill import (GenerationSettings, SelfDistiller, append_jsonl, check_output_path,
                                            done_ids, to_sharegpt)
from lyanna_train.errors import LyannaError
from lyanna_train.locks import output_lock


@entry_point("self_distill")
def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    wanted = GenerationSettings()  # the defaults, declared there
    ap.add_argument("--corpus", nargs="+", default=["sharegpt"])
    ap.add_argument("--target", default=None, help="target model (default: the --draft export's, else smollm2)")
    ap.add_argument("--draft", metavar="EXPORT_DIR", help="exported draft head to speculate with (default: prompt lookup)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--limit", type=int, default=None, help="conversations to regenerate (default: all)")
    ap.add_argument("--batch-size", type=int, default=wanted.batch_size, help="conversations decoded side by side")
    ap.add_argument("--max-new-tokens", type=int, default=wanted.max_new_tokens, help="cap per assistant turn")
    ap.add_argument("--max-prompt-tokens", type=int, default=wanted.max_prompt_tokens)
    ap.add_argument("--max-turns", type=int, default=wanted.max_turns, help="assistant turns regenerated per conversation")
    ap.add_argument("--temperature", type=float, default=wanted.temperature, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=wanted.top_p)
    ap.add_argument("--seed", type=int, default=wanted.seed)
    ap.add_argument("--length-window", type=int, default=wanted.length_window,
                    help="conversations read ahead and decoded in order of length, so rows decoded together are "
                    "alike (1: the corpus order)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--decode", default="default", help="decoding settings: a conf/decode preset or a YAML file")
    cached = CacheSettings()  # the cache's defaults, declared there
    cache = ap.add_argument_group("features in the same pass (lyanna-train data.corpus=[OUT] data.cache_dir=DIR)")
    cache.add_argument("--features", type=Path, metavar="DIR",
                       help="also write the target's features of every conversation, as a feature cache")
    cache.add_argument("--layers", help="capture layers, comma-separated (default: EAGLE-3's 1, L/2-1, L-4)")
    cache.add_argument("--feature-dtype", choices=["bfloat16", "float8_e4m3fn"], default=cached.feature_dtype)
    cache.add_argument("--max-length", type=int, default=cached.max_length, help="tokens per sample: the run's "
                       "data.max_length")
    cache.add_argument("--shard-tokens", type=int, default=cached.shard_tokens, help="the run's data.shard_tokens")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        raise LyannaError(f"--limit must be at least 1, got {args.limit}")
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                  max_prompt_tokens=args.max_prompt_tokens, max_turns=args.max_turns,
                                  batch_size=args.batch_size, seed=args.seed,
                                  length_window=args.length_window)
    check_output_path(args.out)
    corpus = Corpus.resolve(args.corpus)
    inputs = [*args.corpus, *(s.path for s in corpus.sources), *(x for x in (args.target, args.draft) if x)]
    check_apart(args.out, inputs)
    if args.features is not None:
        check_apart(args.features, [*inputs, args.out])
    with contextlib.ExitStack() as held:  # one writer per output (the run-folder lock)
        held.enter_context(output_lock(args.out))
        if args.features is not None:
            held.enter_context(output_lock(args.features))
        return _run(args, corpus, settings)


def _run(args, corpus: Corpus, settings: GenerationSettings) -> int:
    from tqdm.auto import tqdm

    from lyanna_train.runtime.cpu.tuning import tune
    from lyanna_train.runtime.served_models import load_models
    from lyanna_train.runtime.scheduling.scheduler import BatchDecoder
    from lyanna_train.runtime.settings import SamplingParams, load_decode_settings

    refuse_evaluation_sets(corpus)
    target, tokenizer, draft = load_models(args.draft, args.target or (None if args.draft else "smollm2"),
                                           args.draft is not None, args.threads)
    layer_ids, output = None, None
    if args.features is not None:
        layer_ids = _capture_layers(args, target, draft)
        output = _distilled_output(args, corpus, target, tokenizer, layer_ids)
    done = done_ids(args.out)
    decode = load_decode_settings(args.decode)  # the shipped default: speculation on, lossless
    cost = tune(target, draft, shape=decode.tree, say=lambda line: print(line, file=sys.stderr, flush=True))
    decoder = BatchDecoder(target, draft, decode, max_batch=settings.batch_size, cost=cost, layer_ids=layer_ids,
                           record_features=output is not None)
    sampling = SamplingParams(temperature=settings.temperature, top_p=settings.top_p)
    distiller = SelfDistiller(decoder, tokenizer, settings, sampling, record_features=output is not None)
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
        record = to_sharegpt(result.cid, result.messages)
        if output is None:
            append_jsonl(args.out, [record])
        else:  # written a shard at a time, after its features
            output.add(record, result.features)
        written += 1
        tokens += result.new_tokens
        bar.update(resumed[0] + written + sum(distiller.skipped.values()) - bar.n)
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}", refresh=False)
    if output is not None:
        output.close()
    bar.close()
    seconds = max(time.perf_counter() - start, 1e-9)
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(distiller.skipped.items())) or "none"
    cut = ", ".join(f"{n} {why}" for why, n in sorted(distiller.cut.items()))
    print(f"wrote {written} conversations ({tokens} generated tokens, {tokens / seconds:.1f} tok/s) to {args.out}; "
          f"skipped: {skipped}" + (f"; ended early (earlier turns kept): {cut}" if cut else ""))
    if output is not None:
        print(f"features: {args.features} ({len(output.plan)} shards; {output.stats.summary()}; "
              f"{output.recomputed} samples re-tokenized otherwise, their features computed again)")
    return 0


def _capture_layers(args, target, draft) -> list[int]:
    """The cache's capture layers: --layers, else the convention's; a draft must read the same."""
    from lyanna_train.target.capture import check_layer_ids, default_layer_ids, parse_layer_ids

    count = target.config.num_hidden_layers
    layers = check_layer_ids(parse_layer_ids(args.layers) if args.layers else default_layer_ids(count), count)
    drafted = list(draft.cfg.aux_layer_ids or ()) if draft is not None else None
    if drafted and drafted != list(layers):
        raise LyannaError(f"--draft reads layers {drafted}, the feature cache is asked for {list(layers)}: "
                          f"pass --layers {','.join(map(str, drafted))} or another draft")
    return list(layers)


def _distilled_output(args, corpus: Corpus, target, tokenizer, layer_ids):
    from lyanna_train.data.distilled_output import DistilledOutput

    settings = CacheSettings(max_length=args.max_length, shard_tokens=args.shard_tokens,
                             feature_dtype=args.feature_dtype)
    source = {"corpus": [str(args.out)], "regenerated_from": list(args.corpus), "target": args.target}
    return DistilledOutput(args.out, args.features, target, tokenizer, layer_ids, settings, source)


if __name__ == "__main__":
    raise SystemExit(main())
