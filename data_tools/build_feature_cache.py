"""Run the target over the training samples once and cache its features for training.

    python data_tools/build_feature_cache.py --corpus sharegpt --target smollm2 \
        --out checkpoints/features-smollm2-sharegpt [--max-samples 2000]
    # across processes or machines (same --out, or directories copied together afterwards):
    python data_tools/build_feature_cache.py ... --shard 0/4   (then 1/4, 2/4, 3/4)

Resumable: re-running the same command skips finished shards (checksums verified) and
redoes partial or corrupted ones. The cache is complete when every --shard I/N has run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lyanna_train.cli.common import entry_point, parse_shard
from lyanna_train.errors import LyannaError


def build_parser() -> argparse.ArgumentParser:
    from lyanna_train.data.feature_cache_writer import CacheSettings

    d = CacheSettings()
    ap = argparse.ArgumentParser(prog="build_feature_cache", description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", nargs="+", default=["sharegpt"], help="corpus files, directories or embedded names")
    ap.add_argument("--target", default="smollm2", help="target directory, GGUF file or embedded name (smollm2)")
    ap.add_argument("--out", required=True, type=Path, help="cache directory (created, or resumed)")
    ap.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N", help="compute shards k with k %% N == I")
    ap.add_argument("--layers", help="comma-separated decoder layers whose outputs form aux "
                    "(default: EAGLE-3's 1, L/2-1, L-4)")
    ap.add_argument("--max-samples", type=int, help="cache only the first N samples of the corpus")
    ap.add_argument("--max-length", type=int, default=d.max_length, help="tokens per sample (longer ones are cut)")
    ap.add_argument("--batch-tokens", type=int, default=d.batch_tokens, help="padded tokens per target forward")
    ap.add_argument("--shard-tokens", type=int, default=d.shard_tokens, help="tokens per shard file")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the target's compute dtype")
    ap.add_argument("--feature-dtype", choices=["bfloat16", "float8_e4m3fn"], default=d.feature_dtype,
                    help="how features are stored: bfloat16, or float8_e4m3fn with a scale per token and layer "
                    "(half the bytes; lyanna-train reads it with data.feature_dtype=float8_e4m3fn)")
    ap.add_argument("--overwrite", action="store_true", help="delete --out first (never with concurrent --shard runs)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


@entry_point("build_feature_cache")
def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from lyanna_train.atomic import check_apart
    from lyanna_train.data.corpus import Corpus
    from lyanna_train.data.feature_cache_writer import CacheSettings
    from lyanna_train.locks import output_lock

    if args.max_samples is not None and args.max_samples < 1:
        raise LyannaError("--max-samples must be at least 1")
    settings = CacheSettings(max_length=args.max_length, shard_tokens=args.shard_tokens,
                             batch_tokens=args.batch_tokens, feature_dtype=args.feature_dtype)
    check_apart(args.out, [*args.corpus, *(s.path for s in Corpus.resolve(args.corpus).sources), args.target])
    # one writer per shard of --out, claimed before the target is loaded (minutes for a large one)
    with output_lock(args.out, tag=f".shard-{args.shard[0]}of{args.shard[1]}"):
        return _build(args, settings)


def _build(args, settings) -> int:
    import torch

    from lyanna_train.data.corpus import Corpus
    from lyanna_train.data.feature_cache_writer import build_feature_cache
    from lyanna_train.target.capture import parse_layer_ids
    from lyanna_train.data.samples import CorpusSamples, SampleSettings, refuse_evaluation_sets
    from lyanna_train.target.source import load_tokenizer
    from lyanna_train.target.model import load_target_model

    corpus = Corpus.resolve(args.corpus)
    refuse_evaluation_sets(corpus)
    tokenizer = load_tokenizer(args.target)
    model = load_target_model(args.target, dtype=getattr(torch, args.dtype))
    samples = CorpusSamples(corpus, tokenizer, SampleSettings(max_length=args.max_length))
    source = {"corpus": list(args.corpus), "sources": corpus.describe(), "max_samples": args.max_samples,
              "target": args.target}
    build_feature_cache(samples, model, tokenizer, args.out, layer_ids=parse_layer_ids(args.layers) if args.layers else None,
                        settings=settings, shard=args.shard, max_samples=args.max_samples, source=source,
                        overwrite=args.overwrite, progress=not args.no_progress)
    print(f"samples: {samples.stats.summary()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
