"""In-flight batching executor over the paged DiffKV cache (paper sections 5 and 7; TensorRT-LLM's PyExecutor loop).

:meth:`Executor.step` is one iteration of the loop, in TensorRT-LLM's PyExecutor order:

1. check the requests that arrived (empty prompt, ids outside the vocabulary, prompt +
   ``max_tokens`` beyond the model's positions, bad sampling values, a prompt the whole pool
   cannot hold): a bad one fails alone, allocating nothing;
2. schedule (:class:`~.scheduler.Scheduler`): running requests decode one token each, the most
   recently admitted one preempted by recomputation when the decode worst case exceeds the free
   pages; then prompts fill what is left of the step's ``max_num_tokens``: the half-prefilled ones
   first, then waiting requests admitted in FIFO order while the page manager allows, within
   ``max_batch_size`` (the free count: a lower bound from the last step's status, re-read only
   when it refuses). With ``enable_chunked_prefill`` (default) a prompt longer than a step can carry
   beside the decodes gets a chunk and continues in later steps, its K/V kept at full precision until
   its final chunk compacts it (:mod:`trtllm_diffkv.paged.staging`);
3. ``prepare_resources``: ONE :meth:`PagedDiffKVCache.plan` (prefill requests first, then decode);
4. ONE model call over the packed tokens (decode-only steps: one CUDA-graph replay with
   ``use_cuda_graphs``; the logits of the last token of each request, and of every prompt position
   of a prompt chunk asking ``prompt_logprobs``), then :meth:`PagedDiffKVCache.end_step` (a replay
   ends its step itself); one :class:`~.sampling.Sampler` call (with
   the log-probabilities of the rows asking ``logprobs``: then a second device-to-host copy);
5. ONE device-to-host copy (into a pinned buffer, ``non_blocking`` + an event on CUDA) of the
   sampled tokens, the per-slot non-finite K/V flags and the ring counters;
6. ``update_resources``: requests with non-finite K/V fail alone; stop ids, stop strings and
   ``max_tokens`` (:class:`~.stop_checker.StopChecker`); finished and failed requests free every
   page in this same step (``free_resources``).

Overlap (``disable_overlap_scheduler``; TensorRT-LLM's overlap scheduler): a decode-only step whose requests'
draws do not read their host history (no ``logprobs``, no repetition/presence/frequency penalty) is left in
flight: its sampled tokens stay on the device and the host copy is read by the NEXT :meth:`Executor.step`,
which first plans and launches the next decode step of the same requests (its input ids are the in-flight
step's sampled tokens, on the device), then reads and settles the in-flight step (step 6) while the GPU runs
the new one. So the host's planning, bookkeeping and stop checks run beside the kernels instead of between
them. A step's updates therefore come back one :meth:`~Executor.step` call later. The next step is launched
before the in-flight one is read only when the scheduler would run exactly those requests again: no request
waiting that might be admitted, no half-prefilled prompt, the decode worst case within the free-page bound
less the in-flight step's worst case; a request that reaches ``max_tokens`` in the in-flight step is left out
of it. Otherwise the in-flight step is settled first and the step runs as above. A request that stops on a
stop id or string in the in-flight step also ran the launched step: that step's token is dropped (never
streamed) and its pages go back at once, but the step stored one token more, which its result's cache figures
count (``kv_cache_bytes``, ``fp16_kv_cache_bytes``, ``kv_memory_fraction``, the tier fractions, ``pool_pages``,
``pool_used_bytes``). A launch that fails fails its requests after the in-flight step is read.

A step with both prompts and decodes runs 3-6 twice with ``split_mixed_steps`` (default with CUDA graphs):
the decodes first, as a decode-only step (a graph replay), then the prompts eagerly. An eager step's cost is
mostly host work per layer whatever it carries (docs/PERFORMANCE.md, "Chunked prefill steps"); the split
keeps that work to the prompts' part, for the price of reading the weights twice.

Threads: one thread steps; any thread may :meth:`Executor.add_request` and
:meth:`Executor.abort` (neither waits for a step: they go through a small inbox). An abort frees
the request's pages at once between steps, or before the step running now returns. Out of pages is handled per request (preemption), never by failing the batch;
a request that cannot fit even alone fails with the reason.
"""
from __future__ import annotations

import itertools
import threading
import time
import warnings
from dataclasses import dataclass

import torch

from ..engine_config import DEFAULT_MAX_NUM_TOKENS, EngineConfig  # noqa: F401 - DEFAULT_MAX_NUM_TOKENS re-exported
from ..generation.prompts import check_prompt_ids, position_limit
from ..generation.results import PagedGenerationResult, result_fields
from ..kernels.cuda_decode import choose_backend, configured_backend
from ..model.rotation import model_for_kv_config
from ..paged.cache import OutOfPagesError
from ..paged.staging import staging_fits
from ..validators import optional_boolean
from .cuda_graphs import DecodeGraphRunner
from .request import Request, RequestState, RequestUpdate, check_new_request_id
from .resource_manager import DiffKVResourceManager, ScheduledBatch
from .sampling import Sampler, SamplingParams, prompt_logprobs
from .scheduler import Scheduler
from .stop_checker import StopChecker


