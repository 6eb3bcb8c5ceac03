"""Prometheus metrics of one server (``GET /metrics``), kept in their own registry.

Counters are what Prometheus expects (``rate()`` turns them into per-second figures);
τ, the queue length and a recent tokens/s are also given as gauges so that one scrape,
or a person with ``curl``, reads them directly.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class ServingMetrics:
    """Updated by the decode thread (tokens, forwards, slots) and the HTTP handlers (outcomes)."""

    def __init__(self, window_s: float = 10.0):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("lyanna_requests", "Requests by endpoint and outcome (stop, length, cancelled, "
                                "error: failed while decoding, rejected: refused with a 4xx)",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("lyanna_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("lyanna_generation_tokens", "Tokens generated", registry=r)
        self.target_forwards = Counter("lyanna_target_forwards", "Target forwards per request, summed over "
                                       "requests (a fused forward counts once per row), prefill included",
                                       registry=r)
        self.steps = Counter("lyanna_engine_steps", "Batched decoding iterations", registry=r)
        self.waiting = Gauge("lyanna_queue_length", "Requests waiting for a slot", registry=r)
        self.running = Gauge("lyanna_running_requests", "Requests decoding in a slot", registry=r)
        self.latency = Histogram("lyanna_request_latency_seconds", "Submission to last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("lyanna_time_to_first_token_seconds", "Submission to first token",
                                     buckets=LATENCY_BUCKETS, registry=r)
        Gauge("lyanna_mean_accepted_tokens", "τ: tokens generated per target forward (per row), since start",
              registry=r).set_function(self.tau)
        Gauge("lyanna_generation_tokens_per_second", f"Tokens generated per second over the last {window_s:g} s",
              registry=r).set_function(self.tokens_per_second)
        self._window_s = window_s
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self._tokens = self._forwards = 0

    def generated(self, count: int) -> None:
        if count:
            self.generation_tokens.inc(count)
            now = time.monotonic()
            with self._lock:
                self._recent.append((now, count))

    def request_done(self, request) -> None:
        """A request left the runtime: its τ share, latency and first-token time."""
        with self._lock:
            self._tokens += len(request.tokens)
            self._forwards += request.target_forwards
        self.target_forwards.inc(request.target_forwards)
        if request.latency is not None:
            self.latency.observe(request.latency)
        if request.first_token_at is not None:
            self.first_token.observe(request.first_token_at - request.submitted_at)

    def tau(self) -> float:
        with self._lock:
            return self._tokens / self._forwards if self._forwards else 0.0

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self._window_s:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / self._window_s

    def render(self) -> bytes:
        return generate_latest(self.registry)
