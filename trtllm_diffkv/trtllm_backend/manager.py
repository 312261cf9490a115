"""``DiffKVCompressionManager``: TensorRT-LLM's five compression hooks driving DiffKV's page pool.

TensorRT-LLM's ``KVCacheCompressionManager`` (``tensorrt_llm/_torch/pyexecutor/resource_manager.py``)
is a ``BaseResourceManager`` that PyExecutor calls like its other resource managers; the base class
turns those calls into five hooks (developer guide ``kv-cache-compression-development.md``):

=====================================  =================================  =====================================
PyExecutor call (base class)           hook                               here (our runtime's step functions)
=====================================  =================================  =====================================
``prepare_resources``, first chunk     ``on_request_init(request)``       admission checks; our ``Request``
``prepare_resources``, every step      ``on_generation_step_begin(b)``    ``DiffKVResourceManager.prepare_resources``:
                                                                          slots + ONE ``PagedDiffKVCache.plan``
(forward: ``DiffKVAttention`` per layer serves ``PagedDiffKVCache.forward``; the last layer's call ends the
step, ``PagedDiffKVCache.end_step``: it commits the prompts, compacted by the scored prefill)
``update_resources``, final chunks     ``on_context_step_end(requests)``  check each prompt was compacted
``update_resources``, every step       ``on_generation_step_end(b)``      ``DiffKVResourceManager.update_resources``
``free_resources`` (finish, abort)     ``on_request_finish(request)``     ``DiffKVResourceManager.free_resources``
=====================================  =================================  =====================================

Where TensorRT-LLM's order differs from our executor's, this adapter adapts (the core is unchanged):

* our slot is taken together with the step's plan (one ``prepare_resources`` that gives the slots back
  when the pool is short), so ``on_request_init`` only registers the request and the slot comes in
  ``on_generation_step_begin``;
* prompt compaction happens inside the layers (the scored prefill writes the kept tokens tiered), so
  ``on_context_step_end`` has nothing left to move; it checks the prompt is committed;
* TensorRT-LLM's overlap scheduler plans step n+1 before step n's ``update_resources``; our plan needs
  the previous step's end, so a second ``on_generation_step_begin`` without an end is refused with a
  message (``disable_overlap_scheduler=True``);
* a step whose forward failed leaves our plan open; ``on_request_finish`` discards it before it frees; a request
  freed after its step ended and before ``update_resources`` (PyExecutor's order: responses and cancellations
  first) is left out of that step's ``update_resources``;
* TensorRT-LLM builds the manager twice: for its memory estimation (``estimating_kv_cache``: no pool, every hook
  passes, the estimation's dummy requests are served outside any pool) and for serving; its teardown calls
  :meth:`~DiffKVCompressionManager.shutdown`, which releases the pool;
* the model engine's warm-up forwards run dummy requests that never reach the hooks (added through the KV cache
  manager alone): :meth:`~DiffKVCompressionManager.check_step` tells them from planned steps, and the attention
  backend serves them outside the pool.

Not expressible in the framework (written down in docs/RUNTIME.md): the scheduler admits by
TensorRT-LLM's own KV cache manager, not by DiffKV's free pages (the base class's resource counts are
0 by contract), and a hook cannot fail one request alone (a raise fails the iteration's requests).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..engine_config import EngineConfig
from ..model import ModelConfig
from ..paged.cache import NONFINITE_KV_ERROR
from ..runtime.request import Request
from ..runtime.resource_manager import DiffKVResourceManager, ScheduledBatch
from ..runtime.sampling import SamplingParams
from .bases import KVCacheCompressionManager

MANAGER_ATTRIBUTE = "diffkv_compression_manager"
"""Attribute set on TensorRT-LLM's KV cache manager by :meth:`DiffKVCompressionManager.bind_kv_cache_managers`:
how ``DiffKVAttentionMetadata`` (which gets that KV cache manager) finds DiffKV's cache."""


