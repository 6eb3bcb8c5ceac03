"""The FastAPI application: OpenAI routes over one :class:`~.decode_thread.Engine`.

Every request is checked before it reaches the engine, so before anything is allocated
for it (model name, every numeric field's range, the prompt and the token budget against
the context) and refused with an OpenAI-style 400 body; the server goes on serving. A
``max_tokens`` past the context left after the prompt is refused as the OpenAI API refuses
it (``context_length_exceeded``); a request that gives none gets the server's default,
cut to the room the prompt leaves. :mod:`.limits` bounds bodies (413) and requests in
flight or waiting for a slot (429). A request whose client goes away (mid-stream or while a whole response is being
made) is cancelled at once, freeing its slot for the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..runtime.settings import SamplingParams
from .decode_thread import Engine, Job
from .limits import RATE_LIMITED, Limits, RequestLimits
from .metrics import CONTENT_TYPE
from .protocol import (FINISH_REASONS, ChatRequest, CompletionRequest, Envelope, ServingError, error_body, usage)
from .text import StopText


@dataclass
class ServedModel:
    """What the HTTP side needs to know about the model behind the engine."""

    name: str  # the id clients send as ``model``
    tokenizer: object
    max_positions: int | None  # the target's context (None: unbounded)
    default_max_tokens: int = 256  # when a request gives none
    default_sampling: SamplingParams = SamplingParams()  # fields a request leaves out


def create_app(engine: Engine, model: ServedModel, shutdown_timeout: float = 30.0,
               limits: Limits = Limits()) -> FastAPI:
    """The app; its lifespan starts the decode thread and, at shutdown, stops it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.alive:
            engine.start()
        yield
        await asyncio.to_thread(engine.close, shutdown_timeout)

    app = FastAPI(title="lyanna-serve", lifespan=lifespan)
    app.state.engine, app.state.model, app.state.draining, app.state.limits = engine, model, False, limits
    _add_error_handlers(app, engine)
    app.add_middleware(RequestLimits, limits=limits, on_refused=lambda path, status: engine.metrics.requests.labels(
        _endpoint(path), "rejected").inc())
    created = int(time.time())

    @app.get("/health")
    async def health():
        if app.state.draining or not engine.alive:
            state = "draining" if app.state.draining else "engine stopped"
            return JSONResponse({"status": state}, status_code=503)
        return {"status": "ok", "live_requests": engine.live_requests}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": created,
                                            "owned_by": "lyanna-train", "max_model_len": model.max_positions}]}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(app, body.model)
        return await _respond(app, request, body, _completion_prompt(model, body.prompt), body.max_tokens, False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_model(app, body.model)
        return await _respond(app, request, body, _chat_prompt(model, body), body.token_budget, True)

    return app


def _check_model(app: FastAPI, name: str) -> None:
    if app.state.draining:
        raise ServingError("the server is shutting down", code="shutting_down", status=503, kind="server_error")
    if name != app.state.model.name:
        raise ServingError(f"model {name!r} does not exist: this server serves {app.state.model.name!r}",
                           param="model", code="model_not_found")


def _completion_prompt(model: ServedModel, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ServingError(f"one prompt per request is supported, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    ids = model.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
    vocab = len(model.tokenizer)
    if any(not 0 <= t < vocab for t in ids):
        raise ServingError(f"prompt token ids must lie in 0..{vocab - 1}", param="prompt")
    return ids


def _chat_prompt(model: ServedModel, body: ChatRequest) -> list[int]:
    from ..evaluation.prompts import render_prompt

    messages = [m.model_dump(exclude_none=True) | {"content": m.text()} for m in body.messages]
    try:
        return render_prompt(model.tokenizer, messages, chat=True)
    except Exception as err:  # noqa: BLE001 - jinja's raise_exception and template errors alike
        raise ServingError(f"the chat template refused these messages: {err}", param="messages") from None


def _job(model: ServedModel, body, prompt: list[int], max_tokens: int | None, endpoint: str) -> Job:
    param = "messages" if endpoint == "chat" else "prompt"
    if not prompt:
        raise ServingError("the prompt is empty: give at least one token to continue", param=param)
    if model.max_positions is not None and len(prompt) >= model.max_positions:
        raise ServingError(f"the prompt has {len(prompt)} tokens; this model's context is {model.max_positions} "
                           f"tokens (at most {model.max_positions - 1} in the prompt, to leave room for one new token)",
                           param=param, code="context_length_exceeded")
    max_tokens = _token_budget(model, len(prompt), max_tokens, "max_completion_tokens" if
                               getattr(body, "max_completion_tokens", None) else "max_tokens")
    default = model.default_sampling
    sampling = SamplingParams(default.temperature if body.temperature is None else body.temperature,
                              default.top_k, default.top_p if body.top_p is None else body.top_p)
    seed = secrets.randbits(32) if body.seed is None else body.seed
    return Job(prompt, max_tokens, sampling, seed, endpoint)


def _token_budget(model: ServedModel, prompt_tokens: int, asked: int | None, param: str) -> int:
    """``asked``, unless it overruns the context after the prompt (a 400, as OpenAI words it);
    none asked: the server's default, cut to the room left."""
    if model.max_positions is None:
        return asked or model.default_max_tokens
    room = model.max_positions - prompt_tokens
    if asked is None:
        return min(model.default_max_tokens, room)
    if asked > room:
        raise ServingError(f"This model's maximum context length is {model.max_positions} tokens. However, you "
                           f"requested {prompt_tokens + asked} tokens ({prompt_tokens} in the prompt, {asked} in the "
                           "completion). Please reduce the length of the prompt or completion.", param=param,
                           code="context_length_exceeded")
    return asked


def _check_queue(app: FastAPI) -> None:
    """429 when this request would wait behind ``max_queue`` others for a decoding slot."""
    engine, limits = app.state.engine, app.state.limits
    waiting = engine.live_requests - engine.decoder.max_batch
    if waiting >= limits.max_queue:
        raise ServingError(f"{waiting} requests are already waiting for a decoding slot, this server's --max-queue: "
                           "retry later", status=429, **RATE_LIMITED)


async def _respond(app: FastAPI, request: Request, body, prompt: list[int], max_tokens: int | None, chat: bool):
    engine, model = app.state.engine, app.state.model
    endpoint = "chat" if chat else "completions"
    job = _job(model, body, prompt, max_tokens, endpoint)
    _check_queue(app)  # and submit with no await in between: nothing can slip in
    job = engine.submit(job)
    request.state.job = job
    watcher = asyncio.create_task(_cancel_on_disconnect(request, engine, job))
    text = StopText(model.tokenizer, body.stops)
    envelope = Envelope(model.name, chat)
    streaming = False  # once the stream is handed to Starlette, it owns the watcher
    try:
        first = await job.events.get()  # a request the runtime refuses is still a 400, not a broken stream
        if first.refused:
            raise ServingError(first.error or "the request was refused", code="invalid_value")
        pieces = _pieces(engine, job, text, first)
        if body.stream:
            streaming = True
            return StreamingResponse(_sse(engine, job, envelope, pieces, text, watcher),
                                     media_type="text/event-stream")
        parts, reason = [], None
        async for piece, reason in pieces:
            parts.append(piece)
    finally:
        if not streaming:
            watcher.cancel()
    _record(engine, job, reason)
    return envelope.whole("".join(parts), reason, usage(len(prompt), len(text.ids)))


def _record(engine: Engine, job: Job, outcome: str) -> None:
    """Count a request's outcome in the metrics, once."""
    if job.outcome is None:
        job.outcome = outcome
        engine.metrics.requests.labels(job.endpoint, outcome).inc()


async def _pieces(engine: Engine, job: Job, text: StopText, event) -> AsyncIterator[tuple[str, str | None]]:
    """(new text, None) while decoding, then (the rest, OpenAI finish reason) once."""
    while True:
        new = text.add(event.tokens)
        if text.stopped:
            engine.cancel(job)  # the stop string ends the request: free its slot now
            yield new, "stop"
            return
        if event.finish_reason == "error":
            raise ServingError(event.error or "decoding failed", status=500, kind="server_error")
        if event.finish_reason == "cancelled" and job.disconnected:
            return  # nobody is listening
        if event.finish_reason == "cancelled":
            raise ServingError("the request was cancelled: the server is shutting down", status=503,
                               kind="server_error", code="shutting_down")
        if event.finish_reason is not None:
            yield new + text.finish(), FINISH_REASONS[event.finish_reason]
            return
        if new:
            yield new, None
        event = await job.events.get()


async def _sse(engine: Engine, job: Job, envelope: Envelope, pieces, text: StopText, watcher) -> AsyncIterator[str]:
    """Server-sent events as OpenAI streams them; the last chunk carries ``usage``; ``[DONE]`` ends it."""

    def event(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    try:
        if envelope.chat:
            yield event(envelope.chunk("", role=True))
        async for piece, reason in pieces:
            if piece:
                yield event(envelope.chunk(piece))
            if reason is not None:  # counted first: a client may hang up as soon as it has the last chunk
                _record(engine, job, reason)
                yield event(envelope.chunk(None, reason, usage(len(job.prompt), len(text.ids))))
    except ServingError as err:
        _record(engine, job, "error")
        yield event(error_body(err.message, err.kind, err.param, err.code))
    finally:
        watcher.cancel()
        engine.cancel(job)  # a no-op when it ended; frees the slot when the stream was cut short
    yield "data: [DONE]\n\n"


async def _cancel_on_disconnect(request: Request, engine: Engine, job: Job) -> None:
    """Wait for the client to go away (the body is read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.disconnected = True
    engine.cancel(job)
    _record(engine, job, "cancelled")


def _endpoint(path: str) -> str:
    """The metrics' endpoint label of a request path."""
    return "chat" if path.endswith("/chat/completions") else "completions" if path.endswith("/completions") \
        else "other"


def _add_error_handlers(app: FastAPI, engine: Engine) -> None:
    def reject(status: int, request: Request, body: dict) -> JSONResponse:
        job = getattr(request.state, "job", None)
        outcome = "rejected" if status < 500 else "error"
        if job is not None:
            _record(engine, job, outcome)
        else:
            engine.metrics.requests.labels(_endpoint(request.url.path), outcome).inc()
        return JSONResponse(body, status_code=status, headers={"retry-after": "1"} if status == 429 else None)

    @app.exception_handler(ServingError)
    async def serving_error(request: Request, err: ServingError):
        return reject(err.status, request, error_body(err.message, err.kind, err.param, err.code))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0]
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", first.get("msg"))
            message, param = f"malformed JSON body: {detail}", None
        else:
            param = ".".join(where) or None
            message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return reject(400, request, error_body(message, param=param, code="invalid_value"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        code = "request_too_large" if err.status_code == 413 else None  # a chunked body past --max-body-bytes
        return JSONResponse(error_body(str(err.detail), "invalid_request_error", code=code),
                            status_code=err.status_code)
