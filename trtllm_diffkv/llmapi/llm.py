"""``LLM``: the high-level Python API over the in-flight batching executor (TensorRT-LLM's LLM API shape).

Usage::

    from trtllm_diffkv import LLM, SamplingParams
    with LLM(kv_config="default") as llm:           # the default model; or LLM("/path/to/hf_folder")
        for out in llm.generate(["Hello", "Name a planet."], SamplingParams(max_tokens=32, temperature=0)):
            print(out.outputs[0].text)

One background thread owns the :class:`~trtllm_diffkv.runtime.executor.Executor`: it takes
submissions and aborts from a thread-safe queue between steps, runs ``executor.step()`` while any
request is unfinished (and sleeps on the queue otherwise), and hands each request's new tokens to
its :class:`~trtllm_diffkv.llmapi.outputs.AsyncRequest`. So many threads, or an asyncio server, can
share one ``LLM``. A request with bad content (empty prompt, ids outside the vocabulary, too long,
bad sampling values) finishes alone with ``finish_reason == "error"`` and its ``error``; an
exception inside a step fails the requests that were in the executor at that step (their pages
freed) and the loop goes on; :meth:`LLM.shutdown` cancels what is left, frees its pages and joins
the thread.
"""
from __future__ import annotations

import itertools
import numbers
import queue
import threading
import weakref
from dataclasses import asdict, is_dataclass

from ..engine_config import EngineConfig
from ..validators import is_int, optional_positive_int
from .outputs import AsyncRequest, CompletionOutput, RequestEvent, RequestGroup, RequestOutput

__all__ = ["LLM", "RequestOutput", "CompletionOutput", "AsyncRequest", "RequestGroup", "UNAVAILABLE"]

UNAVAILABLE = "the LLM cannot serve requests"
"""How the error of a request refused by an LLM that cannot serve (:meth:`LLM.health`) begins."""

DEFAULT_CPU_KV_MEMORY_BYTES = 256 << 20
"""KV budget on the CPU when neither ``kv_memory_bytes`` nor ``kv_memory_fraction`` is given (a fraction
needs CUDA's free-memory query); on CUDA the executor's default applies (0.9 of free memory)."""


