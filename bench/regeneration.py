"""Benchmark: regenerating answers with the target, on the runtime against batched ``generate``.

The same first turns of a corpus are regenerated (greedy) three ways, each at several batch
sizes, side by side in one run:

* ``generate``: transformers' left-padded batched ``generate`` over fixed batches (how
  self-distillation used to decode; a batch waits for its slowest row);
* ``runtime``: ``data_tools/self_distill.py``'s way, the runtime's continuous batching with
  speculation (the ``--draft`` head, else prompt lookup), which is lossless;
* over ``--pass-conversations``, regeneration alone at each batch size, then at the best one
  the features too: one pass (the decoder records them and
  ``DistilledOutput`` writes the cache as it goes) against two (regenerate, then the feature
  cache's teacher-forced build over the output: what the cache costs per token; regeneration
  cannot beat the target's forward). ``--pass-conversations`` runs these passes over more
  conversations than ``generate`` can decode in minutes: with a few dozen, a batch of 32 rows
  drains for most of the run, and regeneration's tokens/s against the feature pass's is a
  steady-state figure only over enough conversations to keep the rows full.

    python bench/regeneration.py --draft checkpoints/smollm2_135m-export --out bench/results/regen \\
        [--conversations 32] [--max-new-tokens 64] [--batch-size 1,4,8,16] [--generate-batch-size 4]
        [--pass-conversations 192]

Prints tokens/s per method and batch size and the ratios; writes OUT/regeneration.json.
Answers of ``runtime`` are checked against ``generate``'s at batch 1 (greedy: identical up
to floating-point ties).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from lyanna_train.data.chat_template import ChatRenderer
from lyanna_train.data.conversations import Document
from lyanna_train.data.corpus import Corpus, ReadNotes, iter_documents
from lyanna_train.data.distilled_output import DistilledOutput
from lyanna_train.data.feature_cache_writer import build_feature_cache
from lyanna_train.data.samples import CorpusSamples
from lyanna_train.data.self_distill import GenerationSettings, SelfDistiller, append_jsonl, to_sharegpt
from lyanna_train.target.capture import default_layer_ids
from lyanna_train.runtime.cpu.tuning import tune
from lyanna_train.runtime.served_models import load_models
from lyanna_train.runtime.scheduling.scheduler import BatchDecoder
from lyanna_train.runtime.settings import load_decode_settings


def first_turns(corpus: str, count: int) -> list[tuple[str, list[dict]]]:
    """The first ``count`` conversations that open with a user turn, cut before their first answer."""
    out = []
    for doc in iter_documents(Corpus.resolve([corpus]), ReadNotes()):
        if not (isinstance(doc, Document) and doc.is_conversation):
            continue
        msgs = doc.messages
        k = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
        if k and all(str(m.get("content", "")).strip() for m in msgs[:k]):
            out.append((str(doc.index), msgs[:k + 1]))
        if len(out) >= count:
            break
    return out


def by_generate(target, tokenizer, prompts: list[list[int]], stop_ids: list[int], batch: int, new: int) -> list[list[int]]:
    answers = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        longest = max(map(len, chunk))
        ids = torch.full((len(chunk), longest), stop_ids[0], dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(chunk):
            ids[row, longest - len(p):], mask[row, longest - len(p):] = torch.tensor(p), 1
        with torch.inference_mode():
            out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                  eos_token_id=stop_ids, pad_token_id=stop_ids[0])
        for row in out[:, longest:].tolist():
            answers.append(row[:next((k for k, t in enumerate(row) if t in stop_ids), len(row))])
    return answers


def one_pass_vs_two(target, tokenizer, draft, decode, cost, convs, args, sizes: list[int]) -> dict:
    """The same conversations regenerated at each of ``sizes`` (the best one chosen over
    these conversations, not over the short runs above, where a batch drains for most of
    the run), then at the best size with their features: in one pass (the decoder records
    them, :class:`DistilledOutput`) against that regeneration followed by the feature
    cache's build over its output (the teacher-forced pass)."""
    import tempfile

    layers = default_layer_ids(target.config.num_hidden_layers)
    with tempfile.TemporaryDirectory(prefix="regeneration-passes-") as tmp:  # caches stay out of the results
        return _passes(target, tokenizer, draft, decode, cost, convs, sizes, args.max_new_tokens, layers, Path(tmp))


