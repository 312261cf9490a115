"""An OpenAI-compatible HTTP server over one :class:`~trtllm_diffkv.llmapi.llm.LLM` (FastAPI; run by uvicorn).

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``"stream": true`` sends
server-sent events ``data: {chunk}`` and ends with ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus text: :mod:`trtllm_diffkv.serve.metrics`).

Every request is one ``llm.generate_async`` call; the LLM's executor batches all of them in
flight. A bad request (empty prompt, bad sampling values, too long, an unsupported field, text
that is not valid Unicode, a body that is not JSON) gets a 400 response in OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``) and fails alone; every other error response
(404, 405, and a 500 for a server fault, which is logged with its traceback) has the same
shape. When a client disconnects its request is aborted, which frees its KV pages. Sampling
defaults are OpenAI's (``temperature`` 1, ``top_p`` 1; ``max_tokens`` 16 for completions, the
rest of the context for chat).
"""
from __future__ import annotations

import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from . import is_server_fault
from .metrics import prometheus_text
from .openai_protocol import NEUTRAL, ChatCompletionRequest, CompletionRequest, created, is_neutral, new_id

LOG = logging.getLogger("trtllm_diffkv.serve")

__all__ = ["create_app", "BadRequest"]

DISCONNECT_POLL_S = 0.5


