"""Request and response bodies of the OpenAI-compatible server (pydantic models, OpenAI's field names).

Only what the server implements is accepted: ``n``, ``best_of``, ``logprobs``, ``top_logprobs``,
``echo``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` and ``suffix`` at their
neutral values (:data:`NEUTRAL`: absent, ``null`` or the value that changes nothing, e.g.
``"n": 1``, ``"logit_bias": {}``, ``"logprobs": false``); another value is a 400 error naming the
field, never silently ignored. ``top_k``,
``repetition_penalty`` and ``ignore_eos`` are extensions (vLLM and TensorRT-LLM's
``trtllm-serve`` accept the same names). Unknown fields are ignored, as OpenAI's SDK may add some.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "UsageInfo", "ErrorBody", "new_id",
           "NEUTRAL", "is_neutral"]

NEUTRAL = {"n": (None, 1), "best_of": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0),
           "echo": (None, False), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
           "logit_bias": (None, {}), "suffix": (None, "")}
"""Fields accepted only at these values (OpenAI features the server does not implement): field -> the
neutral values (``None`` = absent or ``null``). ``logprobs`` of a completion is an int (``0`` asks for
the chosen tokens' log-probabilities, so only ``null`` is neutral there); ``False == 0`` in Python, so
the server compares booleans and numbers by type as well (:func:`is_neutral`)."""


def is_neutral(name: str, value) -> bool:
    """Whether ``value`` of field ``name`` is one of its :data:`NEUTRAL` values (``True`` is never ``1``)."""
    return any(value is None if neutral is None else
               (type(value) is type(neutral) or {type(value), type(neutral)} <= {int, float}) and value == neutral
               for neutral in NEUTRAL[name])


def new_id(prefix: str) -> str:
    """A response id such as ``cmpl-<24 hex>`` / ``chatcmpl-<24 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, description="new tokens at most (default 16 for completions, "
                                   "the model's limit minus the prompt for chat)")
    temperature: float | None = Field(default=None, description="OpenAI default 1.0; 0 = greedy")
    top_p: float | None = None
    top_k: int | None = Field(default=None, description="extension: 0 = off, 1 = greedy")
    repetition_penalty: float | None = Field(default=None, description="extension: > 0, 1 = off")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = Field(default=None, description='{"include_usage": true} adds a usage chunk')
    ignore_eos: bool = False
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    user: str | None = None


class CompletionRequest(_Request):
    """``POST /v1/completions``: ``prompt`` is a string, or a list of strings (one choice each)."""

    prompt: str | list[str]
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = Field(default=None, description="refused unless empty (no fill-in-the-middle)")


class ChatMessage(BaseModel):
    """One message; ``content`` as a string or OpenAI's list of ``{"type": "text", "text": ...}`` parts."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The message's text (text parts joined; other part types refused).

        Raises:
            ValueError: a non-text part.
        """
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"message content part of type {part.get('type')!r} is not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's chat template."""

    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


class UsageInfo(BaseModel):
    """Token counts of a response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorBody(BaseModel):
    """OpenAI's error object (``{"error": {...}}``)."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


def created() -> int:
    """Unix seconds now (the ``created`` field)."""
    return int(time.time())
