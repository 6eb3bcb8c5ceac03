"""Build a hot-vocabulary artifact: count -> select -> write; and merge count directories."""

from __future__ import annotations

import hashlib
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from .. import __version__
from ..atomic import atomic_directory, check_output_dir, write_json_atomic
from ..data.corpus import Corpus
from ..errors import LyannaError
from ..locks import output_lock
from ..target.fingerprint import tokenizer_fingerprint, vocab_size
from ..target.source import load_tokenizer, resolve_target, tokenizer_dir
from . import artifact
from .counting import CountResult, CountSettings, count_corpus
from .report import plot_coverage, selection_table, write_report
from .selection import SelectionRequest, check_sizes, coverage_curve, rank_tokens, select


def end_of_turn_ids(tokenizer) -> tuple[list[int], list[str]]:
    """Ids that every hot vocabulary must contain: EOS and the template's end-of-turn token."""
    from ..data.chat_template import ChatRenderer

    strings = [tokenizer.eos_token] if tokenizer.eos_token else []
    if getattr(tokenizer, "chat_template", None):
        strings += ChatRenderer(tokenizer).end_of_turn_tokens()
    strings = list(dict.fromkeys(strings))
    ids = [tokenizer.convert_tokens_to_ids(s) for s in strings]
    return [i for i in ids if i is not None], strings


def write_selections(directory: Path, manifest: dict, counts: np.ndarray, heldout_counts: np.ndarray,
                     requests: list[SelectionRequest]) -> dict:
    """Select every request, write the hot files, plot and report; return the manifest."""
    forced = manifest["always_include"]
    ranking = rank_tokens(counts, forced)
    train_curve = coverage_curve(ranking, counts)
    heldout_curve = coverage_curve(ranking, heldout_counts)
    vocab = len(counts)
    selections, seen = [], set()
    for request in requests:
        size = request.resolve_size(vocab, heldout_curve, len(forced))
        if size in seen:
            continue
        seen.add(size)
        hot = select(counts, size, forced)
        heldout = None if np.isnan(heldout_curve[size - 1]) else float(heldout_curve[size - 1])
        selections.append({
            "request": request.label,
            "ratio": size / vocab,
            "size": size,
            "file": artifact.save_hot_vocab(directory, hot, manifest["tokenizer"]["fingerprint"]),
            "coverage_train": float(train_curve[size - 1]),
            "coverage_heldout": heldout,
        })
    manifest["selections"] = selections
    artifact.save_counts(directory, counts, heldout_counts)
    plot_coverage(directory / "coverage.png", train_curve, heldout_curve, selections,
                  f"{manifest['tokenizer']['spec']} on {', '.join(manifest['corpus']['specs'])}")
    write_report(directory, manifest)
    write_json_atomic(directory / artifact.MANIFEST_FILE, manifest)  # last: marks completeness
    return manifest


def _check_result(result: CountResult, settings: CountSettings) -> None:
    docs = sum(result.documents.values())
    if docs == 0:
        why = "; ".join(f"{r} ({n})" for r, n in result.notes.skipped.items()) or "no records"
        raise LyannaError(f"empty corpus: no usable documents ({why})")
    if sum(result.tokens.values()) == 0:
        if settings.mode == "assistant":
            raise LyannaError(
                f"no assistant turns in the corpus ({docs} documents, none with assistant tokens); "
                "use --count all to count every token"
            )
        raise LyannaError(f"the corpus produced no tokens ({docs} documents, all empty)")


def _report_notes(result: CountResult, say) -> None:
    for t in result.notes.truncated:
        say(f"warning: {t.path} is truncated at byte {t.byte_offset}: recovered its {t.records} complete records")
    for b in result.notes.binary:
        say(f"warning: {b.path}: {b.lines:,} lines hold bytes that are not UTF-8 text (binary data?); they were "
            "counted with U+FFFD in place of those bytes")
    if result.notes.skipped:
        parts = [f"{n} × {reason} (first: {result.notes.first_skip[reason]})" for reason, n in result.notes.skipped.items()]
        say(f"skipped {result.notes.n_skipped} records: " + "; ".join(parts))
    if result.no_assistant:
        say(f"note: {result.no_assistant} conversations have no assistant tokens (nothing counted from them)")
    if result.documents["heldout"] == 0 and result.documents["train"]:
        say("warning: the held-out split is empty (corpus too small for --heldout); held-out coverage is not measured")
    if result.unaligned_turns:
        say(f"warning: {result.unaligned_turns} assistant turns could not be located in the template's rendering")


