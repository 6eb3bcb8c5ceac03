"""What speculation costs: the target's verify time per token count, the head's draft time per
drafting row count, and how many candidates pay for their verify.

On a GPU a target forward costs about the same for 1 or 64 tokens, so every candidate is
worth verifying. On a CPU it does not: with SmolLM2 on 2 cores and the measured linear
forms (:mod:`..cpu.small_linear`), 1 token takes ~20 ms, 2-5 ~24, 8 ~30 and 16 ~37
(torch's own linears: 40, 71, 63, 71, 84 ms for 1, 2, 4, 8, 16). So the target's forward
time per number of tokens is measured once (:func:`..cpu.tuning.tune`, cached on disk), and
each iteration verifies the ``n`` most probable candidates that maximise

    (1 + Σ_{i ≤ n} p_i) / cost(n + 1)

(p_i: each candidate's estimated chance to be accepted; the 1 is the target's own next
token). n = 0 is a plain decoding step: speculation is skipped when it would not pay.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


class VerifyCost:
    """Seconds of one target forward over N new tokens, interpolated between measured sizes."""

    def __init__(self, sizes: Sequence[int], seconds: Sequence[float]):
        if len(sizes) != len(seconds) or not sizes or list(sizes) != sorted(sizes):
            raise ValueError("need increasing sizes, one time each")
        self.sizes, self.seconds = list(sizes), list(seconds)

    @classmethod
    def flat(cls) -> "VerifyCost":
        """Every size costs the same: verify every candidate (an accelerator's regime)."""
        return cls([1], [1.0])

    def __call__(self, n: int) -> float:
        i = bisect_left(self.sizes, n)
        if i == 0:
            return self.seconds[0]
        if i == len(self.sizes):  # past the last size: extend the last segment's slope
            if len(self.sizes) == 1:
                return self.seconds[0]
            i = len(self.sizes) - 1
        (a, b), (ta, tb) = self.sizes[i - 1:i + 1], self.seconds[i - 1:i + 1]
        return ta + (tb - ta) * (n - a) / (b - a)


def best_count(probs: Sequence[float], cost: VerifyCost) -> int:
    """probs sorted high to low -> how many to verify (0..len) for the most tokens per second."""
    best, best_rate, expected = 0, 1.0 / cost(1), 1.0
    for n, p in enumerate(probs, start=1):
        expected += p
        rate = expected / cost(n + 1)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def best_width(rows: Sequence[Sequence[float]], cost: Callable[[int], float], limit: int | None = None,
               margin: float = 0.0, plain: float | None = None, drain=None) -> int:
    """Each row's candidate probabilities (in the order they would be verified) -> W, the
    tokens per row of ONE fused verify forward over all rows (the root included).

    The forward computes rows × W tokens whatever each row fills (rows are padded to W),
    so every row verifies its W - 1 best candidates and W maximises

        Σ_rows (1 + Σ_{i < W} p_row,i) / cost(rows · W)

    — the batch's total token count is what the forward costs. With one row this is
    :func:`best_count` + 1. ``limit`` caps W; a width past 1 must beat plain decoding by
    ``margin`` (the measured costs' error). ``plain``: the seconds of W = 1 where a plain
    iteration is priced apart (:meth:`MeasuredCosts.plain`); default ``cost(rows)``.
    ``drain``: a draining batch's :class:`..policy.Drain`: a width is worth the seconds its
    expected tokens take off the batch's remaining time, not their count."""
    most = max((len(p) for p in rows), default=0) + 1
    most = min(most, limit) if limit else most
    prefix = [[0.0] for _ in rows]
    for sums, probs in zip(prefix, rows):
        for p in probs[:most - 1]:
            sums.append(sums[-1] + p)
    expected = [[1 + sums[min(width - 1, len(sums) - 1)] for sums in prefix] for width in range(1, most + 1)]
    worth = [sum(row) for row in expected] if drain is None else \
        drain.saved(torch.tensor(expected, dtype=torch.float64)).tolist()  # per width
    best, best_rate = 1, worth[0] / (cost(len(rows)) if plain is None else plain) * (1 + margin)
    for width in range(2, most + 1):
        rate = worth[width - 1] / cost(len(rows) * width)
        if rate > best_rate:
            best, best_rate = width, rate
    return best


class DraftCost:
    """Seconds of the head's work in one iteration when ``rows`` rows draft: their step 0 over
    the tokens they accepted and their candidate tree (:func:`..cpu.tuning.tune` times both
    per row count for the decoding's tree shape); 0 rows cost nothing."""

    def __init__(self, rows: Sequence[int], seconds: Sequence[float]):
        self._curve = VerifyCost(rows, seconds)

    @classmethod
    def free(cls) -> "DraftCost":
        """Drafting costs nothing next to the verify (an accelerator's regime)."""
        return cls([1], [0.0])

    def __call__(self, rows: int) -> float:
        return 0.0 if rows <= 0 else self._curve(rows)


@dataclass(frozen=True)
class Costs:
    """The measured costs the speculation policy weighs (:mod:`.policy`)."""

    verify: VerifyCost
    draft: DraftCost
    anchor: float = 0.0  # seconds of step 0 per anchor a row that waited catches up (one forward over its backlog)

    @classmethod
    def flat(cls) -> "Costs":
        """An accelerator's regime: every verify width costs the same and drafting is free,
        so every row drafts and verifies its whole tree."""
        return cls(VerifyCost.flat(), DraftCost.free())

    def verify_at(self, rows: int) -> VerifyCost:
        """Seconds of a speculative iteration's fused verify per token count, ``rows`` rows."""
        return self.verify

    def plain(self, rows: int) -> float:
        """Seconds of an iteration that speculates nothing: one token per row, no draft."""
        return self.verify(rows)


CLIP = 3.0  # the most one iteration's measurement moves a cost's scale towards, either way
PROBE_EVERY = 32  # iterations after which a held one is due if none was measured since
CATCH_UP_HORIZON = 8  # iterations a row's catch-up (its waiting anchors' step 0) is paid back over
RATE_WINDOW = 8  # the last consulted and held iterations, per row count, whose delivered tokens/s are compared
RETRY_EVERY = 8  # iterations at a row count where speculation delivered less than plain decoding, per retry ...
RETRY_EVERY_MOST = 128  # ... doubling after each retry that leaves it behind, up to this many
QUIET_AFTER = 8  # plain iterations the policy chose in a row, after which it is consulted only ...
CONSULT_EVERY = 4  # ... one iteration in this many, until it speculates again


class MeasuredCosts:
    """The tuned costs rescaled by what this decoder's own iterations take, whole.

    The tuning times bare forwards: the target's over N tokens of ONE row, a drafting
    iteration on random states. A real iteration also reads every row's own cache,
    proposes every row's free candidates, accepts, rolls the caches back and keeps each
    row's books: at 16 rows on 2 CPU cores a speculative iteration took 1.7x a plain one
    for 1.44x its tokens, where the bare forwards promised a gain. So every iteration is
    timed from proposal to delivery, and the time beside the head's (timed apart)
    rescales the verify curve: apart for plain iterations (one token per row, no draft)
    and speculative ones, and per row count (what a row adds is not what a token adds:
    the tuned curve is one row's), each an average of measured / tuned (weight ``memory``
    for each new iteration); a row count not measured yet takes the nearest one's. The
    curves' shapes come from the tuning, their levels from the decoding itself. Held
    iterations (plain, the policy not consulted) are the ones it may stop having: after
    ``PROBE_EVERY`` iterations without one, one is due (:meth:`plain_due`), so a stale
    plain level cannot keep speculation on.

    The costs are a model; what iterations deliver is the verdict. Each row count keeps
    the tokens/s its last ``RATE_WINDOW`` iterations delivered with the policy consulted
    (whatever it chose: proposing every row's free candidates and choosing is part of
    what speculating costs) and held (plain, nothing proposed: what decoding costs
    without speculation). Compared with the consulted iterations that chose plain
    decoding instead, speculation at 16 rows on 2 CPU cores (48 MT-Bench prompts x 64
    tokens, a server's regime) read 184 against 172 tokens/s and stayed on, while held
    iterations delivered 181 and the run took 0.94x plain decoding's time; judged against
    held ones, 0.99x. Each iteration is charged a
    catch-up (a row's deferred step 0: its prompt's, or the tokens it decoded plainly)
    charged over the ``CATCH_UP_HORIZON`` iterations it is expected to serve. In a draining
    batch, which has few iterations left to serve, it is charged whole (a closed batch of
    16 rows on 2 CPU cores, speculating every few iterations, caught up ~0.25 s in ~9.5 s;
    spread over 8 iterations, speculation read 150 tokens/s against plain decoding's 146
    and stayed on); but not on a retry, whose catch-up is the backlog of a hold the
    verdict imposed. (Charged whole in a server, a new row's prompt made the first
    iterations that drafted for it lose: at 4 clients speculation stopped, 1.02x
    ``--no-draft`` instead of 1.06-1.07x.) Where speculation delivered
    less than plain decoding, iterations are plain, but for a retry after ``RETRY_EVERY``
    of them (:meth:`plain_due`): the policy chooses freely again until its speculative
    iterations at that row count are enough to judge anew (their old ones are dropped; judged
    together with the old ones, one retry could not move the verdict, and at 4 rows of a
    closed batch on 2 CPU cores a hold that began in the first iterations was never lifted,
    where speculation delivered 1.2x plain decoding once it ran). At 16 rows on 2 CPU cores the model,
    with acceptance predicted within 3 %, still chose iterations that delivered 0.8x plain
    decoding's tokens/s. Each retry after which speculation is still behind doubles the
    wait before the next (up to ``RETRY_EVERY_MOST``): at a row count where it never pays,
    retries at a fixed one in eight were 10-26 % of a 16-client server's iterations, up to
    ~9 % slower than a plain one each.

    Consulting the policy costs too: every row's free candidates and its choice took
    ~3.6 ms of a ~60 ms iteration at 16 rows. After ``QUIET_AFTER`` iterations in a row
    in which it chose plain decoding, it is consulted one iteration in ``CONSULT_EVERY``
    (the others are plain at once) until it speculates again."""

    def __init__(self, tuned: Costs, memory: float = 0.2):
        self.tuned, self.memory = tuned, memory
        self.draft_scale = 1.0
        self.plain_scales: dict[int, float] = {}  # rows -> measured / tuned, plain iterations
        self.verify_scales: dict[int, float] = {}  # rows -> measured / tuned, speculative iterations
        self.since_held = 0  # iterations since the last held one (plain, the policy not consulted)
        self.anchor = tuned.anchor  # a catch-up's seconds per anchor, measured as catch-ups happen
        self.delivered: dict[tuple[bool, int], deque] = {}  # (consulted, rows) -> recent (tokens, seconds)
        self.held: dict[int, int] = {}  # rows -> iterations held plain since speculation lost there
        self.retry_every: dict[int, int] = {}  # rows -> iterations held per retry there (doubling)
        self.chose_plain = 0  # iterations in a row in which the policy, consulted, chose plain decoding
        self.quiet = 0  # iterations since the policy went quiet
        self._forced = False  # whether the current iteration was made plain without the policy
        self._retry = False  # whether it is a retry of speculation after a hold

    @staticmethod
    def _scale(scales: dict[int, float], rows: int, default: float = 1.0) -> float:
        if rows in scales:
            return scales[rows]
        return scales[min(scales, key=lambda r: (abs(r - rows), r))] if scales else default

    def verify_at(self, rows: int) -> Callable[[int], float]:
        """A speculative iteration's level is never below a plain one's at the same row count:
        it runs at least the same forward, so a level measured below is noise (read as a
        gain, it made 61 of 63 iterations at 16 rows draft one row only to verify nothing
        more: 0.91x plain decoding's tokens/s)."""
        scale = max(self._scale(self.verify_scales, rows), self._scale(self.plain_scales, rows))
        return lambda tokens: scale * self.tuned.verify(tokens)

    def plain(self, rows: int) -> float:
        """Before any plain iteration is measured, the tuned level: cheap, so one is tried."""
        return self._scale(self.plain_scales, rows) * self.tuned.verify(rows)

    def draft(self, rows: int) -> float:
        return self.draft_scale * self.tuned.draft(rows)

    @property
    def sizes(self) -> list[int]:
        return self.tuned.verify.sizes

    def plain_due(self, rows: int) -> bool:
        """Whether the next iteration over ``rows`` rows is plain without consulting the
        policy: to measure what plain decoding costs now, because speculation delivered less
        there, or because the policy keeps choosing plain decoding anyway (each call counts
        towards the next retry or consultation)."""
        self._retry = False
        self._forced = self._due(rows)
        return self._forced

    def _due(self, rows: int) -> bool:
        if self.since_held >= PROBE_EVERY:
            return True
        verdict = self.speculation_verdict(rows)
        if verdict == "lost":
            every = self.retry_every.get(rows, RETRY_EVERY)
            self.held[rows] = self.held.get(rows, 0) + 1
            if self.held[rows] < every:
                return True
            self.held[rows] = 0  # a retry; if speculation is still behind after it, the next waits longer
            self._retry = True
            self.retry_every[rows] = min(2 * every, RETRY_EVERY_MOST)
            self.delivered.pop((True, rows), None)  # judged on the iterations it starts, not the old ones
            return False
        if verdict == "won":  # the retries' pace starts again
            self.held.pop(rows, None)
            self.retry_every.pop(rows, None)
        if self.chose_plain >= QUIET_AFTER:
            self.quiet += 1
            return self.quiet % CONSULT_EVERY != 0
        return False

    def delivered_rate(self, consulted: bool, rows: int) -> float | None:
        """Tokens/s the last iterations of that kind delivered at ``rows`` rows (the nearest
        row count with enough of them; None: none has)."""
        enough = 4 if consulted else 2
        counts = [r for (s, r), runs in self.delivered.items() if s == consulted and len(runs) >= enough]
        if not counts:
            return None
        runs = self.delivered[(consulted, min(counts, key=lambda r: (abs(r - rows), r)))]
        return sum(t for t, _ in runs) / max(sum(s for _, s in runs), 1e-9)

    def speculation_verdict(self, rows: int) -> str | None:
        """Whether iterations with the policy consulted delivered fewer tokens/s than held
        ones near ``rows`` ("lost"), as many or more ("won"), or too few of either were
        measured (None)."""
        consulted, held = self.delivered_rate(True, rows), self.delivered_rate(False, rows)
        if consulted is None or held is None:
            return None
        return "lost" if consulted < held else "won"

    def speculation_lost(self, rows: int) -> bool:
        return self.speculation_verdict(rows) == "lost"

    def observe_iteration(self, rows: int, width: int, drafted: int, seconds: float, draft_seconds: float,
                          tokens: int | None = None, catch_up: float = 0.0, draining: bool = False,
                          consulted: bool | None = None) -> None:
        """One whole iteration: ``rows`` rows verified ``width`` tokens each, ``drafted`` of
        them drafted, in ``seconds`` of which ``draft_seconds`` were the head's; it delivered
        ``tokens`` (None: not counted) after a catch-up of ``catch_up`` seconds, in a batch
        that ``draining`` only shrinks; ``consulted``: whether the policy chose it (None:
        a speculative iteration was, a plain one was not)."""
        rest = max(seconds - draft_seconds, 0.0)
        plain = width == 1 and not drafted
        consulted = not plain if consulted is None else consulted
        self.since_held = self.since_held + 1 if consulted else 0
        if not plain:
            self.chose_plain = self.quiet = 0
        elif not self._forced:
            self.chose_plain += 1
        retry, self._forced, self._retry = self._retry, False, False
        if tokens is not None:
            runs = self.delivered.setdefault((consulted, rows), deque(maxlen=RATE_WINDOW))
            runs.append((tokens, seconds + (catch_up if draining and not retry else catch_up / CATCH_UP_HORIZON)))
        scales = self.plain_scales if plain else self.verify_scales
        tuned = self.tuned.verify(rows * width)
        if rows in scales:
            scales[rows] = self._blend(scales[rows], rest, tuned)
        elif tuned > 0:  # a row count's first measurement is its level
            scales[rows] = _clipped(rest / tuned)
        if drafted:
            self.draft_scale = self._blend(self.draft_scale, draft_seconds, self.tuned.draft(drafted))

    def observe_catch_up(self, anchors: int, seconds: float) -> None:
        if anchors and self.tuned.anchor > 0:
            self.anchor = self.tuned.anchor * self._blend(self.anchor / self.tuned.anchor, seconds / anchors,
                                                          self.tuned.anchor)

    def _blend(self, scale: float, seconds: float, tuned: float) -> float:
        """One observation's ratio to the tuned figure, clipped to [1/CLIP, CLIP]: a first call
        (kernels not warm, buffers allocated) or a pause of the machine moves the average, it
        does not take it over (one such catch-up once read 11x its steady cost)."""
        if tuned <= 0:
            return scale
        return scale + self.memory * (_clipped(seconds / tuned) - scale)


def _clipped(ratio: float) -> float:
    return min(max(ratio, 1 / CLIP), CLIP)