def prefill_chunk_positions(batch: ScheduledBatch) -> list[tuple[int, int]]:
    """The prompt positions ``[start, end)`` each context request of ``batch`` brings in this step (batch order).

    The one home of where a step's prefill tokens come from: the executor packs these tokens, and the
    packed rows of request ``i`` are ``sum(end - start of the requests before it)`` onwards. A caller that
    needs a chunk's per-position logits (prompt logprobs, ``echo``) passes those rows as ``logits_indices``;
    logits of row ``j`` of a chunk predict prompt position ``start + j + 1``.
    """
    return [(r.num_cached_tokens, r.num_cached_tokens + r.num_new_tokens) for r in batch.context_requests]


def sampling_rows(batch: ScheduledBatch) -> list[int]:
    """Packed rows whose logits the step samples: the last row of each context request that completes its
    prefill (unchunked or final chunk), then each generation request's row (``logits_indices``)."""
    rows, at = [], 0
    for r, (start, end) in zip(batch.context_requests, prefill_chunk_positions(batch)):
        at += end - start
        if r.completes_prefill:
            rows.append(at - 1)
    return rows + list(range(at, at + len(batch.generation_requests)))


def check_overlap_setting(disable_overlap_scheduler, *, tensor_parallel: bool) -> None:
    """Check an ``Executor``'s ``disable_overlap_scheduler`` value (TensorRT-LLM's ``LLM`` argument of that name).

    Raises:
        ValueError: a value other than ``True``, ``False`` or ``None``; ``False`` (overlap forced on) with
            ``tensor_parallel``: a tensor-parallel run does not overlap steps (every rank reads each step's
            status before the next). :class:`~trtllm_diffkv.parallel.TensorParallelExecutor` calls it before
            it spawns the ranks, each rank's :class:`Executor` again.
    """
    optional_boolean("disable_overlap_scheduler", disable_overlap_scheduler)
    if disable_overlap_scheduler is False and tensor_parallel:
        raise ValueError("disable_overlap_scheduler=False: a tensor-parallel run does not overlap steps (every "
                         "rank reads each step's status before the next)")


@dataclass(eq=False, slots=True)
class LaunchedStep:
    """A step whose forward and sampler ran (launched on the GPU) and whose host copy is not read yet.

    Attributes:
        batch: its :class:`ScheduledBatch` (after ``prepare_resources``).
        sampled: its requests that sample a token (batch order): the first ``len(sampled)`` values of the read.
        tokens: int64 ``[len(sampled)]`` sampled token ids on the device (the next decode step's input ids).
        logprobs: the sampler's :class:`~.sampling.StepLogprobs` on the device, or ``None``.
        host: the pinned int64 buffer the status is copied into (a CPU run: the values already read).
        event: the CUDA event recorded after the copy, or ``None`` on the CPU.
        t0: ``time.perf_counter()`` at the start of the :meth:`Executor.step` that launched it.
        worst_case_pages: pages its decode may take (``decode_pages_needed``), set when it is left in flight
            (reserved in the scheduler's free bound until it is read); 0 for a step read at once.
    """

    batch: ScheduledBatch
    sampled: list
    tokens: torch.Tensor
    logprobs: object
    host: object
    event: object
    t0: float
    worst_case_pages: int = 0


class SingleProcess:
    """The executor's parallel hook when one process holds the whole model (the default; no-ops).

    A multi-process hook (:class:`trtllm_diffkv.parallel.TensorParallelHook`) has the same two methods.
    """

    def resource_manager(self, *args, **kwargs) -> DiffKVResourceManager:
        """The executor's resource manager: ``DiffKVResourceManager(*args, **kwargs)``."""
        return DiffKVResourceManager(*args, **kwargs)

    def step_status(self, status: torch.Tensor, num_requests: int) -> torch.Tensor:
        """The step's status as the executor reads it: int64 ``[num_requests + max_batch_size + 2]`` (sampled
        tokens, per-slot non-finite flags, ring start/end; :meth:`DiffKVResourceManager.device_status`),
        here unchanged. ``num_requests``: the requests that sampled a token (not a prompt's non-final chunk)."""
        return status


