"""The OpenAI wire format: request bodies (checked by pydantic), response and chunk bodies, errors.

Only what the runtime can honour is accepted: ``n``, ``best_of`` other than 1, ``echo`` and
``logprobs`` are refused with a 400 naming the field rather than silently ignored. Fields
left out take the server's defaults (``--decode`` preset's sampling, ``--max-tokens``),
so a client that sends nothing but a prompt gets what ``lyanna-generate`` would give.
Unknown extra fields are ignored, as OpenAI-compatible servers commonly do. Every number
is range-checked here (integers strictly: ``true`` or ``2.5`` is no token budget), so
nothing out of range reaches the runtime.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..runtime.scheduling.requests import SEED_RANGE


class ServingError(Exception):
    """A request the server refuses: becomes an OpenAI-style error body with ``status``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """``{"error": {...}}`` as the OpenAI API (and the ``openai`` client's exceptions) shape it."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Sampling(BaseModel):
    """Fields completions and chat share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1, strict=True)  # past the context: refused by the app
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1], strict=True)
    n: int = Field(1, strict=True)
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported: send one request per choice")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo", "logprobs", "best_of", "suffix")
    @classmethod
    def _unsupported(cls, value, info):
        harmless = {"echo": False, "best_of": 1}.get(info.field_name)  # the defaults, said out loud
        if value is not None and (value is not harmless if isinstance(value, bool) else value != harmless):
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id...: handed to the template as they are

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict], None] = None

    def text(self) -> str:
        """The content as one string (text parts joined; other parts refused)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ServingError(f"message content of type {part.get('type')!r} is not supported (text only)",
                                   param="messages")
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool | None = None
    tools: list | None = None

    @field_validator("logprobs", "tools")
    @classmethod
    def _unsupported(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Envelope:
    """The id, creation time and model every body and chunk of one response repeats."""

    def __init__(self, model: str, chat: bool):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _body(self, kind: str, choice: dict, extra: dict | None = None) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [choice], **(extra or {})}

    def whole(self, text: str, finish_reason: str, used: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._body("chat.completion", choice, {"usage": used})
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._body("text_completion", choice, {"usage": used})

    def chunk(self, text: str | None, finish_reason: str | None = None, used: dict | None = None,
              role: bool = False) -> dict:
        """One streamed piece; the last one carries ``finish_reason`` and ``usage``."""
        extra = {"usage": used} if used is not None else None
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._body("chat.completion.chunk", choice, extra)
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._body("text_completion", choice, extra)
