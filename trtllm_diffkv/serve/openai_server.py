"""An OpenAI-compatible HTTP server over one :class:`~trtllm_diffkv.llmapi.llm.LLM` (FastAPI; run by uvicorn).

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``"stream": true`` sends
server-sent events ``data: {chunk}`` and ends with ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus text: :mod:`trtllm_diffkv.serve.metrics`).

Every request is one ``llm.generate_async`` call, made in a worker thread (tokenizing a long prompt
or a list of thousands never blocks the event loop: ``/health`` keeps answering); the LLM's executor
batches all of them in flight. A body over ``max_body_bytes`` (default :data:`MAX_BODY_BYTES`) is
answered 413 before it is read in full, and a prompt with more characters than the model's context
can hold (:meth:`~trtllm_diffkv.llmapi.llm.LLM.max_prompt_chars`) is refused before it is tokenized. A bad request (empty prompt, bad sampling values, too long, an unsupported field, text
that is not valid Unicode, a body that is not JSON) gets a 400 response in OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``) and fails alone; every other error response
(404, 405, and a 500 for a server fault, which is logged with its traceback) has the same
shape. When a client disconnects its request is aborted, which frees its KV pages. Sampling
defaults are OpenAI's (``temperature`` 1, ``top_p`` 1; ``max_tokens`` 16 for completions, the
rest of the context for chat).

Log-probabilities: completions' ``logprobs: k`` gives OpenAI's legacy object (``tokens``,
``token_logprobs``, ``top_logprobs``: the chosen token and the top ``k`` as ``{token text: logprob}``,
``text_offset``: character offsets in the choice's text); chat's ``logprobs: true`` +
``top_logprobs: k`` gives ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``; both
streamed per chunk too. Values are the sampler's (after the penalties and the temperature, before
top-k/top-p: :mod:`trtllm_diffkv.runtime.sampling`). ``echo`` prepends the prompt text and, with
``logprobs``, the prompt tokens' log-probabilities (raw logits; the first token's ``null``);
``echo`` with ``max_tokens: 0`` returns the prompt alone (one token is generated and dropped, as
vLLM does; ``completion_tokens`` 0). ``n`` / ``best_of``: each choice is an independent request
(:meth:`~trtllm_diffkv.runtime.sampling.SamplingParams.child_params`: child ``i`` is seeded
``seed + i * 0x9E3779B97F4A7C15 mod 2**64``, child 0 the request's seed), the prompt prefilled once
per choice (no page sharing); ``best_of`` keeps the ``n`` with the highest cumulative
log-probability; choices are ordered prompt by prompt (``index = prompt * n + i``), ``usage`` sums every
sequence run (the dropped ``best_of`` ones too), and a disconnect aborts all of them.

``usage`` carries DiffKV's numbers besides OpenAI's token counts (:func:`_usage`): ``kv_memory_fraction``
(KV bytes / FP16 KV bytes of the same tokens), ``high_fraction``, ``low_fraction``, ``pruned_fraction``
(tier shares; ``null`` for the ``fp16`` preset) and ``kv_pool_bytes`` (pool bytes the request held at its
end). Shutdown (:class:`Drain`): new requests get a 503 in OpenAI's shape, requests in flight get the
drain time to finish, then are aborted through the LLM (pages freed): a waiting non-streaming request
gets a 503, a stream ends with an error event and ``data: [DONE]``. One access-log line per request
goes to the ``trtllm_diffkv.serve.access`` logger at INFO.
"""
from __future__ import annotations

import asyncio
import codecs
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from . import is_server_fault, is_unavailable
from .http_limits import host_allowed
from .metrics import ServingMetrics
from ..runtime.detokenizer import token_bytes, token_texts
from ..runtime.sampling import best_of_order
from .openai_protocol import (CHAT_NEUTRAL, CHAT_UNSUPPORTED, NEUTRAL, UNSUPPORTED, ChatCompletionRequest, CompletionRequest, created,
                              is_neutral, new_id)

LOG = logging.getLogger("trtllm_diffkv.serve")
ACCESS_LOG = logging.getLogger("trtllm_diffkv.serve.access")

__all__ = ["create_app", "BadRequest", "Drain", "MAX_BODY_BYTES"]

