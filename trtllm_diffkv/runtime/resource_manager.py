"""The page-pool runtime wrapper: one object owns the paged cache's pool, page manager and slots between steps.

:class:`DiffKVResourceManager` is the design card's runtime wrapper with the contract of
TensorRT-LLM's PyTorch-executor ``BaseResourceManager``
(``tensorrt_llm/_torch/pyexecutor/resource_manager.py``), so a TensorRT-LLM adapter can drive
it without changes. TensorRT-LLM's PyExecutor step is: fetch requests -> schedule ->
``prepare_resources(batch)`` -> forward -> sample -> update requests -> ``update_resources(batch)``;
finished requests go to ``free_resources(request)``; the capacity scheduler asks
``get_max_resource_count()`` and ``get_needed_resource_to_completion(request)``.

=====================================  ==========================================================
TensorRT-LLM ``BaseResourceManager``   here
=====================================  ==========================================================
``prepare_resources(scheduled_batch)`` slots for the context requests, then ONE
                                       :meth:`PagedDiffKVCache.plan` of the step (prefill reserve,
                                       decode decisions of every layer, one ``append_decode``)
``update_resources(scheduled_batch)``  after forward + sampling: the step's non-finite K/V flags
                                       (per request) and the true free page count
``free_resources(request)``            every page of the request back to the ring; slot freed
``get_max_resource_count()``           pages in the pool
``get_needed_resource_to_completion``  worst-case pages the request holds at its end
=====================================  ==========================================================

The budget (``kv_memory_bytes``, or ``kv_memory_fraction`` of the free GPU memory) covers
the pool AND the page manager's bookkeeping (ring, page table, per-row tier counts, slot
states) AND the per-row metadata (fp16 key offsets), so the bytes asked for are the bytes
allocated (:meth:`DiffKVResourceManager.allocated_bytes`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..config import DiffKVConfig
from ..engine_config import DEFAULT_MAX_NUM_TOKENS, EngineConfig
from ..generation.prompts import position_limit
from ..memory import PageFormat, PageManager
from ..paged.cache import NONFINITE_KV_ERROR, PagedDiffKVCache
from ..paged.row_meta import RowMetadataFormat
from ..validators import number_in_range, positive_int
from .request import Request


@dataclass
class ScheduledBatch:
    """One step's requests (TensorRT-LLM's ``ScheduledRequests``): context (prefill) requests run
    first, then generation (decode) requests; each a :class:`~.request.Request`."""

    context_requests: list[Request] = field(default_factory=list)
    generation_requests: list[Request] = field(default_factory=list)

    @property
    def all_requests(self) -> list[Request]:
        return self.context_requests + self.generation_requests

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)

    @property
    def num_tokens(self) -> int:
        """Tokens of the step: every context request's prefill chunk + one per generation request."""
        return sum(r.num_new_tokens for r in self.context_requests) + len(self.generation_requests)


def kv_budget_bytes(kv_memory_bytes: int | None, kv_memory_fraction: float | None, device: torch.device) -> int:
    """The byte budget from exactly one of a byte count and a fraction of the device's free memory now.

    Raises:
        ValueError: both given, a non-positive byte count, a fraction outside (0, 1], or a
            fraction (or neither) on a device that is not CUDA (give ``kv_memory_bytes`` there).
    """
    if kv_memory_bytes is not None and kv_memory_fraction is not None:
        raise ValueError("give one of kv_memory_bytes and kv_memory_fraction, not both")
    if kv_memory_bytes is not None:
        return positive_int("kv_memory_bytes", kv_memory_bytes)
    if device.type != "cuda":
        raise ValueError(f"on {device} give kv_memory_bytes (kv_memory_fraction is a fraction of free GPU memory)")
    fraction = 0.9 if kv_memory_fraction is None else kv_memory_fraction
    number_in_range("kv_memory_fraction", fraction, 0, 1, low_open=True)
    free_bytes, _total = torch.cuda.mem_get_info(device)
    return int(free_bytes * fraction)


def resolve_engine_config(engine_config: EngineConfig, model_config) -> EngineConfig:
    """``engine_config`` with its model-derived sizes filled in (the one home of those defaults).

    ``max_seq_len`` ``None``: the model's positions (:func:`~trtllm_diffkv.generation.prompts.position_limit`;
    a given value is kept as is: the executor caps it). ``max_num_tokens`` ``None``: ``max(8192,
    max_batch_size)`` with chunked prefill, else ``max(8192, max_seq_len)``. ``device`` ``None``: CUDA when
    available, else the CPU. ``chunk_staging_bytes`` stays as it is: the paged cache, the staging's owner, sizes
    ``None`` (one prompt of ``max_seq_len`` tokens). A config with those three given comes back unchanged.
    """
    engine, mc = engine_config, model_config
    max_seq_len = engine.max_seq_len or position_limit(mc)
    max_num_tokens = engine.max_num_tokens
    if max_num_tokens is None:
        max_num_tokens = max(DEFAULT_MAX_NUM_TOKENS, engine.max_batch_size) if engine.enable_chunked_prefill \
            else max(8192, max_seq_len)
    device = engine.device if engine.device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    resolved = dict(max_seq_len=max_seq_len, max_num_tokens=max_num_tokens, device=device)
    if all(getattr(engine, name) == value for name, value in resolved.items()):
        return engine
    return engine.replace(**resolved)


