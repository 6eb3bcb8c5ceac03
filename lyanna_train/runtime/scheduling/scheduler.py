"""Continuous batching for speculative decoding: requests join, decode side by side, leave.

This is the runtime's one decoding stack: :func:`generate` (one prompt) is a batch of one,
and ``lyanna-bench`` and ``lyanna-serve`` decode through :class:`BatchDecoder` too.

A :class:`BatchDecoder` holds up to ``max_batch`` running sequences in the slots of its
caches. Three calls drive it — what a server sits on:

* :meth:`~BatchDecoder.submit` queues a request (checked at once: a bad one fails alone,
  with a one-line ``error``);
* :meth:`~BatchDecoder.step` admits waiting requests into free slots (their prefill),
  runs one iteration for the running rows (:mod:`.batch`: propose → ONE fused
  verify → accept) and returns what each request received; a row that finishes (EOS,
  ``max_new_tokens``, the context's end) frees its slot for the next request;
* :meth:`~BatchDecoder.cancel` ends a request and frees its slot, touching no other row.

Slots stay contiguous (a freed slot takes the last row), so every forward runs over a
plain run of rows.

**Verification fusion.** By default every running row's tree is verified in ONE target
forward every iteration (``DecodeSettings.fusion``: :class:`FusionSettings`
``micro_batches=1``). The design's variant holds verification: the rows are split into ``micro_batches`` blocks, drafted on
successive steps, their trees held until every block is ready (a bounded delay of
``micro_batches - 1`` steps), then verified together, shallow tree levels admitted first
(``shallow_first``). ``lyanna-bench --batch-size ... --hold K`` measures both.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from itertools import islice
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from ...models.draft_head import DraftHead
from ...target.capture import LayerCapture
from ..drafting.propose import plain_rows, propose_rows
from ..drafting.state import BatchDraftState
from ..pricing.cost import Costs, MeasuredCosts
from ..pricing.estimates import AcceptanceEstimates
from ..pricing.policy import fit_trees
from ..settings import DecodeSettings, FusionSettings, SamplingParams
from ..verification.recording import FeatureRecorder, unclosed
from ..verification.step import accept_rows, verify_rows
from ..verification.target_step import check_target_masks, draft_capture
from ..token_tree import TokenTree
from .batch import Batch, Row, prefill_groups, prefill_rows
from ..verification.ragged_cache import RaggedCache
from .requests import Request, Status, check_request, cut, stop_ids


@dataclass
class Update:
    """What one request received in one step."""

    request: Request
    tokens: list[int] = field(default_factory=list)  # new this step, after the cut

    @property
    def finished(self) -> bool:
        return self.request.done


class BatchDecoder:
    """Speculative decoding of many requests at once, each lossless as if decoded alone.

    ``draft`` None: prompt lookup only (or plain decoding). ``cost``: the measured verify
    and draft costs the speculation policy weighs under ``verify: auto``
    (:func:`..cpu.tuning.tune`; None: :meth:`.Costs.flat`, an accelerator's regime).
    ``eos_ids``: stop ids for requests that give none (None: the target's
    ``generation_config``). ``layer_ids``: the target layers the draft reads. ``fusion``:
    overrides ``settings.fusion``. ``record_features``: each finished request carries the
    target's features of its prompt and tokens (``Request.features``, :mod:`..verification.
    recording`), taken from the decoding's own forwards; ``layer_ids`` then names the capture
    layers (default: the draft's, else the convention's)."""

    def __init__(self, target, draft: DraftHead | None, settings: DecodeSettings = DecodeSettings(),
                 max_batch: int = 8, cost: Costs | None = None, eos_ids: int | Sequence[int] | None = None,
                 layer_ids: Sequence[int] | None = None, fusion: FusionSettings | None = None,
                 record_features: bool = False):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        check_target_masks(target)
        capture = draft_capture(target, draft, layer_ids)
        if record_features and capture is None:
            capture = LayerCapture(target, layer_ids)
        self.max_batch, self.fusion, self._tuned = max_batch, fusion or settings.fusion, cost
        self.batch = Batch(target, draft, capture, RaggedCache.for_model(target, max_batch),
                           BatchDraftState(draft, max_batch) if draft is not None else None, settings,
                           _measured(cost, target),
                           getattr(target.config, "max_position_embeddings", None),
                           width_limit=cost.verify.sizes[-1] if cost is not None else None,
                           recorder=FeatureRecorder(target) if record_features else None)
        self.eos = frozenset(stop_ids(target, eos_ids))
        self.waiting: deque[Request] = deque()
        self._refused: list[Request] = []  # failed at submit, reported by the next step
        self._blocks: list[slice] = []  # micro-batches of the current hold cycle still to draft
        self._held: list[TokenTree] = []  # their drafted trees, rows 0.. in order
        self._ids = 0
        self._began: float | None = None  # when the current (unheld) iteration began: it is timed whole
        self._waited = 0  # iterations a free slot has waited for partners (:meth:`_wait_for_partners`)

    @property
    def rows(self) -> list[Row]:
        return self.batch.rows

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.rows or self._refused)

    def submit(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams | None = None, seed: int | None = None,
               eos_ids: int | Sequence[int] | None = None, closing: Sequence[int] = ()) -> Request:
        """Queue a request -> its handle (``status`` FAILED with ``error`` if it cannot be served).

        ``closing`` (recording decoders only): the tokens a chat template puts after an answer
        (its end-of-turn token and what follows it); their features are recorded after the
        answer's, all of them or, when the answer already ends with their first few, the rest."""
        try:
            prompt, error = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().tolist(), None
        except (TypeError, ValueError, RuntimeError, OverflowError) as err:  # ids past int64, not numbers
            prompt, error = [], f"prompt ids must be integers of the target's vocabulary: {err}"
        eos = self.eos if eos_ids is None else frozenset(stop_ids(self.batch.target, eos_ids))
        self._ids += 1
        request = Request(self._ids, prompt, max_new_tokens, sampling or self.batch.settings.sampling,
                          self.batch.settings.seed if seed is None else seed, eos, closing=tuple(closing))
        error = error or check_request(prompt, max_new_tokens, self.batch.target.config.vocab_size,
                                       self.batch.max_positions, request.seed)
        if error is not None:
            request.finish(Status.FAILED, "error", error)
            self._refused.append(request)
        else:
            self.waiting.append(request)
        return request

    def cancel(self, request: Request) -> bool:
        """End ``request`` now (its slot is freed; no other row is touched) -> whether it was live."""
        if request.done:
            return False
        if request in self.waiting:
            self.waiting.remove(request)
        request.finish(Status.CANCELLED, "cancelled")
        if not self._blocks:  # mid hold-cycle, rows stay in place until it is verified
            with torch.inference_mode():
                self._free_done()
        return True

    def step(self, closed: bool = False) -> list[Update]:
        """Admit, then one iteration for the running rows -> each request's news this step.

        ``closed``: no request will come after those queued (:meth:`run` steps so): the
        batch drains, and the policy values an iteration by the time it takes off the run's
        remaining time (:meth:`_slots_left`, :class:`..pricing.policy.Drain`). A server's
        steps are never closed: a freed slot is taken by the next request a client sends."""
        updates = [Update(r) for r in self._refused]
        self._refused = []
        with torch.inference_mode():
            self._admit(updates)
            if not self._blocks:  # mid hold-cycle, rows stay in place until it is verified
                self._free_done()
            self.batch.left = self._slots_left() if closed else None
            if self.rows and self.fusion.micro_batches == 1:
                rows = slice(0, len(self.rows))
                self._began = time.perf_counter()
                probe = self.batch.settings.verify == "auto" and isinstance(self.batch.costs, MeasuredCosts) \
                    and self.batch.costs.plain_due(len(self.rows))  # "fit" and "all" draft for every row, always
                self._verify(rows, plain_rows(self.batch, rows) if probe else propose_rows(self.batch, rows), updates,
                             consulted=not probe)
            elif self.rows:
                self._hold_step(updates)
            if not self._blocks:
                self._free_done()
        return updates

    def warm_up(self, prompt_tokens: int = 96, new_tokens: int = 16, seed: int = 0) -> float:
        """Decode ``max_batch`` synthetic requests at once, then forget what their iterations
        measured -> seconds taken. A server calls it before its first request: on a CPU the
        first forwards at each shape pay one-off costs (kernels built for it, buffers
        grown), and a closed-loop run of 48 requests at 16 clients, started cold, read
        0.84x the tokens/s of the same run warm."""
        if not self.idle:
            raise RuntimeError("warm_up runs on an idle decoder, before the first request")
        begin = time.perf_counter()
        generator = torch.Generator().manual_seed(seed)
        vocab = self.batch.target.config.vocab_size
        room = prompt_tokens if self.batch.max_positions is None else \
            max(1, min(prompt_tokens, self.batch.max_positions - new_tokens - 1))
        for _ in range(self.max_batch):
            self.submit(torch.randint(vocab, (room,), generator=generator), new_tokens, eos_ids=())
        for _ in self.run():
            pass
        self.batch.costs = _measured(self._tuned, self.batch.target)
        return time.perf_counter() - begin

    def run(self) -> Iterator[Update]:
        """Step until every request is done, yielding each update (no request comes after
        the ones submitted: the batch drains at the end)."""
        while not self.idle:
            yield from self.step(closed=True)

    def _admit(self, updates: list[Update]) -> None:
        """Take waiting requests into free slots; those admitted together are prefilled
        together, in forwards of at most ``fusion.prefill_tokens`` padded tokens
        (:func:`.batch.prefill_groups`)."""
        if self._wait_for_partners():
            return
        admitted = []
        while self.waiting and len(self.rows) + len(admitted) < self.max_batch:
            request = self.waiting.popleft()
            room = self._budget(request)  # memory sized by the context, never by the request's budget
            context = torch.zeros(len(request.prompt) + min(room, 4096) + 64, dtype=torch.long)  # Row.append grows
            context[:len(request.prompt)] = torch.tensor(request.prompt)
            # the generator lives where the logits it samples from are (the target's device)
            generator = torch.Generator(self.batch.target.device).manual_seed(request.seed)
            admitted.append(Row(request, context, len(request.prompt), generator,
                                AcceptanceEstimates(getattr(self.batch.draft, "measured_acceptance", ()))))
        for group in prefill_groups([row.length for row in admitted], self.fusion.prefill_tokens):
            start = len(self.rows)
            self.rows.extend(admitted[i] for i in group)
            for row in self.rows[start:]:
                row.request.status = Status.RUNNING
            firsts = prefill_rows(self.batch, slice(start, len(self.rows)))
            for slot, first in zip(range(start, len(self.rows)), firsts):
                row = self.rows[slot]
                row.append([first])
                row.request.target_forwards = 1
                row.request.first_token_at = time.perf_counter()
                updates.append(self._deliver(slot, row, [first]))

    def _wait_for_partners(self) -> bool:
        """Whether a free slot waits this step instead of admitting: while a running row will
        reach its token budget within ``fusion.admit_wait`` iterations, for at most that many.
        Requests admitted together share a prefill forward (:func:`.batch.prefill_groups`),
        and on a CPU a forward's fixed cost outweighs a few idle row-iterations. Rows that
        speculate finish apart, so a server's freed slots were refilled one prompt at a time:
        16 closed-loop clients x 48 MT-Bench prompts x 64 tokens on 2 CPU cores took 21-26
        prefill forwards at once, 11-13 waiting up to 4 iterations, and ~4 % less time."""
        free = self.max_batch - len(self.rows)
        wait = self.fusion.admit_wait - self._waited
        if wait > 0 and free > 0 and self.waiting and any(
                row.closing is None and 0 < self._left(row) <= wait for row in self.rows):
            self._waited += 1
            return True
        self._waited = 0
        return False

    def _verify(self, rows: slice, trees: list[TokenTree], updates: list[Update], consulted: bool = True) -> None:
        active = self.rows[rows]
        room = [None if self.batch.max_positions is None else self.batch.max_positions - row.length for row in active]
        costs = self.batch.costs if self.batch.settings.verify != "all" else None
        drafted = sum(row.drafted for row in active)
        left = self.batch.left[rows] if self.batch.left is not None else None
        trees = fit_trees(trees, room, costs, self.fusion.shallow_first, self.batch.settings.margin, drafted > 0, left)
        begin = time.perf_counter()
        logits, aux = verify_rows(self.batch, rows, trees)
        verified = time.perf_counter() - begin
        news = accept_rows(self.batch, rows, trees, logits, aux)
        delivered = 0
        for slot, row, tree, new in zip(range(rows.start, rows.stop), active, trees, news):
            if row.closing is not None:  # a finished answer's closing: no token of its request
                if not row.request.done and self.batch.recorder.count(row.request) == row.length:
                    updates.append(self._closed(row))
                continue
            row.request.target_forwards += 1
            row.request.accept_lengths.append(len(new))
            row.request.tree_sizes.append(len(tree))
            if not row.request.done:  # cancelled mid hold-cycle: verified with the others, nothing delivered
                updates.append(self._deliver(slot, row, new))
                delivered += len(updates[-1].tokens)
        if isinstance(self.batch.costs, MeasuredCosts):  # what this iteration took, for the next ones' choices
            # whole, from proposal to delivery, but a catch-up (a one-off, priced apart); a hold
            # cycle's iteration spans steps: its verify and drafting only
            seconds = time.perf_counter() - self._began - self.batch.catch_up_seconds if self._began is not None \
                else verified + self.batch.draft_seconds
            self.batch.costs.observe_iteration(len(trees), max(len(t) for t in trees), drafted, seconds,
                                               self.batch.draft_seconds, delivered, self.batch.catch_up_seconds,
                                               draining=self.batch.left is not None, consulted=consulted)
        self.batch.draft_seconds = self.batch.catch_up_seconds = 0.0
        self._began = None

    def _hold_step(self, updates: list[Update]) -> None:
        """Draft the next micro-batch; when every block of the cycle is drafted, verify all."""
        if not self._blocks:
            n, k = len(self.rows), min(self.fusion.micro_batches, len(self.rows))
            self._blocks = [slice(n * i // k, n * (i + 1) // k) for i in range(k)]
            self._held = []
        block = self._blocks.pop(0)
        self._held += propose_rows(self.batch, block)
        if not self._blocks:
            self._verify(slice(0, len(self._held)), self._held, updates)
            self._held = []

    def _slots_left(self) -> list[int]:
        """Each slot's tokens still to decode in a closed run -> its row's tokens left plus the
        budgets of the waiting requests it will take, each placed in the slot that frees
        first.

        Valued so (:class:`..pricing.policy.Drain`), an iteration is worth the time it takes
        off the run's end, and tokens that put one row ahead of the others are worth little:
        its slot's next request only starts earlier, and the run ends a tail of rows later.
        Requests past the first two per slot are left out: they add about the same to every
        slot, which changes no slot's standing (``Drain`` compares the slots' differences),
        and a closed run may queue thousands."""
        free = self.max_batch - len(self.rows)
        rows = [self._left(row) for row in self.rows]
        heap = [(left, slot) for slot, left in enumerate(rows)]
        heapq.heapify(heap)
        for request in islice(self.waiting, free, free + 2 * len(rows)):  # no rows: none
            left, slot = heapq.heappop(heap)
            rows[slot] = left + self._budget(request)
            heapq.heappush(heap, (rows[slot], slot))
        return rows

    def _budget(self, request: Request) -> int:
        """The most tokens a waiting ``request`` can deliver (its budget, the target's context)."""
        budget = request.max_new_tokens
        return budget if self.batch.max_positions is None else min(budget, self.batch.max_positions - len(request.prompt))

    def _left(self, row: Row) -> int:
        """The most tokens ``row`` can still deliver (its budget, the target's context)."""
        left = row.request.max_new_tokens - len(row.request.tokens)
        return left if self.batch.max_positions is None else min(left, self.batch.max_positions - row.length)

    def _deliver(self, slot: int, row: Row, new: list[int]) -> Update:
        """Append a row's new tokens to its request (cut at EOS / its token budget)."""
        request = row.request
        before = len(request.tokens)
        limit = request.max_new_tokens
        if self.batch.max_positions is not None:
            limit = min(limit, self.batch.max_positions - len(request.prompt))
        request.tokens, done = cut(request.tokens + new, request.eos, limit)
        if done:
            reason = "eos" if request.tokens[-1] in request.eos else \
                "length" if len(request.tokens) >= request.max_new_tokens else "context"
            if self.batch.recorder is not None:
                self._close(slot, row, reason)
            else:
                request.finish(Status.FINISHED, reason)
        return Update(request, request.tokens[before:])

    def _close(self, slot: int, row: Row, reason: str) -> None:
        """A recording decoder's answer is complete: its last token, which no forward has
        scored yet, and the closing tokens after it (:func:`..verification.recording.unclosed`)
        are scored one per iteration inside the batch's own verify forwards (the row's root
        alone, the next closing token forced), and the request finishes when the last one is
        (:meth:`_closed`). A row cut inside an accepted path goes back to its answer's last
        token: both caches hold tokens past it that the request does not keep."""
        request = row.request
        ids = request.prompt + request.tokens
        extra = unclosed(request.tokens, request.closing)
        if self.batch.max_positions is not None and len(ids) + len(extra) > self.batch.max_positions:
            extra = []  # the context is full: the answer stays unclosed
        self.batch.recorder.cut(request, len(ids) - 1)
        self.batch.cache.lengths[slot] = len(ids) - 1
        row.length, row.closing, row.reason = len(ids), list(extra), reason

    def _closed(self, row: Row) -> Update:
        """Every position of a closing row is scored: its request finishes, with its features."""
        request = row.request
        request.features = self.batch.recorder.finish(request, row.context[:row.length].tolist())
        request.finish(Status.FINISHED, row.reason)
        return Update(request)

    def _free_done(self) -> None:
        """Free the slots of finished and cancelled rows; the last row takes each freed slot."""
        for slot in reversed(range(len(self.rows))):
            if self.rows[slot].request.done:
                if self.batch.recorder is not None and self.rows[slot].request.features is None:
                    self.batch.recorder.forget(self.rows[slot].request)  # cancelled: nothing to hand over
                last = len(self.rows) - 1
                if slot != last:
                    self.batch.cache.move_row(last, slot)
                    if self.batch.draft_state is not None:
                        self.batch.draft_state.move_row(last, slot)
                    self.rows[slot] = self.rows[last]
                else:
                    self.batch.cache.reset_row(slot)
                    if self.batch.draft_state is not None:
                        self.batch.draft_state.reset_row(slot)
                self.rows.pop()


def _measured(cost: Costs | None, target):
    """The costs the policy weighs: the tuned ones, rescaled online by what iterations take
    on this CPU (an accelerator's are left as given; None: :meth:`.Costs.flat`)."""
    if cost is None:
        return Costs.flat()
    return MeasuredCosts(cost) if target.device.type == "cpu" else cost


def generate_batch(target, draft: DraftHead | None, prompts: Sequence, max_new_tokens: int,
                   settings: DecodeSettings = DecodeSettings(), max_batch: int = 8, cost: Costs | None = None,
                   eos_ids: int | Sequence[int] | None = None, layer_ids: Sequence[int] | None = None,
                   fusion: FusionSettings | None = None,
                   sampling: Sequence[SamplingParams | None] | None = None,
                   seeds: Sequence[int | None] | None = None) -> list[Request]:
    """Decode ``prompts`` with at most ``max_batch`` at a time (continuous batching) ->
    their requests, in order (``tokens``, ``status``, ``error``, timings)."""
    decoder = BatchDecoder(target, draft, settings, max_batch, cost, eos_ids, layer_ids, fusion)
    requests = [decoder.submit(p, max_new_tokens, sampling[i] if sampling else None, seeds[i] if seeds else None)
                for i, p in enumerate(prompts)]
    for _ in decoder.run():
        pass
    return requests


def generate(target, draft: DraftHead | None, prompt_ids, max_new_tokens: int, settings: DecodeSettings = DecodeSettings(),
             eos_ids: int | Sequence[int] | None = None, layer_ids: Sequence[int] | None = None,
             on_tokens: Callable[[list[int]], None] | None = None, cost: Costs | None = None) -> Request:
    """Speculative decoding of one prompt ([P] or [1, P] ids): a batch of one -> its request
    (``tokens``, ``accept_lengths``, ``tree_sizes``, ``target_forwards``, ``wall_time``).

    Greedy output is token for token what ``target.generate(do_sample=False)`` gives
    (floating-point ties aside); sampled output has exactly the target's distribution.
    ``draft`` None: prompt lookup only (or plain decoding). ``eos_ids``: stop after any of
    these (None: the target's ``generation_config``; ``()``: never). ``on_tokens`` receives
    each iteration's new tokens (streaming). A request that cannot be served raises
    ``ValueError`` with the reason."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
        raise ValueError(f"one prompt at a time ([P] or [1, P] ids), got shape {tuple(ids.shape)}: "
                         f"use generate_batch for several")
    decoder = BatchDecoder(target, draft, settings, 1, cost, eos_ids, layer_ids)
    request = decoder.submit(ids, max_new_tokens)
    for update in decoder.run():
        if update.request.error is not None:
            raise ValueError(update.request.error)
        if on_tokens is not None and update.tokens:
            on_tokens(update.tokens)
    return request