def build(corpus_specs: list[str], tokenizer_spec: str, out: str | Path, requests: list[SelectionRequest],
          settings: CountSettings, num_proc: int = 1, overwrite: bool = False, progress: bool = True,
          say=print, tokenizer=None) -> dict:
    """Count ``corpus_specs`` with the tokenizer, select ``requests``, write ``out`` atomically
    (one writer). ``tokenizer``: the one ``tokenizer_spec`` loads, where the caller holds it
    already (a training run): it is not loaded twice more."""
    with output_lock(out):
        return _build(corpus_specs, tokenizer_spec, out, requests, settings, num_proc, overwrite, progress, say,
                      tokenizer)


def _build(corpus_specs, tokenizer_spec, out, requests, settings, num_proc, overwrite, progress, say,
           tokenizer=None) -> dict:
    if not requests:
        raise LyannaError("no selection requested (give --ratios, --sizes or --coverage)")
    corpus = Corpus.resolve(corpus_specs)
    out = check_output_dir(out, overwrite, inputs=[*corpus_specs, *(s.path for s in corpus.sources), tokenizer_spec])
    ref = resolve_target(tokenizer_spec)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(ref)
    tok_dir = tokenizer_dir(ref)
    vocab = vocab_size(tokenizer)
    check_sizes(requests, vocab)  # now, not after the whole corpus is counted
    forced, forced_strings = end_of_turn_ids(tokenizer)
    if settings.mode == "assistant" and not getattr(tokenizer, "chat_template", None):
        raise LyannaError(f"tokenizer {tokenizer_spec} has no chat template: use --count all to count raw text")

    bar = None
    if progress:
        from tqdm.auto import tqdm

        import sys

        interactive = sys.stderr.isatty()  # in logs, a line every 10 s instead of a redraw
        bar = tqdm(unit="tok", unit_scale=True, desc="counting", dynamic_ncols=True,
                   mininterval=0.2 if interactive else 10.0)
    docs_seen = [0]

    def on_batch(docs: int, tokens: int) -> None:
        docs_seen[0] += docs
        if bar is not None:
            bar.update(tokens)
            bar.set_postfix(docs=docs_seen[0], refresh=False)

    try:
        result = count_corpus(corpus, tok_dir, vocab, settings, num_proc=num_proc, progress=on_batch,
                              tokenizer=tokenizer)
    finally:
        if bar is not None:
            bar.close()
    _report_notes(result, say)
    _check_result(result, settings)

    manifest = {
        "format": artifact.FORMAT,
        "version": artifact.VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "lyanna_train": __version__,
        "tokenizer": {
            "spec": tokenizer_spec,
            "description": ref.description,
            "fingerprint": tokenizer_fingerprint(tokenizer),
            "vocab_size": vocab,
            "chat_template_sha256": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest(),
        },
        "corpus": {"specs": list(corpus_specs), "sources": corpus.describe(), "hash": corpus.content_hash()},
        "count": {"mode": settings.mode, "heldout": settings.heldout, "seed": settings.seed,
                  "shard": f"{settings.shard[0]}/{settings.shard[1]}"},
        "always_include": forced,
        "always_include_tokens": forced_strings,
        "documents": result.documents,
        "tokens": result.tokens,
        "tokens_encoded": result.tokens_encoded,
        "skipped": {"total": result.notes.n_skipped, "reasons": result.notes.skipped, "first": result.notes.first_skip},
        "truncated": [{"path": t.path, "byte_offset": t.byte_offset, "records": t.records} for t in result.notes.truncated],
        "no_assistant_conversations": result.no_assistant,
        "unaligned_assistant_turns": result.unaligned_turns,
        "timing": {"seconds": round(result.seconds, 3), "num_proc": num_proc,
                   "tokens_encoded_per_second": round(result.tokens_encoded / max(result.seconds, 1e-9))},
    }
    with atomic_directory(out, overwrite=overwrite) as tmp:
        write_selections(tmp, manifest, result.counts, result.heldout_counts, requests)
    _summary(manifest, result.seconds, out, say)
    return manifest