class BadRequest(Exception):
    """A request the server refuses: answered with ``status`` and OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def _error(message: str, param: str | None = None, status: int = 400) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


def _check_text(value, param: str) -> None:
    """Refuse strings that are not valid Unicode (a lone surrogate such as ``"\\ud83d"``, which JSON allows)
    anywhere in the body: they cannot be tokenized or encoded as UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRequest(f"'{param}' is not valid Unicode text: {exc.reason} at character {exc.start} "
                             f"({value[exc.start]!a})", param) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, param)
            _check_text(item, f"{param}.{key}" if param else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_text(item, f"{param}[{index}]")


def _sampling_params(body, max_tokens: int):
    from ..runtime.sampling import SamplingParams

    for name, neutrals in NEUTRAL.items():
        if name in type(body).model_fields and not is_neutral(name, getattr(body, name)):
            allowed = " or ".join(repr(v) if v is not None else "null" for v in neutrals)
            raise BadRequest(f"'{name}' = {getattr(body, name)!r} is not supported (only {allowed})", name)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    return SamplingParams(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k,
                          repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                          seed=body.seed, stop=[s for s in stop if s] or None if stop else None,
                          ignore_eos=body.ignore_eos)


async def _next(handle, request: Request):
    """The handle's next output; aborts the request (and returns ``None``) if the client disconnects."""
    task = asyncio.ensure_future(handle.__anext__())
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            handle.abort()
            await task
            return None


def _usage(output) -> dict:
    prompt, completion = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(llm, model_name: str) -> FastAPI:
    """The FastAPI app serving ``llm`` under the model id ``model_name``.

    The app does not own ``llm``: the caller shuts it down (``trtllm-diffkv serve`` does after uvicorn exits).
    """
    app = FastAPI(title="trtllm-diffkv OpenAI-compatible server")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
        if first.get("type") == "json_invalid":  # loc is ("body", <character offset>)
            offset = first.get("loc", (None, None))[-1]
            reason = (first.get("ctx") or {}).get("error", "")
            return _error(f"the request body is not valid JSON ({reason} at character {offset})"
                          if reason else f"the request body is not valid JSON (at character {offset})")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(f"{where}: {first.get('msg')}" if where else str(first.get("msg")), where or None)

    @app.exception_handler(BadRequest)
    async def _bad(_, exc: BadRequest):
        return _error(exc.message, exc.param, exc.status)

    @app.exception_handler(HTTPException)
    async def _http(_, exc: HTTPException):  # FastAPI's own: unparseable body (400), unknown path (404), 405
        message = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:
            message = "the request body cannot be parsed as JSON (not UTF-8, or nested too deeply)"
        return _error(message, status=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):  # a server fault, never a traceback to the client
        LOG.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return _error(f"internal server error ({type(exc).__name__})", status=500)

    def check_model(body) -> None:
        if body.model is not None and body.model != model_name:
            raise BadRequest(f"model {body.model!r} does not exist; this server serves {model_name!r}", "model", 404)

    @app.get("/health")
    async def health():
        thread = getattr(llm, "_thread", None)
        if thread is not None and not thread.is_alive():
            return _error("the LLM's generation loop is not running", status=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created(),
                                            "owned_by": "trtllm-diffkv"}]}

    @app.get("/metrics")
    async def metrics():
        stats = await asyncio.to_thread(llm.stats)  # waits for a step in progress: off the event loop
        return PlainTextResponse(prometheus_text(stats), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        _check_text(body.model_dump(), "")
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        if not prompts:
            raise BadRequest("'prompt' is an empty list", "prompt")
        if body.stream and len(prompts) > 1:
            raise BadRequest("streaming takes one prompt (got a list of several)", "prompt")
        params = _sampling_params(body, 16 if body.max_tokens is None else body.max_tokens)
        handles = [llm.generate_async(p, params, streaming=body.stream) for p in prompts]
        meta = {"id": new_id("cmpl"), "object": "text_completion", "created": created(), "model": model_name}
        if body.stream:
            return await _stream(handles[0], request, body, meta, chat=False)
        finals = await asyncio.gather(*(_next(h, request) for h in handles))
        _raise_first_error(finals, handles)
        choices = [{"index": i, "text": f.outputs[0].text, "logprobs": None,
                    "finish_reason": f.outputs[0].finish_reason} for i, f in enumerate(finals)]
        usage = {k: sum(_usage(f)[k] for f in finals) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return {**meta, "choices": choices, "usage": usage}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body)
        _check_text(body.model_dump(), "")
        params = _sampling_params(body, 1)  # refuses unsupported fields before the chat template runs
        ids = _chat_prompt_ids(llm, body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = _sampling_params(body, max(1, llm.max_seq_len - len(ids)) if max_tokens is None else max_tokens)
        handle = llm.generate_async(ids, params, streaming=body.stream)
        meta = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": created(), "model": model_name}
        if body.stream:
            return await _stream(handle, request, body, {**meta, "object": "chat.completion.chunk"}, chat=True)
        final = await _next(handle, request)
        _raise_first_error([final], [handle])
        completion = final.outputs[0]
        return {**meta, "choices": [{"index": 0, "message": {"role": "assistant", "content": completion.text},
                                     "logprobs": None, "finish_reason": completion.finish_reason}],
                "usage": _usage(final)}

    return app


def _chat_prompt_ids(llm, body: ChatCompletionRequest) -> list[int]:
    tokenizer = llm.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise BadRequest("the model has no chat template: use /v1/completions", "messages")
    if not body.messages:
        raise BadRequest("'messages' is empty", "messages")
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    except ValueError as exc:
        raise BadRequest(str(exc), "messages") from None
    try:  # the template may refuse a conversation (e.g. "roles must alternate"): the client's to fix
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - jinja2's TemplateError and what the template raises
        raise BadRequest(f"the chat template refused the messages: {exc}", "messages") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _raise_first_error(finals, handles) -> None:
    if any(f is None for f in finals):  # the client is gone: nobody reads the answer
        for handle in handles:
            handle.abort()
        raise BadRequest("client disconnected", status=499)
    for final in finals:
        if final.error is not None:
            for handle in handles:
                handle.abort()
            server_side = is_server_fault(final)  # a failed executor step, a shutdown: not the request's fault
            if server_side:
                LOG.error("request failed in the LLM: %s", final.error)
            raise BadRequest(final.error, None, 500 if server_side else 400)


async def _stream(handle, request: Request, body, meta: dict, chat: bool):
    """Wait for the first output (an error then is a 400 response), then stream the rest as SSE; a client
    that disconnects aborts the request (before the first token: :func:`_next`; after: Starlette cancels
    the stream, whose ``finally`` aborts)."""
    first = await _next(handle, request)
    _raise_first_error([first], [handle])
    include_usage = bool((body.stream_options or {}).get("include_usage"))

    def chunk(output) -> dict:
        completion = output.outputs[0]
        reason = completion.finish_reason if output.finished else None
        if chat:
            delta = {"content": completion.text_diff} if completion.text_diff or not output.finished else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": completion.text_diff, "logprobs": None, "finish_reason": reason}
        return {**meta, "choices": [choice]}

    async def events():
        output = first
        try:
            if chat:
                yield _sse({**meta, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
            while True:
                if output.error is not None:
                    yield _sse({"error": {"message": output.error, "type": "internal_error", "param": None,
                                          "code": None}})
                    break
                if output.outputs[0].text_diff or output.finished:
                    yield _sse(chunk(output))
                if output.finished:
                    if include_usage:
                        yield _sse({**meta, "choices": [], "usage": _usage(output)})
                    break
                output = await handle.__anext__()
            yield "data: [DONE]\n\n"
        finally:
            if not handle.finished:  # the client went away mid-stream: free the request's pages
                handle.abort()

    return StreamingResponse(events(), media_type="text/event-stream")