def model_config_from_pretrained(pretrained_config) -> ModelConfig:
    """Our :class:`ModelConfig` from TensorRT-LLM's ``pretrained_config`` (a transformers config or its dict).

    Raises:
        ValueError: no config, or a model DiffKV's attention does not serve (architectures other than
            Llama / Mistral / Qwen2 decoders, sliding-window attention, biases it does not implement).
    """
    if pretrained_config is None:
        raise ValueError("DiffKVCompressionManager needs the model's pretrained_config (its head counts and dims)")
    hf = pretrained_config if isinstance(pretrained_config, Mapping) else pretrained_config.to_dict()
    try:
        model_config = ModelConfig.from_hf_dict(hf)
    except ValueError as exc:
        raise ValueError(f"DiffKV does not serve this model: {exc}") from None
    if type(model_config) is not ModelConfig:  # another family's config (Gemma 3): its layers are not DiffKV's here
        raise ValueError(f"DiffKV does not serve this model: {model_config.architecture} (inside TensorRT-LLM: "
                         "Llama / Mistral / Qwen2 decoders)")
    if model_config.sliding_window is not None:
        raise ValueError(f"DiffKV does not serve sliding-window attention "
                         f"(sliding_window={model_config.sliding_window})")
    return model_config


class DiffKVCompressionManager(KVCacheCompressionManager):
    """DiffKV's compression manager: owns DiffKV's page pool (a :class:`DiffKVResourceManager`).

    Built by the DiffKV branch of TensorRT-LLM's factory (:func:`~.registration.create_diffkv_manager`), once with
    ``estimating=True`` for TensorRT-LLM's memory estimation (no pool: the estimation's dummy requests are served
    by :class:`~.attention.DiffKVAttention`'s warm-up path, outside the pool) and once for serving; TensorRT-LLM's
    teardown calls :meth:`shutdown` between them.

    Args:
        config: a :class:`~.config.DiffKVCompressionConfig`.
        pretrained_config: the model's config (a transformers config or its dict; the factory passes
            ``model_engine.model.model_config.pretrained_config``).
        mapping: the parallel layout (``model_engine.mapping``; ``None``: one device).
        estimating: TensorRT-LLM's ``estimating_kv_cache``: bind no pool, let every hook pass.

    Attributes:
        kv_config, model_config: the DiffKV policy and the model shape.
        rm: the :class:`DiffKVResourceManager` (after :meth:`bind_kv_cache_managers`; ``None`` while estimating and
            after :meth:`shutdown`).
        request_errors: ``{request_id: message}`` of requests whose keys or values were not finite
            (edge case 1); TensorRT-LLM gives a resource manager no way to fail one request.

    Raises:
        FileNotFoundError, ValueError: a missing or mismatched calibration file, a model DiffKV does
            not serve (:func:`model_config_from_pretrained`), a head_dim the tier formats refuse, a parallel
            layout (tensor / pipeline / context parallelism, attention data parallelism).
    """

    uses_iteration_lifecycle = True

    def __init__(self, config, *, pretrained_config, mapping=None, estimating: bool = False) -> None:
        # a variant seen in TensorRT-LLM's index (tests/trtllm_backend/trtllm_manifest.py)
        if _base_takes("pretrained_config"):
            super().__init__(config, pretrained_config=pretrained_config)
        else:
            super().__init__(config)
        _check_mapping(mapping)
        self.pretrained_config, self.estimating = pretrained_config, bool(estimating)
        self.model_config = model_config_from_pretrained(pretrained_config)
        self.kv_config = config.to_kv_config()
        mc = self.model_config
        self.kv_config.validate_for_model(mc.head_dim, mc.num_heads, mc.num_kv_heads)  # calibrated_for too
        self._rotations: torch.Tensor | None = None  # key_rotation: [layers, kv heads, D, D] on the cache device
        self._dtype = _dtype_of(config.dtype, pretrained_config)
        self.rm: DiffKVResourceManager | None = None
        self._requests: dict = {}  # TensorRT-LLM request id -> our runtime Request
        self._batch: ScheduledBatch | None = None  # the planned step, until its end
        self.request_errors: dict = {}

    def key_rotation(self, layer_idx: int, device: torch.device) -> torch.Tensor | None:
        """``float32 [num_kv_heads, head_dim, head_dim]``: layer ``layer_idx``'s rotations
        (:func:`~trtllm_diffkv.model.rotation.key_rotation_matrices`, ``rotation_seed``) on ``device``, or ``None``
        without ``key_rotation``. TensorRT-LLM runs its own model, so :class:`~.attention.DiffKVAttention` rotates
        q, k and v itself and rotates the output back (our model folds the value side into ``v_proj`` /
        ``o_proj`` instead; the same products)."""
        if self.kv_config.key_rotation == "none":
            return None
        if self._rotations is None or self._rotations.device != device:
            from ..model.rotation import key_rotation_matrices

            mc = self.model_config
            self._rotations = key_rotation_matrices(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                                    self.kv_config.rotation_seed).to(device)
        return self._rotations[layer_idx]

    # ------------------------------------------------------------------ binding
    def bind_kv_cache_managers(self, kv_cache_manager, draft_kv_cache_manager=None) -> None:
        """Bind TensorRT-LLM's KV cache manager (base class: V2 only), refuse what DiffKV cannot serve, build the pool.

        The pool is sized by the config's budget for TensorRT-LLM's ``max_batch_size`` requests of
        ``max_seq_len`` tokens, ``max_num_tokens`` per step (read from the KV cache manager, after it has lowered
        ``max_seq_len`` to what its own pool holds). While estimating no pool is built.

        Raises:
            TypeError: a V1 KV cache manager (the message names ``use_kv_cache_manager_v2=True``).
            ValueError: a draft KV cache (speculative decoding), or a pool that cannot hold one prefill of
                ``max_seq_len`` tokens (TensorRT-LLM admits any prompt up to it, and a refusal inside a hook fails
                every request of the iteration).
        """
        try:
            super().bind_kv_cache_managers(kv_cache_manager, draft_kv_cache_manager)
        except TypeError as exc:
            raise TypeError(f"{exc}: DiffKV needs kv_cache_config=KvCacheConfig(use_kv_cache_manager_v2=True) "
                            f"(got {type(kv_cache_manager).__name__}; 'auto' selects V1 for Llama)") from exc
        if draft_kv_cache_manager is not None:
            raise ValueError("DiffKV does not support speculative decoding (a draft KV cache was bound)")
        setattr(kv_cache_manager, MANAGER_ATTRIBUTE, self)
        if self.estimating:
            return
        config = self.config
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        engine = EngineConfig(max_batch_size=kv_cache_manager.max_batch_size, max_seq_len=kv_cache_manager.max_seq_len,
                              max_num_tokens=kv_cache_manager.max_num_tokens, kv_memory_bytes=config.kv_memory_bytes,
                              kv_memory_fraction=config.kv_memory_fraction,
                              high_tokens_per_page=config.high_tokens_per_page, enable_chunked_prefill=False,
                              device=device)
        self.rm = DiffKVResourceManager(
            self.model_config, self.kv_config, engine,
            dtype=self._dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16), kv_config_checked=True)
        need, total = self.rm.prefill_pages_needed(kv_cache_manager.max_seq_len), self.rm.get_max_resource_count()
        if need > total:  # else a prompt TensorRT-LLM admits could only fail every request of its iteration
            self.shutdown()
            raise ValueError(f"DiffKV's pool ({total} pages) cannot hold one prefill of max_seq_len="
                             f"{kv_cache_manager.max_seq_len} tokens ({need} pages): raise kv_memory_bytes / "
                             "kv_memory_fraction or lower max_seq_len")

    def shutdown(self) -> None:
        """TensorRT-LLM's teardown (``teardown_managers``, after estimation and at exit): forget every request and
        the planned step, release DiffKV's pool (the cache's tensors go with :attr:`rm`), detach from the KV cache
        manager. The hooks then raise "not bound"."""
        self._requests.clear()
        self._batch, self.rm, self._rotations = None, None, None
        if self.kv_cache_manager is not None and \
                getattr(self.kv_cache_manager, MANAGER_ATTRIBUTE, None) is self:
            delattr(self.kv_cache_manager, MANAGER_ATTRIBUTE)
        super().shutdown()

    # ------------------------------------------------------------------ the five hooks
    def on_request_init(self, request, **kwargs) -> None:
        """Before the request's first prefill chunk: register it, after DiffKV's admission checks.

        A request already registered (its prefill restarts, e.g. after TensorRT-LLM paused it) first
        gives back every page it held: its prompt is scored and compacted again, as our executor's
        preemption by recomputation does.

        Raises:
            ValueError: a chunked prefill (DiffKV scores the whole prompt with its last 64 queries at
                once: ``enable_chunked_prefill=False``), or a request whose prefill needs more pages
                than DiffKV's whole pool.
        """
        if self.estimating:
            return
        rm = self._bound()
        n = int(request.prompt_len)
        chunk = getattr(request, "context_chunk_size", n)
        if chunk < n:
            raise ValueError(f"request {request.py_request_id}: DiffKV scores the whole prompt at once; its "
                             f"{n}-token prompt came in a {chunk}-token chunk (set enable_chunked_prefill=False)")
        need, total = rm.prefill_pages_needed(n), rm.get_max_resource_count()
        if need > total:
            raise ValueError(f"request {request.py_request_id}: its prefill needs {need} DiffKV pages, the pool has "
                             f"{total} (raise kv_memory_bytes / kv_memory_fraction)")
        old = self._requests.pop(request.py_request_id, None)
        if old is not None:
            rm.free_resources(old)
        prompt = [int(t) for t in request.get_tokens(0)[:n]]
        ours = Request(request.py_request_id, prompt, SamplingParams(max_tokens=max(1, int(request.max_new_tokens))))
        ours.prefill_token_ids = list(prompt)
        self._requests[request.py_request_id] = ours

    def on_generation_step_begin(self, scheduled_batch, **kwargs) -> None:
        """Before the forward: slots for the new prompts and ONE plan of the step (``prepare_resources``).

        Raises:
            RuntimeError: a step planned while the previous one has not ended (the overlap scheduler:
                ``disable_overlap_scheduler=True``), or a request without ``on_request_init``.
            OutOfPagesError: DiffKV's pool cannot hold the step's worst case (nothing changed).
        """
        if self.estimating:
            return
        rm = self._bound()
        if self._batch is not None:
            raise RuntimeError("DiffKV plans a step after the previous step ended; TensorRT-LLM's overlap scheduler "
                               "plans ahead (set disable_overlap_scheduler=True)")
        batch = ScheduledBatch([self._ours(r) for r in scheduled_batch.context_requests],
                               [self._ours(r) for r in scheduled_batch.generation_requests])
        if batch.batch_size:
            rm.prepare_resources(batch)
            self._batch = batch

    def on_context_step_end(self, requests, **kwargs) -> None:
        """After the forward of the requests' final prefill chunk: their prompts must be committed, compacted.

        Raises:
            RuntimeError: a prompt not stored (the layers were not served by ``DiffKVAttention``:
                ``attn_backend="DIFFKV"``).
        """
        if self.estimating:
            return
        cache = self._bound().cache
        for request in requests:
            ours = self._requests.get(request.py_request_id)
            if ours is None:  # finished or cancelled in this iteration: PyExecutor frees before update_resources
                continue
            if ours.slot is None or cache.prompt_len[ours.slot] != len(ours.prompt_token_ids):
                raise RuntimeError(f"request {request.py_request_id}: its prompt is not in DiffKV's cache after its "
                                   "prefill; serve the layers with attn_backend='DIFFKV' (DiffKVAttention)")

    def on_generation_step_end(self, scheduled_batch, **kwargs) -> None:
        """After the forward and TensorRT-LLM's KV update: end our step (``update_resources``).

        Requests whose keys or values were not finite go to :attr:`request_errors`.

        Raises:
            RuntimeError: the batch is not the one planned at the step's beginning.
        """
        batch, self._batch = self._batch, None
        if batch is None:
            return
        # requests that finished or were cancelled in this iteration are freed (and left out of ``batch``) before
        # PyExecutor's update_resources, which still passes them in its scheduled batch
        ids = [r.py_request_id for r in (*scheduled_batch.context_requests, *scheduled_batch.generation_requests)
               if r.py_request_id in self._requests]
        if ids != [r.request_id for r in batch.all_requests]:
            raise RuntimeError(f"the step ended with requests {ids}, it was planned with "
                               f"{[r.request_id for r in batch.all_requests]}")
        self.request_errors.update(self._bound().update_resources(batch))

    def on_request_finish(self, request, **kwargs) -> None:
        """Completion or abort: every DiffKV page of the request back to the ring, its slot freed.

        A step still open (its forward failed, or never ran) is discarded first: its slots' pages are then freed
        as each of its requests finishes. A request that finishes after its step ended (its last layer ends it)
        and before ``update_resources`` (PyExecutor answers and frees finished and cancelled requests first) is
        only left out of the step's bookkeeping: the other requests' step stands; if that step stored a non-finite
        key or value of it, the error goes to :attr:`request_errors` here (one device read of its flag), since
        the release clears the flag ``update_resources`` would have reported.
        """
        ours = self._requests.pop(request.py_request_id, None)
        if ours is None or self.rm is None:
            return
        if self._batch is not None:
            if self.rm.cache.planned_step is not None:
                self.rm.cache.discard_step()
                self._batch = None
            else:
                if ours.slot is not None and int(self.rm.cache.error_flags[ours.slot]):
                    self.request_errors[ours.request_id] = NONFINITE_KV_ERROR
                self._batch = ScheduledBatch([r for r in self._batch.context_requests if r is not ours],
                                             [r for r in self._batch.generation_requests if r is not ours])
                if not self._batch.batch_size:  # the step's last request: nothing left for update_resources
                    self._batch = None
        self.rm.free_resources(ours)

    # ------------------------------------------------------------------ for the attention backend
    def check_step(self, request_ids, seq_lens, num_contexts: int) -> bool:
        """Whether a forward's attention metadata is DiffKV's planned step (called by ``DiffKVAttentionMetadata``).

        ``False`` for the forwards DiffKV serves outside its pool: TensorRT-LLM's memory estimation (this manager
        built with ``estimating``) and the model engine's warm-up batches (dummy requests added through the KV cache
        manager alone: no step planned, none of their ids ever reached ``on_request_init``).

        Args:
            request_ids: the step's request ids, context requests first.
            seq_lens: ``[batch]`` new tokens per request (prompt tokens of a context request, 1 for decode).
            num_contexts: how many of them are context requests.

        Raises:
            RuntimeError: no step planned for requests DiffKV knows (the compression manager's
                ``prepare_resources`` did not run), or requests, their order or their token counts differ from the
                plan.
        """
        if self.estimating:
            return False
        batch = self._batch
        if batch is None:
            known = [rid for rid in request_ids if rid in self._requests]
            if not known:
                return False
            raise RuntimeError(f"no DiffKV step is planned for requests {known}: the DiffKV compression manager's "
                               "prepare_resources must run before the forward")
        want = [r.request_id for r in batch.all_requests]
        lens = [int(x) for x in seq_lens]
        want_lens = [len(r.prefill_token_ids) for r in batch.context_requests] + [1] * len(batch.generation_requests)
        if list(request_ids) != want or lens != want_lens or num_contexts != len(batch.context_requests):
            raise RuntimeError(f"attention metadata (requests {list(request_ids)}, seq_lens {lens}, {num_contexts} "
                               f"contexts) disagrees with DiffKV's plan (requests {want}, seq_lens {want_lens})")
        return True

    def request_stats(self, request_id):
        """The request's tier counts and pool bytes now (:meth:`PagedDiffKVCache.request_stats`; a device read)."""
        return self._bound().cache.request_stats(self._requests[request_id].slot)

    # ------------------------------------------------------------------ helpers
    def _bound(self) -> DiffKVResourceManager:
        if self.rm is None:
            raise RuntimeError("DiffKVCompressionManager is not bound: bind_kv_cache_managers() first")
        return self.rm

    def _ours(self, request) -> Request:
        try:
            return self._requests[request.py_request_id]
        except KeyError:
            raise RuntimeError(f"request {request.py_request_id} reached DiffKV without on_request_init") from None


