"""Outputs and request handles of the :class:`~trtllm_diffkv.llmapi.llm.LLM` API.

Shaped as TensorRT-LLM's LLM API (``tensorrt_llm/executor/result.py``): a
:class:`RequestOutput` holds ``request_id``, ``prompt``, ``prompt_token_ids``,
``outputs`` (one :class:`CompletionOutput` per sequence: cumulative ``text`` and ``token_ids``
plus ``text_diff`` / ``token_ids_diff`` since the previous output of the same
request; with ``SamplingParams.logprobs`` also ``logprobs``, ``logprobs_diff`` and
``cumulative_logprob``, with ``prompt_logprobs`` the prompt's), ``finished``; we add ``error``
(a failed request carries its message instead of raising) and ``metrics`` (the executor's
statistics at finish).

An :class:`AsyncRequest` is what ``LLM.generate_async`` returns: ``await req`` /
``await req.aresult()`` / ``req.result()`` give the final output; ``async for``
or ``for`` over it give cumulative outputs (each update with ``streaming=True``,
only the final one otherwise); ``req.abort()`` cancels it. ``SamplingParams(n > 1 or best_of > 1)``
gives a :class:`RequestGroup` instead: the same calls over independent child requests. The LLM's background
thread feeds it :class:`RequestEvent` objects through a :class:`_Channel` (thread-safe,
awaitable); the consumer turns them into text with :class:`IncrementalDetokenizer`,
so detokenization never slows the step loop.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

from ..runtime.detokenizer import IncrementalDetokenizer
from ..runtime.sampling import best_of_order



@dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence of a request (``RequestOutput.outputs[0]``).

    Attributes:
        index: the sequence's index in the request (0 .. n - 1; 0 for ``n == 1``).
        text: generated text so far, special tokens and the stop token removed, cut before a
            matched stop string; while streaming, the last ``len(longest stop string) - 1``
            characters and an incomplete multi-byte character are held back until they are
            settled, so the ``text_diff`` of successive outputs concatenate to the final ``text``.
        token_ids: generated token ids so far (int; a stop token that ended the request included).
        text_diff, token_ids_diff: what is new since the previous output handed to the caller.
        finish_reason: ``None`` while running; ``"stop"`` (stop token or stop string),
            ``"length"`` (``max_tokens``), ``"cancelled"`` (aborted, or the LLM shut down) or
            ``"error"`` (see ``RequestOutput.error``).
        stop_reason: the stop token id (int) or stop string (str) that ended it, else ``None``.
        logprobs: with ``SamplingParams.logprobs``: one ``{token id: Logprob}`` per token of
            ``token_ids`` (the sampled token first, then the top alternatives; TensorRT-LLM's
            ``TokenLogprobs``), else ``None``. Values: ``log_softmax`` of the penalized,
            temperature-scaled logits before top-k/top-p (:mod:`trtllm_diffkv.runtime.sampling`).
        logprobs_diff: the entries of the tokens in ``token_ids_diff``.
        cumulative_logprob: the sum of the sampled tokens' log-probabilities (``None`` without ``logprobs``).
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: one entry per prompt token, ``None``
            for the first (raw logits), set once the prefill ran; else ``None``.
    """

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    text_diff: str = ""
    token_ids_diff: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list | None = None
    logprobs_diff: list | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list | None = None

    @property
    def length(self) -> int:
        """Generated tokens so far."""
        return len(self.token_ids)


@dataclass(frozen=True)
class RequestOutput:
    """One request's output (cumulative), as TensorRT-LLM's ``RequestOutput``.

    Attributes:
        request_id: int, unique within its :class:`~trtllm_diffkv.llmapi.llm.LLM`.
        prompt: the prompt text, or ``None`` when the prompt was given as token ids.
        prompt_token_ids: the ids fed to the model (after the chat template, if any).
        outputs: one :class:`CompletionOutput` (``n`` of them for a :class:`RequestGroup`).
        finished: whether this is the request's last output.
        error: why the request failed (``finish_reason == "error"``), else ``None``.
        metrics: the executor's per-request statistics at finish (KV memory fraction, tier
            fractions, pool pages, tokens/s, ...; see ``RequestUpdate``), else ``None``.
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    metrics: dict | None = None


@dataclass(frozen=True)
class RequestEvent:
    """What the LLM's loop thread tells a request: new tokens, and the end when ``finished``.

    At the end, ``text`` is the executor's final text (cut before a matched stop string by its
    :class:`~trtllm_diffkv.runtime.stop_checker.StopChecker`, the one place stop strings are searched) and
    ``stop_reason`` the stop id or string that matched; both ``None`` for a request that never ran.
    """

    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    stop_token_id: int | None = None
    metrics: dict | None = None
    text: str | None = None
    stop_reason: int | str | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    time: float = field(default_factory=time.monotonic)
    """When the loop thread produced it (``time.monotonic()`` seconds): the request's latency marks."""


