"""Greedy generation on the paged DiffKV cache: one request or a static batch (paper section 5).

:class:`PagedGenerator` has the API of :class:`~trtllm_diffkv.generation.reference.ReferenceGenerator`
(``generate``, ``generate_ids``, same :class:`GenerationResult` fields) plus
``generate_batch``: the prompts are prefilled together in one step, then every
live request decodes one token per step, all in one model call, until each
stops. A request that fails (empty prompt, bad ids, too long, non-finite
keys/values, pool exhausted) comes back with ``finish_reason == "error"``; it
allocates nothing or releases what it held, and the others go on.

Each result also reports what the request really held in the pool at its end
(:class:`PagedGenerationResult`): pages x page size + its per-row metadata,
next to the accounted packed bytes (``kv_cache_bytes``) and the fraction of
FP16 (``kv_memory_fraction``).
"""
from __future__ import annotations

import time

import torch

from .prompts import check_prompt_ids
from .reference import ReferenceGenerator, sync_device
from .results import GenerationResult, PagedGenerationResult, result_from_fields
from ..engine_config import EngineConfig
from ..paged.cache import OutOfPagesError, PagedDiffKVCache
from ..validators import optional_positive_int


class PagedGenerator(ReferenceGenerator):
    """Greedy generation with a :class:`PagedDiffKVCache` (static batching).

    Args:
        model, tokenizer, model_config, kv_config, stop_token_ids: as
            :class:`~trtllm_diffkv.generation.reference.ReferenceGenerator`.
        num_pages: pool size; ``None`` sizes each batch's pool for the worst
            case (every token high precision).
        high_tokens_per_page: page sizing (:meth:`PageFormat.for_config`).
        use_triton: as :class:`PagedDiffKVCache` (default: on CUDA).

    A batch whose prompts a fixed ``num_pages`` pool cannot take together at
    prefill runs in waves (in order); a prompt that needs more than the whole
    pool fails alone.

    Raises:
        ValueError: ``kv_config`` cannot run this model, or a bad ``num_pages``.
    """

    def __init__(self, model, tokenizer, model_config, kv_config, stop_token_ids=None, *,
                 num_pages: int | None = None, high_tokens_per_page: int = 32, use_triton: bool | None = None):
        super().__init__(model, tokenizer, model_config, kv_config, stop_token_ids)
        optional_positive_int("num_pages", num_pages, allowed="a positive integer, or None to size each batch's pool")
        self.num_pages, self.high_tokens_per_page, self.use_triton = num_pages, high_tokens_per_page, use_triton
        self.last_cache: PagedDiffKVCache | None = None

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int) -> GenerationResult:
        """Greedy generation of one request from token ids; errors come back in the result, never raised."""
        return self.generate_batch([prompt_ids], max_new_tokens)[0]

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[GenerationResult]:
        """Greedy generation of a static batch; one result per prompt, in order; never raises for a request."""
        results: list[PagedGenerationResult | None] = [None] * len(prompts)
        admitted = []
        for i, ids in enumerate(prompts):
            try:
                self._check_request(ids, max_new_tokens)
                admitted.append(i)
            except Exception as exc:  # noqa: BLE001 - a bad request must not stop the others
                results[i] = _error(ids, exc)
        pending = admitted
        while pending:  # waves: requests the pool cannot take with the others wait for the next one
            try:
                pending = self._run(prompts, pending, max_new_tokens, results)
            except Exception as exc:  # noqa: BLE001 - report, never raise
                for i in pending:
                    if results[i] is None:
                        results[i] = _error(prompts[i], exc)
                pending = []
        return results

    # ------------------------------------------------------------------ internals
    def _check_request(self, ids, max_new_tokens) -> None:
        check_prompt_ids(ids, max_new_tokens, self.model_config)

    def _new_cache(self, prompts, admitted, max_new_tokens) -> PagedDiffKVCache:
        mc = self.model_config
        max_len = max(len(prompts[i]) for i in admitted) + max_new_tokens
        num_pages = self.num_pages
        if num_pages is None:
            from ..memory import PageFormat

            fmt = PageFormat.for_config(self.kv_config, mc.head_dim, self.high_tokens_per_page)
            num_pages = len(admitted) * mc.num_layers * mc.num_kv_heads * (fmt.prompt_reserve_pages(max_len) + 2)
        tokens = sum(len(prompts[i]) for i in admitted)
        return PagedDiffKVCache(self.kv_config, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                                EngineConfig(max_batch_size=len(admitted), max_seq_len=max_len,
                                             max_num_tokens=max(tokens, len(admitted)), device=self.device,
                                             high_tokens_per_page=self.high_tokens_per_page, use_triton=self.use_triton,
                                             enable_chunked_prefill=False), num_pages=num_pages, dtype=self.dtype)

    def _run(self, prompts, pending, max_new_tokens, results) -> list[int]:
        """Run the requests of ``pending`` the pool can take together; return those left for a later wave."""
        admitted, deferred = self._fit(prompts, pending, max_new_tokens, results)
        if admitted:
            try:
                self._run_wave(prompts, admitted, max_new_tokens, results)
            except Exception as exc:  # noqa: BLE001 - the wave's requests fail; the deferred ones still run
                for i in admitted:
                    if results[i] is None:
                        results[i] = _error(prompts[i], exc)
        return deferred

    def _fit(self, prompts, pending, max_new_tokens, results) -> tuple[list[int], list[int]]:
        """Split ``pending`` into what one pool takes at prefill (in order) and what waits; fail what never fits."""
        if self.num_pages is None:
            return list(pending), []  # the pool is sized for the whole batch
        from ..memory import PageFormat

        mc = self.model_config
        fmt = PageFormat.for_config(self.kv_config, mc.head_dim, self.high_tokens_per_page)
        rows = mc.num_layers * mc.num_kv_heads
        admitted, deferred, used = [], [], 0
        for i in pending:
            need = rows * (fmt.prompt_reserve_pages(len(prompts[i])) + 2)  # prompt reserve + the first decode steps
            if need > self.num_pages:
                results[i] = _error(prompts[i], OutOfPagesError(
                    f"the prompt needs up to {need} pages at prefill and the first decode step; the pool has "
                    f"{self.num_pages}"))
            elif used + need <= self.num_pages:
                admitted.append(i)
                used += need
            else:
                deferred.append(i)
        return admitted, deferred

    def _run_wave(self, prompts, admitted, max_new_tokens, results) -> None:
        cache = self.last_cache = self._new_cache(prompts, admitted, max_new_tokens)
        dev = self.device
        slot_of = {i: s for s, i in enumerate(admitted)}
        live, out, times = [], {i: [] for i in admitted}, {}
        with torch.inference_mode():
            sync_device(dev)
            t0 = time.perf_counter()
            try:
                cache.plan([slot_of[i] for i in admitted], [len(prompts[i]) for i in admitted], [0] * len(admitted),
                           [True] * len(admitted))
            except OutOfPagesError as exc:
                for i in admitted:
                    results[i] = _error(prompts[i], exc)
                return
            ids = torch.tensor([t for i in admitted for t in prompts[i]], device=dev)
            pos = torch.cat([torch.arange(len(prompts[i]), device=dev) for i in admitted])
            last = torch.tensor([len(prompts[i]) for i in admitted], device=dev).cumsum(0) - 1
            logits = self.model(ids, pos, cache, logits_indices=last)
            cache.end_step()
            tokens = logits.argmax(-1).tolist()
            sync_device(dev)
            t1 = time.perf_counter()
            for i, tok in zip(admitted, tokens):
                out[i].append(tok)
                live.append(i)
            live = self._settle(cache, prompts, live, out, results, slot_of, max_new_tokens, times, t0, t1, t1)
            while live:
                lens = [len(prompts[i]) + len(out[i]) - 1 for i in live]
                try:
                    cache.plan([slot_of[i] for i in live], [n + 1 for n in lens], lens, [False] * len(live))
                except OutOfPagesError as exc:  # static batch: the longest request gives way
                    victim = max(live, key=lambda i: lens[live.index(i)])
                    cache.release([slot_of[victim]])
                    results[victim] = _error(prompts[victim], exc)
                    live.remove(victim)
                    continue
                ids = torch.tensor([out[i][-1] for i in live], device=dev)
                logits = self.model(ids, torch.tensor(lens, device=dev), cache)
                cache.end_step()
                tokens = logits.argmax(-1).tolist()
                for i, tok in zip(live, tokens):
                    out[i].append(tok)
                sync_device(dev)
                live = self._settle(cache, prompts, live, out, results, slot_of, max_new_tokens, times, t0, t1,
                                    time.perf_counter())

    def _settle(self, cache, prompts, live, out, results, slot_of, max_new_tokens, times, t0, t1, now) -> list[int]:
        """Fail requests with non-finite K/V, finish the ones that stopped; return those still live."""
        errors = cache.step_errors()
        still = []
        for i in live:
            slot = slot_of[i]
            if slot in errors:
                cache.release([slot])
                results[i] = _error(prompts[i], ValueError(errors[slot]))
                continue
            done = out[i][-1] in self.stop_token_ids or len(out[i]) >= max_new_tokens
            if not done:
                still.append(i)
                continue
            results[i] = self._finished(cache, slot, prompts[i], out[i], t1 - t0, now - t1)
            cache.release([slot])
        return still

    def _finished(self, cache, slot, prompt, out, prefill_s, decode_s) -> PagedGenerationResult:
        stats = cache.request_stats(slot)
        return result_from_fields(**self.result_fields(len(prompt), out, stats, prefill_s, decode_s),
                       pool_pages=stats.pool_pages, pool_used_bytes=stats.pool_used_bytes)


def _error(ids, exc: Exception) -> PagedGenerationResult:
    n = len(ids) if hasattr(ids, "__len__") else 0
    return result_from_fields(prompt_tokens=n, finish_reason="error", error=f"{type(exc).__name__}: {exc}")
