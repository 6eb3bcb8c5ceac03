"""Count how often the target's tokenizer emits each token over a corpus.

Streaming: memory is bounded by the vocabulary and one batch of texts. Documents are
rendered with the chat template (assistant spans as character ranges), tokenized in
batches by the Rust tokenizer, and assistant tokens are picked with the encodings'
character->token maps, so the counted ids are exactly those of a direct
``tokenizer(text, add_special_tokens=False)`` call on the rendered text.
"""

from __future__ import annotations

import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..data.chat_template import ChatRenderer, TemplateRenderError, token_range
from ..data.conversations import Document, Skip
from ..data.corpus import Corpus, ReadNotes, iter_documents
from ..errors import LyannaError

COUNT_MODES = ("assistant", "all")
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class CountSettings:
    mode: str = "assistant"  # assistant: assistant-turn tokens of conversations; all: every token
    heldout: float = 0.05  # fraction of documents held out to measure coverage on
    seed: int = 0  # seeds the held-out split
    shard: tuple[int, int] = (0, 1)  # (I, N): count documents with index % N == I
    strict: bool = False  # malformed JSON is an error instead of a skip
    batch_docs: int = 64
    batch_chars: int = 1 << 20

    def __post_init__(self):
        if self.mode not in COUNT_MODES:
            raise LyannaError(f"--count must be one of {', '.join(COUNT_MODES)}, not {self.mode!r}")
        if not 0.0 <= self.heldout < 1.0:
            raise LyannaError(f"--heldout must be in [0, 1), not {self.heldout}")
        i, n = self.shard
        if not (n >= 1 and 0 <= i < n):
            raise LyannaError(f"--shard must be I/N with 0 <= I < N, not {i}/{n}")


@dataclass
class CountResult:
    counts: np.ndarray  # int64 [vocab], train split
    heldout_counts: np.ndarray  # int64 [vocab], held-out split
    documents: dict = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    tokens: dict = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    tokens_encoded: int = 0  # every token the tokenizer produced (the work done)
    no_assistant: int = 0  # conversations without any assistant token
    unaligned_turns: int = 0  # assistant turns the template did not let us locate
    notes: ReadNotes = field(default_factory=ReadNotes)
    seconds: float = 0.0

    def add(self, other: "CountResult") -> None:
        self.counts += other.counts
        self.heldout_counts += other.heldout_counts
        for split in SPLITS:
            self.documents[split] += other.documents[split]
            self.tokens[split] += other.tokens[split]
        self.tokens_encoded += other.tokens_encoded
        self.no_assistant += other.no_assistant
        self.unaligned_turns += other.unaligned_turns
        self.notes.merge(other.notes)
        if not self.notes.truncated:
            self.notes.truncated = list(other.notes.truncated)
        if not self.notes.binary:  # (every worker reads every file)
            self.notes.binary = list(other.notes.binary)


