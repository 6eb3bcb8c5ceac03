"""The decode thread: the only code that touches the :class:`BatchDecoder`.

HTTP handlers run on the event loop; decoding runs here, one ``step`` after another, for
every request at once (continuous batching: requests join and leave between steps).
Handlers talk to the thread through a command inbox (submit, cancel) and hear back
through each job's own ``asyncio.Queue``, filled with ``call_soon_threadsafe``: the
engine never waits for a client, so a slow reader only lets its own queue grow.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

import torch

from ..runtime.scheduling.requests import Request, Status
from ..runtime.settings import SamplingParams
from ..runtime.scheduling.scheduler import BatchDecoder
from .metrics import ServingMetrics

log = logging.getLogger("lyanna_train.serving")


@dataclass
class Event:
    """What a job hears: new tokens, and once, how it ended (runtime reasons: eos, length,
    context, cancelled, error)."""

    tokens: list[int]
    finish_reason: str | None = None
    error: str | None = None
    refused: bool = False  # the runtime refused the request at submission (a bad request, not a fault)


@dataclass(eq=False)
class Job:
    """One HTTP request's decoding; created on the event loop, fed by the decode thread."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int
    endpoint: str = "completions"
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: Request | None = None  # set by the engine when it submits
    outcome: str | None = None  # how the HTTP side counted it (once) in the metrics
    disconnected: bool = False  # the client went away

    def post(self, event: Event) -> None:
        """Called from the decode thread."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """Owns ``decoder`` on a daemon thread: ``start``, ``submit``/``cancel`` from any thread, ``close``."""

    def __init__(self, decoder: BatchDecoder, metrics: ServingMetrics | None = None):
        self.decoder, self.metrics = decoder, metrics or ServingMetrics()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[Request, Job] = {}
        self._thread = threading.Thread(target=self._run, name="lyanna-engine", daemon=True)
        self._threads = torch.get_num_threads()  # OpenMP settings are per thread: carry the caller's over
        self.failure: BaseException | None = None
        self._live, self._live_lock = 0, threading.Lock()  # submitted, final event not yet posted

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def live_requests(self) -> int:
        """Requests submitted and not yet done (in the inbox, waiting or in a slot): what the
        HTTP side's ``--max-queue`` counts, and /health reports."""
        return self._live

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def submit(self, job: Job) -> Job:
        with self._live_lock:
            self._live += 1
        self._inbox.put(("submit", job))
        return job

    def cancel(self, job: Job) -> None:
        """Stop decoding ``job`` and free its slot (a no-op once it is done)."""
        self._inbox.put(("cancel", job))

    def close(self, timeout: float | None = None) -> None:
        """Cancel whatever is still live and stop the thread."""
        if self._thread.is_alive():
            self._inbox.put(("stop", None))
            self._thread.join(timeout)

    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        try:
            while True:
                command = self._inbox.get() if self.decoder.idle else self._poll()
                while command is not None:
                    if not self._handle(*command):
                        return
                    command = self._poll()
                if not self.decoder.idle:
                    self._step()
        except BaseException as err:  # noqa: BLE001 - the thread must tell the jobs before it dies
            self.failure = err
            log.exception("decode thread stopped")
            self._fail_all(f"internal error: {type(err).__name__}: {err}")

    def _poll(self):
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _handle(self, kind: str, job: Job | None) -> bool:
        if kind == "stop":
            for job in list(self._jobs.values()):
                self.decoder.cancel(job.request)
                self._finished(job, Event([], "cancelled"))
            return False
        if kind == "submit":
            job.request = self.decoder.submit(job.prompt, job.max_tokens, job.sampling, job.seed)
            self._jobs[job.request] = job
            self.metrics.prompt_tokens.inc(len(job.prompt))
        elif kind == "cancel" and job.request is not None and job.request in self._jobs:
            self.decoder.cancel(job.request)
            self._finished(job, Event([], "cancelled"))
        self._gauges()
        return True

    def _step(self) -> None:
        try:
            updates = self.decoder.step()
        except Exception as err:  # noqa: BLE001 - one failed step fails its requests, not the server
            log.exception("decoding step failed")
            self._fail_all(f"internal error while decoding: {type(err).__name__}: {err}")
            return
        self.metrics.steps.inc()
        # A request can get two updates in one step (its prefill token, then a verify's), and
        # ``Update.finished`` reads the request's state now: only its last update ends it.
        last = {id(update.request): i for i, update in enumerate(updates)}
        for i, update in enumerate(updates):
            job = self._jobs.get(update.request)
            if job is None:
                continue
            self.metrics.generated(len(update.tokens))
            request = update.request
            if update.finished and last[id(request)] == i:
                self._finished(job, Event(update.tokens, request.finish_reason, request.error,
                                          refused=request.status is Status.FAILED))
            elif update.tokens:
                job.post(Event(update.tokens))
        self._gauges()

    def _finished(self, job: Job, event: Event) -> None:
        del self._jobs[job.request]
        with self._live_lock:
            self._live -= 1
        self.metrics.request_done(job.request)
        job.post(event)

    def _fail_all(self, message: str) -> None:
        for job in list(self._jobs.values()):
            try:
                self.decoder.cancel(job.request)
            except Exception:  # noqa: BLE001 - the decoder may be what broke
                pass
            self._finished(job, Event([], "error", message))

    def _gauges(self) -> None:
        self.metrics.waiting.set(len(self.decoder.waiting))
        self.metrics.running.set(len(self.decoder.rows))