DISCONNECT_POLL_S = 0.5
MAX_BODY_BYTES = 8 << 20
"""Request bodies above this many bytes get a 413 (``trtllm-diffkv serve --max-body-bytes``); 8 MiB holds
a prompt filling a 128k-token context several times over."""
SHUTDOWN_MESSAGE = "the server is shutting down"
MAX_REQUEST_SEQUENCES = 4096
"""Most sequences one request may run over all its prompts (prompts x ``best_of``/``n``), checked before
anything is queued: 1,000 prompts x ``n`` 256 would queue 256,000 executor requests."""


class BadRequest(Exception):
    """A request the server refuses: answered with ``status`` and OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def _error_body(message: str, param: str | None = None, status: int = 400) -> dict:
    kind = "invalid_request_error" if status < 500 else "service_unavailable" if status == 503 else "internal_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _error(message: str, param: str | None = None, status: int = 400) -> JSONResponse:
    return JSONResponse(_error_body(message, param, status), status)


class Drain:
    """The app's shutdown state and the handles of the requests in flight (``app.state.drain``).

    :meth:`drain` (``trtllm-diffkv serve`` calls it when uvicorn starts shutting down) sets
    ``draining`` (new requests: 503), waits up to ``timeout_s`` for the requests in flight, then
    aborts the rest through the LLM (``aborted`` set: their responses become 503s / error events).
    """

    def __init__(self):
        self.draining = False
        self.aborted = False
        self.live: set = set()

    def add(self, handles) -> None:
        """Track ``handles`` (refused with a 503 once draining)."""
        if self.draining:
            for handle in handles:
                handle.abort()
            raise BadRequest(SHUTDOWN_MESSAGE, status=503)
        self.live.update(handles)

    def discard(self, handles) -> None:
        self.live.difference_update(handles)

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests, wait up to ``timeout_s`` seconds for the live ones, abort what is left.

        Returns:
            the number of requests aborted.
        """
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.live)
        if left:
            self.aborted = True
            LOG.warning("shutdown: aborting %d request(s) still in flight after %.1f s", len(left), timeout_s)
            for handle in left:
                handle.abort()
        return len(left)


class _Guard:
    """Pure ASGI middleware: the ``Host`` rule (400), the body cap (413), the body's deadline (408), UTF-8 bodies
    (400), the draining state (503) and the access log.

    The body cap checks ``Content-Length`` before anything is read and counts the bytes of a chunked
    body as they arrive, so an oversized request never reaches JSON parsing. ``allowed_hosts``: the
    :func:`~trtllm_diffkv.serve.http_limits.host_allowed` patterns (``None``: any host); ``receive_timeout_s``: the
    body must be in within this many seconds of the request head (``None``: no deadline).
    """

    def __init__(self, app, drain: Drain, max_body_bytes: int, allowed_hosts=None, receive_timeout_s=None):
        self.app, self.drain, self.max_body_bytes = app, drain, max_body_bytes
        self.allowed_hosts, self.receive_timeout_s = allowed_hosts, receive_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [None]

        async def send_logged(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, send_logged)
        finally:
            usage = (scope.get("state") or {}).get("usage") or {}
            ACCESS_LOG.info("%s %s %s %.1f ms prompt_tokens=%s completion_tokens=%s", scope["method"], scope["path"],
                            status[0], (time.perf_counter() - start) * 1e3, usage.get("prompt_tokens", "-"),
                            usage.get("completion_tokens", "-"))

    async def _guarded(self, scope, receive, send):
        headers = dict(scope.get("headers") or ())
        host = headers.get(b"host")
        if not host_allowed(None if host is None else host.decode("latin-1"), self.allowed_hosts):
            return await _send_json(send, 400, _error_body(
                f"Host {host.decode('latin-1')!r} is not served here (allowed: {', '.join(self.allowed_hosts)}; "
                "trtllm-diffkv serve --allowed-hosts adds names)"))
        if self.drain.draining and scope["path"].startswith("/v1/") and scope["method"] == "POST":
            return await _send_json(send, 503, _error_body(SHUTDOWN_MESSAGE, status=503))
        length = headers.get(b"content-length")
        too_big = _error_body(f"the request body is larger than {self.max_body_bytes} bytes", status=413)
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _send_json(send, 413, too_big)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        deadline = None if self.receive_timeout_s is None else time.monotonic() + self.receive_timeout_s
        while True:  # read the body here, counting: a chunked body has no Content-Length
            try:
                message = await asyncio.wait_for(receive(), None if deadline is None else
                                                 max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return await _send_json(send, 408, _error_body(
                    f"the request body did not arrive within {self.receive_timeout_s:g} s", status=408))
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await _send_json(send, 413, too_big)
            if not message.get("more_body"):
                break
        body, sent = b"".join(chunks), [False]
        if body and json.detect_encoding(body) not in ("utf-8", "utf-8-sig"):  # json.loads would take UTF-16/32
            return await _send_json(send, 400, _error_body(
                f"the request body is not UTF-8 JSON (it reads as {json.detect_encoding(body).upper()})"))

        async def replay():
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _send_json(send, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})


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


