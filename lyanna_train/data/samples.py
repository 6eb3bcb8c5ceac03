"""Conversations -> training samples: chat-templated ``input_ids`` with a ``loss_mask``.

The mask marks exactly the tokens the target would generate in assistant turns (the
end-of-turn token included, template headers excluded), derived from the template
itself by :class:`~lyanna_train.data.chat_template.ChatRenderer`.

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
from .conversations import Document, Skip
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
        enc = self.backend.encode(rendered.text, add_special_tokens=False)
        ids = torch.tensor(enc.ids, dtype=torch.int64)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        for start, end in rendered.spans:
            a, b = token_range(enc, start, end)
            mask[a:b] = True
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