class Executor:
    """In-flight batching of many requests over one :class:`DiffKVResourceManager`.

    Args:
        model: ``model(input_ids, positions, backend, logits_indices=None) -> logits``
            (:class:`~trtllm_diffkv.model.llama.LlamaForCausalLM`); its device and dtype are used.
        model_config: the model's shape, ``vocab_size`` and position limit.
        kv_config: the DiffKV policy (``fp16`` preset: no compression).
        engine_config: the sizes, budget and backends (:class:`~trtllm_diffkv.engine_config.EngineConfig`, its
            fields documented there and in docs/RUNTIME.md "Engine config"; ``None``: its defaults). Here:
            ``max_seq_len`` is capped at the model's positions; ``max_num_tokens`` must be ``>= max_batch_size``;
            ``use_cuda_graphs`` replays decode-only steps from CUDA graphs over bucketed batch sizes
            (:class:`~.cuda_graphs.DecodeGraphRunner`, its forward graphs captured here; a capture that fails
            warns and decodes eagerly; ``None``: on when the device is CUDA and the cache runs the Triton
            kernels); ``split_mixed_steps`` (``None``: as ``use_cuda_graphs``, so every rank of a
            tensor-parallel run decides alike even where its capture failed) runs a mixed step as two model
            calls (module docstring; outputs are the unsplit step's up to the last bit of batched matmuls);
            ``disable_overlap_scheduler`` ``None`` overlaps when CUDA graphs are asked for (or defaulted) in one
            process; ``profile`` synchronizes around the timed regions (:meth:`stats`'s
            ``bookkeeping_fraction`` then measures device time).
        tokenizer: decodes result texts and stop strings (optional; stop strings need it).
        stop_token_ids: the checkpoint's stop ids (``model.loader.stop_token_ids``), plus the
            tokenizer's ``eos_token_id``.
        parallel: the hook of a multi-process run (:class:`SingleProcess` when ``None``): it builds
            the resource manager and combines the step's status over the processes
            (:class:`trtllm_diffkv.parallel.TensorParallelHook`: every rank takes the same decisions).
        kv_config_checked: the caller already ran ``kv_config.validate_for_model`` for this model (:class:`LLM
            <trtllm_diffkv.llmapi.LLM>` does when it loads the model): not again. Otherwise it runs here, once
            (the resource manager and the cache built here do not repeat it).

    Raises:
        ValueError: a bad size or budget (also ``max_num_tokens < max_batch_size``), ``kv_config`` cannot run
            this model, ``disable_overlap_scheduler=False`` with tensor parallelism, or a value of
            ``TRTLLM_DIFFKV_DECODE_BACKEND`` that is not ``auto``/``cuda``/``triton``.
    """

    def __init__(self, model, model_config, kv_config, engine_config: EngineConfig | None = None, *,
                 tokenizer=None, stop_token_ids=(), parallel=None, kv_config_checked: bool = False) -> None:

        configured_backend()  # a bad TRTLLM_DIFFKV_DECODE_BACKEND fails here, naming the variable, before loading
        engine = EngineConfig() if engine_config is None else engine_config
        if not isinstance(engine, EngineConfig):
            raise TypeError(f"engine_config must be an EngineConfig, got {type(engine).__name__}")
        param = next(model.parameters())
        kv_config = kv_config.for_model(model_config)  # the model's sliding-window layers, if any
        self.model, self.model_config, self.kv_config, self.tokenizer = model, model_config, kv_config, tokenizer
        self.device = torch.device(engine.device) if engine.device is not None else param.device
        self.parallel = SingleProcess() if parallel is None else parallel
        if not kv_config_checked:
            kv_config.validate_for_model(model_config.head_dim, model_config.num_heads, model_config.num_kv_heads,
                                         model_config.num_layers)
        limit = position_limit(model_config)
        engine = engine.replace(max_seq_len=min(engine.max_seq_len or limit, limit), device=self.device)
        resource_manager = self.parallel.resource_manager(model_config, kv_config, engine, dtype=param.dtype,
                                                          kv_config_checked=True)
        self.rm = resource_manager
        self.cache = resource_manager.cache
        self.engine_config = resource_manager.engine_config
        self.model = model_for_kv_config(model, kv_config)  # key_rotation: the rotated copy
        self.decode_backend = self._decode_backend(param.dtype)
        self.max_batch_size, self.max_num_tokens = resource_manager.max_batch_size, resource_manager.max_num_tokens
        if self.max_num_tokens < self.max_batch_size:  # every running request decodes in every step
            raise ValueError(f"max_num_tokens={self.max_num_tokens} must be >= max_batch_size={self.max_batch_size} "
                             "(a step carries one token of each running request)")
        self.max_seq_len = min(resource_manager.max_seq_len_tokens, limit)
        use_cuda_graphs, split_mixed_steps = engine.use_cuda_graphs, engine.split_mixed_steps
        disable_overlap_scheduler = engine.disable_overlap_scheduler
        if use_cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graphs=True needs a CUDA device, got {self.device}")
        if use_cuda_graphs is None:
            use_cuda_graphs = self.device.type == "cuda" and self.cache.use_triton
        self.split_mixed_steps = bool(use_cuda_graphs) if split_mixed_steps is None else split_mixed_steps
        single = isinstance(self.parallel, SingleProcess)
        check_overlap_setting(disable_overlap_scheduler, tensor_parallel=not single)
        self.overlap_steps = single and (bool(use_cuda_graphs) if disable_overlap_scheduler is None
                                         else not disable_overlap_scheduler)
        self.profile = engine.profile
        self._graphs = self._capture_graphs() if use_cuda_graphs else None  # DecodeGraphRunner
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_ids = set(stop_token_ids or ()) | ({eos} if eos is not None else set())
        self.sampler = Sampler(model_config.vocab_size, self.device)
        self.enable_chunked_prefill = engine.enable_chunked_prefill
        self.scheduler = Scheduler(self.rm, self.max_batch_size, self.max_num_tokens, self.enable_chunked_prefill)
        self.requests: dict = {}  # live requests by id
        self._checkers: dict = {}
        self._pending: list[RequestUpdate] = []  # aborts done between steps, reported by the next step
        self._ids = itertools.count()
        self._lock = threading.Lock()  # held by step() for the whole step
        self._inbox_lock = threading.Lock()  # held for microseconds: add_request / abort never wait for a step
        self._inbox: list[Request] = []
        self._abort_ids: list = []
        n = 2 * self.max_batch_size + 2
        cuda = self.device.type == "cuda"
        # two pinned buffers and events in turn: a step in flight keeps its own while the next one copies
        self._hosts = [torch.empty(n, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._turn = 0
        self._inflight: LaunchedStep | None = None  # the decode step launched and not read (overlap)
        self._totals = dict(steps=0, batch_requests=0, output_tokens=0, step_s=0.0, bookkeeping_s=0.0,
                            finished=0, failed=0, aborted=0, overlapped_steps=0)

    @property
    def waiting(self):
        """Queued requests, FIFO (:attr:`Scheduler.waiting`)."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        """Requests in the batch, in admission order (:attr:`Scheduler.running`)."""
        return self.scheduler.running

    # ------------------------------------------------------------------ public API
    def add_request(self, prompt_token_ids, sampling_params: SamplingParams | None = None, request_id=None):
        """Queue a request; returns its id. Its content is checked at the next :meth:`step`, where a bad
        request fails alone (``RequestUpdate.finish_reason == "error"``). ``sampling_params=None``:
        greedy, 64 new tokens (TensorRT-LLM's default is greedy); ``request_id=None``: a new int.

        Raises:
            ValueError: ``request_id`` is already live or not hashable (the only errors raised here).
        """
        with self._inbox_lock:
            if request_id is None:
                request_id = next(self._ids)
                while request_id in self.requests:
                    request_id = next(self._ids)
            else:
                check_new_request_id(request_id, self.requests)
            params = SamplingParams.greedy_params() if sampling_params is None else sampling_params
            request = Request(request_id, prompt_token_ids, params, arrival_time=time.perf_counter())
            self.requests[request_id] = request
            self._inbox.append(request)
        return request_id

    def abort(self, request_id) -> None:
        """End a request: its pages go back to the pool at once between steps, or before the step running
        now returns; a step reports it (``finish_reason == "abort"``). Unknown or finished ids are ignored.
        Never waits for a step."""
        with self._inbox_lock:
            self._abort_ids.append(request_id)
        if self._lock.acquire(blocking=False):  # else the holder carries it out when it lets go (_unlock)
            try:
                self._drain(self._pending)
            finally:
                self._unlock()

    def _unlock(self) -> None:
        """Release the step lock, then carry out aborts that came while it was held.

        Every holder lets go through here, and :meth:`abort` queues its id before it tries the lock, so
        an abort is never lost: either it takes the lock itself, or the holder sees the id after releasing.
        """
        while True:
            self._lock.release()
            if not self._abort_ids or not self._lock.acquire(blocking=False):
                return
            self._drain(self._pending)

    def _drain(self, updates: list) -> None:
        """Move new requests to the scheduler's queue and carry out the aborts (under the step lock)."""
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._abort_ids = self._abort_ids, []
        for request in inbox:
            self.scheduler.add(request)
        for request_id in aborts:
            request = self.requests.get(request_id)
            if request is not None and not request.finished:
                self._end(request, "abort", None, updates)
                self._totals["aborted"] += 1

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running, an abort is still to be reported, or a launched step is
        still to be read (overlap)."""
        return bool(self.requests or self._pending or self._inflight is not None)

    def run_until_done(self) -> dict:
        """Step until every request ended; returns ``{request_id: Request}`` of the requests live at the call
        (each with ``finish_reason``, ``output_token_ids`` and ``result``)."""
        requests = dict(self.requests)
        while self.has_unfinished():
            self.step()
        return requests

    def step(self) -> list[RequestUpdate]:
        """One in-flight batching iteration (module docstring); returns the updates of the requests it changed
        (with the overlap, a decode step's tokens come back from the next call)."""
        self._lock.acquire()
        try:
            updates, self._pending = self._pending, []
            self._drain(updates)
            self._sync()
            t0 = time.perf_counter()
            self._check_new(updates)
            if self._inflight is None or not self._continue(updates, t0):
                self._settle_inflight(updates)
                batch, rejected = self.scheduler.schedule()
                for request, exc in rejected:
                    self._fail(request, exc, updates)
                if batch.batch_size:
                    self._run(batch, updates, t0)
                    self._count_step(batch, t0)
            self._drain(updates)  # aborts that came during the step: their pages back before it returns
            if self._inflight is not None and not any(r.state is RequestState.RUNNING for r in self._inflight.sampled):
                self._settle_inflight(updates)  # nobody left in the step in flight (stopped, aborted): read it now
            return updates
        finally:
            self._unlock()

    def _count_step(self, batch: ScheduledBatch, t0: float) -> None:
        self._totals["steps"] += 1
        self._totals["batch_requests"] += batch.batch_size
        self._totals["step_s"] += time.perf_counter() - t0

    def stats(self) -> dict:
        """Executor and pool statistics now (device reads on the GPU).

        Returns:
            dict: ``running``, ``waiting``, ``pool_pages``, ``free_pages``, ``used_pages``,
            ``used_bytes``, ``bookkeeping_bytes``, ``budget_bytes``, ``kv_memory_fraction`` (pool
            bytes used / FP16 bytes of the same tokens; ``None`` when empty), ``steps``,
            ``output_tokens``, ``output_tokens_per_s`` (over the time spent in steps),
            ``mean_batch_size`` (requests per step), ``bookkeeping_fraction`` (time in
            ``prepare_resources`` + ``update_resources`` / step time; device time only with
            ``profile=True``), ``preemptions``, ``finished``, ``failed``, ``aborted``, ``overlapped_steps``
            (steps launched before the previous one was read: the overlap).
        """
        self._lock.acquire()
        try:
            t = self._totals
            out = dict(running=len(self.running), waiting=len(self.waiting), **self.rm.stats())
            out.update(steps=t["steps"], output_tokens=t["output_tokens"],
                       output_tokens_per_s=t["output_tokens"] / t["step_s"] if t["step_s"] else None,
                       mean_batch_size=t["batch_requests"] / t["steps"] if t["steps"] else None,
                       bookkeeping_fraction=t["bookkeeping_s"] / t["step_s"] if t["step_s"] else None,
                       preemptions=self.scheduler.preemptions, finished=t["finished"], failed=t["failed"],
                       aborted=t["aborted"], overlapped_steps=t["overlapped_steps"])
            return out
        finally:
            self._unlock()

    # ------------------------------------------------------------------ admission checks
    def _check_new(self, updates: list) -> None:
        for request in [r for r in self.waiting if not r.checked]:
            try:
                self._check(request)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                self._fail(request, exc, updates)

    def check_request(self, prompt_token_ids, params) -> list[int]:
        """Every check a request must pass before it may wait for pages (the one home of the request rules;
        the ``LLM`` API calls it before queueing, :meth:`add_request`'s requests meet it at the next step).

        Args:
            prompt_token_ids: the prompt's token ids (list or tuple of ints).
            params: its :class:`SamplingParams`.

        Returns:
            The ids as Python ints.

        Raises:
            ValueError: not a ``SamplingParams``, a bad sampling value, a bad prompt
                (:func:`~trtllm_diffkv.generation.prompts.check_prompt_ids`), prompt + ``max_tokens`` past
                ``max_seq_len``, or a re-prefill after preemption (prompt + ``max_tokens`` - 1 tokens) that
                could not fit one step (``max_num_tokens``) nor, chunked, the staging (``chunk_staging_bytes``).
            OutOfPagesError: the prompt, or (``fp16``) its last decode step, needs more pages than the pool has.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.model_config.vocab_size)
        prompt_token_ids = check_prompt_ids(prompt_token_ids, params.max_tokens, self.model_config)
        n = len(prompt_token_ids)
        if n + params.max_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds max_seq_len "
                             f"{self.max_seq_len}")
        longest = n + params.max_tokens - 1  # a re-prefill after preemption brings prompt + generated tokens
        if longest > self.max_num_tokens:
            if not self.enable_chunked_prefill:
                raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) - 1 exceeds max_num_tokens="
                                 f"{self.max_num_tokens} (the most tokens one step carries; enable_chunked_prefill "
                                 "is off)")
            staged, limit = self.rm.staging_bytes_needed(longest), self.cache.staging_limit_bytes
            if not staging_fits(staged, 0, limit):  # alone in an empty staging: the cache's rule
                raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) - 1 is more than one step's "
                                 f"max_num_tokens={self.max_num_tokens}, and prefilled in chunks it would stage "
                                 f"{staged} bytes, more than chunk_staging_bytes={limit}")
        need, total = self.rm.prefill_pages_needed(n), self.rm.get_max_resource_count()
        if need > total:
            raise OutOfPagesError(f"the prompt needs {need} pages at prefill; the whole pool has {total}")
        if not self.kv_config.tiered and params.max_tokens > 1:  # no tiers: the end is known exactly
            fmt, rows, last = self.cache.page_format, self.cache.rows_per_slot, n + params.max_tokens - 1
            need = rows * fmt.pages_for_tokens("high", last - 1) + self.rm.decode_pages_needed(1)
            if need > total:  # its last decode step could never be planned, even alone
                raise OutOfPagesError(f"the request needs {need} pages by its last decode step (prompt {n} + "
                                      f"max_tokens {params.max_tokens}); the whole pool has {total}")
        return prompt_token_ids

    def _check(self, request: Request) -> None:
        params = request.sampling_params
        request.prompt_token_ids = self.check_request(request.prompt_token_ids, params)
        checker = self._checkers[request.request_id] = StopChecker(params, self.stop_token_ids, self.tokenizer)
        self.sampler.add(request.request_id, params, len(request.prompt_token_ids), checker.min_tokens_stop_ids)
        request.prefill_token_ids = list(request.prompt_token_ids)
        request.history = list(request.prompt_token_ids)
        request.checked = True

    # ------------------------------------------------------------------ the step
    def _run(self, batch: ScheduledBatch, updates: list, t0: float) -> None:
        """Steps 3-6 of the module docstring over ``batch``; with ``split_mixed_steps`` a batch with both prompts
        and decodes as two of them, decodes first. A decode-only batch the overlap may leave in flight is left
        in flight (:meth:`_defer`)."""
        if self.split_mixed_steps and batch.context_requests and batch.generation_requests:
            self._run_batch(ScheduledBatch(generation_requests=batch.generation_requests), updates, t0)
            self._run_batch(ScheduledBatch(context_requests=batch.context_requests), updates, t0)
            return
        launched = self._launch(batch, updates, t0)
        if launched is None:
            return
        if self._may_defer(batch):
            self._defer(launched)
        else:
            self._settle(launched, updates)

    def _run_batch(self, batch: ScheduledBatch, updates: list, t0: float) -> None:
        """Steps 3-6 over ``batch``, read before returning."""
        launched = self._launch(batch, updates, t0)
        if launched is not None:
            self._settle(launched, updates)

    # ------------------------------------------------------------------ overlap
    def _may_defer(self, batch: ScheduledBatch) -> bool:
        """Whether the launched ``batch`` may stay in flight: overlap on, decode-only, and no request whose
        next draw reads its host history (:meth:`Sampler.reads_history`) or that asks ``logprobs`` (a second copy)."""
        return (self.overlap_steps and not batch.context_requests and bool(batch.generation_requests)
                and not any(r.sampling_params.logprobs is not None or Sampler.reads_history(r.sampling_params)
                            for r in batch.generation_requests))

    def _defer(self, launched: LaunchedStep) -> None:
        """Leave ``launched`` in flight: its requests' lengths from the cache now, and its decode worst case off
        the free-page bound until it is read."""
        launched.worst_case_pages = self.rm.decode_pages_needed(len(launched.batch.generation_requests))
        self.scheduler.reserve(launched.worst_case_pages)
        self.rm.note_lengths(launched.batch)
        self._inflight = launched

    def _continue(self, updates: list, t0: float) -> bool:
        """The overlap: launch the next decode step of the in-flight step's requests (input ids: its sampled
        tokens, on the device), then settle the in-flight step while the GPU runs the new one. ``False``, with
        nothing done, when the scheduler might run another batch (:meth:`Scheduler.runs_unchanged`)."""
        inflight = self._inflight
        sampled = inflight.sampled
        live = [r for r in sampled if r.state is RequestState.RUNNING]
        if not live or len(live) != len(self.scheduler.running):
            return False
        rows = [i for i, r in enumerate(sampled) if r.state is RequestState.RUNNING
                and len(r.output_token_ids) + 1 < r.sampling_params.max_tokens]  # else it ends in the in-flight step
        if not rows or not self.scheduler.runs_unchanged(len(rows), shrinking=len(rows) < len(live),
                                                         in_flight_pages=inflight.worst_case_pages):
            return False
        batch = ScheduledBatch(generation_requests=[sampled[i] for i in rows])
        ids = inflight.tokens if len(rows) == len(sampled) else \
            inflight.tokens[torch.tensor(rows, dtype=torch.long, device=inflight.tokens.device)]
        self._inflight, failed = None, []
        launched = self._launch(batch, updates, t0, input_ids=ids, failed=failed)
        if launched is not None:
            self._defer(launched)  # the new step in flight
            self._totals["overlapped_steps"] += 1
        self._settle(inflight, updates, deferred=True,
                     later_pages=0 if launched is None else launched.worst_case_pages)
        for request, exc in failed:  # the launch failed: its requests fail once the step before it is read
            if not request.finished:
                self._fail(request, exc, updates)
        if launched is not None:
            self._count_step(batch, t0)
        return True

    def _settle_inflight(self, updates: list) -> None:
        """Read and settle the step left in flight, if any."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._settle(inflight, updates, deferred=True)

    # ------------------------------------------------------------------ launch and settle
    def _launch(self, batch: ScheduledBatch, updates: list, t0: float, input_ids=None,
                failed: list | None = None) -> LaunchedStep | None:
        """Steps 3-5 up to the launch: plan, forward, sampler, the host copy enqueued. ``None`` when the plan
        was refused (pages: retried next step) or the step failed (its requests failed; with ``failed``, a list,
        ``(request, exception)`` pairs appended there instead, for the caller to fail after reading the step in
        flight). ``input_ids``: a decode-only batch's input ids on the device (the overlap), else its last tokens
        from the host."""
        def fail(request, exc):
            if failed is None:
                self._fail(request, exc, updates)
            else:
                failed.append((request, exc))

        requests = batch.all_requests
        graphs = self._graph_runner(batch)
        pad_to = graphs.bucket_for(batch.batch_size) if graphs is not None else None
        try:
            t1 = self._sync()
            self.rm.prepare_resources(batch, pad_to=pad_to, known_free_pages=self.scheduler.free_estimate)
            t2 = self._sync()
        except OutOfPagesError:  # the estimate was stale: retry next step, nothing changed
            self.scheduler.unschedule(batch)
            self.scheduler.observe_free(self.rm.free_pages())
            return None
        except Exception as exc:  # noqa: BLE001 - the cache refused the step (nothing changed): its requests fail
            for request in requests:
                fail(request, exc)
            return None
        self._totals["bookkeeping_s"] += t2 - t1
        for request in batch.context_requests:
            if request.prefill_start_time is None:
                request.prefill_start_time = t0
        sampled = [r for r in requests if r.completes_prefill]  # half-prefilled prompts sample nothing yet
        try:
            with torch.inference_mode():
                tokens, step_logprobs = self._forward(batch, graphs, input_ids)
                host, event = self._start_read(self.parallel.step_status(
                    torch.cat([tokens, self.rm.device_status()]), len(sampled)))
        except Exception as exc:  # noqa: BLE001 - the step failed: its requests fail, the executor goes on
            self.cache.discard_step()
            for request in requests:
                fail(request, RuntimeError(f"the step failed: {type(exc).__name__}: {exc}"))
            return None
        return LaunchedStep(batch, sampled, tokens, step_logprobs, host, event, t0)

    def _settle(self, launched: LaunchedStep, updates: list, *, deferred: bool = False, later_pages: int = 0) -> None:
        """Steps 5-6 of a launched step: wait for its host copy, ``update_resources``, the stop checks.

        Requests that ended since its launch (aborted, or stopped in the step read before it: overlap) are
        skipped. ``deferred``: read in a later :meth:`step` than its launch (releases may have come in between:
        the free bound stays stale); ``later_pages``: the worst case of a step launched after it and not read."""
        batch, sampled = launched.batch, launched.sampled
        try:
            host = self._finish_read(launched)
            logprobs = {} if launched.logprobs is None else launched.logprobs.to_host(  # a second copy, when asked
                host[:len(sampled)], [sampled[b].sampling_params.logprobs for b in launched.logprobs.rows])
        except Exception as exc:  # noqa: BLE001 - the step failed: its requests fail, the executor goes on
            for request in batch.all_requests:
                if not request.finished:
                    self._fail(request, RuntimeError(f"the step failed: {type(exc).__name__}: {exc}"), updates)
            return
        t3 = self._sync()
        live = ScheduledBatch(context_requests=[r for r in batch.context_requests if not r.finished],
                              generation_requests=[r for r in batch.generation_requests if not r.finished])
        errors = self.rm.update_resources(live, host[len(sampled):])
        self.scheduler.observe_free(self.rm.free_pages_after_step - later_pages, keep_stale=deferred)
        t4 = self._sync()
        self._totals["bookkeeping_s"] += t4 - t3
        tokens_of = dict(zip(map(id, sampled), host[:len(sampled)]))
        logprobs_of = {id(sampled[row]): entry for row, entry in logprobs.items()}
        for request in live.all_requests:
            if request.request_id in errors:
                self._fail(request, ValueError(errors[request.request_id]), updates)
            elif id(request) in tokens_of:
                self._advance(request, int(tokens_of[id(request)]), launched.t0, t4, updates,
                              logprobs_of.get(id(request)))

    @property
    def use_cuda_graphs(self) -> bool:
        """Whether decode-only steps replay CUDA graphs (False after a failed capture)."""
        return self._graphs is not None

    def _decode_backend(self, dtype: torch.dtype) -> str:
        """Which decode attention runs: ``"torch"`` (no Triton kernels), ``"triton"`` or ``"cuda"``.

        Raises:
            ValueError: ``TRTLLM_DIFFKV_DECODE_BACKEND=cuda`` where the CUDA kernel cannot run this model
                (at start, not at every request's first decode step).
        """
        if not self.cache.use_triton:
            return "torch"

        mc = self.model_config
        return choose_backend(None, self.cache.page_format, mc.num_heads, mc.num_kv_heads, dtype,
                              self.device.type == "cuda")

    def _capture_graphs(self):
        """Capture the decode forward graphs of every batch bucket; ``None`` (and a warning) on failure."""

        try:
            return DecodeGraphRunner(self.model, self.cache)
        except Exception as exc:  # noqa: BLE001 - serve eagerly rather than not at all
            self.cache.discard_step()
            warnings.warn(f"CUDA-graph capture failed, decoding eagerly: {type(exc).__name__}: {exc}",
                          RuntimeWarning, stacklevel=3)
            return None

    def _graph_runner(self, batch: ScheduledBatch):
        """The decode CUDA graphs for a decode-only batch, else ``None``."""
        if self._graphs is None or batch.context_requests:
            return None
        return self._graphs

    def _forward(self, batch: ScheduledBatch, graphs=None, input_ids=None):
        """One model call (or one decode graph replay) over the packed tokens and one sampler call;
        ``(int64 tokens on the device, one per request that completes its prefill or decodes (batch order),
        StepLogprobs or None)``. A prompt chunk asking for ``prompt_logprobs`` gets the logits of each of
        its prompt positions (:meth:`_prompt_logprob_rows`). ``input_ids``: a decode-only batch's input ids
        on the device (the in-flight step's sampled tokens), else each request's last token from the host."""
        ids, positions = [], []
        for r, (start, end) in zip(batch.context_requests, prefill_chunk_positions(batch)):
            ids += r.prefill_token_ids[start:end]
            positions += range(start, end)
        for r in batch.generation_requests:
            if input_ids is None:
                ids.append(r.output_token_ids[-1])
            positions.append(r.num_cached_tokens)
        if input_ids is not None:
            if batch.context_requests:
                raise ValueError("device input ids are for a decode-only step")
            ids = input_ids
        dev = self.device
        rows = None
        if batch.context_requests:
            rows = sampling_rows(batch)
            echo = self._prompt_logprob_rows(batch, rows)
            rows = torch.tensor((echo[0] if echo is not None else rows) or [len(ids) - 1],
                                device=dev)  # only half-prefilled prompts: one row, unused
        else:
            echo = None
        if graphs is not None:
            logits = graphs.run(ids, positions)  # replays the step and ends it
        else:
            logits = self.model(torch.as_tensor(ids, device=dev), torch.tensor(positions, device=dev), self.cache,
                                logits_indices=rows)
            self.cache.end_step()
        if echo is not None:
            for request, logit_rows, start in echo[2]:
                entries = prompt_logprobs(logits[torch.tensor(logit_rows, device=dev)], request.prompt_token_ids,
                                          request.sampling_params.prompt_logprobs, start)
                request.prompt_logprobs = entries if start == 0 else request.prompt_logprobs + entries
            logits = logits[torch.tensor(echo[1], dtype=torch.long, device=dev)]
        requests = [r for r in batch.all_requests if r.completes_prefill]
        if not requests:
            return torch.empty(0, dtype=torch.int64, device=dev), None
        request_ids, histories = [r.request_id for r in requests], [r.history for r in requests]
        if any(r.sampling_params.logprobs is not None for r in requests):
            return self.sampler.sample_with_logprobs(logits, request_ids, histories)
        return self.sampler.sample(logits, request_ids, histories), None

    @staticmethod
    def _prompt_logprob_rows(batch: ScheduledBatch, rows: list[int]):
        """Prompt log-probabilities (echo): which packed tokens get logits. ``rows``: the packed rows the
        sampler reads (:func:`sampling_rows`). ``None`` when no prompt chunk asks, else ``(logits_indices,
        the positions of ``rows`` in them, [(request, its prompt positions' logits rows, the chunk's first
        position)])``. A chunk asks when its request has ``prompt_logprobs``, the entries so far end where
        the chunk starts (a prefill that starts over after a preemption starts them over; a re-prefill of a
        request that has them all asks nothing) and the chunk holds prompt positions."""
        asks, at = [], 0
        for request, (start, end) in zip(batch.context_requests, prefill_chunk_positions(batch)):
            count, have = len(request.prompt_token_ids), request.prompt_logprobs
            missing = have is None or len(have) < count
            if (request.sampling_params.prompt_logprobs is not None and missing and start < count
                    and (start == 0 or (have is not None and len(have) == start + 1))):
                asks.append((request, at, start, min(end, count)))
            at += end - start
        if not asks:
            return None
        select = sorted(set(rows) | {first + j for _, first, start, end in asks for j in range(end - start)})
        where = {row: i for i, row in enumerate(select)}
        return select, [where[row] for row in rows], [
            (request, [where[first + j] for j in range(end - start)], start) for request, first, start, end in asks]

    def _start_read(self, values: torch.Tensor):
        """The step's one device-to-host copy, enqueued: into a pinned buffer, ``non_blocking``, an event after it
        (two buffers in turn: a step left in flight keeps its own). ``(host values or buffer, event or None)``;
        on the CPU the values are read here."""
        if self._events is None:
            return values.tolist(), None
        turn, self._turn = self._turn, self._turn ^ 1
        event = self._events[turn]
        event.synchronize()  # the step that used this buffer was read already: returns at once
        host = self._hosts[turn][:values.numel()]
        host.copy_(values, non_blocking=True)
        event.record()
        return host, event

    @staticmethod
    def _finish_read(launched: LaunchedStep) -> list[int]:
        """Wait for a launched step's host copy; its values."""
        if launched.event is None:
            return launched.host
        launched.event.synchronize()
        return launched.host.tolist()

    def _sync(self) -> float:
        if self.profile and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _advance(self, request: Request, token: int, t0: float, now: float, updates: list, logprobs=None) -> None:
        if request.first_token_time is None:
            request.first_token_time = now
            request.prefill_s = now - (request.prefill_start_time if request.prefill_start_time is not None else t0)
        request.output_token_ids.append(token)
        extra = dict(logprobs=None if logprobs is None else [logprobs],
                     prompt_logprobs=request.prompt_logprobs if len(request.output_token_ids) == 1 else None)
        request.history.append(token)
        self._totals["output_tokens"] += 1
        checker = self._checkers[request.request_id]
        done, reason, stop_id = checker.check(request.output_token_ids)
        if done:
            request.result = self._result(request, reason, stop_id, now)
            self._end(request, reason, stop_id, updates, [token], checker.stop_reason, **extra)
            self._totals["finished"] += 1
        else:
            updates.append(RequestUpdate(request.request_id, [token], **extra))

    # ------------------------------------------------------------------ ends
    def _result(self, request: Request, reason: str, stop_id, now: float) -> PagedGenerationResult:
        """The finished request's :class:`GenerationResult` fields + pool pages and bytes (read before release)."""
        stats = self.cache.request_stats(request.slot)
        out, checker = request.output_token_ids, self._checkers[request.request_id]
        text = checker.text_for(out) if self.tokenizer is not None else ""
        fields = result_fields(len(request.prompt_token_ids), out, stats, request.prefill_s,
                               now - request.first_token_time, kv_config=self.kv_config, tokenizer=self.tokenizer,
                               stop_token_ids=set(checker.stop_token_ids), finish_reason=reason,
                               stop_token_id=stop_id, text=text)
        return PagedGenerationResult(**fields, pool_pages=stats.pool_pages, pool_used_bytes=stats.pool_used_bytes)

    def _fail(self, request: Request, exc: Exception, updates: list) -> None:
        message = f"{type(exc).__name__}: {exc}"
        prompt = request.prompt_token_ids
        request.error = message
        request.result = PagedGenerationResult(
            token_ids=list(request.output_token_ids), prompt_tokens=len(prompt) if hasattr(prompt, "__len__") else 0,
            generated_tokens=len(request.output_token_ids), finish_reason="error", error=message)
        self._end(request, "error", None, updates)
        self._totals["failed"] += 1

    def _end(self, request: Request, reason: str, stop_id, updates: list, new_tokens=(), stop_reason=None,
             **extra) -> None:
        """Finish, fail or abort: every page back now, out of every queue, one final update."""
        self.scheduler.remove(request)
        self.sampler.remove(request.request_id)
        self._checkers.pop(request.request_id, None)
        self.requests.pop(request.request_id, None)
        request.state, request.finish_reason, request.stop_token_id = RequestState.FINISHED, reason, stop_id
        request.finish_time = time.perf_counter()
        if request.result is None:  # abort
            prompt = request.prompt_token_ids
            request.result = PagedGenerationResult(
                token_ids=list(request.output_token_ids), prompt_tokens=len(prompt) if hasattr(prompt, "__len__") else 0,
                generated_tokens=len(request.output_token_ids), finish_reason="abort")
        updates.append(RequestUpdate(request.request_id, list(new_tokens), True, reason, request.error, stop_id,
                                     request.result, stop_reason, **extra))