def _body_problem(error: dict, content_type: str | None) -> str:
    """What is wrong with a request body that is not a JSON object, from pydantic's error on the whole body:
    empty, not read as JSON (FastAPI parses JSON only under ``Content-Type: application/json``; ``curl -d``
    sends ``application/x-www-form-urlencoded``), or JSON of another type."""
    value = error.get("input")
    if error.get("type") == "missing" or value == b"":
        return "the request body is empty: send a JSON object"
    if isinstance(value, (bytes, bytearray)):
        return ("the request body was not read as JSON: send it with Content-Type: application/json (got "
                + (repr(content_type) if content_type else "none") + ")")
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
             type(None): "null"}
    return f"the request body must be a JSON object, got {kinds.get(type(value), type(value).__name__)}"


def _sampling_params(body, max_tokens: int):
    from ..runtime.sampling import SamplingParams

    for name in UNSUPPORTED:
        if getattr(body, name, None) is not None:
            raise BadRequest(f"'{name}' is not supported by this server (send it null or leave it out)", name)
    if isinstance(body, ChatCompletionRequest):
        for name in CHAT_UNSUPPORTED:
            if getattr(body, name, None) is not None:
                raise BadRequest(f"'{name}' is a /v1/completions field; chat completions have none", name)
    table = CHAT_NEUTRAL if isinstance(body, ChatCompletionRequest) else NEUTRAL
    for name, neutrals in table.items():
        if name in type(body).model_fields and not is_neutral(name, getattr(body, name), table):
            allowed = " or ".join(repr(v) if v is not None else "null" for v in neutrals)
            raise BadRequest(f"'{name}' = {getattr(body, name)!r} is not supported (only {allowed})", name)
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        raise BadRequest("'stream_options.continuous_usage_stats' is not supported (usage comes in one chunk at the "
                         "end with include_usage)", "stream_options.continuous_usage_stats")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs, prompt_logprobs, best_of = (body.top_logprobs or 0) if body.logprobs else None, None, None
    else:
        logprobs, best_of = body.logprobs, body.best_of
        prompt_logprobs = body.logprobs if body.echo else None
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k,
                            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                            seed=body.seed, stop=[s for s in stop if s] or None if stop else None,
                            ignore_eos=body.ignore_eos, n=1 if body.n is None else body.n, best_of=best_of,
                            logprobs=logprobs, prompt_logprobs=prompt_logprobs, stop_token_ids=body.stop_token_ids,
                            min_tokens=body.min_tokens,
                            include_stop_str_in_output=bool(body.include_stop_str_in_output))
    try:
        params.validate()
    except ValueError as exc:  # the message starts with the field's name
        message = str(exc)
        field = message.split(" ", 1)[0].split("=", 1)[0]
        field = {"logprobs": "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs",
                 "prompt_logprobs": "logprobs"}.get(field, field)
        if isinstance(body, ChatCompletionRequest) and field == "top_logprobs":
            message = message.replace("logprobs", "top_logprobs", 1)
        raise BadRequest(message, field if field in type(body).model_fields else None) from None
    return params


def _logprob_texts(tokenizer, ids, entries, as_bytes: bool = False) -> dict[int, str] | dict[int, bytes]:
    """Token id -> its text (``as_bytes``: its bytes, :func:`~trtllm_diffkv.runtime.detokenizer.token_bytes`) for
    every id in ``ids`` and in the ``entries`` (one decode call)."""
    wanted = set(ids)
    for entry in entries:
        wanted.update(entry or ())
    wanted = sorted(wanted)
    return dict(zip(wanted, (token_bytes if as_bytes else token_texts)(tokenizer, wanted)))


