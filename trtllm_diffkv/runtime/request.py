"""One request's state in the in-flight batching executor, and the per-step update it streams.

:class:`Request` is the executor's (and the resource manager's) view of a request, like
TensorRT-LLM's ``LlmRequest``: ids, sampling parameters, the tokens generated so far, the
request slot it holds in the paged cache, and its state. :class:`RequestUpdate` is what
:meth:`~.executor.Executor.step` returns for each request that changed in a step (the new
token ids; at the end the finish reason, the error, the result fields).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


def check_new_request_id(request_id, live) -> None:
    """Refuse a caller's request id that is not hashable or already among ``live`` (a mapping or set of ids).

    Raises:
        ValueError: naming the id.
    """
    try:
        in_use = request_id in live
    except TypeError:
        raise ValueError(f"request id {request_id!r} must be hashable (an int or a str)") from None
    if in_use:
        raise ValueError(f"request id {request_id!r} is already in use")


class RequestState(enum.Enum):
    """Where a request is: queued (``WAITING``; also after a preemption), in the batch
    (``RUNNING``: its tokens are in the cache), or done (``FINISHED``: stop, length, error, abort)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A generation request (TensorRT-LLM's ``LlmRequest`` role).

    Attributes:
        request_id: the caller's id (any hashable), unique among live requests.
        prompt_token_ids: the prompt's token ids.
        sampling_params: a :class:`~.sampling.SamplingParams`.
        arrival_time: ``time.perf_counter()`` at :meth:`~.executor.Executor.add_request`.
        state: a :class:`RequestState`.
        output_token_ids: generated token ids so far (the stop token included).
        slot: the paged cache's request slot while ``RUNNING``, else ``None``.
        num_cached_tokens: tokens stored in the cache (prompt and generated); 0 unless ``RUNNING``. A copy
            of the owner, the paged cache's ``seq_len[slot]``, taken by ``DiffKVResourceManager.update_resources``
            after each step (and reset when the slot is given back); the scheduler reads it, never advances it.
            While its prompt is prefilled in chunks: the prompt tokens of the chunks that ran (kept at full
            precision in the cache's staging until the final chunk).
        prefill_token_ids: what the next prefill brings: the prompt, or after a preemption by
            recomputation the prompt + every generated token.
        prefill_chunk_tokens: tokens of ``prefill_token_ids`` the step being scheduled carries (set by the
            scheduler; 0: all that are left, one whole prefill).
        prefill_start_time: ``time.perf_counter()`` at the start of the step of its first prefill chunk.
        num_preemptions: times its pages were taken back and it went back to the queue.
        finish_reason: ``"stop"``, ``"length"``, ``"error"``, ``"abort"`` once finished.
        stop_token_id: the id that stopped it (``finish_reason == "stop"`` by an id), else ``None``.
        error: the message of a failed request.
        result: at the end, the :class:`~trtllm_diffkv.generation.static_batch.PagedGenerationResult`
            (the fields of :class:`~trtllm_diffkv.generation.reference.GenerationResult` + pool pages and bytes).
        first_token_time, finish_time: ``time.perf_counter()`` of the first generated token and of the end.
        prefill_s: wall seconds from the start of the step that brought its first prefill chunk to its
            first token (one step unless the prompt was chunked; shared with the requests of that step).
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: once its prefill (every chunk) ran, one entry
            per prompt token (:func:`~.sampling.prompt_logprobs`), else ``None`` (partial while chunked).
    """

    request_id: Any
    prompt_token_ids: list[int]
    sampling_params: Any
    arrival_time: float = 0.0
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    num_cached_tokens: int = 0
    prefill_token_ids: list[int] = field(default_factory=list)
    prefill_chunk_tokens: int = 0
    prefill_start_time: float | None = None
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_token_id: int | None = None
    error: str | None = None
    result: Any = None
    first_token_time: float | None = None
    finish_time: float | None = None
    prefill_s: float | None = None
    checked: bool = False
    history: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def is_prefill(self) -> bool:
        """Whether its next step is a prefill (chunk): no tokens in the cache yet, or a prompt half-prefilled."""
        return self.num_cached_tokens < len(self.prefill_token_ids) or self.num_cached_tokens == 0

    @property
    def num_new_tokens(self) -> int:
        """Tokens it brings to its next step: its prefill chunk (default the whole rest), or one decode token."""
        if not self.is_prefill:
            return 1
        return self.prefill_chunk_tokens or len(self.prefill_token_ids) - self.num_cached_tokens

    @property
    def seq_len(self) -> int:
        """Tokens stored in the cache after its next step."""
        return self.num_cached_tokens + self.num_new_tokens

    @property
    def prefill_in_progress(self) -> bool:
        """Whether some but not all of its prefill chunks ran (it holds a slot, pages and staging, and no token yet)."""
        return 0 < self.num_cached_tokens < len(self.prefill_token_ids)

    @property
    def completes_prefill(self) -> bool:
        """Whether its next step ends its prefill (an unchunked prefill, the final chunk) or decodes: it samples a token."""
        return not self.is_prefill or self.seq_len >= len(self.prefill_token_ids)


@dataclass
class RequestUpdate:
    """What one :meth:`~.executor.Executor.step` changed for one request (token streaming).

    Attributes:
        request_id: the request's id.
        new_token_ids: token ids generated in this step (empty for a request that failed or
            was aborted before producing one). Tokens of a request already sent are never sent
            again, also after a preemption.
        finished: whether the request ended in this step.
        finish_reason: ``"stop"``, ``"length"``, ``"error"``, ``"abort"``, or ``None`` while running.
        error: the message when ``finish_reason == "error"``.
        stop_token_id: the stop id that ended it, else ``None``.
        result: at the end, the request's ``PagedGenerationResult`` (text, token ids, counts,
            memory and tier fractions, pool pages and bytes, tokens/s), else ``None``.
        stop_reason: after a stop, the stop id (int) or stop string (str) that matched
            (:attr:`StopChecker.stop_reason`), else ``None``.
        logprobs: with ``SamplingParams.logprobs``: one ``{token id: Logprob}`` per new token (the
            sampled token first, then the top alternatives), else ``None``.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: in the update of the first generated
            token, one entry per prompt token (``None`` for the first), else ``None``.
    """

    request_id: Any
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    stop_token_id: int | None = None
    result: Any = None
    stop_reason: int | str | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None
