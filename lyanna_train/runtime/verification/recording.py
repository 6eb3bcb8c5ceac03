"""The target's features for every token it decodes, kept while it decodes them.

Self-distillation needs, for each token of a regenerated answer, what the feature cache
holds (:mod:`lyanna_train.data.feature_cache`): the capture layers' outputs (``aux``), the
last hidden state (the LM head's input) and the teacher's full-vocabulary top-1 and
logsumexp. Decoding computes all of them already — the prompt's in the prefill, each
accepted token's in the verify forward that scored it — so a :class:`FeatureRecorder`
keeps them instead of paying a second, teacher-forced pass. Rejected candidates and
padding are never kept; tokens a row accepted past its request's cut are dropped when it
ends. The one token no forward has scored yet (the last) and the request's ``closing``
tokens (what a chat template puts after an answer) are then scored inside the batch's
next verify forwards, one per iteration, the row's root alone with the next closing token
forced (:meth:`..scheduling.scheduler.BatchDecoder._close`): a recorded conversation is the
whole turn a training sample holds. A forward of their own per request (two tokens of one
row) cost 4.6-4.9 s of a ~136 s one pass over 192 ShareGPT turns at 64 rows (fp32, Zen 4);
riding along, the rows' slot time gives most of it back: ~1 % faster in alternating runs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ...target.capture import logits_summary


@dataclass
class RecordedFeatures:
    """One request's features, position t for token t of ``ids`` (prompt + answer + closing)."""

    ids: list[int]  # the tokens they are the features of
    aux: torch.Tensor  # [T, k·H] the capture layers' outputs, concatenated
    last: torch.Tensor  # [T, H] what the LM head reads: lm_head(last) == the target's logits
    top1: torch.Tensor  # [T] int64 argmax of the full-vocabulary logits
    logsumexp: torch.Tensor  # [T] float32 of the same logits

    def __len__(self) -> int:
        return self.aux.shape[0]


def unclosed(answer: list[int], closing) -> list[int]:
    """The closing tokens still to come after ``answer``: all of ``closing``, or the rest of
    it when ``answer`` already ends with its first few (e.g. the end-of-turn token)."""
    closing = list(closing)
    for k in range(min(len(closing), len(answer)), 0, -1):
        if answer[-k:] == closing[:k]:
            return closing[k:]
    return closing


class FeatureRecorder:
    """Keeps each request's features as its forwards compute them (:meth:`keep`), in order."""

    def __init__(self, target):
        self.head = target.get_output_embeddings()
        self.last: torch.Tensor | None = None  # the LM head's input in the latest watched forward
        self._kept: dict[int, list[tuple[torch.Tensor, ...]]] = {}

    @contextlib.contextmanager
    def watching(self):
        """Hook the LM head's input for the forwards run inside (``self.last``)."""
        def hook(_module, inputs):
            self.last = inputs[0]

        handle = self.head.register_forward_pre_hook(hook)
        try:
            yield self
        finally:
            handle.remove()

    def keep(self, request, aux: torch.Tensor, last: torch.Tensor, logits: torch.Tensor) -> None:
        """Append the next positions of ``request`` ([N, ...] each, in token order)."""
        top1, lse = logits_summary(logits)  # as the feature cache's build summarises them
        self._kept.setdefault(request.id, []).append((aux.detach().clone(), last.detach().clone(), top1, lse))

    def count(self, request) -> int:
        return sum(chunk[0].shape[0] for chunk in self._kept.get(request.id, ()))

    def cut(self, request, length: int) -> None:
        """Forget ``request``'s positions from ``length`` on (to score them again)."""
        chunks = self._kept.get(request.id)
        if chunks and self.count(request) > length:
            self._kept[request.id] = [tuple(torch.cat([c[k] for c in chunks])[:length] for k in range(4))]

    def finish(self, request, ids: list[int]) -> RecordedFeatures:
        """The features of ``ids`` (prompt + delivered tokens + closing), forgotten here."""
        chunks = self._kept.pop(request.id, [])
        length = len(ids)
        parts = [torch.cat([c[k] for c in chunks])[:length] for k in range(4)]
        if parts[0].shape[0] != length:
            raise RuntimeError(f"request {request.id}: {parts[0].shape[0]} positions recorded, {length} needed")
        return RecordedFeatures(list(ids), *parts)

    def forget(self, request) -> None:
        self._kept.pop(request.id, None)