def _passes(target, tokenizer, draft, decode, cost, convs, sizes, max_new_tokens, layers, work: Path) -> dict:
    regenerated = {}
    for batch in sizes:
        settings = GenerationSettings(max_new_tokens=max_new_tokens, batch_size=batch)
        begin = time.perf_counter()
        distiller = SelfDistiller(BatchDecoder(target, draft, decode, batch, cost, layer_ids=layers), tokenizer,
                                  settings)
        done = list(distiller.regenerate(convs))
        append_jsonl(work / f"two-{batch}.jsonl", [to_sharegpt(r.cid, r.messages) for r in done])
        seconds = time.perf_counter() - begin
        new_tokens = sum(r.new_tokens for r in done)
        regenerated[batch] = {"seconds": seconds, "new_tokens": new_tokens, "regenerated": len(done),
                              "tokens_per_s": new_tokens / seconds}
        print(f"batch {batch}: regenerating {len(convs)} conversations {new_tokens / seconds:.1f} tok/s", flush=True)
    batch = max(regenerated, key=lambda b: regenerated[b]["tokens_per_s"])
    best = regenerated[batch]
    begin = time.perf_counter()
    built = build_feature_cache(CorpusSamples(Corpus.resolve([str(work / f"two-{batch}.jsonl")]), tokenizer), target,
                                tokenizer, work / "two-features", layer_ids=layers, progress=False, say=lambda *_: None)
    features = time.perf_counter() - begin
    settings = GenerationSettings(max_new_tokens=max_new_tokens, batch_size=batch)
    begin = time.perf_counter()
    decoder = BatchDecoder(target, draft, decode, batch, cost, layer_ids=layers, record_features=True)
    distiller = SelfDistiller(decoder, tokenizer, settings, record_features=True)
    output = DistilledOutput(work / "one.jsonl", work / "one-features", target, tokenizer, layers)
    for r in distiller.regenerate(convs):
        output.add(to_sharegpt(r.cid, r.messages), r.features)
    output.close()
    one = time.perf_counter() - begin
    check = build_feature_cache(CorpusSamples(Corpus.resolve([str(work / "one.jsonl")]), tokenizer), target,
                                tokenizer, work / "one-features", layer_ids=layers, progress=False, say=lambda *_: None)
    two = best["seconds"] + features
    result = {"batch_size": batch, "conversations": len(convs), "regenerated": best["regenerated"],
              "regenerate_by_batch": {str(b): r for b, r in regenerated.items()},
              "two_pass": {"seconds": two, "regenerate_seconds": best["seconds"], "features_seconds": features,
                           "new_tokens": best["new_tokens"], "regenerate_tokens_per_s": best["tokens_per_s"],
                           "feature_tokens": built.tokens_computed, "feature_tokens_per_s": built.tokens_per_second},
              "one_pass": {"seconds": one, "samples": output.stats.samples, "recomputed_samples": output.recomputed,
                           "shards": len(output.plan), "left_for_the_trainer_to_compute": check.shards_written}}
    print(f"batch {batch}: two passes {two:.1f} s (regenerate {best['seconds']:.1f} + features {features:.1f}), "
          f"one pass {one:.1f} s -> {two / one:.2f}x; {output.recomputed}/{output.stats.samples} samples re-tokenized "
          f"otherwise; trainer's build over it computed {check.shards_written} shards", flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", help="exported draft head (default: prompt lookup only)")
    p.add_argument("--target", default=None, help="target (default: the draft's, else smollm2)")
    p.add_argument("--corpus", default="sharegpt")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", default="1,4,8,16")
    p.add_argument("--generate-batch-size", default=None,
                   help="the batch sizes generate runs at (default: --batch-size's); e.g. only its best one, "
                        "when the runtime is measured at sizes where generate takes minutes")
    p.add_argument("--pass-conversations", type=int, default=None,
                   help="conversations the one-pass / two-pass comparison regenerates (default: --conversations)")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    sizes = [int(b) for b in args.batch_size.split(",")]
    generate_sizes = [int(b) for b in (args.generate_batch_size or args.batch_size).split(",")]
    target, tokenizer, draft = load_models(args.draft, args.target or (None if args.draft else "smollm2"),
                                           args.draft is not None)
    decode = load_decode_settings("default")  # what data_tools/self_distill.py decodes with
    cost = tune(target, draft, shape=decode.tree, say=print)
    convs = first_turns(args.corpus, args.conversations)
    probe = SelfDistiller(BatchDecoder(target, None, decode, 1), tokenizer)
    renderer, stop_ids = ChatRenderer(tokenizer), probe.stop_ids
    prompts = [tokenizer.backend_tokenizer.encode(renderer.render(m[:-1], add_generation_prompt=True),
                                                  add_special_tokens=False).ids for _, m in convs]
    results: dict[str, dict[str, dict]] = {"generate": {}, "runtime": {}}
    reference = None
    for batch in generate_sizes:
        begin = time.perf_counter()
        answers = by_generate(target, tokenizer, prompts, stop_ids, batch, args.max_new_tokens)
        seconds = time.perf_counter() - begin
        reference = reference or answers
        tokens = sum(map(len, answers))
        results["generate"][str(batch)] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
        print(f"batch {batch}: generate {tokens / seconds:.1f} tok/s", flush=True)
    for batch in sizes:
        settings = GenerationSettings(max_new_tokens=args.max_new_tokens, batch_size=batch)
        distiller = SelfDistiller(BatchDecoder(target, draft, decode, batch, cost), tokenizer, settings)
        begin = time.perf_counter()
        done = {r.cid: r for r in distiller.regenerate(convs)}
        seconds = time.perf_counter() - begin
        tokens = sum(r.new_tokens for r in done.values())
        same = sum(done[cid].messages[-1]["content"] == tokenizer.decode(ref)
                   for (cid, _), ref in zip(convs, reference) if cid in done)
        results["runtime"][str(batch)] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                                          "identical_to_generate": f"{same}/{len(convs)}"}
        print(f"batch {batch}: runtime {tokens / seconds:.1f} tok/s ({same}/{len(convs)} answers identical to "
              f"generate's)", flush=True)
    pass_convs = first_turns(args.corpus, args.pass_conversations) if args.pass_conversations else convs
    passes = one_pass_vs_two(target, tokenizer, draft, decode, cost, pass_convs, args, sizes)
    feature_tps = passes["two_pass"]["feature_tokens_per_s"]
    best = {m: max(r.values(), key=lambda x: x["tokens_per_s"]) for m, r in results.items()}
    summary = {
        "command": "python bench/regeneration.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
        "conversations": len(convs), "max_new_tokens": args.max_new_tokens, "batch_sizes": sizes,
        "generate_batch_sizes": generate_sizes,
        "results": results, "feature_pass_tokens_per_s": feature_tps, "passes": passes,
        "one_pass_vs_two": passes["two_pass"]["seconds"] / passes["one_pass"]["seconds"],
        "runtime_vs_generate": best["runtime"]["tokens_per_s"] / best["generate"]["tokens_per_s"],
        "runtime_vs_feature_pass": best["runtime"]["tokens_per_s"] / feature_tps,
        # the same conversations both ways: regeneration's new tokens/s in the two-pass run
        "regeneration_vs_feature_pass": passes["two_pass"]["regenerate_tokens_per_s"] / feature_tps,
        "environment": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                        "threads": torch.get_num_threads()},
    }
    print(f"best runtime / best generate: {summary['runtime_vs_generate']:.2f}x; "
          f"best runtime / feature pass ({feature_tps:.0f} tok/s): {summary['runtime_vs_feature_pass']:.2f}x "
          f"({summary['regeneration_vs_feature_pass']:.2f}x over the passes' {len(pass_convs)} conversations); "
          f"one pass (data and features) / two passes: {summary['one_pass_vs_two']:.2f}x faster")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "regeneration.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