def _summary(manifest: dict, seconds: float, out: Path, say) -> None:
    docs, toks = manifest["documents"], manifest["tokens"]
    rate = manifest["tokens_encoded"] / max(seconds, 1e-9)
    say(f"\ncounted {toks['train']:,} + {toks['heldout']:,} held-out {manifest['count']['mode']} tokens from "
        f"{docs['train']:,} + {docs['heldout']:,} held-out documents in {seconds:.1f} s "
        f"({rate:,.0f} tokens/s tokenized); skipped {manifest['skipped']['total']} records\n")
    say(selection_table(manifest["selections"], manifest["tokenizer"]["vocab_size"]))
    say(f"\nwrote {out}/ (manifest.json, counts.safetensors, hot-*.safetensors, coverage.png, report.md)")


def merge(directories: list[str], out: str | Path, requests: list[SelectionRequest], overwrite: bool = False,
          say=print) -> dict:
    """Sum the counts of several count directories (e.g. ``--shard I/N`` runs) and re-select (one writer)."""
    with output_lock(out):
        return _merge(directories, out, requests, overwrite, say)


def _merge(directories, out, requests, overwrite, say) -> dict:
    if not requests:
        raise LyannaError("no selection requested (give --ratios, --sizes or --coverage)")
    if len(directories) < 1:
        raise LyannaError("merge needs at least one count directory")
    out = check_output_dir(out, overwrite, inputs=directories)
    loaded = [artifact.load_counts(d) for d in directories]
    first = loaded[0][0]
    for d, (m, _, _) in zip(directories, loaded):
        if m["tokenizer"]["fingerprint"] != first["tokenizer"]["fingerprint"]:
            raise LyannaError(f"cannot merge {d}: it was counted with another tokenizer "
                              f"({m['tokenizer']['spec']} vs {first['tokenizer']['spec']})")
        for key in ("mode", "heldout", "seed"):
            if m["count"][key] != first["count"][key]:
                raise LyannaError(f"cannot merge {d}: count {key} {m['count'][key]!r} differs from {first['count'][key]!r}")
    shards = [(m["corpus"]["hash"], m["count"]["shard"]) for m, _, _ in loaded]
    duplicates = {s for s in shards if shards.count(s) > 1}
    if duplicates:
        raise LyannaError(f"cannot merge: the same shard of the same corpus is given twice ({sorted(d[1] for d in duplicates)})")
    by_corpus: dict[str, set] = {}
    for h, shard in shards:
        by_corpus.setdefault(h, set()).add(shard)
    for h, got in by_corpus.items():
        n = int(next(iter(got)).split("/")[1])
        if n > 1 and len(got) < n:
            say(f"warning: only {len(got)} of {n} shards of corpus {h[:19]}… are merged: counts are partial")

    counts = sum(c for _, c, _ in loaded)
    heldout = sum(h for _, _, h in loaded)
    corpus_hashes = sorted(by_corpus)
    manifest = dict(first)
    manifest.update({
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "corpus": {
            "specs": list(dict.fromkeys(s for m, _, _ in loaded for s in m["corpus"]["specs"])),
            "sources": [src for m, _, _ in loaded for src in m["corpus"]["sources"]],
            "hash": corpus_hashes[0] if len(corpus_hashes) == 1
            else "sha256:" + hashlib.sha256("".join(corpus_hashes).encode()).hexdigest(),
        },
        "count": dict(first["count"], shard="merged"),
        "documents": {k: sum(m["documents"][k] for m, _, _ in loaded) for k in first["documents"]},
        "tokens": {k: sum(m["tokens"][k] for m, _, _ in loaded) for k in first["tokens"]},
        "tokens_encoded": sum(m["tokens_encoded"] for m, _, _ in loaded),
        "skipped": {"total": sum(m["skipped"]["total"] for m, _, _ in loaded),
                    "reasons": _sum_dicts(m["skipped"]["reasons"] for m, _, _ in loaded),
                    "first": _first_dicts(m["skipped"]["first"] for m, _, _ in loaded)},
        "merged_from": [{"path": str(d), "shard": m["count"]["shard"], "corpus_hash": m["corpus"]["hash"]}
                        for d, (m, _, _) in zip(directories, loaded)],
    })
    manifest.pop("timing", None)
    start = time.perf_counter()
    with atomic_directory(out, overwrite=overwrite) as tmp:
        write_selections(tmp, manifest, counts, heldout, requests)
    say(selection_table(manifest["selections"], manifest["tokenizer"]["vocab_size"]))
    say(f"\nmerged {len(directories)} count directories into {out}/ in {time.perf_counter() - start:.1f} s")
    return manifest


def _sum_dicts(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _first_dicts(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out.setdefault(k, v)
    return out

