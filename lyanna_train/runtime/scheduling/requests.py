"""A decoding request's life in the batched runtime: waiting, running, then done.

A request is checked when it is submitted, before anything is allocated for it: an empty
prompt, a token outside the target's vocabulary, a prompt that leaves no room in the
target's context, a token budget or seed that is not an integer in range fails that
request alone, with a one-line reason in ``error``, and the others are served. A budget
past the context is not an error here: decoding stops at the context's end (finish
reason ``context``), and memory is sized by the context, never by the budget.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ..settings import SamplingParams


class Status(str, enum.Enum):
    WAITING = "waiting"  # submitted, no slot yet
    RUNNING = "running"  # in a slot, decoding
    FINISHED = "finished"  # EOS, max_new_tokens or the context's end (``finish_reason``)
    FAILED = "failed"  # refused: ``error`` says why
    CANCELLED = "cancelled"


@dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int  # of this request's own sampling generator
    eos: frozenset[int]
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)  # new tokens, cut after EOS and at max_new_tokens
    finish_reason: str | None = None  # "eos", "length", "context", "cancelled", "error"
    error: str | None = None
    target_forwards: int = 0  # prefill included
    accept_lengths: list[int] = field(default_factory=list)  # tokens per verify forward after the prefill
    tree_sizes: list[int] = field(default_factory=list)  # nodes this row verified per forward, root included
    features: object = None  # RecordedFeatures of prompt + tokens (+ closing), when the decoder records them
    closing: tuple[int, ...] = ()  # tokens that close the answer, recorded after it (see BatchDecoder.submit)
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.FAILED, Status.CANCELLED)

    @property
    def latency(self) -> float | None:
        """Seconds from submission to the last token (None while not done)."""
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    @property
    def wall_time(self) -> float | None:
        """Seconds from submission to the last token (what :func:`.scheduler.generate` reports)."""
        return self.latency

    @property
    def mean_acceptance(self) -> float:
        """New tokens per target forward this request took part in (prefill included)."""
        return len(self.tokens) / max(self.target_forwards, 1)

    def finish(self, status: Status, reason: str, error: str | None = None) -> None:
        self.status, self.finish_reason, self.error = status, reason, error
        self.finished_at = time.perf_counter()


SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed takes


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_request(prompt, max_new_tokens: int, vocab_size: int, max_positions: int | None,
                  seed: int = 0) -> str | None:
    """Why this request cannot be served (one line), or None."""
    if not _integer(max_new_tokens) or max_new_tokens < 1:
        return f"max_new_tokens must be an integer of at least 1, got {max_new_tokens!r}"
    if not _integer(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        return f"seed must be an integer in {SEED_RANGE[0]}..{SEED_RANGE[1]}, got {seed!r}"
    if len(prompt) == 0:
        return "empty prompt: give at least one token to continue"
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"token id {bad} is outside the target's vocabulary (0..{vocab_size - 1})"
    if max_positions is not None and len(prompt) >= max_positions:
        return (f"prompt of {len(prompt)} tokens does not fit the target's context of {max_positions} positions "
                f"(at most {max_positions - 1}, to leave room for a new token)")
    return None


def stop_ids(target, eos_ids) -> set[int]:
    """The ids a request stops after: ``eos_ids``, or the target's ``generation_config`` (None)
    as ``target.generate`` does; ``()`` never stops."""
    if eos_ids is None:
        eos_ids = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos_ids is None:
        return set()
    return {int(eos_ids)} if isinstance(eos_ids, int) else {int(e) for e in eos_ids}


def cut(tokens: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut after the first EOS and at max_new_tokens; True when generation is over."""
    for i, tok in enumerate(tokens[:max_new_tokens]):
        if tok in eos:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens
