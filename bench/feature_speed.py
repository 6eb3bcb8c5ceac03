"""Benchmark: feature-cache writer vs a bare target forward over the very same batches.

Side by side in one run, on the embedded SmolLM2 target with ShareGPT conversations:

* bare: ``model.base_model(input_ids, use_cache=False)`` under ``inference_mode`` over the
  batches the writer forms (same samples, same length grouping, same padding), nothing kept;
* writer: ``build_feature_cache`` end to end (planning pass, forward with layer capture,
  bf16 packing, background shard writes with checksums, manifest), timed from outside.

The samples are split into ``--rounds`` parts run in the order bare, writer, writer, bare, ...
so that drift in machine load (a shared CPU) hits both sides alike; rates per second of
wall time and per second of this process's CPU time are both printed. Rates count real
(unpadded) tokens. Target: writer >= 90% of bare. The default run takes ~2 minutes.

``--teacher-summary`` also stores the teacher's full-vocabulary top-1 and logsumexp (what
training uses by default): the writer then runs the LM head too, so the bare side becomes
the full causal-LM forward ``model(input_ids)`` with its logits.

Usage: python bench/feature_speed.py [--batches 30] [--batch-tokens 1024] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def load_samples(tokenizer, max_length: int, tokens: int) -> list:
    from lyanna_train.data.corpus import Corpus
    from lyanna_train.data.samples import SampleSettings, iter_samples

    out, total = [], 0
    for sample in iter_samples(Corpus.resolve(["sharegpt"]), tokenizer, SampleSettings(max_length=max_length)):
        out.append(sample)
        total += len(sample)
        if total >= tokens:
            break
    return out


def bare_forward(model, samples, settings) -> tuple[int, int, int, float]:
    """(real tokens, padded tokens, forward passes, seconds) over the writer's batches."""
    from lyanna_train.data.batching import collate
    from lyanna_train.data.feature_cache_writer import shard_batches, shard_samples

    batches = [collate(batch, pad_id=0)["input_ids"] for group in shard_samples(samples, settings)
               for batch in shard_batches(group, settings.batch_tokens)]
    real = sum(min(len(s), settings.max_length) for s in samples)
    start = time.perf_counter()
    with torch.inference_mode():
        for ids in batches:
            (model if settings.teacher_summary else model.base_model)(input_ids=ids, use_cache=False)
    return real, sum(ids.numel() for ids in batches), len(batches), time.perf_counter() - start


def writer(model, tokenizer, samples, settings, root) -> tuple[int, float, int]:
    """(tokens, seconds, bytes on disk) for one cache build."""
    from lyanna_train.data.feature_cache_writer import build_feature_cache

    start = time.perf_counter()
    result = build_feature_cache(samples, model, tokenizer, root, settings=settings, progress=False,
                                 say=lambda *_: None)
    return result.tokens_computed, time.perf_counter() - start, result.bytes_written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=30, help="about this many forward passes per side")
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--shard-tokens", type=int, default=4096, help="small, so rounds write several shards")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--teacher-summary", action="store_true",
                    help="store the teacher summary too; compare with the full forward (logits)")
    args = ap.parse_args()

    from lyanna_train.data.feature_cache_writer import CacheSettings
    from lyanna_train.target.source import load_tokenizer
    from lyanna_train.target.model import load_target_model

    tokenizer = load_tokenizer("smollm2")
    model = load_target_model("smollm2", dtype=getattr(torch, args.dtype))
    settings = CacheSettings(max_length=args.max_length, shard_tokens=args.shard_tokens,
                             batch_tokens=args.batch_tokens, teacher_summary=args.teacher_summary)
    samples = load_samples(tokenizer, args.max_length, int(args.batches * args.batch_tokens * 0.9))
    parts = [samples[r::args.rounds] for r in range(args.rounds)]
    bare_forward(model, samples[:2], settings)  # warm-up (allocator, kernels)
    print(f"SmolLM2-135M ({args.dtype}, {torch.get_num_threads()} threads), {len(samples)} ShareGPT samples, "
          f"batch-tokens {args.batch_tokens}, max-length {args.max_length}, {args.rounds} rounds")
    totals = {"bare": [0, 0.0, 0.0], "writer": [0, 0.0, 0.0]}  # tokens, wall s, process CPU s
    padded = passes = disk = 0
    with tempfile.TemporaryDirectory(prefix="feature-speed-") as tmp:
        for r, part in enumerate(parts):
            order = ("bare", "writer") if r % 2 == 0 else ("writer", "bare")
            line = []
            for side in order:
                cpu = time.process_time()
                if side == "bare":
                    tokens, pad, n, seconds = bare_forward(model, part, settings)
                    padded, passes = padded + pad, passes + n
                else:
                    tokens, seconds, nbytes = writer(model, tokenizer, part, settings, f"{tmp}/round-{r}")
                    disk += nbytes
                for i, v in enumerate((tokens, seconds, time.process_time() - cpu)):
                    totals[side][i] += v
                line.append(f"{side} {tokens / seconds:,.0f} tok/s")
            print(f"  round {r}: {tokens:,} tokens; " + ", ".join(line) + f" (load {os.getloadavg()[0]:.1f})")
    rate = {side: (t / wall, t / cpu) for side, (t, wall, cpu) in totals.items()}
    print(f"bare forward : {rate['bare'][0]:,.1f} tokens/s, {rate['bare'][1]:,.1f} tokens/CPU-s ({passes} passes, "
          f"{totals['bare'][0] / padded:.1%} of padded tokens real)")
    print(f"cache writer : {rate['writer'][0]:,.1f} tokens/s, {rate['writer'][1]:,.1f} tokens/CPU-s")
    print(f"ratio        : {rate['writer'][0] / rate['bare'][0]:.3f} wall, {rate['writer'][1] / rate['bare'][1]:.3f} "
          "CPU time (target >= 0.90; on a shared CPU the CPU-time ratio is the steadier one)")
    print(f"disk         : {disk / totals['writer'][0]:,.1f} bytes/token ({disk / 1e6:.1f} MB for "
          f"{totals['writer'][0]:,} tokens)")


if __name__ == "__main__":
    main()
