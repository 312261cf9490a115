"""Request and response bodies of the OpenAI-compatible server (pydantic models, OpenAI's field names).

Only what the server implements is accepted: ``logit_bias`` and ``suffix`` only at their neutral
values (:data:`NEUTRAL`: absent, ``null`` or the value that changes nothing: ``"logit_bias": {}``,
``"suffix": ""``); another value is a 400 error naming the field, never silently ignored. ``n``,
``best_of``, ``logprobs``, ``top_logprobs``, ``echo``, ``presence_penalty`` and
``frequency_penalty`` are implemented (:mod:`trtllm_diffkv.serve.openai_server`). ``tools``, ``tool_choice``, ``functions``, ``function_call`` and
``response_format`` (features the server does not implement) are refused with a 400 naming the field
unless absent or ``null`` (:data:`UNSUPPORTED`). Where OpenAI's API says integer (``max_tokens``,
``n``, ``best_of``, ``logprobs`` of a completion, ``top_logprobs``, ``seed``, ...) only a JSON integer
is accepted: ``true`` or ``"3"`` is a 400 naming the field, never coerced (pydantic's strict types);
number fields take integers and floats but not booleans or strings. ``top_k``,
``repetition_penalty`` and ``ignore_eos`` are extensions (vLLM and TensorRT-LLM's
``trtllm-serve`` accept the same names), and so are vLLM's ``stop_token_ids``, ``min_tokens`` and
``include_stop_str_in_output`` (implemented as vLLM's rules:
:class:`~trtllm_diffkv.runtime.sampling.SamplingParams`). Unknown fields are ignored, as OpenAI's SDK may add some.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "StreamOptions", "UsageInfo", "ErrorBody", "new_id",
           "NEUTRAL", "CHAT_NEUTRAL", "UNSUPPORTED", "CHAT_UNSUPPORTED", "is_neutral"]

NEUTRAL = {"logit_bias": (None, {}), "suffix": (None, "")}
"""Fields of a completion accepted only at these values (OpenAI features the server does not implement):
field -> the neutral values (``None`` = absent or ``null``); ``False == 0`` in Python, so the server
compares booleans and numbers by type as well (:func:`is_neutral`)."""

CHAT_NEUTRAL = dict(NEUTRAL)
"""The same for a chat completion."""

UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "parallel_tool_calls")
"""Fields refused unless absent or ``null``: tool calling and structured output are not implemented, and
ignoring them would hand the client text it did not ask for."""


CHAT_UNSUPPORTED = ("best_of", "echo", "suffix")
"""Completions-only fields refused on a chat completion unless absent or ``null`` (OpenAI's chat API has none of
them; ignoring one would hand the client something else than it asked for)."""


def is_neutral(name: str, value, neutrals: dict | None = None) -> bool:
    """Whether ``value`` of field ``name`` is one of its neutral values in ``neutrals`` (default
    :data:`NEUTRAL`; :data:`CHAT_NEUTRAL` for a chat completion). ``True`` is never ``1``."""
    from ..runtime.sampling import is_neutral_value

    return is_neutral_value(value, (NEUTRAL if neutrals is None else neutrals)[name])


def new_id(prefix: str) -> str:
    """A response id such as ``cmpl-<24 hex>`` / ``chatcmpl-<24 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` (a JSON boolean: ``"false"`` is a 400, as OpenAI answers, never
    truthy) adds a usage chunk before ``[DONE]``; vLLM's ``continuous_usage_stats`` is refused unless false
    (no per-chunk usage here). Unknown keys are ignored, as in the request."""

    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, description="new tokens at most (default 16 for completions, "
                                   "the model's limit minus the prompt for chat)")
    temperature: StrictFloat | None = Field(default=None, description="OpenAI default 1.0; 0 = greedy")
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = Field(default=None, description="extension: 0 = off, 1 = greedy")
    repetition_penalty: StrictFloat | None = Field(default=None, description="extension: > 0, 1 = off")
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = Field(default=None, description='{"include_usage": true} adds a usage '
                                                 'chunk')
    ignore_eos: StrictBool = False
    n: StrictInt | None = Field(default=None, description="choices per prompt (independent requests, seeds "
                                "derived from seed); default 1")
    presence_penalty: StrictFloat | None = Field(default=None, description="OpenAI's, in [-2, 2]")
    frequency_penalty: StrictFloat | None = Field(default=None, description="OpenAI's, in [-2, 2]")
    logit_bias: dict | None = None
    stop_token_ids: list[StrictInt] | None = Field(default=None, description="extension (vLLM): token ids that "
                                                   "stop generation besides the model's end ids")
    min_tokens: StrictInt | None = Field(default=None, description="extension (vLLM): no stop id or stop string "
                                         "before this many tokens")
    include_stop_str_in_output: StrictBool | None = Field(default=None, description="extension (vLLM): keep the "
                                                          "matched stop string (or stop id's text) in the text")
    user: str | None = None
    tools: object = None
    tool_choice: object = None
    functions: object = None
    function_call: object = None
    response_format: object = None
    parallel_tool_calls: object = None


class CompletionRequest(_Request):
    """``POST /v1/completions``: ``prompt`` in any of OpenAI's four forms: a string, a list of strings (one prompt
    each), a list of token ids, or a list of lists of token ids (one prompt each; ids are JSON integers, checked
    against the model's vocabulary by the server); ``n`` choices per prompt."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    best_of: StrictInt | None = Field(default=None, description=">= n: the n of best_of sequences with the "
                                      "highest cumulative log-probability")
    logprobs: StrictInt | None = Field(default=None, description="per token: the chosen token's log-probability "
                                       "and this many top alternatives (0 .. 20)")
    echo: StrictBool | None = Field(default=None, description="prepend the prompt to the text (and its "
                                    "log-probabilities to logprobs); max_tokens 0 then returns the prompt alone")
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
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    best_of: object = None  # completions-only fields: refused on chat (CHAT_UNSUPPORTED), not ignored
    echo: object = None
    suffix: object = None


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
