"""What every running row shares in a batch, each row's own state, and a row's prefill.

Rows are the slots of the runtime's caches (:class:`..verification.ragged_cache.RaggedCache` for the
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
from ..verification.ragged_cache import RaggedCache
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
    left: list[int] | None = None  # what each slot still has to decode while the batch drains (BatchDecoder._slots_left); else None
    recorder: object = None  # a FeatureRecorder (:mod:`..verification.recording`): every accepted token's features


def next_token(logits: torch.Tensor, row: Row) -> int:
    """The row's next token from its logits [V]: argmax, or sampled with its generator."""
    params = row.request.sampling
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(warp_probs(logits, params), 1, generator=row.generator))


# Most padded tokens per real prompt token in one prefill forward. On 2 CPU cores (SmolLM2,
# fp32) 16 prompts of 100 tokens took 2.47 s in one forward against 3.19 s one by one (1.29x),
# 4 of 400 tokens the same either way: padding past ~1/4 would cost more than it saves.
PREFILL_PADDING = 1.25


def prefill_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Which of the rows admitted together are prefilled in one forward -> groups of their
    indices. Shortest first, so a group's padding (every prompt is padded to its longest)
    stays small: a row joins the group while the group's padded tokens stay within
    ``budget`` and within ``PREFILL_PADDING`` times its real ones. ``budget`` 0: one row
    per forward."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        p = lengths[i]
        if groups and (len(groups[-1]) + 1) * p <= min(budget, PREFILL_PADDING * (real + p)):
            groups[-1].append(i)
            real += p
        else:
            groups.append([i])
            real = p
    return groups


def prefill_rows(batch: Batch, rows: slice) -> list[int]:
    """Fill slots ``rows`` with their rows' prompts (x_0..x_{P-1}) in ONE forward -> each
    row's first new token x_P.

    Prompts of unlike lengths are padded at their ends: a prompt token reads only the tokens
    before it (the mask is causal), so padding changes no real position, and the entries
    it leaves in the cache lie past the row's length, where the next forward writes."""
    device = batch.target.device
    members = batch.rows[rows]
    lengths = [row.length for row in members]
    width = max(lengths)
    prompt = torch.zeros(len(members), width, dtype=torch.long, device=device)
    for i, row in enumerate(members):
        prompt[i, :row.length] = row.context[:row.length].to(device)
    for slot in range(rows.start, rows.stop):
        batch.cache.reset_row(slot)
    offsets = batch.cache.begin(rows, width)
    recorder = batch.recorder
    # a recording decoder keeps every prompt position's logits; otherwise only each row's last
    last = None if recorder is not None else torch.tensor(lengths, device=device) - 1
    with recorder.watching() if recorder is not None else contextlib.nullcontext():
        logits, aux = ragged_forward(batch.target, batch.capture, batch.cache, prompt,
                                     torch.arange(width, device=device).expand(len(members), width),
                                     chunk_mask(offsets, width, width), logits_at=last)
    firsts = []
    for i, (slot, row) in enumerate(zip(range(rows.start, rows.stop), members)):
        p = row.length
        if recorder is not None:  # every prompt position's features, from this one forward
            recorder.keep(row.request, aux[i, :p], recorder.last[i, :p], logits[i, :p])
        batch.cache.advance(slot, p)
        firsts.append(next_token(logits[i, p - 1] if recorder is not None else logits[i, -1], row))
    if batch.draft is not None:  # the draft's step 0 over the prompt waits until the row first drafts
        following = torch.cat([prompt[:, 1:], prompt.new_zeros(len(members), 1)], dim=1)
        following[torch.arange(len(members), device=device), torch.tensor(lengths, device=device) - 1] = \
            torch.tensor(firsts, device=device)
        for slot in range(rows.start, rows.stop):
            batch.draft_state.reset_row(slot)
        batch.draft_state.defer(rows, aux, following, lengths)
    return firsts
