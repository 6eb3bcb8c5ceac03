"""What one client can make the server hold: a bounded body, a bounded number of requests.

Refusals come before any work: a body past ``max_body_bytes`` is a 413 as soon as its
``Content-Length`` (or, for a chunked body, the bytes received) says so; a request that
would be the ``max_concurrency + 1``-th in flight, or that would wait behind
``max_queue`` others for a decoding slot, is a 429 with ``Retry-After``. Each is the
OpenAI-style error body, so the ``openai`` client raises its own exception for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.exceptions import HTTPException

from .protocol import error_body

RATE_LIMITED = {"kind": "requests", "code": "rate_limit_exceeded"}  # as the OpenAI API words a 429


@dataclass(frozen=True)
class Limits:
    """The server's bounds (``lyanna-serve --max-concurrency --max-queue --max-body-bytes``)."""

    max_concurrency: int = 512  # generation requests handled at once, from the body's first byte to the last chunk
    max_queue: int = 256  # requests waiting for a decoding slot (beyond the ``--max-batch`` decoded)
    max_body_bytes: int = 8 * 2**20  # a request body past this is refused unread

    def __post_init__(self):
        for name in ("max_concurrency", "max_queue", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


async def _send_error(send, status: int, body: dict, headers: tuple = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


class RequestLimits:
    """ASGI middleware around the app: body size (413) and requests in flight (429) on ``POST /v1/...``."""

    def __init__(self, app, limits: Limits, on_refused=None):
        self.app, self.limits, self.in_flight = app, limits, 0
        self.on_refused = on_refused or (lambda path, status: None)  # counts refusals in the metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        limit = self.limits.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await self._refuse(scope, send, 413, self._too_large(limit))
        if self.in_flight >= self.limits.max_concurrency:
            return await self._refuse(scope, send, 429, error_body(
                f"the server is handling {self.in_flight} requests, its --max-concurrency: retry later",
                RATE_LIMITED["kind"], code=RATE_LIMITED["code"]), ((b"retry-after", b"1"),))
        received = 0

        async def bounded_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # a chunked body without Content-Length: FastAPI answers it, a 413
                    self.on_refused(scope["path"], 413)
                    raise HTTPException(413, self._too_large(limit)["error"]["message"])
            return message

        self.in_flight += 1
        try:
            await self.app(scope, bounded_receive, send)
        finally:
            self.in_flight -= 1

    @staticmethod
    def _too_large(limit: int) -> dict:
        return error_body(f"the request body is larger than this server's limit of {limit:,} bytes "
                          "(--max-body-bytes)", code="request_too_large")

    async def _refuse(self, scope, send, status: int, body: dict, headers: tuple = ()) -> None:
        self.on_refused(scope["path"], status)
        await _send_error(send, status, body, headers)