def is_heldout(index: int, fraction: float, seed: int) -> bool:
    """Seeded, order-free coin flip per document (splitmix64 of seed and index)."""
    if fraction <= 0:
        return False
    z = (index + (seed + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return z / 2.0**64 < fraction


class ShardCounter:
    """Counts the documents of one worker; used in-process or inside a worker process."""

    def __init__(self, tokenizer, vocab: int, settings: CountSettings, on_flush=None):
        self.on_flush = on_flush  # called with (documents, tokens encoded) after each batch
        self.backend = tokenizer.backend_tokenizer
        self.settings = settings
        # One renderer for both modes; None only for a template-less tokenizer in "all" mode,
        # where a conversation is then an error (raw text still counts).
        self.renderer = ChatRenderer(tokenizer) if settings.mode == "assistant" or tokenizer.chat_template else None
        self.result = CountResult(np.zeros(vocab, np.int64), np.zeros(vocab, np.int64))
        self._batch: list[tuple[str, list | None, str]] = []
        self._chars = 0
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")
        self._pending = None  # (future of encodings, batch) being tokenized

    def _render(self, doc: Document) -> tuple[str, list | None]:
        if not doc.is_conversation:
            return doc.text, None
        if self.renderer is None:
            raise LyannaError("the tokenizer has no chat template to render conversations with")
        if self.settings.mode == "all":  # every token the template renders
            return self.renderer.render(doc.messages), None
        rendered = self.renderer.render_with_spans(doc.messages)
        self.result.unaligned_turns += rendered.unaligned_turns
        if not rendered.spans:
            self.result.no_assistant += 1
        return rendered.text, rendered.spans

    def add(self, item: Document | Skip) -> None:
        if isinstance(item, Skip):
            if item.malformed and self.settings.strict:
                raise LyannaError(f"{item.reason} (--strict)")
            return
        try:
            text, spans = self._render(item)
        except TemplateRenderError as err:
            self.result.notes.skip(str(err), f"record {item.index}")
            return
        split = "heldout" if is_heldout(item.index, self.settings.heldout, self.settings.seed) else "train"
        self.result.documents[split] += 1
        self._batch.append((text, spans, split))
        self._chars += len(text)
        if len(self._batch) >= self.settings.batch_docs or self._chars >= self.settings.batch_chars:
            self.flush()

    def flush(self) -> None:
        """Start tokenizing the pending batch and count the previous one meanwhile.

        The Rust tokenizer releases the GIL, so reading, parsing and rendering the next
        batch (Python) overlaps the encoding of this one (Rust): a two-stage pipeline.
        """
        if not self._batch:
            return
        batch, self._batch, self._chars = self._batch, [], 0
        future = self._encoder.submit(self.backend.encode_batch, [t for t, _, _ in batch], add_special_tokens=False)
        self._collect()
        self._pending = (future, batch)

    def finish(self) -> CountResult:
        """Flush, wait for the last batch, and return the result."""
        self.flush()
        self._collect()
        self._encoder.shutdown()
        return self.result

    def _collect(self) -> None:
        if self._pending is None:
            return
        future, batch = self._pending
        self._pending = None
        picked: dict[str, list[int]] = {s: [] for s in SPLITS}
        encoded = 0
        for enc, (_, spans, split) in zip(future.result(), batch):
            ids = enc.ids
            encoded += len(ids)
            if spans is None:
                picked[split] += ids
            else:
                for start, end in spans:
                    a, b = token_range(enc, start, end)
                    picked[split] += ids[a:b]
        vocab = len(self.result.counts)
        for split, target in (("train", self.result.counts), ("heldout", self.result.heldout_counts)):
            if picked[split]:
                ids = np.asarray(picked[split], dtype=np.int64)
                if ids.max() >= vocab:
                    raise LyannaError(f"tokenizer produced id {ids.max()} outside its vocabulary of {vocab}")
                target += np.bincount(ids, minlength=vocab)
                self.result.tokens[split] += len(ids)
        self.result.tokens_encoded += encoded
        if self.on_flush is not None:
            self.on_flush(len(batch), encoded)


def _keep(shard: tuple[int, int], worker: int, workers: int):
    i, n = shard
    return lambda index: index % n == i and (index // n) % workers == worker


def count_worker(corpus: Corpus, tok_dir: str, vocab: int, settings: CountSettings,
                 worker: int = 0, workers: int = 1, on_flush=None, tokenizer=None) -> CountResult:
    """Count the documents of ``worker`` (of ``workers``) within the settings' shard, with
    ``tokenizer`` when the caller already holds the one ``tok_dir`` gives (else loaded)."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True, trust_remote_code=False)
    counter = ShardCounter(tokenizer, vocab, settings, on_flush)
    start = time.perf_counter()
    for item in iter_documents(corpus, counter.result.notes, _keep(settings.shard, worker, workers)):
        counter.add(item)
    result = counter.finish()
    result.seconds = time.perf_counter() - start
    return result


def _process_main(out, args) -> None:
    """Worker-process entry: one Rust thread per process, since processes already share the cores."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        result = count_worker(*args, on_flush=lambda d, t: out.put(("progress", d, t)))
        out.put(("done", result, None))
    except LyannaError as err:
        out.put(("error", str(err), None))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which re-raises
        out.put(("crash", f"{type(err).__name__}: {err}", None))


def count_corpus(corpus: Corpus, tok_dir: str, vocab: int, settings: CountSettings,
                 num_proc: int = 1, progress=None, tokenizer=None) -> CountResult:
    """Count ``corpus`` with ``num_proc`` processes; ``progress(docs, tokens)`` after each batch.

    With one process the Rust tokenizer parallelises each batch itself (``tokenizer``, if
    given, is that process's: loading it again took ~0.15-0.4 s of a small build); with
    several, each process takes every ``num_proc``-th document of the shard.
    """
    start = time.perf_counter()
    if num_proc <= 1:
        result = count_worker(corpus, tok_dir, vocab, settings, on_flush=progress, tokenizer=tokenizer)
        result.seconds = time.perf_counter() - start
        return result
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_process_main, args=(out, (corpus, tok_dir, vocab, settings, w, num_proc)),
                         daemon=True) for w in range(num_proc)]
    for p in procs:
        p.start()
    total = CountResult(np.zeros(vocab, np.int64), np.zeros(vocab, np.int64))
    done = 0
    try:
        while done < num_proc:
            try:
                kind, payload, extra = out.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise LyannaError("a counting worker process died unexpectedly") from None
                continue
            if kind == "progress":
                if progress is not None:
                    progress(payload, extra)
            elif kind == "done":
                total.add(payload)
                done += 1
            elif kind == "error":
                raise LyannaError(payload)
            else:
                raise RuntimeError(f"counting worker failed: {payload}")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    total.seconds = time.perf_counter() - start
    return total
