"""Self-distillation: regenerate assistant turns with the target itself.

A draft learns to predict what *the target* says, so training on the target's own
answers (rather than another model's) raises acceptance. Every assistant turn of a
conversation is regenerated from the conversation so far (user turns kept, earlier
assistant turns already regenerated), up to ``max_turns``.

The decoding is the serving runtime's continuous batching (``data_tools/self_distill.py``
hands in a :class:`..runtime.scheduling.scheduler.BatchDecoder`, speculation on, which
is lossless): up to ``batch_size`` conversations are in flight, a conversation's next
turn is submitted the moment its previous one finishes, and a finished conversation
frees its place for the next — no row waits for the slowest of a fixed batch. Each
turn samples with its own seed, derived from the run's seed and the conversation's id,
so a conversation's answers do not depend on which others shared its batch.

Output is ShareGPT-format JSONL, one conversation per line (the last answer with the ids
the target emitted for it, ``token_ids``: the decoded text can tokenize otherwise), appended and fsynced as each
conversation completes, so a run killed at any point resumes by skipping the ids
already written (a torn last line is cut) and writes nothing twice.
"""

from __future__ import annotations

import itertools
import json
import os
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Protocol

from ..errors import LyannaError
from ..ranges import check_fields, integer, number, ranged
from .chat_template import ChatRenderer, TemplateRenderError
from .conversations import TOKEN_IDS

_TO_SHAREGPT = {"user": "human", "assistant": "gpt", "system": "system"}


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = ranged(256, integer(1))  # per turn
    temperature: float = ranged(0.0, number(0))  # 0 = greedy
    top_p: float = ranged(1.0, number(0, 1, low_open=True))
    # a turn whose prompt is longer ends the conversation there
    max_prompt_tokens: int = ranged(1024, integer(1))
    max_turns: int = ranged(1, integer(1))  # assistant turns regenerated per conversation (later ones are cut)
    # conversations in flight. Wider batches regenerate faster while the target's forward grows slower than
    # its rows (192 ShareGPT first turns x 128 tokens, SmolLM2 with the recipe's head, 2-core Xeon: 104 /
    # 177 / 194 new tokens/s at 8 / 32 / 64); the KV cache grows with it (32 rows of 1,280 tokens: 1.9 GB for
    # SmolLM2, 5.4 GB for an 8B Llama in bf16)
    batch_size: int = ranged(32, integer(1))
    seed: int = ranged(0, integer(0))
    # conversations read ahead and ordered by length (:func:`by_length`); 1 keeps the corpus order
    length_window: int = ranged(512, integer(1))

    def __post_init__(self):
        check_fields(self, LyannaError)


class Decoder(Protocol):
    """What regeneration needs of a decoder (the runtime's ``BatchDecoder`` is one): submit
    a prompt, step until its request is done. Kept as a protocol so the data layer does
    not import the runtime."""

    def submit(self, prompt_ids, max_new_tokens: int, sampling=None, seed: int | None = None,
               eos_ids=None, closing=()): ...

    def step(self) -> list: ...


def by_length(conversations: Iterable[tuple[str, list[dict]]], window: int) -> Iterator[tuple[str, list[dict]]]:
    """The conversations ``window`` at a time, each window ordered by the length of what comes
    before its first answer, ascending and descending in turn (so one window's end and the
    next one's start are alike).

    Rows decoded together attend over the longest row's cache (the ragged cache pads to it):
    ShareGPT's first prompts run from a few tokens to a thousand, and in corpus order the rows
    of a batch of 32 held 2.4x the entries they read; ordered by length, 1.6x (SmolLM2, 64
    conversations, 256 new tokens). Each conversation keeps its own seed, so the order
    changes no answer; memory holds one window of texts."""
    def size(item):
        messages = item[1]
        first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        return sum(len(str(m.get("content", ""))) for m in messages[:first])

    todo, descending = iter(conversations), False
    while chunk := list(itertools.islice(todo, window)):
        yield from sorted(chunk, key=size, reverse=descending)
        descending = not descending


def turn_seed(seed: int, cid: str, turn: int) -> int:
    """A turn's sampling seed: the run's seed, the conversation and the turn, nothing else."""
    return ((zlib.crc32(f"{seed}\0{cid}\0{turn}".encode()) << 16) ^ seed) & (2 ** 62 - 1)


@dataclass
class Regenerated:
    cid: str
    messages: list[dict]  # ends on a regenerated assistant turn
    new_tokens: int
    features: object = None  # the target's features of the whole conversation (record_features)


@dataclass
class _Conversation:
    cid: str
    source: list[dict]
    out: list[dict] = field(default_factory=list)
    cursor: int = 0
    turns: int = 0
    new_tokens: int = 0
    features: object = None  # of the latest turn's prompt, answer and closing tokens