class _Channel:
    """Events from the loop thread to one request's consumer; blocking and awaitable."""

    def __init__(self, key=None, listener=None):
        self.key = key
        self._cond = threading.Condition()
        self._events: deque[RequestEvent] = deque()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.listener = listener  # optional queue.Queue told ``key`` (the request id) after every event (ModelRunner)

    def put(self, event: RequestEvent) -> None:
        with self._cond:
            self._events.append(event)
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # the waiter's event loop is closed: nobody to wake
                pass
        if self.listener is not None:
            self.listener.put(self.key)

    def take(self, timeout: float | None = None) -> list[RequestEvent]:
        """All pending events, waiting up to ``timeout`` s for at least one (``[]`` on timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: self._events, timeout)
            events = list(self._events)
            self._events.clear()
            return events

    async def take_async(self) -> list[RequestEvent]:
        """All pending events, awaiting at least one."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._events:
                    events = list(self._events)
                    self._events.clear()
                    return events
                future = loop.create_future()
                self._waiters.append((loop, future))
            await future


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class AsyncRequest:
    """Handle of one submitted request (``LLM.generate_async``); TensorRT-LLM's ``GenerationResult`` shape.

    ``await req`` or ``await req.aresult()``: the final :class:`RequestOutput`; ``req.result(timeout)``:
    the same, blocking; ``async for out in req`` / ``for out in req``: cumulative outputs (every update
    when created with ``streaming=True``, else only the final one); ``req.abort()``: cancel (pages are
    freed by the loop thread at its next step boundary). One consumer at a time.

    Attributes:
        request_id, prompt, prompt_token_ids, sampling_params, streaming: as submitted.
        arrival_time, first_token_time, finished_time: ``time.monotonic()`` seconds at submission, when
            the loop thread produced the first token and the end (``None`` until then; set as the consumer
            reads the events, stamped when they were produced): TTFT, TPOT and end-to-end latency.
    """

    def __init__(self, llm, request_id: int, prompt, prompt_token_ids: list[int], sampling_params,
                 streaming: bool, stop_token_ids: set[int], listener=None):
        self._llm, self.request_id, self.prompt = llm, request_id, prompt
        self.prompt_token_ids, self.sampling_params, self.streaming = prompt_token_ids, sampling_params, streaming
        self._channel = _Channel(request_id, listener)
        self._lock = threading.Lock()
        tokenizer = getattr(llm, "tokenizer", None)
        self._detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stop_token_ids = set(stop_token_ids)
        stop = getattr(sampling_params, "stop", None)  # may be invalid here: the request then fails with its error
        stops = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, (list, tuple)) else []
        # streamed text holds back what could be the start of a stop string (the executor decides the match)
        self._hold = max((len(s) for s in stops if isinstance(s, str)), default=1) - 1
        self._ids: list[int] = []
        self._logprobs: list = []  # one entry per id in _ids when sampling_params.logprobs is set
        self._prompt_logprobs = None
        self._wants_logprobs = getattr(sampling_params, "logprobs", None) is not None
        self._shown_logprobs = 0
        self._done = False
        self._final: RequestOutput | None = None
        self._shown_text, self._shown_ids = 0, 0
        self._finish_reason = self._stop_reason = self._error = self._metrics = None
        self.arrival_time = time.monotonic()
        self.first_token_time = self.finished_time = None

    # ------------------------------------------------------------------ consumer API
    @property
    def finished(self) -> bool:
        """Whether the final output has been received (by any consumer call)."""
        return self._done

    def abort(self) -> None:
        """Cancel the request; it finishes with ``finish_reason == "cancelled"`` (no-op when finished)."""
        self._llm.abort(self.request_id)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request finishes; returns the final output.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout  # a total bound, not per event
        while not self._done:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            events = self._channel.take(left)
            if not events:
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            self._apply(events)
        return self._snapshot(final=True)

    async def aresult(self) -> RequestOutput:
        """Await the final output."""
        while not self._done:
            self._apply(await self._channel.take_async())
        return self._snapshot(final=True)

    def __await__(self):
        return self.aresult().__await__()

    def __iter__(self):
        return self

    def __next__(self) -> RequestOutput:
        if self._final is not None:
            raise StopIteration
        if not self.streaming or self._done:
            return self.result()
        self._apply(self._channel.take())
        return self._snapshot(final=self._done)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._final is not None:
            raise StopAsyncIteration
        if not self.streaming or self._done:
            return await self.aresult()
        self._apply(await self._channel.take_async())
        return self._snapshot(final=self._done)

    # ------------------------------------------------------------------ internals
    def _poll(self) -> RequestOutput:
        """Apply what has arrived without blocking; the cumulative output (the final one once finished)."""
        self._apply(self._channel.take(0))
        return self._snapshot(final=self._done)

    def _apply(self, events: list[RequestEvent]) -> None:
        with self._lock:
            for event in events:
                if self._done:
                    break
                ids = list(event.new_token_ids)
                self._ids.extend(ids)
                if event.logprobs:
                    self._logprobs.extend(event.logprobs)
                if event.prompt_logprobs is not None:
                    self._prompt_logprobs = event.prompt_logprobs
                if ids and self.first_token_time is None:
                    self.first_token_time = event.time
                if event.finished:
                    self.finished_time = event.time
                if event.finished:
                    self._finish(event, ids)
                elif self._detok is not None:
                    self._detok.push(ids)

    def _finish(self, event: RequestEvent, ids: list[int]) -> None:
        reason = {"abort": "cancelled", "aborted": "cancelled"}.get(event.finish_reason, event.finish_reason)
        if event.error is not None and reason != "cancelled":
            reason = "error"
        text_ids = ids
        stop_id = event.stop_token_id
        if stop_id is None and reason == "stop" and self._ids and self._ids[-1] in self._stop_token_ids:
            stop_id = self._ids[-1]
        if reason == "stop" and stop_id is not None and self._ids and self._ids[-1] == stop_id:
            self._stop_reason = stop_id
            text_ids = ids[:-1]  # the stop token is not text (as the reference generator)
        self._finish_reason, self._error, self._metrics = reason, event.error, event.metrics
        if isinstance(event.stop_reason, str):
            self._stop_reason = event.stop_reason
        if self._detok is not None:
            self._detok.push(text_ids)
            self._detok.finish()
            if event.text is not None and reason == "stop":
                # the stop checker's cut; never take back text already shown
                self._detok.text = event.text if len(event.text) >= self._shown_text else \
                    self._detok.text[:self._shown_text]
        self._done = True

    def _visible_text(self, final: bool) -> str:
        if self._detok is None:
            return ""
        text = self._detok.text
        if not final and self._hold:
            text = text[:max(self._shown_text, len(text) - self._hold)]  # could be the start of a stop string
        return text

    def _snapshot(self, final: bool) -> RequestOutput:
        with self._lock:
            if final and self._final is not None:
                return self._final
            text = self._visible_text(final)
            ids = list(self._ids)
            logprobs = cumulative = diff = None
            if self._wants_logprobs:
                logprobs, diff = list(self._logprobs), self._logprobs[self._shown_logprobs:]
                cumulative = sum(entry[token].logprob for entry, token in zip(logprobs, ids))
            out = CompletionOutput(0, text, ids, text[self._shown_text:], ids[self._shown_ids:],
                                   self._finish_reason if final else None, self._stop_reason if final else None,
                                   logprobs, diff, cumulative, self._prompt_logprobs)
            self._shown_text, self._shown_ids, self._shown_logprobs = len(text), len(ids), len(self._logprobs)
            output = RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), [out], final,
                                   self._error if final else None, self._metrics if final else None)
            if final:
                self._final = output
            return output