class _CompletionChoice:
    """One completion choice's text and legacy ``logprobs`` object, whole or streamed piece by piece.

    Args:
        tokenizer: decodes the token texts (and a prompt given as token ids, for ``echo``).
        prompt: the choice's prompt (text or token ids).
        echo: prepend the prompt (and its log-probabilities) to the first piece.
        logprobs: the request's ``logprobs`` (``None``: no ``logprobs`` object).
        prompt_only: ``echo`` with ``max_tokens`` 0: the generated token is dropped.
    """

    def __init__(self, tokenizer, prompt, echo: bool, logprobs: int | None, prompt_only: bool):
        self.tokenizer, self.prompt, self.echo, self.logprobs = tokenizer, prompt, echo, logprobs
        self.prompt_only, self.started, self.offset = prompt_only, False, 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # text_offset: characters completed so far
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())

    def piece(self, output, text: str, token_ids: list[int], entries) -> tuple[str, dict | None]:
        """``(text, logprobs object)`` of what is new: ``text`` / ``token_ids`` / ``entries`` (the output's
        ``logprobs`` entries of those ids) new since the previous piece; the prompt first when echoing."""
        ids, listed, out, in_text = [], [], "", []
        if self.echo and not self.started:
            prompt_ids = list(output.prompt_token_ids)
            out = self.prompt if isinstance(self.prompt, str) else (
                self.tokenizer.decode(prompt_ids) if self.tokenizer is not None else "")
            ids += prompt_ids
            listed += getattr(output.outputs[0], "prompt_logprobs", None) or [None] * len(prompt_ids)
            # a text prompt is the client's text: a special token the tokenizer added (BOS) is not in it
            in_text += [not isinstance(self.prompt, str) or t not in self._special for t in prompt_ids]
        self.started = True
        if not self.prompt_only:
            ids += list(token_ids)
            listed += list(entries or [None] * len(token_ids))
            in_text += [t not in self._special for t in token_ids]  # the text skips special tokens
            out += text
        if self.logprobs is None:
            return out, None
        texts = _logprob_texts(self.tokenizer, ids, listed)
        pieces = _logprob_texts(self.tokenizer, ids, (), as_bytes=True)
        body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry, shown in zip(ids, listed, in_text):
            body["tokens"].append(texts[token])
            body["token_logprobs"].append(None if entry is None else entry[token].logprob)
            body["top_logprobs"].append(None if entry is None else
                                        {texts[t]: lp.logprob for t, lp in sorted(entry.items(), key=_rank)})
            body["text_offset"].append(self.offset)  # where the token's first whole character starts
            if shown:  # characters count once complete: the 3 tokens of one emoji start at the same offset
                self.offset += len(self._utf8.decode(pieces[token]))
        return out, body


def _rank(item) -> int:
    return item[1].rank


def _chat_logprobs(tokenizer, token_ids: list[int], entries, top: int) -> dict:
    """OpenAI's chat ``logprobs`` object (``{"content": [...]}``) of ``token_ids`` with their entries. ``bytes``
    are each token's own bytes (:func:`~trtllm_diffkv.runtime.detokenizer.token_bytes`): a token holding part of
    a multi-byte character has that part, not the UTF-8 of U+FFFD, so the tokens' bytes joined rebuild the text
    (what OpenAI's field is for); ``token`` is the token's decode (U+FFFD for such a part)."""
    texts = _logprob_texts(tokenizer, token_ids, entries)
    pieces = _logprob_texts(tokenizer, token_ids, entries, as_bytes=True)
    content = []
    for token, entry in zip(token_ids, entries or ()):
        tops = sorted(entry.items(), key=_rank)[:top]
        content.append({"token": texts[token], "logprob": entry[token].logprob, "bytes": list(pieces[token]),
                        "top_logprobs": [{"token": texts[t], "logprob": lp.logprob, "bytes": list(pieces[t])}
                                         for t, lp in tops]})
    return {"content": content}