def pages_in_budget(budget_bytes: int, page_format: PageFormat, *, max_slots: int, rows_per_slot: int,
                    max_seq_len_tokens: int, row_bytes: int) -> int:
    """Pages that fit in ``budget_bytes`` once the page manager's bookkeeping and the row metadata are paid.

    The bookkeeping is :attr:`PageManager.bookkeeping_bytes` (linear in ``num_pages``: one int32
    ring entry per page, plus the page table and counters of ``max_slots * rows_per_slot`` rows).
    """
    def bookkeeping(num_pages: int) -> int:
        probe = SimpleNamespace(num_pages=num_pages, max_slots=max_slots, rows_per_slot=rows_per_slot,
                                max_pages_per_row=-(-max_seq_len_tokens // page_format.min_tokens_per_page) + 1)
        return PageManager.bookkeeping_bytes.fget(probe)

    fixed = bookkeeping(0) + max_slots * rows_per_slot * row_bytes
    per_page = page_format.page_size_bytes + bookkeeping(1) - bookkeeping(0)
    return max(0, (budget_bytes - fixed) // per_page)


class DiffKVResourceManager:
    """Owns the :class:`PagedDiffKVCache` (pool + page manager + row metadata) and the request slots.

    Args:
        model_config: the model's shape (``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``).
        kv_config: the DiffKV policy (``fp16`` preset: no compression).
        engine_config: the sizes and backends (:class:`~trtllm_diffkv.engine_config.EngineConfig`; default: its
            defaults). Read here: ``max_batch_size`` (request slots), ``max_seq_len`` (sizes the page table),
            ``max_num_tokens`` (sizes the cache's output buffer), ``kv_memory_bytes`` (pool + bookkeeping + row
            metadata) or ``kv_memory_fraction`` (of the free GPU memory now, ``torch.cuda.mem_get_info``; 0.9 on
            CUDA when neither is given, as TensorRT-LLM's ``free_gpu_memory_fraction``), ``high_tokens_per_page``,
            ``use_triton``, ``page_manager``, ``read_path``, and the staging of prompts prefilled in chunks
            (:attr:`EngineConfig.staging_limit_bytes`; outside the budget), ``device`` (where the pool lives).
            ``None`` sizes and device are filled by :func:`resolve_engine_config` (the staging by the cache).
        dtype: the model dtype.
        kv_config_checked: the caller already ran ``kv_config.validate_for_model`` for this model (the executor
            does, before building this manager): not again here.

    Attributes:
        cache: the :class:`PagedDiffKVCache`; the model's attention backend.
        budget_bytes: the budget the sizes were computed from.
        engine_config: ``engine_config`` resolved (:func:`resolve_engine_config`).

    Raises:
        ValueError: a bad budget (see :func:`kv_budget_bytes`), a budget below one page after
            the bookkeeping, or a configuration the cache refuses.
    """

    def __init__(self, model_config, kv_config: DiffKVConfig, engine_config: EngineConfig | None = None, *,
                 dtype: torch.dtype = torch.float32, kv_config_checked: bool = False) -> None:
        mc = model_config
        engine = resolve_engine_config(EngineConfig() if engine_config is None else engine_config, mc)
        device = torch.device(engine.device)
        max_batch_size, max_seq_len_tokens = engine.max_batch_size, engine.max_seq_len
        self.budget_bytes = kv_budget_bytes(engine.kv_memory_bytes, engine.kv_memory_fraction, device)
        kv_config = kv_config.for_model(mc)  # the model's sliding-window layers, if any (self when already there)
        if not kv_config_checked:
            kv_config.validate_for_model(mc.head_dim, mc.num_heads, mc.num_kv_heads, mc.num_layers)
        fmt = PageFormat.for_config(kv_config, mc.head_dim, engine.high_tokens_per_page)
        rows_per_slot = mc.num_layers * mc.num_kv_heads
        num_pages = pages_in_budget(self.budget_bytes, fmt, max_slots=max_batch_size, rows_per_slot=rows_per_slot,
                                    max_seq_len_tokens=max_seq_len_tokens,
                                    row_bytes=RowMetadataFormat.for_config(kv_config, mc.head_dim).row_bytes)
        if num_pages < 1:
            raise ValueError(f"a KV budget of {self.budget_bytes} bytes holds no {fmt.page_size_bytes}-byte page once "
                             f"the page table of {max_batch_size} slots x {max_seq_len_tokens} tokens is paid; give more "
                             "bytes, or lower max_batch_size / max_seq_len")
        self.cache = PagedDiffKVCache(kv_config, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim, engine,
                                      num_pages=num_pages, dtype=dtype, kv_config_checked=True)
        self.kv_config, self.device, self.engine_config = kv_config, device, engine
        self.max_batch_size, self.max_seq_len_tokens = max_batch_size, max_seq_len_tokens
        self.max_num_tokens = engine.max_num_tokens
        self._free_slots = list(range(max_batch_size - 1, -1, -1))  # pop() takes the lowest slot
        self._slot_owner: dict[int, Request] = {}
        self.free_pages_after_step = num_pages  # true count read with the last step's status

    # ------------------------------------------------------------------ TensorRT-LLM contract
    def prepare_resources(self, batch: ScheduledBatch, *, pad_to: int | None = None,
                          known_free_pages: int | None = None) -> None:
        """Slots for the new context requests, then plan the step (TensorRT-LLM ``prepare_resources``).

        ONE :meth:`PagedDiffKVCache.plan`: prefill requests reserve their prompt pages at their first
        chunk (all tokens counted high; a request's chunk is ``Request.num_new_tokens`` tokens from
        ``Request.num_cached_tokens``), decode requests get every layer's decisions and one ``append_decode``.

        Args:
            batch: the step's requests.
            pad_to: a decode-only step padded to a CUDA-graph bucket (``PagedDiffKVCache.plan``).
            known_free_pages: a lower bound on the free pages (the executor's estimate) that
                spares ``plan`` its device read of the free count when the step fits in it.

        Raises:
            OutOfPagesError: too few free pages for the worst case of the step; nothing changed
                (the context requests' slots are given back).
            ValueError: too many requests or tokens, or a request the cache refuses.
        """
        new = [r for r in batch.context_requests if r.slot is None]
        if len(new) > len(self._free_slots):
            raise ValueError(f"{len(new)} new context requests, {len(self._free_slots)} free slots")
        taken = []
        for request in new:
            request.slot = self._free_slots.pop()
            self._slot_owner[request.slot] = request
            taken.append(request)
        reqs = batch.all_requests
        try:
            self.cache.plan([r.slot for r in reqs], [r.seq_len for r in reqs],
                            [r.num_cached_tokens for r in reqs], [r.is_prefill for r in reqs],
                            pad_to=pad_to, known_free_pages=known_free_pages,
                            prompt_lens=[len(r.prefill_token_ids) if r.is_prefill else r.seq_len for r in reqs],
                            decoded_from=[len(r.prompt_token_ids) if r.is_prefill else r.seq_len for r in reqs])
        except Exception:
            for request in taken:
                self._give_slot(request)
            raise

    def update_resources(self, batch: ScheduledBatch, status: list[int] | None = None) -> dict:
        """After forward and sampling (TensorRT-LLM ``update_resources``): per-request errors of the step.

        Args:
            batch: the step's batch (its layers all ran).
            status: the host values of :meth:`device_status` when the caller read them in its
                one device-to-host copy; ``None`` reads them here (one device read).

        Returns:
            ``{request_id: message}`` for requests whose keys or values were not finite (edge
            case 1); the caller fails them and calls :meth:`free_resources`. Also updates
            :attr:`free_pages_after_step`, the true free page count after the step's allocations, and copies each
            request's length from the cache (``cache.seq_len[slot]``, the one owner) into ``num_cached_tokens``.
        """
        if status is None:
            status = self.device_status().tolist()
        flags, (start, end) = status[:self.max_batch_size], status[self.max_batch_size:]
        self.free_pages_after_step = int(end - start)
        self.note_lengths(batch)
        return {r.request_id: NONFINITE_KV_ERROR for r in batch.all_requests if flags[r.slot]}

    def note_lengths(self, batch: ScheduledBatch) -> None:
        """Copy each request's length from the cache (``cache.seq_len[slot]``, the one owner, advanced by the
        step's ``end_step``) into ``num_cached_tokens`` and clear its chunk (host only). Called by
        :meth:`update_resources`, and by the executor right after launching a step it reads later."""
        seq_len = self.cache.seq_len
        for request in batch.all_requests:
            request.num_cached_tokens, request.prefill_chunk_tokens = seq_len[request.slot], 0

    def free_resources(self, request: Request) -> None:
        """Every page of the request back to the ring and its slot freed (TensorRT-LLM ``free_resources``);
        a request without a slot is a no-op."""
        if request.slot is None:
            return
        self.cache.release([request.slot])
        self._give_slot(request)

    def get_max_resource_count(self) -> int:
        """Pages in the pool (TensorRT-LLM ``get_max_resource_count``)."""
        return self.cache.manager.num_pages

    def get_needed_resource_to_completion(self, request: Request) -> int:
        """Worst-case pages the request holds at its end (TensorRT-LLM ``get_needed_resource_to_completion``).

        With ``N`` = prompt + ``max_tokens`` tokens, per (layer, KV head) row: the prompt
        reserve, or ``ceil(N / P_high)`` high pages + ``ceil(N / P_low)`` low pages with
        compression (pages never return before the end, paper section 5). DiffKV's pruning and
        low tier usually need far fewer: the executor admits by the step's need instead.
        """
        fmt, n = self.cache.page_format, len(request.prompt_token_ids) + request.sampling_params.max_tokens
        per_row = fmt.pages_for_tokens("high", n) + (fmt.pages_for_tokens("low", n) if self.kv_config.tiered else 0)
        per_row = max(per_row, fmt.prompt_reserve_pages(max(1, len(request.prompt_token_ids))))
        return self.cache.rows_per_slot * per_row

    # ------------------------------------------------------------------ sizing and status
    def prefill_pages_needed(self, num_tokens: int) -> int:
        """Pages a prefill of ``num_tokens`` tokens reserves (page manager's ``reserve_pages_needed``)."""
        return self.cache.manager.reserve_pages_needed([num_tokens])

    def staging_bytes_needed(self, num_tokens: int) -> int:
        """Staging bytes a prompt of ``num_tokens`` tokens holds while prefilled in chunks (host arithmetic)."""
        return self.cache.staging_bytes_for(num_tokens)

    def staging_fits(self, new_bytes: int) -> bool:
        """Whether prompts staging ``new_bytes`` more may start now (the cache's rule, which its plan applies:
        :func:`~trtllm_diffkv.paged.staging.staging_fits`)."""
        return self.cache.staging_fits(new_bytes)

    def decode_pages_needed(self, num_requests: int) -> int:
        """Worst-case pages one decode step of ``num_requests`` takes (the cache's ``decode_pages_needed``)."""
        return self.cache.decode_pages_needed(num_requests)

    def free_pages(self) -> int:
        """True free page count now (a device read on the GPU)."""
        return self.cache.manager.free_pages()

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def device_status(self) -> torch.Tensor:
        """int64 ``[max_batch_size + 2]`` on the cache device: each slot's error flag of the step, then the
        ring's (start, end); error flags cleared. Device ops only (no host synchronization)."""
        manager, flags = self.cache.manager, self.cache.take_error_flags().to(torch.int64)
        ring = getattr(manager, "ring_state", None)
        if ring is None:
            ring = torch.tensor([manager.ring_start, manager.ring_end], dtype=torch.int64, device=flags.device)
        return torch.cat([flags, ring[:2]])

    @property
    def bookkeeping_bytes(self) -> int:
        """Page manager bookkeeping + row metadata bytes (inside the budget)."""
        return self.cache.manager.bookkeeping_bytes + self.cache.row_meta.size_bytes

    def allocated_bytes(self) -> int:
        """Pool + page manager bookkeeping + row metadata: at most the budget."""
        return self.cache.pool.size_bytes + self.bookkeeping_bytes

    def stats(self) -> dict:
        """Pool state now (device reads on the GPU).

        Returns:
            dict with ``pool_pages``, ``free_pages``, ``used_pages``, ``page_size_bytes``,
            ``used_bytes`` (pages held x page size + active rows' metadata), ``staging_bytes`` (held by
            prompts half-prefilled in chunks, outside the pool), ``bookkeeping_bytes``,
            ``budget_bytes``, ``kv_memory_fraction`` (used bytes / FP16 bytes of the tokens stored;
            ``None`` with nothing stored).
        """
        cache = self.cache
        free = self.free_pages()
        tokens = sum(cache.seq_len)
        fp16_bytes = tokens * cache.rows_per_slot * 2 * cache.head_dim * 2
        used = cache.pool_used_bytes()
        return dict(pool_pages=cache.manager.num_pages, free_pages=free, used_pages=cache.manager.num_pages - free,
                    page_size_bytes=cache.page_format.page_size_bytes, used_bytes=used,
                    staging_bytes=cache.staging_bytes_used(),
                    bookkeeping_bytes=self.bookkeeping_bytes, budget_bytes=self.budget_bytes,
                    kv_memory_fraction=used / fp16_bytes if fp16_bytes else None)

    def _give_slot(self, request: Request) -> None:
        self._slot_owner.pop(request.slot, None)
        self._free_slots.append(request.slot)
        self._free_slots.sort(reverse=True)
        request.slot = None
        request.num_cached_tokens = 0
