"""Conversations -> training samples: chat-templated ``input_ids`` with a ``loss_mask``.

The mask marks exactly the tokens the target would generate in assistant turns (the
end-of-turn token included, template headers excluded), derived from the template
itself by :class:`~lyanna_train.data.chat_template.ChatRenderer`. An assistant turn that
carries the target's own ``token_ids`` (a regenerated one) takes them in place of its
content's tokenization.

Truncation policy: a sample longer than ``max_length`` keeps its first ``max_length``
tokens (every kept assistant token then has its real context) with ``overflow=truncate``,
or is dropped with ``overflow=drop``; either way it is counted. A sample left with no
assistant token is skipped and counted; if that happens to every sample, building stops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..errors import LyannaError
from .chat_template import ChatRenderer, TemplateRenderError, token_range
from .conversations import TOKEN_IDS, Document, Skip
from .corpus import Corpus, ReadNotes, iter_documents

EVALUATION_ONLY = {"mtbench": "MT-Bench", "mt_bench_question": "MT-Bench", "tasks": "tasks-unlike-chat"}


@dataclass
class Sample:
    """One training sequence. ``loss_mask[t]`` is True where token ``t`` is an assistant token."""

    index: int  # document index in the corpus stream
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]

    def __len__(self) -> int:
        return len(self.input_ids)


MAX_LENGTH = 2048  # tokens per sample by default, for every stage (EAGLE-3 trains on 2048)


@dataclass(frozen=True)
class SampleSettings:
    max_length: int = MAX_LENGTH  # tokens per sample
    overflow: str = "truncate"  # truncate | drop: what happens to longer samples

    def __post_init__(self):
        if self.max_length < 2:
            raise LyannaError(f"max_length must be at least 2, not {self.max_length}")
        if self.overflow not in ("truncate", "drop"):
            raise LyannaError(f"overflow must be 'truncate' or 'drop', not {self.overflow!r}")


@dataclass
class SampleStats:
    """What building samples passed over, by reason (reported, never silent)."""

    samples: int = 0
    tokens: int = 0
    assistant_tokens: int = 0
    truncated: int = 0
    skipped: dict = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def summary(self) -> str:
        parts = [f"{self.samples} samples, {self.tokens} tokens ({self.assistant_tokens} assistant)"]
        if self.truncated:
            parts.append(f"{self.truncated} truncated")
        parts += [f"{n} skipped: {reason}" for reason, n in self.skipped.items()]
        return "; ".join(parts)


def refuse_evaluation_sets(corpus: Corpus) -> None:
    """Training on a benchmark's prompts would inflate every figure measured on it."""
    for source in corpus.sources:
        for key, name in EVALUATION_ONLY.items():
            if source.origin == key or key in source.path.rsplit("/", 1)[-1]:
                raise LyannaError(f"{source.path} is the {name} evaluation set: it is for measuring, not training")


class SampleBuilder:
    """Tokenize documents into :class:`Sample` objects for one tokenizer."""

    def __init__(self, tokenizer, settings: SampleSettings = SampleSettings()):
        self.renderer = ChatRenderer(tokenizer)
        self.backend = tokenizer.backend_tokenizer
        self.vocab_size = len(tokenizer)
        self.settings = settings

    def build(self, doc: Document, stats: SampleStats) -> Sample | None:
        if not doc.is_conversation:
            stats.skip("raw text (no assistant turn to learn)")
            return None
        try:
            rendered = self.renderer.render_with_spans(doc.messages)
        except TemplateRenderError as err:
            stats.skip(str(err))
            return None
        if not rendered.spans:
            stats.skip("no assistant tokens in the rendered conversation")
            return None
        emitted = self._emitted(doc.messages, rendered)
        if isinstance(emitted, str):
            stats.skip(emitted)
            return None
        ids, mask = self._tokens(rendered, emitted)
        if len(ids) > self.settings.max_length:
            if self.settings.overflow == "drop":
                stats.skip(f"longer than max_length {self.settings.max_length} (dropped)")
                return None
            stats.truncated += 1
            ids, mask = ids[: self.settings.max_length], mask[: self.settings.max_length]
            if not mask.any():
                stats.skip(f"no assistant token within max_length {self.settings.max_length}")
                return None
        stats.samples += 1
        stats.tokens += len(ids)
        stats.assistant_tokens += int(mask.sum())
        return Sample(doc.index, ids, mask)

    def _emitted(self, messages, rendered) -> list[tuple[int, int, list[int]]] | str:
        """``(start, end, ids)``: the content characters of each assistant turn that carries its
        own ``token_ids``, in order, or why the conversation cannot be used. A turn whose
        content the template rewrites (trims, say) keeps its text's tokens."""
        out = []
        for (start, _end), turn in zip(rendered.spans, rendered.turns):
            own = messages[turn].get(TOKEN_IDS)
            if own is None:
                continue
            if max(own) >= self.vocab_size:
                return f"'{TOKEN_IDS}' outside the tokenizer's vocabulary"
            content = messages[turn]["content"]
            if content and rendered.text[start:start + len(content)] == content:
                out.append((start, start + len(content), own))
        return out

    def _tokens(self, rendered, emitted) -> tuple[torch.Tensor, torch.Tensor]:
        """The conversation's ids and assistant mask. The text between emitted contents is
        tokenized piece by piece, as regeneration tokenized the prompt before an answer and
        the closing after it (a header's newline and an answer's first one would otherwise
        merge into one token the target never read)."""
        ids, mask, cursor = [], [], 0
        for start, end, own in emitted + [(len(rendered.text), len(rendered.text), [])]:
            enc = self.backend.encode(rendered.text[cursor:start], add_special_tokens=False)
            piece = [False] * len(enc.ids)
            for s, e in rendered.spans:  # each span's part inside this piece
                s, e = max(s, cursor), min(e, start)
                if s < e:
                    a, b = token_range(enc, s - cursor, e - cursor)
                    piece[a:b] = [True] * (b - a)
            ids += enc.ids + own
            mask += piece + [True] * len(own)
            cursor = end
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool)


class CorpusSamples:
    """The corpus as samples, re-read on every iteration (for consumers that plan, then
    compute); ``stats`` describes the latest complete pass."""

    def __init__(self, corpus: Corpus, tokenizer, settings: SampleSettings = SampleSettings()):
        self.corpus, self.tokenizer, self.settings = corpus, tokenizer, settings
        self.stats = SampleStats()

    def __iter__(self) -> Iterator[Sample]:
        self.stats = SampleStats()
        return iter_samples(self.corpus, self.tokenizer, self.settings, self.stats)


def iter_samples(corpus: Corpus, tokenizer, settings: SampleSettings = SampleSettings(),
                 stats: SampleStats | None = None, notes: ReadNotes | None = None,
                 keep=lambda i: True) -> Iterator[Sample]:
    """Stream the corpus as samples; raises if the documents yield no sample at all."""
    refuse_evaluation_sets(corpus)
    stats = stats if stats is not None else SampleStats()
    notes = notes if notes is not None else ReadNotes()
    builder = SampleBuilder(tokenizer, settings)
    for item in iter_documents(corpus, notes, keep):
        if isinstance(item, Skip):
            stats.skip(item.reason if not item.malformed else "malformed JSON")
            continue
        sample = builder.build(item, stats)
        if sample is not None:
            yield sample
    if stats.samples == 0:
        raise LyannaError(f"no training sample in {', '.join(corpus.specs)}: {stats.summary()} "
                          "(the chat template marks no assistant token in any conversation)")