async def _finals(handles, request: Request) -> list:
    """The final outputs of ``handles`` (non-streaming; streaming: the first), with one disconnect watcher for all
    of them; on a disconnect every handle is aborted and the list holds ``None``. One that comes with an error (a
    refused prompt among several, a failed request) aborts the others at once: the response is that error, so
    their work would be thrown away (they end ``cancelled`` soon after, freeing their pages)."""
    tasks = [asyncio.ensure_future(handle.__anext__()) for handle in handles]
    pending, aborted = set(tasks), False
    try:
        while pending:
            done, pending = await asyncio.wait(pending, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            if not aborted and any(task.exception() is not None or task.result().error is not None for task in done):
                aborted = True
                for handle in handles:
                    handle.abort()
            elif not done and await request.is_disconnected():
                for handle in handles:
                    handle.abort()
                await asyncio.wait(pending)
                return [None] * len(handles)
        return [task.result() for task in tasks]
    finally:
        for task in pending:  # this coroutine was cancelled (the server stops): leave no task behind
            task.cancel()


def _usage(outputs, dropped_tokens: int = 0, sequences_per_prompt: int = 1) -> dict:
    """OpenAI's token counts of the finished ``outputs`` (one per sequence run) plus DiffKV's numbers;
    ``dropped_tokens``: generated tokens not returned (``echo`` with ``max_tokens`` 0), not counted;
    ``sequences_per_prompt``: the ``n`` / ``best_of`` sequences each prompt ran (``outputs`` prompt by prompt):
    ``prompt_tokens`` counts each prompt once, as OpenAI and vLLM do, ``completion_tokens`` every sequence.

    ``kv_memory_fraction``: KV bytes / FP16 KV bytes over all choices' tokens; ``high_fraction``,
    ``low_fraction``, ``pruned_fraction``: tier shares weighted by each choice's FP16 KV bytes (its
    stored tokens); ``kv_pool_bytes``: pool bytes the choices held at their end (pages and metadata).
    ``None`` where the executor reported nothing (tier shares under the ``fp16`` preset).
    """
    prompt = sum(len(o.prompt_token_ids) for o in outputs[::max(1, sequences_per_prompt)])
    completion = sum(len(o.outputs[0].token_ids) for o in outputs) - dropped_tokens
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    metrics = [o.metrics or {} for o in outputs]
    fp16 = [m.get("fp16_kv_cache_bytes") or 0 for m in metrics]
    kv = [m.get("kv_cache_bytes") for m in metrics]
    usage["kv_memory_fraction"] = (sum(kv) / sum(fp16) if sum(fp16) and None not in kv else None)
    for name in ("high_fraction", "low_fraction", "pruned_fraction"):
        values = [m.get(name) for m in metrics]
        usage[name] = (sum(v * w for v, w in zip(values, fp16)) / sum(fp16)
                       if sum(fp16) and None not in values else None)
    pool = [m.get("pool_used_bytes") for m in metrics]
    usage["kv_pool_bytes"] = sum(pool) if None not in pool else None
    return usage


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(llm, model_name: str, *, max_body_bytes: int = MAX_BODY_BYTES, allowed_hosts=None,
               receive_timeout_s: float | None = None) -> FastAPI:
    """The FastAPI app serving ``llm`` under the model id ``model_name``.

    Args:
        llm: an :class:`~trtllm_diffkv.llmapi.llm.LLM` (or an object with its ``generate_async``, ``tokenizer``,
            ``max_seq_len`` and ``stats``; ``health()`` when it has one).
        model_name: the id clients send as ``model``.
        max_body_bytes: request bodies above this get a 413 (read no further).
        allowed_hosts: ``Host`` header values answered (names, IP addresses, networks, ``"*"``; any port:
            :func:`~trtllm_diffkv.serve.http_limits.host_allowed`); others get a 400. ``None``: any host.
        receive_timeout_s: a request body not in within this many seconds of its head gets a 408 (``None``: no
            deadline; the head's deadline is the HTTP protocol's: :func:`~trtllm_diffkv.serve.http_limits.http_protocol`).

    The app does not own ``llm``: the caller shuts it down (``trtllm-diffkv serve`` does after uvicorn exits).
    ``app.state.drain`` is its :class:`Drain`.

    Raises:
        ValueError: ``max_body_bytes`` < 1, a bad ``allowed_hosts`` entry.
    """
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    app = FastAPI(title="trtllm-diffkv OpenAI-compatible server")
    drain = app.state.drain = Drain()
    serving_metrics = app.state.metrics = ServingMetrics(llm, model_name)
    if allowed_hosts is not None:
        from .http_limits import check_allowed_hosts

        allowed_hosts = check_allowed_hosts(allowed_hosts)
    app.add_middleware(_Guard, drain=drain, max_body_bytes=max_body_bytes, allowed_hosts=allowed_hosts,
                       receive_timeout_s=receive_timeout_s)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
        if first.get("type") == "json_invalid":  # loc is ("body", <character offset>)
            offset = first.get("loc", (None, None))[-1]
            reason = (first.get("ctx") or {}).get("error", "")
            return _error(f"the request body is not valid JSON ({reason} at character {offset})"
                          if reason else f"the request body is not valid JSON (at character {offset})")
        if tuple(first.get("loc", ())) == ("body",):  # the whole body: pydantic's words name neither it nor the fix
            return _error(_body_problem(first, request.headers.get("content-type")))
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
        problem = llm.health() if hasattr(llm, "health") else None
        if problem is not None:  # a broken tensor-parallel group, a stopped loop: restart the server
            return _error(f"the server cannot serve requests: {problem}", status=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created(),
                                            "owned_by": "trtllm-diffkv"}]}

    @app.get("/metrics")
    async def metrics():
        text = await asyncio.to_thread(serving_metrics.text)  # llm.stats() waits for a step: off the event loop
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        _check_text(body.model_dump(), "")
        prompts = _completion_prompts(body.prompt, llm)
        if body.stream and len(prompts) > 1:
            raise BadRequest("streaming takes one prompt (got a list of several)", "prompt")
        prompt_only = bool(body.echo) and body.max_tokens == 0  # the prompt's logprobs alone (lm-eval's shape)
        params = _sampling_params(body, 1 if prompt_only else 16 if body.max_tokens is None else body.max_tokens)
        if body.stream and params.num_sequences > params.n:
            raise BadRequest("'best_of' > 'n' cannot be streamed (the best are known at the end)", "best_of")
        children = params.child_params()  # at most MAX_SEQUENCES: _sampling_params validated n and best_of
        if len(prompts) * len(children) > MAX_REQUEST_SEQUENCES:
            raise BadRequest(f"{len(prompts)} prompts x {len(children)} sequences = {len(prompts) * len(children)} "
                             f"exceeds {MAX_REQUEST_SEQUENCES} sequences per request",
                             "n" if body.best_of is None else "best_of")
        for prompt in prompts:  # each is one request per child
            if isinstance(prompt, str):
                _check_prompt_chars(llm, [prompt], "prompt")
        # tokenizing happens in generate_async: in a worker thread, so the event loop keeps serving
        handles = await asyncio.to_thread(lambda: [llm.generate_async(p, c, streaming=body.stream)
                                                   for p in prompts for c in children])
        drain.add(handles)
        tokenizer = getattr(llm, "tokenizer", None)

        def view(prompt):
            return _CompletionChoice(tokenizer, prompt, bool(body.echo), body.logprobs, prompt_only)

        try:
            meta = {"id": new_id("cmpl"), "object": "text_completion", "created": created(), "model": model_name}
            if body.stream:
                views = [view(prompts[0]) for _ in handles]

                def render(i, output):
                    completion = output.outputs[0]
                    new = completion.text_diff or output.finished or (body.echo and not views[i].started) or (
                        body.logprobs is not None and completion.token_ids_diff)
                    if not new:
                        return None
                    text, logprobs = views[i].piece(output, completion.text_diff, completion.token_ids_diff,
                                                    getattr(completion, "logprobs_diff", None))
                    reason = ("length" if prompt_only else completion.finish_reason) if output.finished else None
                    return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}

                return await _stream(handles, request, body, meta, chat=False, drain=drain,
                                     observe=serving_metrics.observe, render=render,
                                     dropped_tokens=len(handles) if prompt_only else 0,
                                     sequences_per_prompt=len(children))
            finals = await _finals(handles, request)
            for handle in handles:
                serving_metrics.observe(handle)
            _raise_first_error(finals, handles, drain,
                               (lambda i: i // len(children)) if len(prompts) > 1 else None)
            choices, k = [], len(children)
            for p, prompt in enumerate(prompts):
                group = finals[p * k:(p + 1) * k]
                order = best_of_order([getattr(f.outputs[0], "cumulative_logprob", None) or 0.0 for f in group], params.n)
                for j, i in enumerate(order):
                    completion = group[i].outputs[0]
                    text, logprobs = view(prompt).piece(group[i], completion.text, completion.token_ids,
                                                        getattr(completion, "logprobs", None))
                    choices.append({"index": p * params.n + j, "text": text, "logprobs": logprobs,
                                    "finish_reason": "length" if prompt_only else completion.finish_reason})
            usage = request.state.usage = _usage(finals, len(finals) if prompt_only else 0, k)
            return {**meta, "choices": choices, "usage": usage}
        finally:
            if not body.stream:
                drain.discard(handles)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body)
        _check_text(body.model_dump(), "")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # refuses unsupported fields and bad values before the chat template runs
        params = _sampling_params(body, llm.max_seq_len if max_tokens is None else max_tokens)
        _check_prompt_chars(llm, [m.content if isinstance(m.content, str) else json.dumps(m.content)
                                  for m in body.messages], "messages")
        ids = await asyncio.to_thread(_chat_prompt_ids, llm, body)  # the template and tokenizer: off the loop
        params = _sampling_params(body, max(1, llm.max_seq_len - len(ids)) if max_tokens is None else max_tokens)
        handles = [llm.generate_async(ids, child, streaming=body.stream) for child in params.child_params()]
        drain.add(handles)
        tokenizer = getattr(llm, "tokenizer", None)

        def logprobs(completion, token_ids, entries):
            return None if params.logprobs is None else _chat_logprobs(tokenizer, token_ids, entries, params.logprobs)

        try:
            meta = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": created(), "model": model_name}
            if body.stream:
                def render(i, output):
                    completion = output.outputs[0]
                    if not (completion.text_diff or output.finished or (params.logprobs is not None
                                                                        and completion.token_ids_diff)):
                        return None
                    delta = {"content": completion.text_diff} if completion.text_diff or not output.finished else {}
                    return {"index": i, "delta": delta,
                            "logprobs": logprobs(completion, completion.token_ids_diff, getattr(completion, "logprobs_diff", None)),
                            "finish_reason": completion.finish_reason if output.finished else None}

                return await _stream(handles, request, body, {**meta, "object": "chat.completion.chunk"}, chat=True,
                                     drain=drain, observe=serving_metrics.observe, render=render,
                                     sequences_per_prompt=len(handles))
            finals = await _finals(handles, request)
            for handle in handles:
                serving_metrics.observe(handle)
            _raise_first_error(finals, handles, drain)
            choices = [{"index": i, "message": {"role": "assistant", "content": f.outputs[0].text},
                        "logprobs": logprobs(f.outputs[0], f.outputs[0].token_ids, getattr(f.outputs[0], "logprobs", None)),
                        "finish_reason": f.outputs[0].finish_reason} for i, f in enumerate(finals)]
            usage = request.state.usage = _usage(finals, sequences_per_prompt=len(finals))
            return {**meta, "choices": choices, "usage": usage}
        finally:
            if not body.stream:
                drain.discard(handles)

    return app


def _completion_prompts(prompt, llm) -> list:
    """The requests of a completion's ``prompt`` (OpenAI's four forms: a string, a list of strings, a list of token
    ids, a list of lists of token ids): one text or one id list per request, ids checked against the model's
    vocabulary and positions (:func:`~trtllm_diffkv.generation.prompts.check_prompt_ids`) before anything is
    submitted.

    Raises:
        BadRequest: an empty list, an empty id list, or an id outside ``[0, vocab_size)``; ``param`` ``prompt``.
    """
    from ..generation.prompts import check_prompt_ids

    if isinstance(prompt, str):
        return [prompt]
    prompts = list(prompt)
    if not prompts:
        raise BadRequest("'prompt' is an empty list", "prompt")
    if isinstance(prompts[0], int):  # one prompt of token ids (pydantic has checked that all are integers)
        prompts = [prompts]
    config = getattr(llm, "model_config", None)
    for index, ids in enumerate(prompts):
        if isinstance(ids, list) and config is not None:
            try:
                check_prompt_ids(ids, 1, config)
            except ValueError as exc:
                where = "'prompt'" if len(prompts) == 1 else f"'prompt'[{index}]"
                raise BadRequest(f"{where}: {exc}", "prompt") from None
    return prompts


def _check_prompt_chars(llm, texts, param: str) -> None:
    """Refuse ``texts`` (the parts of one prompt) whose characters cannot fit the context in any tokenization
    (:meth:`~trtllm_diffkv.llmapi.llm.LLM.max_prompt_chars`), before anything is tokenized."""
    limit = getattr(llm, "max_prompt_chars", None)
    limit = limit() if callable(limit) else None
    chars = sum(len(t) for t in texts if isinstance(t, str))
    if limit is not None and chars > limit:
        raise BadRequest(f"'{param}' holds {chars} characters: more than max_seq_len {llm.max_seq_len} tokens "
                         f"can hold ({limit} characters at most with this tokenizer)", param)


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


def _raise_first_error(finals, handles, drain: Drain | None = None, prompt_of=None) -> None:
    """Raise the :class:`BadRequest` of the first failed output of ``finals`` (after aborting every handle): 499
    for a client gone, 503 for a shutdown or an LLM that cannot serve, 500 for a server fault, else 400.
    ``prompt_of``: output index -> prompt index, for a completion of several prompts (a 400 then names
    ``'prompt'[i]``)."""
    if any(f is None for f in finals):  # the client is gone: nobody reads the answer
        for handle in handles:
            handle.abort()
        raise BadRequest("client disconnected", status=499)
    if drain is not None and drain.aborted and any(f.outputs[0].finish_reason == "cancelled" for f in finals):
        for handle in handles:
            handle.abort()
        raise BadRequest(f"{SHUTDOWN_MESSAGE}: the request was cancelled before it finished", status=503)
    for index, final in enumerate(finals):
        if final.error is not None:
            for handle in handles:
                handle.abort()
            server_side = is_server_fault(final)  # a failed executor step, a shutdown: not the request's fault
            if server_side:
                LOG.error("request failed in the LLM: %s", final.error)
            status = 503 if is_unavailable(final) else 500 if server_side else 400
            if status == 400 and prompt_of is not None:
                raise BadRequest(f"'prompt'[{prompt_of(index)}]: {final.error}", "prompt")
            raise BadRequest(final.error, None, status)


async def _stream(handles, request: Request, body, meta: dict, chat: bool, drain: Drain, observe, render,
                  dropped_tokens: int = 0, sequences_per_prompt: int = 1):
    """Wait for every handle's first output (an error then is a 400 response), then stream the rest as SSE,
    the handles' chunks in the order they come (``render(i, output)``: handle ``i``'s choice dict, or
    ``None`` when there is nothing to send). A client that disconnects aborts every request (before the
    first tokens: :func:`_finals`; after: Starlette cancels the stream, whose ``finally`` aborts). A stream
    cut by the shutdown ends with an error event and ``[DONE]``."""
    try:
        firsts = await _finals(handles, request)
        _raise_first_error(firsts, handles, drain)
    except BaseException:
        drain.discard(handles)
        raise
    include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)

    async def events():
        outputs, pending, ready = list(firsts), {}, list(range(len(handles)))
        try:
            if chat:
                for i in range(len(handles)):
                    yield _sse({**meta, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]})
            cut = False
            while (ready or pending) and not cut:
                for i in ready:
                    output = outputs[i]
                    if output.error is not None:
                        yield _sse({"error": {"message": output.error, "type": "internal_error", "param": None,
                                              "code": None}})
                        cut = True
                        break
                    if drain.aborted and output.outputs[0].finish_reason == "cancelled":
                        if output.outputs[0].text_diff:
                            choice = render(i, output)
                            if choice is not None:
                                yield _sse({**meta, "choices": [{**choice, "finish_reason": None}]})
                        yield _sse(_error_body(f"{SHUTDOWN_MESSAGE}: the stream was cancelled before it finished",
                                               status=503))
                        cut = True
                        break
                    choice = render(i, output)
                    if choice is not None:
                        yield _sse({**meta, "choices": [choice]})
                    if not output.finished:
                        pending[asyncio.ensure_future(handles[i].__anext__())] = i
                ready = []
                if pending and not cut:
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        i = pending.pop(task)
                        outputs[i] = task.result()
                        ready.append(i)
            if not cut:
                request.state.usage = usage = _usage(outputs, dropped_tokens, sequences_per_prompt)
                if include_usage:
                    yield _sse({**meta, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            for task in pending:
                task.cancel()
            drain.discard(handles)
            for handle in handles:
                observe(handle)
                if not handle.finished:  # the client went away mid-stream: free the request's pages
                    handle.abort()

    return StreamingResponse(events(), media_type="text/event-stream")