def encode_prompt(tokenizer, prompt: str, chat_template: bool) -> list[int]:
    """Token ids of ``prompt``: wrapped in the tokenizer's chat template (as a user turn, with the
    generation prompt) when ``chat_template`` and the tokenizer has one, else encoded as is (with the
    tokenizer's special tokens, e.g. BOS). Same rule as ``ReferenceGenerator.encode``."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def load_source(model, kv_config, device, dtype):
    """Load ``model`` (None = default model, a HF folder, a ``.gguf``, or an engine dir written by
    ``trtllm-diffkv build``) on ``device`` (None: CUDA when available) in ``dtype`` (None: the engine
    dir's dtype on CUDA, else float32 on the CPU and bfloat16 on CUDA).

    Returns:
        ``(model, tokenizer, model_config, kv_config, stop_token_ids, engine_info)``; ``kv_config``
        resolved (a preset name, a :class:`DiffKVConfig`, or ``None`` = the engine dir's or ``"default"``);
        with its ``key_rotation`` the model is rotated in place (the product loaded it: no second copy of
        ``v_proj`` / ``o_proj``, ``model/rotation.py``); ``engine_info`` is the engine dir's ``EngineDirInfo`` or
        ``None``.

    Raises:
        FileNotFoundError, ValueError: as :func:`~trtllm_diffkv.model.loader.load_model`; an unknown preset.
    """
    import torch

    from ..config import resolve_kv_config
    from ..model.loader import default_dtype, load_model, stop_token_ids
    from ..model.rotation import model_for_kv_config

    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    info = None
    if model is not None:
        try:
            from ..export.engine_dir import is_engine_dir, read_engine_dir
        except ImportError:  # the build package is optional
            is_engine_dir = None
        if is_engine_dir is not None and is_engine_dir(model):
            info = read_engine_dir(model)
            engine_dir, model = model, info.model_path
            kv_config = info.kv_config if kv_config is None else kv_config
            if dtype is None and device.type == "cuda":  # on the CPU: float32 (half matmuls are slow there)
                dtype = getattr(torch, info.dtype)
    kv_config = "default" if kv_config is None else kv_config
    kv_config = resolve_kv_config(kv_config)
    dtype = dtype if dtype is not None else default_dtype(device)
    net, tokenizer, model_config = load_model(model, device=device, dtype=dtype)
    if info is not None:
        from ..export.engine_dir import check_engine_matches_model

        check_engine_matches_model(engine_dir, model_config)
    kv_config = kv_config.for_model(model_config)  # the model's sliding-window layers, if any
    kv_config.validate_for_model(model_config.head_dim, model_config.num_heads, model_config.num_kv_heads,
                                 model_config.num_layers)
    net = model_for_kv_config(net, kv_config, in_place=True)
    return net, tokenizer, model_config, kv_config, stop_token_ids(model), info



def _with_default_sizes(executor_kwargs: dict, device) -> dict:
    """``executor_kwargs`` with ``kv_memory_bytes`` = :data:`DEFAULT_CPU_KV_MEMORY_BYTES` and ``max_batch_size``
    = 64 when not given (the budget only off CUDA, where a fraction of free memory cannot be read)."""
    import torch

    budget_given = {"kv_memory_bytes", "kv_memory_fraction"} & executor_kwargs.keys()
    if torch.device(device).type != "cuda" and not budget_given:
        executor_kwargs["kv_memory_bytes"] = DEFAULT_CPU_KV_MEMORY_BYTES
    executor_kwargs.setdefault("max_batch_size", 64)
    return executor_kwargs


def take_all(q: queue.Queue, block: bool) -> list:
    """The queue's next item (waiting for one when ``block``) and every item already behind it; ``[]`` if none."""
    try:
        items = [q.get(block=block)]
    except queue.Empty:
        return []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items

def set_num_threads(num_threads: int | None) -> None:
    """``torch.set_num_threads(num_threads)`` (``None``: leave torch's setting).

    Raises:
        ValueError: not an int >= 1.
    """
    if num_threads is None:
        return
    if not is_int(num_threads) or num_threads < 1:
        raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}")
    import torch

    torch.set_num_threads(num_threads)


def max_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` can decode to: the longest vocabulary entry.

    A byte-level BPE entry has one character per byte (GPT-2's byte-to-unicode map) and a
    SentencePiece entry one per character (``"\u2581"`` for the space, ``<0xNN>`` for a byte), so
    an entry is never shorter than its decoded text; a text of ``c`` characters needs at least
    ``c / max_token_chars`` tokens.
    """
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


class LLM:
    """Generate with a DiffKV-compressed, in-flight batched KV cache (TensorRT-LLM ``LLM`` shape).

    Args:
        model: a Hugging Face checkpoint folder, a ``.gguf`` file, an engine dir written by
            ``trtllm-diffkv build``, or ``None`` for the default model (SmolLM2-135M-Instruct).
            Local paths only.
        kv_config: a preset name (``"default"``, ``"fp16"``, ...) or a
            :class:`~trtllm_diffkv.config.DiffKVConfig`; ``None``: the engine dir's, else ``"default"``.
        device: ``None`` = CUDA when available, else CPU.
        dtype: model dtype; ``None`` = float32 on CPU, bfloat16 on GPU.
        max_batch_size: requests in one step at most; ``None``: the engine dir's, else 64.
        kv_memory_bytes, kv_memory_fraction: the page pool's budget (bytes, bookkeeping included, or a
            fraction of the free GPU memory); ``None``: 0.9 of the free GPU memory on CUDA,
            :data:`DEFAULT_CPU_KV_MEMORY_BYTES` (256 MiB) on the CPU.
        max_seq_len: prompt + ``max_tokens`` limit per request (tokens); ``None`` = the model's.
        num_threads: torch's intra-op CPU threads (``torch.set_num_threads``, process-wide; with
            tensor parallelism, each rank's); ``None``: torch's default (all cores). On the CPU the speed
            changes up to 10x with it.
        tensor_parallel_size: ranks the model is split over (``None`` or 1: this process runs it). ``N >
            1`` spawns N rank processes (:class:`~trtllm_diffkv.parallel.TensorParallelExecutor`: gloo on
            the CPU, NCCL with one GPU per rank, rank ``r`` on ``cuda:r``: ``device`` picks only the
            type); ``kv_memory_bytes``/``kv_memory_fraction`` are then per rank. Takes a HF folder, a
            ``.gguf`` or ``None`` (not an engine dir). docs/RUNTIME.md "Tensor parallelism".
        **executor_kwargs: the other fields of the :class:`~trtllm_diffkv.engine_config.EngineConfig` the
            :class:`~trtllm_diffkv.runtime.executor.Executor` gets (built once here; docs/RUNTIME.md "Engine
            config"), e.g. ``max_num_tokens`` (tokens per step; default 8192), ``enable_chunked_prefill`` (default ``True``) and
            ``disable_overlap_scheduler`` (default ``None``: overlap where decode replays CUDA graphs in one
            process; ``False`` forces it on and is refused with ``tensor_parallel_size`` > 1, before any rank
            starts), TensorRT-LLM's ``LLM`` names.

    Attributes:
        tokenizer, model_config, kv_config, stop_token_ids, executor.

    Raises:
        FileNotFoundError, ValueError: the model cannot be loaded or ``kv_config`` cannot run it; a
            ``tensor_parallel_size`` the model cannot be split over (naming the field).
    """

    def __init__(self, model=None, kv_config=None, *, device=None, dtype=None, max_batch_size: int | None = None,
                 kv_memory_bytes: int | None = None, kv_memory_fraction: float | None = None,
                 max_seq_len: int | None = None, num_threads: int | None = None,
                 tensor_parallel_size: int | None = None, **executor_kwargs):
        optional_positive_int("tensor_parallel_size", tensor_parallel_size, allowed="a positive integer")
        if tensor_parallel_size is not None and tensor_parallel_size > 1:
            self._start_tensor_parallel(model, kv_config, tensor_parallel_size, device=device, dtype=dtype,
                                        max_batch_size=max_batch_size, kv_memory_bytes=kv_memory_bytes,
                                        kv_memory_fraction=kv_memory_fraction, max_seq_len=max_seq_len,
                                        num_threads=num_threads, **executor_kwargs)
            return
        set_num_threads(num_threads)
        net, tokenizer, model_config, kv_config, stop_ids, info = load_source(model, kv_config, device, dtype)
        if info is not None:
            max_batch_size = info.max_batch_size if max_batch_size is None else max_batch_size
            max_seq_len = info.max_seq_len if max_seq_len is None else max_seq_len
        self._start(net, tokenizer, model_config, kv_config, stop_ids, max_batch_size=max_batch_size,
                    kv_memory_bytes=kv_memory_bytes, kv_memory_fraction=kv_memory_fraction,
                    max_seq_len=max_seq_len, kv_config_checked=True, **executor_kwargs)

    @classmethod
    def from_model(cls, model, tokenizer, model_config, kv_config="default", *, stop_token_ids=(),
                   max_seq_len: int | None = None, **executor_kwargs) -> "LLM":
        """An LLM over an already loaded model (``load_model``'s triple); ``tokenizer`` may be ``None``
        (prompts must then be token ids). Other arguments as :class:`LLM`."""
        from ..config import resolve_kv_config

        self = cls.__new__(cls)
        kv_config = resolve_kv_config(kv_config)
        self._start(model, tokenizer, model_config, kv_config, set(stop_token_ids), max_seq_len=max_seq_len,
                    **executor_kwargs)
        return self

    def _start_tensor_parallel(self, model, kv_config, tensor_parallel_size: int, *, device, dtype, num_threads,
                               **executor_kwargs) -> None:
        """``LLM(..., tensor_parallel_size=N)``: the same loop thread over a :class:`TensorParallelExecutor`."""
        import torch

        from ..config import resolve_kv_config
        from ..parallel.launcher import TensorParallelExecutor

        if model is not None:
            try:
                from ..export.engine_dir import is_engine_dir
            except ImportError:  # the build package is optional
                is_engine_dir = None
            if is_engine_dir is not None and is_engine_dir(model):
                raise ValueError(f"tensor_parallel_size={tensor_parallel_size} takes a HF folder, a .gguf or None; "
                                 f"{model} is an engine dir (pass the model it was built from)")
        device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        executor_kwargs = _with_default_sizes({k: v for k, v in executor_kwargs.items() if v is not None}, device)
        executor = TensorParallelExecutor(model, resolve_kv_config("default" if kv_config is None else kv_config),
                                          tensor_parallel_size, device=device, dtype=dtype, num_threads=num_threads,
                                          **executor_kwargs)
        self._start(None, executor.tokenizer, executor.model_config, executor.kv_config, executor.stop_token_ids,
                    executor=executor)

    def _start(self, model, tokenizer, model_config, kv_config, stop_ids, *, max_seq_len=None, executor=None,
               kv_config_checked: bool = False, **executor_kwargs):
        """Start the loop thread over ``executor``, or over an :class:`Executor` built from one
        :class:`~trtllm_diffkv.engine_config.EngineConfig` of ``max_seq_len`` and ``executor_kwargs`` (``None``
        values left out); ``kv_config_checked``: :func:`load_source` already validated ``kv_config`` for the model."""
        from ..runtime.executor import Executor

        self.tokenizer, self.model_config, self.kv_config = tokenizer, model_config, kv_config
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_ids = set(stop_ids) | ({eos} if eos is not None else set())
        if executor is None:
            executor_kwargs = {k: v for k, v in executor_kwargs.items() if v is not None}
            device = executor_kwargs.get("device") or next(model.parameters()).device
            engine_config = EngineConfig(max_seq_len=max_seq_len, **_with_default_sizes(executor_kwargs, device))
            executor = Executor(model, model_config, kv_config, engine_config, tokenizer=tokenizer,
                                stop_token_ids=tuple(self.stop_token_ids), kv_config_checked=kv_config_checked)
        self.executor = executor
        self.max_batch_size = executor.max_batch_size
        self.max_seq_len = self.executor.max_seq_len  # checked and capped at the model's positions there
        self._commands: queue.Queue = queue.Queue()
        self._live: dict[int, AsyncRequest] = {}  # owned by the loop thread
        self._ids = itertools.count()
        self._counts = {"requests_submitted": 0, "requests_finished": 0, "requests_failed": 0, "requests_cancelled": 0,
                        "step_errors": 0, "prompt_tokens": 0}
        self._counts_lock = threading.Lock()
        self._groups = weakref.WeakValueDictionary()  # group request id -> RequestGroup, while its caller holds it
        self._closed = False
        self._max_prompt_chars = None
        self._submit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="trtllm-diffkv-llm", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ submission
    def generate(self, prompts, sampling_params=None, *, chat_template: bool = False):
        """Generate for one prompt or a batch, in-flight batched; blocks until all finish.

        Args:
            prompts: a ``str``, a list of token ids, or a list of either (a batch). A list of numbers is one
                prompt (a ``bool`` or ``float`` among them fails it, named), never a batch of numbers.
            sampling_params: ``None`` (greedy, 64 tokens), one
                :class:`~trtllm_diffkv.runtime.sampling.SamplingParams` for all, or a list (one per prompt).
            chat_template: wrap ``str`` prompts in the tokenizer's chat template.

        Returns:
            one :class:`RequestOutput` for a single prompt, else a list in the prompts' order. A bad
            prompt or bad sampling values give an output with ``error`` set; the others go on.

        Raises:
            ValueError: ``sampling_params`` is a list whose length differs from the batch's.
        """
        if hasattr(prompts, "tolist") and getattr(prompts, "ndim", None) == 1:  # a 1-D tensor / array: one prompt
            prompts = prompts.tolist()
        single = isinstance(prompts, (str, bytes)) or (isinstance(prompts, (list, tuple)) and bool(prompts)
                                                       and all(isinstance(t, numbers.Number) for t in prompts))
        batch = [prompts] if single else list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(batch):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(batch)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(batch)
        requests = [self.generate_async(p, sp, chat_template=chat_template) for p, sp in zip(batch, params)]
        outputs = [request.result() for request in requests]
        return outputs[0] if single else outputs

    def generate_stream(self, prompt, sampling_params=None, *, chat_template: bool = False):
        """Stream one request: yields cumulative :class:`RequestOutput` (``text_diff`` / ``token_ids_diff``
        hold what is new), the last one with ``finished`` set. Leaving the loop early aborts the request."""
        request = self.generate_async(prompt, sampling_params, streaming=True, chat_template=chat_template)
        try:
            yield from request
        finally:
            if not request.finished:
                request.abort()

    def generate_async(self, prompt, sampling_params=None, *, streaming: bool = False,
                       chat_template: bool = False, _listener=None) -> AsyncRequest | RequestGroup:
        """Submit one request; returns at once with its :class:`AsyncRequest` (never raises for the request's
        content: a bad prompt or bad sampling values finish it with ``error``). ``n > 1`` or ``best_of > 1``:
        a :class:`RequestGroup` of independent child requests (seeds derived from the request's seed); it
        streams all ``n`` sequences with ``streaming=True`` unless ``best_of > n`` (then the request fails:
        the ``n`` best are known only at the end).

        Raises:
            RuntimeError: the LLM was shut down.
        """
        if self._closed:
            raise RuntimeError("this LLM was shut down; create a new one")
        from ..runtime.sampling import SamplingParams

        problem = self.health()
        if problem is not None:  # the request's content is not at fault: a server answers 503
            request = AsyncRequest(self, next(self._ids), prompt if isinstance(prompt, str) else None, [],
                                   sampling_params, streaming, self.stop_token_ids, _listener)
            request._channel.put(RequestEvent([], True, "error", f"{UNAVAILABLE}: {problem}"))
            self._count("requests_submitted", "requests_failed")
            return request

        params = SamplingParams.greedy_params() if sampling_params is None else sampling_params
        if isinstance(params, SamplingParams) and params.num_sequences != 1 and _valid(params, self.model_config):
            if not streaming:
                return self._group(RequestGroup([self.generate_async(prompt, child, chat_template=chat_template,
                                                                     _listener=_listener)
                                                 for child in params.child_params()], params))
            if params.best_of in (None, params.n):
                listener = queue.Queue()
                return self._group(RequestGroup([self.generate_async(prompt, child, streaming=True,
                                                                     chat_template=chat_template, _listener=listener)
                                                 for child in params.child_params()], params, listener=listener))
        rid = next(self._ids)
        text = prompt if isinstance(prompt, str) else None
        try:
            if not isinstance(params, SamplingParams):  # before the prompt is tokenized
                raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
            ids = self.executor.check_request(self._prompt_ids(prompt, chat_template), params)  # validates params
            if streaming and params.num_sequences != 1:  # valid with n > 1 here: only best_of > n
                raise ValueError(f"n={params.n} / best_of={params.best_of}: best_of > n cannot stream (the n best "
                                 "are known only at the end; use streaming=False)")
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            request = AsyncRequest(self, rid, text, [], params, streaming, self.stop_token_ids, _listener)
            request._channel.put(RequestEvent([], True, "error", self._failure(exc)))
            self._count("requests_submitted", "requests_failed")
            return request
        request = AsyncRequest(self, rid, text, ids, params, streaming, self.stop_token_ids, _listener)
        self._count("requests_submitted")
        with self._counts_lock:
            self._counts["prompt_tokens"] += len(ids)
        with self._submit_lock:  # shutdown() cannot slip between this check and the put
            if self._closed:  # shut down while the prompt was being tokenized: answer it here
                request._channel.put(RequestEvent([], True, "abort",
                                                  "the LLM was shut down before the request started"))
                self._count("requests_cancelled")
            else:
                self._commands.put(("add", request))
        return request

    def max_prompt_chars(self) -> int | None:
        """Characters a prompt text may have at most: ``max_seq_len`` tokens x :func:`max_token_chars`.
        A longer text cannot fit in any tokenization, so it is refused before it is tokenized (a 24 MB
        prompt would take tens of seconds to tokenize only to be refused). ``None`` without a tokenizer."""
        if self._max_prompt_chars is None and hasattr(self.tokenizer, "get_vocab"):
            self._max_prompt_chars = self.max_seq_len * max_token_chars(self.tokenizer)
        return self._max_prompt_chars

    def _prompt_ids(self, prompt, chat_template: bool) -> list[int]:
        from ..generation.prompts import check_prompt_text

        if isinstance(prompt, str):
            check_prompt_text(prompt)  # "" is empty; whitespace is a prompt (OpenAI and vLLM take it)
            if self.tokenizer is None:
                raise ValueError("the model has no tokenizer files: give prompts as lists of token ids")
            limit = self.max_prompt_chars()
            if limit is not None and len(prompt) > limit:
                raise ValueError(f"prompt of {len(prompt)} characters exceeds max_seq_len {self.max_seq_len} in any "
                                 f"tokenization ({limit} characters at most)")
            return encode_prompt(self.tokenizer, prompt, chat_template)
        if hasattr(prompt, "tolist"):  # a 1-D tensor / array of ids
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"a prompt is a str or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)  # checked by check_prompt_ids

    def health(self) -> str | None:
        """``None`` while this LLM can serve, else why not: its generation loop stopped, or its executor cannot step
        again (a tensor-parallel group whose rank failed or exited:
        :attr:`~trtllm_diffkv.parallel.TensorParallelExecutor.broken`). Cheap (no step is waited for): servers
        answer ``/health`` with it. From then on every request fails at once with an error starting with
        :data:`UNAVAILABLE` (``trtllm-diffkv serve``: a 503); create a new ``LLM``."""
        if self._closed:
            return "the LLM was shut down"
        if not self._thread.is_alive():
            return "the generation loop is not running"
        broken = getattr(self.executor, "broken", None)
        if broken is not None:
            return f"the tensor-parallel group is broken: {broken}"
        return None

    def _failure(self, exc: Exception) -> str:
        """The error message of a request that ``exc`` refused: :data:`UNAVAILABLE` and why when the LLM cannot
        serve any more (the executor raised because its group broke), else the exception's own."""
        problem = self.health()
        return f"{UNAVAILABLE}: {problem}" if problem is not None else _message(exc)

    def _group(self, group: RequestGroup) -> RequestGroup:
        """Remember ``group`` under its ``request_id`` (its first child's) while the caller holds it, so that
        :meth:`abort` of that id cancels every child."""
        with self._counts_lock:
            self._groups[group.request_id] = group
        return group

    def abort(self, request_id: int) -> None:
        """Cancel a request: it finishes with ``finish_reason == "cancelled"``; its pages are freed by the
        loop thread before its next step. The ``request_id`` of a :class:`RequestGroup` (``n > 1`` /
        ``best_of``) cancels every child, as ``group.abort()``. A finished or unknown id is ignored."""
        if self._closed:
            return
        with self._counts_lock:
            group = self._groups.get(request_id)
        for rid in [request_id] if group is None else [child.request_id for child in group.children]:
            self._commands.put(("abort", rid))

    def stats(self) -> dict:
        """LLM counters (``requests_submitted``, ``requests_finished``, ``requests_failed``,
        ``requests_cancelled``, ``step_errors``: steps that raised, ``prompt_tokens``: prompt tokens of the
        requests accepted) and the
        executor's ``stats()`` (running, waiting, pool pages, kv_memory_fraction, tokens/s, ...; read
        between steps: it waits for a step in progress to end)."""
        with self._counts_lock:
            counts = dict(self._counts)
        return {**self.executor.stats(), **counts}

    def shutdown(self) -> None:
        """Cancel every unfinished request (freeing its pages), stop and join the loop thread. Idempotent."""
        with self._submit_lock:  # every "add" queued before this is handled or cancelled by the loop
            if not self._closed:
                self._closed = True
                self._commands.put(("shutdown",))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        close = getattr(self.executor, "close", None)  # the tensor-parallel ranks
        if close is not None and not self._thread.is_alive():
            close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ the loop thread
    def _loop(self) -> None:
        device = getattr(self.executor, "device", None)
        if device is not None and device.type == "cuda":
            import torch

            torch.cuda.set_device(device)  # kernels launch on the thread's current device
        running = True
        while running:
            for command in take_all(self._commands, block=not self._live):
                running = self._handle(command) and running
            if running and self._live:
                self._step()
        self._cancel_all("the LLM was shut down before the request finished")

    def _handle(self, command) -> bool:
        kind = command[0]
        if kind == "add":
            self._add(command[1])
        elif kind == "abort":
            self._finish_aborted(command[1], None)
        return kind != "shutdown"

    def _add(self, request: AsyncRequest) -> None:
        self._live[request.request_id] = request
        try:
            self.executor.add_request(request.prompt_token_ids, request.sampling_params,
                                      request_id=request.request_id)
        except Exception as exc:  # noqa: BLE001 - the request fails alone
            self._finish_aborted(request.request_id, self._failure(exc))

    def _step(self) -> None:
        if not self.executor.has_unfinished():  # nothing left to run for requests still waiting here
            for rid in list(self._live):
                self._finish_aborted(rid, "the executor dropped the request without a final update")
            return
        try:
            updates = self.executor.step()
        except Exception as exc:  # noqa: BLE001 - fail the requests in the step, keep serving
            self._count("step_errors")
            for rid in self._in_step():
                self._finish_aborted(rid, f"the executor step failed: {_message(exc)}")
            return
        for update in updates:
            request = self._live.get(update.request_id)
            if request is None:
                continue  # aborted here already
            metrics = _metrics(update.result) if update.finished else None
            text = getattr(update.result, "text", None) if update.finished else None
            request._channel.put(RequestEvent(list(update.new_token_ids), update.finished, update.finish_reason,
                                        update.error, update.stop_token_id, metrics, text, update.stop_reason,
                                        getattr(update, "logprobs", None), getattr(update, "prompt_logprobs", None)))
            if update.finished:
                del self._live[update.request_id]
                reason = update.finish_reason
                self._count("requests_cancelled" if reason == "abort" else "requests_failed" if reason == "error"
                            else "requests_finished")

    def _in_step(self) -> list[int]:
        """Ids of the requests a failed step may have touched: those the executor has running (all live
        ones when it does not say)."""
        running = getattr(self.executor, "running", None)
        if running is None:
            return list(self._live)
        ids = [getattr(r, "request_id", r) for r in running]
        return [rid for rid in ids if rid in self._live]

    def _finish_aborted(self, rid, error: str | None) -> None:
        request = self._live.pop(rid, None)
        if request is None:
            return
        try:
            self.executor.abort(rid)
        except Exception as exc:  # noqa: BLE001 - the request ends either way
            error = error or f"abort failed: {_message(exc)}"
        request._channel.put(RequestEvent([], True, "error" if error else "abort", error))
        self._count("requests_failed" if error else "requests_cancelled")

    def _cancel_all(self, why: str) -> None:
        while True:  # submissions that raced with shutdown
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                self._add(command[1])
        for rid in list(self._live):
            request = self._live.pop(rid)
            try:
                self.executor.abort(rid)
            except Exception:  # noqa: BLE001 - shutting down: the request is cancelled either way
                pass
            request._channel.put(RequestEvent([], True, "abort", why))
            self._count("requests_cancelled")

    def _count(self, *names: str) -> None:
        with self._counts_lock:
            for name in names:
                self._counts[name] += 1


def _valid(params, model_config) -> bool:
    """Whether ``params`` pass :meth:`SamplingParams.validate` (else the single-request path fails them)."""
    try:
        params.validate(model_config.vocab_size)
    except ValueError:
        return False
    return True


def _message(exc: Exception) -> str:
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


def _metrics(result) -> dict | None:
    if result is None:
        return None
    if is_dataclass(result):
        return asdict(result)
    return dict(result) if isinstance(result, dict) else None
