"""``lyanna-serve``: the batched speculative-decoding runtime behind an OpenAI-compatible HTTP API.

One decode thread owns the runtime's :class:`~lyanna_train.runtime.scheduling.scheduler.BatchDecoder`
and steps it (:mod:`.engine`); HTTP handlers (:mod:`.app`, FastAPI on uvicorn) turn
OpenAI requests (:mod:`.protocol`) into prompt ids, submit them and read their tokens back
from per-request queues, so a slow client never holds up the batch. :mod:`.text` turns
tokens into text with stop strings, :mod:`.metrics` exposes Prometheus counters,
:mod:`.limits` bounds what one client can make the server hold (body size, requests in
flight and waiting) and :mod:`.server` runs uvicorn with a bounded drain on SIGTERM.
"""
