"""The engine's settings: one frozen :class:`EngineConfig`, validated once when it is made.

The settings are the model-independent ones of the in-flight executor (:class:`~trtllm_diffkv.runtime.executor.Executor`),
its resource manager (:class:`~trtllm_diffkv.runtime.resource_manager.DiffKVResourceManager`) and the paged cache:
batch and step sizes, the KV budget, page sizing, chunked prefill, CUDA graphs and the kernel backend. The DiffKV
policy is :class:`~trtllm_diffkv.config.DiffKVConfig`; the model's shape is its ``ModelConfig``. :class:`LLM
<trtllm_diffkv.llmapi.LLM>` builds one from its keyword arguments (TensorRT-LLM's ``LLM`` names); the table of
fields with units, defaults and rules is in docs/RUNTIME.md, "Engine config".

``None`` in a size means "derived from the model": the resource manager fills ``max_seq_len``,
``max_num_tokens`` and ``device`` (:func:`~trtllm_diffkv.runtime.resource_manager.resolve_engine_config`), the paged
cache ``chunk_staging_bytes``.

Pure Python: the core's lowest floor may import it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .validators import (boolean, choice, number_in_range, optional_boolean, optional_non_negative_int,
                         optional_positive_int, positive_int)

__all__ = ["EngineConfig", "DEFAULT_MAX_NUM_TOKENS", "PAGE_MANAGERS", "READ_PATHS"]

DEFAULT_MAX_NUM_TOKENS = 8192
"""Default ``max_num_tokens`` with chunked prefill: a step carries the running decodes and at most this many
tokens in all (TensorRT-LLM's ``max_num_tokens`` default). Prompts that a step can carry beside the decodes go
whole (waiting a step when earlier prompts used the room); longer ones are chunked. Not vLLM's 2048: on the
H200 each prompt step is ~35 ms of host work at the default model's shape, and 2048-token steps ran the
servers' workload (one ~2k-token prompt in eight) at about half the requests/s of 8192 on the executor alone
(docs/PERFORMANCE.md, "Chunked prefill steps")."""

PAGE_MANAGERS = ("auto", "cpu", "triton")
"""``page_manager`` values: ``"triton"`` (``TritonPageManager``), ``"cpu"`` (``CpuPageManager``), ``"auto"``:
Triton on CUDA, CPU otherwise."""

READ_PATHS = ("auto", "torch")
"""``read_path`` values: ``"auto"``, the read-path kernels when present; ``"torch"``, the torch attention beside
the Triton write path (tests of the write path on the GPU)."""


@dataclass(frozen=True)
class EngineConfig:
    """The executor's settings (frozen; checked once, in ``__post_init__``).

    Attributes:
        max_batch_size: requests in one step at most (request slots). Integer >= 1; default 64.
        max_num_tokens: tokens one step carries at most (TensorRT-LLM's name): decodes first, then prompt chunks.
            Integer >= 1, or ``None``: :data:`DEFAULT_MAX_NUM_TOKENS` (or ``max_batch_size`` if larger) with
            chunked prefill, ``max(8192, max_seq_len)`` without. The executor requires ``>= max_batch_size``.
        max_seq_len: tokens of one request at most, prompt + ``max_tokens``. Integer >= 1, or ``None``: the
            model's positions (the executor caps a larger value there).
        kv_memory_bytes: bytes of the KV budget: the page pool + the page manager's bookkeeping + the row
            metadata. Integer >= 1, or ``None``.
        kv_memory_fraction: the KV budget as a fraction of the free GPU memory when the cache is built, in
            (0, 1]; CUDA only. ``None`` with ``kv_memory_bytes`` also ``None``: 0.9 on CUDA (TensorRT-LLM's
            ``free_gpu_memory_fraction``). At most one of the two is given.
        high_tokens_per_page: tokens of a high-tier (or FP16) page (:meth:`~trtllm_diffkv.memory.PageFormat.for_config`).
            Integer >= 1; default 32.
        enable_chunked_prefill: split prompts over steps (TensorRT-LLM's and vLLM's name). ``True`` or ``False``;
            default ``True``. ``False``: each prompt is prefilled in one step.
        chunk_staging_bytes: bytes the full-precision staging of half-prefilled prompts holds at once (outside the
            KV budget). Integer >= 0, or ``None``: one prompt of ``max_seq_len`` tokens. Unused without chunked
            prefill.
        use_cuda_graphs: replay decode-only steps from CUDA graphs. ``True``, ``False`` or ``None`` (default: on
            when the device is CUDA and the cache runs the Triton kernels); ``True`` on a CPU is refused by the
            executor.
        split_mixed_steps: run a step's decodes and prompts as two model calls, decodes first. ``True``,
            ``False`` or ``None`` (default: as ``use_cuda_graphs``).
        disable_overlap_scheduler: ``True``: every step reads its own results before it returns; ``False``:
            overlap decode-only steps. ``None`` (default): overlap where CUDA graphs are on, in one process.
        use_triton: the Triton kernels (``True`` on the CPU needs ``TRITON_INTERPRET=1``) or their torch versions.
            ``True``, ``False`` or ``None`` (default: on CUDA).
        page_manager: one of :data:`PAGE_MANAGERS`; default ``"auto"``.
        read_path: one of :data:`READ_PATHS`; default ``"auto"``.
        device: where the cache lives (a ``torch.device`` or its name), or ``None``: the model's device.
        profile: synchronize around the executor's timed regions so that its ``bookkeeping_fraction`` measures
            device time (benchmarks only; slower). ``True`` or ``False``; default ``False``.

    Raises:
        ValueError: a field outside its rule, naming the field (``"max_batch_size=0 must be a positive integer"``),
            or both ``kv_memory_bytes`` and ``kv_memory_fraction``.
        TypeError: an unknown field (``EngineConfig(**kwargs)``).
    """

    max_batch_size: int = 64
    max_num_tokens: int | None = None
    max_seq_len: int | None = None
    kv_memory_bytes: int | None = None
    kv_memory_fraction: float | None = None
    high_tokens_per_page: int = 32
    enable_chunked_prefill: bool = True
    chunk_staging_bytes: int | None = None
    use_cuda_graphs: bool | None = None
    split_mixed_steps: bool | None = None
    disable_overlap_scheduler: bool | None = None
    use_triton: bool | None = None
    page_manager: str = "auto"
    read_path: str = "auto"
    device: object = None
    profile: bool = False

    def __post_init__(self) -> None:
        boolean("enable_chunked_prefill", self.enable_chunked_prefill)
        for name in ("max_seq_len", "max_num_tokens"):
            optional_positive_int(name, getattr(self, name))
        optional_non_negative_int("chunk_staging_bytes", self.chunk_staging_bytes)
        positive_int("max_batch_size", self.max_batch_size)
        if self.kv_memory_bytes is not None and self.kv_memory_fraction is not None:
            raise ValueError("give one of kv_memory_bytes and kv_memory_fraction, not both")
        if self.kv_memory_bytes is not None:
            positive_int("kv_memory_bytes", self.kv_memory_bytes)
        if self.kv_memory_fraction is not None:
            number_in_range("kv_memory_fraction", self.kv_memory_fraction, 0, 1, low_open=True)
        positive_int("high_tokens_per_page", self.high_tokens_per_page)
        for name in ("use_cuda_graphs", "split_mixed_steps", "disable_overlap_scheduler", "use_triton"):
            optional_boolean(name, getattr(self, name))
        choice("page_manager", self.page_manager, PAGE_MANAGERS)
        choice("read_path", self.read_path, READ_PATHS)
        boolean("profile", self.profile)

    @property
    def staging_limit_bytes(self) -> int | None:
        """Staging bytes the cache may hold: ``chunk_staging_bytes`` with chunked prefill, else 0 (no chunked
        prompts); ``None`` while ``chunk_staging_bytes`` is not resolved."""
        return self.chunk_staging_bytes if self.enable_chunked_prefill else 0

    def replace(self, **changes) -> "EngineConfig":
        """A copy with ``changes`` (checked like a new one)."""
        return dataclasses.replace(self, **changes)