class RequestGroup:
    """Handle of an ``n > 1`` / ``best_of`` request (``LLM.generate_async``): ``best_of`` (else ``n``)
    independent child requests (:meth:`~trtllm_diffkv.runtime.sampling.SamplingParams.child_params`:
    seeds derived from the request's), each its own :class:`AsyncRequest` in :attr:`children`.

    The same calls as :class:`AsyncRequest`: ``result(timeout)``, ``await``, ``aresult()``, iteration (the
    final output only; with ``streaming``, one cumulative output of all ``n`` sequences each time any child
    has new tokens, ``index`` 0 .. n - 1, each with its own ``*_diff`` since the previous one, then the final
    output; nothing once ``result()`` gave the final output, as :class:`AsyncRequest`), ``abort()`` (every
    child: all their pages go back; so does ``llm.abort(group.request_id)``). Streaming needs ``best_of`` unset or ``n``.
    The final :class:`RequestOutput` holds ``n`` :class:`CompletionOutput` (``index`` 0 .. n - 1): with
    ``best_of > n`` the ``n`` children with the highest ``cumulative_logprob``, best first
    (:func:`~trtllm_diffkv.runtime.sampling.best_of_order`), else the children in order. A child that
    failed fails the group: ``error`` is the first child's error. ``metrics`` are the first chosen child's.

    Attributes:
        children: the child handles (``best_of`` of them), in seed order.
        request_id: the first child's id; prompt, prompt_token_ids, sampling_params (the request's).
        streaming: whether iteration streams (``listener``: the queue.Queue the streaming children tell
            their request id after every event).
    """

    def __init__(self, children: list[AsyncRequest], sampling_params, listener=None):
        self.children, self.sampling_params = list(children), sampling_params
        self.streaming, self._listener = listener is not None, listener
        first = self.children[0]
        self.request_id, self.prompt, self.prompt_token_ids = first.request_id, first.prompt, first.prompt_token_ids
        self._final: RequestOutput | None = None
        self._given = False
        self._ended: set[int] = set()  # streaming: the children whose final output an update already held

    @property
    def finished(self) -> bool:
        """Whether every child's final output has been received."""
        return all(child.finished for child in self.children)

    def abort(self) -> None:
        """Cancel every child (no-op for the finished ones)."""
        for child in self.children:
            child.abort()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until every child finished (``timeout``: seconds in all); the merged final output.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        finals = [child.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
                  for child in self.children]
        return self._merge(finals)

    async def aresult(self) -> RequestOutput:
        """Await every child; the merged final output."""
        return self._merge(list(await asyncio.gather(*(child.aresult() for child in self.children))))

    def __await__(self):
        return self.aresult().__await__()

    def __iter__(self):
        return self

    def __next__(self) -> RequestOutput:
        if self._given or self._final is not None:  # the final output was handed out (iteration or result())
            raise StopIteration
        if self.streaming:
            return self._next_streamed()
        self._given = True
        return self.result()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._given or self._final is not None:
            raise StopAsyncIteration
        if self.streaming:  # the children's events come through one thread-safe queue: wait for it off the loop
            return await asyncio.get_running_loop().run_in_executor(None, self._next_streamed)
        self._given = True
        return await self.aresult()

    def _next_streamed(self) -> RequestOutput:
        """The next streamed output: wait until a child has an event, then every child's cumulative output."""
        if not all(child.finished for child in self.children):
            self._listener.get()
            while not self._listener.empty():  # every event already waiting is in the snapshots below
                self._listener.get_nowait()
        snapshots = [child._poll() for child in self.children]
        outputs = []
        for i, snap in enumerate(snapshots):
            out = snap.outputs[0]  # a child's final output is the same object from its end on: its diffs are old
            if i in self._ended:
                out = replace(out, text_diff="", token_ids_diff=[],
                              logprobs_diff=None if out.logprobs_diff is None else [])
            outputs.append(replace(out, index=i))
        self._ended.update(i for i, snap in enumerate(snapshots) if snap.finished)
        if all(child.finished for child in self.children):
            self._given = True
            return self._merge([replace(snap, outputs=[out]) for snap, out in zip(snapshots, outputs)])
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), outputs, False)

    def _merge(self, finals: list[RequestOutput]) -> RequestOutput:
        if self._final is not None:
            return self._final
        n = self.sampling_params.n
        failed = next((f for f in finals if f.error is not None), None)
        if failed is None and len(finals) > n:
            order = best_of_order([f.outputs[0].cumulative_logprob or 0.0 for f in finals], n)
        else:
            order = list(range(min(n, len(finals))))
        outputs = [replace(finals[i].outputs[0], index=j) for j, i in enumerate(order)]
        chosen = failed if failed is not None else finals[order[0]]
        self._final = RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), outputs, True,
                                    chosen.error, chosen.metrics)
        return self._final