class SelfDistiller:
    """Regenerates the assistant turns of conversations with a target through ``decoder``.

    ``sampling``: what the decoder's ``submit`` takes for ``settings``' temperature and
    top-p (the runtime's ``SamplingParams``; None: the decoder's default, greedy).
    ``skipped`` counts conversations that gave nothing, by reason; ``cut`` those that
    ended early but kept the turns they had. ``record_features`` (a decoder that records
    them): each conversation comes with the target's features of all its tokens, its last
    turn closed as the chat template closes it."""

    def __init__(self, decoder: Decoder, tokenizer, settings: GenerationSettings = GenerationSettings(),
                 sampling=None, record_features: bool = False):
        self.decoder, self.tokenizer, self.settings, self.sampling = decoder, tokenizer, settings, sampling
        self.renderer = ChatRenderer(tokenizer)
        eot = [tokenizer.convert_tokens_to_ids(t) for t in self.renderer.end_of_turn_tokens()]
        self.stop_ids = sorted({i for i in eot + [tokenizer.eos_token_id] if i is not None})
        self.closing = (tokenizer.backend_tokenizer.encode(self.renderer.closing_text(), add_special_tokens=False).ids
                        if record_features else None)
        self.skipped: Counter[str] = Counter()
        self.cut: Counter[str] = Counter()

    def regenerate(self, conversations: Iterable[tuple[str, list[dict]]]) -> Iterator[Regenerated]:
        """Yield each conversation with its assistant turns replaced, in the order they finish
        (taken in :func:`by_length`'s order)."""
        todo = by_length(conversations, self.settings.length_window)
        flying: dict[object, _Conversation] = {}  # request -> its conversation
        exhausted = False
        while flying or not exhausted:
            while not exhausted and len(flying) < self.settings.batch_size:
                item = next(todo, None)
                if item is None:
                    exhausted = True
                    break
                conv = _Conversation(str(item[0]), list(item[1]))
                result = self._next_turn(conv, flying)
                if result is not None:
                    yield result
            if not flying:
                continue
            for update in self.decoder.step():
                conv = flying.get(update.request)
                if conv is None or not update.request.done:
                    continue
                del flying[update.request]
                result = self._finish_turn(conv, update.request, flying)
                if result is not None:
                    yield result

    def _next_turn(self, conv: _Conversation, flying: dict) -> Regenerated | None:
        """Submit ``conv``'s next assistant turn -> None, or the conversation if it is over."""
        msgs = conv.source
        while conv.cursor < len(msgs) and msgs[conv.cursor]["role"] != "assistant":
            if not str(msgs[conv.cursor].get("content", "")).strip():
                return self._end(conv, "empty turn")
            conv.out.append(msgs[conv.cursor])
            conv.cursor += 1
        if conv.turns >= self.settings.max_turns or conv.cursor >= len(msgs) or not conv.out:
            return self._end(conv, None if conv.turns else "no assistant turn")
        try:
            text = self.renderer.render(conv.out, add_generation_prompt=True)
        except TemplateRenderError:
            return self._end(conv, "template cannot render")
        ids = self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) > self.settings.max_prompt_tokens:
            return self._end(conv, "prompt over max_prompt_tokens")
        seed = turn_seed(self.settings.seed, conv.cid, conv.turns)
        if self.closing is None:
            request = self.decoder.submit(ids, self.settings.max_new_tokens, self.sampling, seed, self.stop_ids)
        else:
            request = self.decoder.submit(ids, self.settings.max_new_tokens, self.sampling, seed, self.stop_ids,
                                          closing=self.closing)
        flying[request] = conv
        return None

    def _finish_turn(self, conv: _Conversation, request, flying: dict) -> Regenerated | None:
        answer = [t for t in request.tokens if t not in self.stop_ids]
        if request.error is not None:
            return self._end(conv, "refused by the decoder")
        if not answer:
            return self._end(conv, "target stopped at once")
        for message in conv.out:  # earlier answers are history now, read as a server reads it: as text
            message.pop(TOKEN_IDS, None)
        conv.out.append({"role": "assistant", "content": self.tokenizer.decode(answer), TOKEN_IDS: answer})
        conv.new_tokens += len(answer)
        conv.features = request.features
        conv.cursor += 1
        conv.turns += 1
        return self._next_turn(conv, flying)

    def _end(self, conv: _Conversation, reason: str | None) -> Regenerated | None:
        """Close ``conv`` (``reason`` None: it ran its course) -> the turns it has, ending on an
        answer, or None with the skip counted by reason."""
        while conv.out and conv.out[-1]["role"] != "assistant":
            conv.out.pop()
        if not conv.turns:
            self.skipped[reason] += 1
            return None
        if reason is not None:
            self.cut[reason] += 1
        return Regenerated(conv.cid, conv.out, conv.new_tokens, conv.features)


def to_sharegpt(cid: str, messages: list[dict]) -> dict:
    """A ShareGPT record; the last answer keeps the ids the target emitted (``token_ids``)."""
    turns = []
    for m in messages:
        turn = {"from": _TO_SHAREGPT[m["role"]], "value": m["content"]}
        if TOKEN_IDS in m:
            turn[TOKEN_IDS] = list(m[TOKEN_IDS])
        turns.append(turn)
    return {"id": cid, "conversations": turns}


def done_ids(path: Path) -> set[str]:
    """Ids already in an output file; a torn last line (interrupted write) is cut off."""
    if not path.exists():
        return set()
    ids, good_bytes = set(), 0
    with open(path, "rb") as fh:
        for line in fh:
            try:
                ids.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                break
            good_bytes += len(line)
    if good_bytes < path.stat().st_size:
        with open(path, "r+b") as fh:
            fh.truncate(good_bytes)
    return ids


def append_jsonl(path: Path, records: Iterable[dict]) -> None:
    """Append whole lines and fsync, so a crash leaves at most one torn line (cut on resume)."""
    with open(path, "a", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def check_output_path(path: Path) -> None:
    if path.exists() and path.is_dir():
        raise LyannaError(f"--out {path} is a directory; give a .jsonl file")
    path.parent.mkdir(parents=True, exist_ok=True)