def _base_takes(keyword: str) -> bool:
    """Whether TensorRT-LLM's ``KVCacheCompressionManager.__init__`` has the parameter ``keyword``."""
    import inspect

    return keyword in inspect.signature(KVCacheCompressionManager.__init__).parameters


def _check_mapping(mapping) -> None:
    """Refuse parallel layouts: DiffKV's pool holds every KV head of every layer on one device.

    Raises:
        ValueError: ``tp_size``, ``pp_size`` or ``cp_size`` above 1, or ``enable_attention_dp``, naming it.
    """
    if mapping is None:
        return
    for name in ("tp_size", "pp_size", "cp_size"):
        size = getattr(mapping, name, 1)
        if size != 1:
            label = {"tp_size": "tensor", "pp_size": "pipeline", "cp_size": "context"}[name]
            raise ValueError(f"DiffKV does not support {label} parallelism ({name}={size}); its pool holds every KV "
                             "head of every layer on one GPU")
    if getattr(mapping, "enable_attention_dp", False):
        raise ValueError("DiffKV does not support attention data parallelism (enable_attention_dp=True)")


def _dtype_of(name: str, pretrained_config):
    """torch dtype for ``dtype`` (``"auto"``: the model's ``torch_dtype`` if it names one, else ``None``)."""
    if name != "auto":
        return getattr(torch, name)
    value = pretrained_config.get("torch_dtype") if isinstance(pretrained_config, Mapping) else \
        getattr(pretrained_config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    return getattr(torch, value) if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype) \
        else None
