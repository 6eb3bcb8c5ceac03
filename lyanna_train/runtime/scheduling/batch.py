"""What every running row shares in a batch, each row's own state, and a row's prefill.

Rows are the slots of the runtime's caches (:class:`.ragged_cache.RaggedCache` for the
target, :class:`..drafting.state.BatchDraftState` for the draft), one sequence each. One
iteration over a run of rows is: :func:`..drafting.propose.propose_rows` (each row's
candidates, the head drafting for the rows the policy picks), :func:`..pricing.policy.
fit_trees` (what the fused verify covers), :func:`..verification.step.verify_rows` (ONE
target forward) and :func:`..verification.step.accept_rows`; the scheduler
(:mod:`.scheduler`) strings them together.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ...models.draft_head import DraftHead
from ..drafting.state import BatchDraftState, chunk_mask
from ..pricing.cost import Costs
from ..pricing.estimates import AcceptanceEstimates
from ..settings import DecodeSettings
from ..verification.sampling import warp_probs
from ..verification.target_step import ragged_forward
from .ragged_cache import RaggedCache
from .requests import Request


@dataclass(eq=False)
class Row:
    """A running request's decoding state outside the shared caches."""

    request: Request
    context: torch.Tensor  # [capacity] ids x_0..x_{n-1} (prompt included) in the first n slots
    length: int  # n
    generator: torch.Generator
    estimates: AcceptanceEstimates = field(default_factory=AcceptanceEstimates)
    drafted: bool = False  # whether the head drafted for this row in the current iteration
    # a recording decoder's finished answer, its last positions still to score: the tokens forced
    # after the row's last one (what a chat template closes a turn with), one per iteration, and
    # why the request ended; None while the row decodes
    closing: list[int] | None = None
    reason: str = ""

    @property
    def last_token(self) -> int:
        return int(self.context[self.length - 1])

    def append(self, tokens: list[int]) -> None:
        end = self.length + len(tokens)
        if end > self.context.shape[0]:
            self.context = torch.cat([self.context, self.context.new_zeros(end)])
        self.context[self.length:end] = torch.tensor(tokens, dtype=torch.long)
        self.length = end


@dataclass(eq=False)
class Batch:
    """The models and caches every row shares; row i of ``rows`` lives in slot i."""

    target: torch.nn.Module
    draft: DraftHead | None
    capture: object  # LayerCapture, None without a draft
    cache: RaggedCache
    draft_state: BatchDraftState | None
    settings: DecodeSettings
    costs: Costs  # or a MeasuredCosts: anything with verify(tokens) and draft(rows) in seconds
    max_positions: int | None  # the target's context (None: unbounded)
    rows: list[Row] = field(default_factory=list)
    width_limit: int | None = None  # most tokens per row a fused verify takes (the measured range)
    draft_seconds: float = 0.0  # the head's work in the current iteration (trees, step 0)
    catch_up_seconds: float = 0.0  # its catch-up of rows that waited (a one-off, priced apart)
    weights: list[float] | None = None  # each row's token worth this iteration (a draining batch); None: 1 each
    recorder: object = None  # a FeatureRecorder (:mod:`..verification.recording`): every accepted token's features


def next_token(logits: torch.Tensor, row: Row) -> int:
    """The row's next token from its logits [V]: argmax, or sampled with its generator."""
    params = row.request.sampling
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(warp_probs(logits, params), 1, generator=row.generator))


def prefill_row(batch: Batch, slot: int, row: Row) -> int:
    """Fill slot ``slot`` with ``row``'s prompt (x_0..x_{P-1}) -> its first new token x_P."""
    device = batch.target.device
    prompt = row.context[:row.length].to(device)[None]
    p = prompt.shape[1]
    batch.cache.reset_row(slot)
    offsets = batch.cache.begin(slice(slot, slot + 1), p)
    recorder = batch.recorder
    with recorder.watching() if recorder is not None else contextlib.nullcontext():
        logits, aux = ragged_forward(batch.target, batch.capture, batch.cache, prompt,
                                     torch.arange(p, device=device)[None], chunk_mask(offsets, p, p),
                                     logits_to_keep=0 if recorder is not None else 1)
    if recorder is not None:  # every prompt position's features, from this one forward
        recorder.keep(row.request, aux[0], recorder.last[0], logits[0])
    batch.cache.advance(slot, p)
    first = next_token(logits[0, -1], row)
    if batch.draft is not None:  # the draft's step 0 over the prompt waits until the row first drafts
        batch.draft_state.reset_row(slot)
        following = torch.cat([prompt[:, 1:], torch.tensor([[first]], device=device)], dim=1)
        batch.draft_state.defer(slice(slot, slot + 1), aux, following, [p])
    return first
