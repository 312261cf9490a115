"""A stand-in for TensorRT-LLM's PyTorch backend (TensorRT-LLM cannot be installed here), for the DiffKV adapter.

Reproduced from NVIDIA/TensorRT-LLM's sources, as read with the search tool on 2026-12-01 (docs/RUNTIME.md,
"DiffKV inside TensorRT-LLM's PyTorch backend", lists the files and commits):

* ``llmapi/llm_args.py``: ``KvCacheCompressionConfig`` is a pydantic model (extra fields refused) with an
  ``algorithm`` string, the class attribute ``changes_physical_kv_length = False`` and the admission
  predicates ``supports_block_reuse()`` / ``supports_speculative_decoding()``, both ``False`` by default;
  ``KvCacheConfig.enable_block_reuse`` defaults to ``True``.
* ``_torch/pyexecutor/_util.py``: ``validate_kv_cache_compression_compatibility(config, kv_cache_config,
  spec_config)`` raises ``ValueError`` ("block reuse", "speculative decoding") unless the config's
  predicate allows it; ``create_kv_cache_compression_manager(config, *, pretrained_config)`` has one
  branch per algorithm and returns ``None`` with a warning for an unregistered one; the creator builds
  the compression manager before the KV cache manager, then binds it.
* ``_torch/pyexecutor/resource_manager.py``: ``BaseResourceManager`` (abstract resource counts);
  ``ResourceManager`` calls its managers in order, the target KV cache manager's ``update_resources``
  with ``(batch, attn_metadata, kv_cache_dtype_byte_size)``, the others with ``(batch)``;
  ``KVCacheCompressionManager(config, *, pretrained_config=None)``: ``bind_kv_cache_managers(target,
  draft=None)`` requires ``KVCacheManagerV2`` (``TypeError`` otherwise) and sets
  ``kv_compression_manages_history`` from ``changes_physical_kv_length``; ``prepare_resources`` fires
  ``on_request_init(request)`` for each context request's first chunk, then
  ``on_generation_step_begin(scheduled_batch)``; ``update_resources`` fires
  ``on_context_step_end(context_requests_last_chunk)`` when there are any, then
  ``on_generation_step_end(scheduled_batch)``; ``free_resources`` fires ``on_request_finish(request)``;
  the hooks are called positionally, so an override with another signature fails with ``TypeError``;
  resource counts are 0.
* ``_torch/attention_backend/interface.py``: ``AttentionBackend.__init__(layer_idx, num_heads, head_dim,
  num_kv_heads=None, quant_config=None, skip_create_weights_in_init=False, **kwargs)``, ``forward(q, k, v,
  metadata, *, attention_mask=CAUSAL, **kwargs)`` raising ``NotImplementedError``, ``Metadata`` class
  attribute; ``AttentionMetadata`` a keyword-only dataclass with ``prepare()``.
* ``_torch/attention_backend/utils.py``: ``get_attention_backend`` (an if-chain falling back to
  ``TrtllmAttention``) and ``create_attention``'s keyword call of the backend class.
* ``_torch/pyexecutor/py_executor.py``: each iteration handles cancellations (a cancelled active
  request is terminated: ``free_resources``), schedules, ``prepare_resources``, runs the forward
  (metadata ``prepare()`` first), samples, updates the requests, ``update_resources``, then terminates
  finished requests (``free_resources``); an exception in the forward or the sampling fails every active
  request (``_handle_errors``: each terminated) and the loop goes on (the stand-in treats an exception
  anywhere in the iteration so).
* ``LlmRequest``: ``py_request_id`` and ``is_first_context_chunk`` as the framework's tests use them;
  ``prompt_len``, ``max_new_tokens``, ``get_tokens(beam)``, ``context_chunk_size`` and
  ``context_current_position`` are the binding's names as the adapter assumes them (not re-read).

What it does NOT reproduce: TensorRT-LLM's kernels (``TrtllmAttention.forward`` raises), KVCacheManagerV2's
pages (it only counts blocks per request) and its admission by free blocks, chunked prefill, the overlap
scheduler, CUDA graphs, the pinned/CUDA copies of ``seq_lens``, the order in which ``ResourceManager``
frees across managers (the adapter does not depend on it), speculative decoding, and the model: our
``LlamaForCausalLM`` stands in for TensorRT-LLM's, with :class:`AttentionModuleStandIn` in the role of
TensorRT-LLM's ``Attention`` module (RoPE applied before the backend, flat ``[tokens, heads * dim]`` tensors).
"""
from __future__ import annotations

import contextlib
import enum
import itertools
import sys
import types
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar, Generic, Optional, TypeVar, Union

import torch
from pydantic import BaseModel, ConfigDict

ADAPTER = "trtllm_diffkv.trtllm_backend"


# ---------------------------------------------------------------- llmapi/llm_args.py
class StrictBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KvCacheCompressionConfig(StrictBaseModel):
    algorithm: str
    changes_physical_kv_length: ClassVar[bool] = False

    def supports_block_reuse(self) -> bool:
        return False

    def supports_speculative_decoding(self) -> bool:
        return False


class KvCacheConfig(StrictBaseModel):
    enable_block_reuse: bool = True
    free_gpu_memory_fraction: Optional[float] = None


KvCacheCompressionConfigType = Union[KvCacheCompressionConfig]


class TorchLlmArgs(StrictBaseModel):
    """The ``LLM(...)`` arguments the adapter's path reads (a small subset). Each :func:`installed` makes a fresh
    subclass (the adapter widens its ``kv_cache_compression_config`` field): build them with :func:`llm_args`."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    model: str = "local"
    attn_backend: str = "TRTLLM"
    kv_cache_config: KvCacheConfig = KvCacheConfig()
    kv_cache_compression_config: Optional[KvCacheCompressionConfigType] = None
    speculative_config: Optional[object] = None
    tensor_parallel_size: int = 1
    disable_overlap_scheduler: bool = False
    enable_chunked_prefill: bool = False


# ---------------------------------------------------------------- pyexecutor: requests and batches
class LlmRequestState(enum.Enum):
    CONTEXT_INIT = 1
    GENERATION_IN_PROGRESS = 2
    GENERATION_COMPLETE = 3


class LlmRequest:
    def __init__(self, request_id: int, input_tokens: list[int], max_new_tokens: int,
                 context_chunk_size: int | None = None) -> None:
        self.py_request_id = request_id
        self._tokens = list(input_tokens)
        self.prompt_len = len(input_tokens)
        self.max_new_tokens = max_new_tokens
        self.state = LlmRequestState.CONTEXT_INIT
        self.context_chunk_size = self.prompt_len if context_chunk_size is None else context_chunk_size
        self.context_current_position = 0
        self.py_num_compressed_tokens = 0
        self.finish_reason: str | None = None

    def get_tokens(self, beam: int) -> list[int]:
        return list(self._tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self._tokens[self.prompt_len:]

    @property
    def is_first_context_chunk(self) -> bool:
        return self.context_current_position == 0

    @property
    def is_last_context_chunk(self) -> bool:
        return self.context_current_position + self.context_chunk_size >= self.prompt_len


class ScheduledRequests:
    def __init__(self, context_requests=(), generation_requests=()) -> None:
        self.context_requests = list(context_requests)
        self.generation_requests = list(generation_requests)

    @property
    def context_requests_last_chunk(self) -> list:
        return [r for r in self.context_requests if r.is_last_context_chunk]

    def all_requests(self) -> list:
        return self.context_requests + self.generation_requests

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)


# ---------------------------------------------------------------- pyexecutor/resource_manager.py
class BaseResourceManager(ABC):
    @abstractmethod
    def get_max_resource_count(self) -> int:
        raise NotImplementedError

    @abstractmethod
    def get_needed_resource_to_completion(self, request) -> int:
        raise NotImplementedError

    def prepare_resources(self, scheduled_batch) -> None:
        pass

    def update_resources(self, scheduled_batch) -> None:
        pass

    def free_resources(self, request) -> None:
        pass

    def shutdown(self) -> None:
        pass


class ResourceManagerType(enum.Enum):
    KV_CACHE_MANAGER = "KV_CACHE_MANAGER"
    DRAFT_KV_CACHE_MANAGER = "DRAFT_KV_CACHE_MANAGER"
    SEQ_SLOT_MANAGER = "SEQ_SLOT_MANAGER"
    KV_CACHE_COMPRESSION_MANAGER = "KV_CACHE_COMPRESSION_MANAGER"


class ResourceManager:
    def __init__(self, resource_managers: dict) -> None:
        self.resource_managers = OrderedDict(resource_managers)

    def prepare_resources(self, scheduled_batch) -> None:
        for manager in self.resource_managers.values():
            manager.prepare_resources(scheduled_batch)

    def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None) -> None:
        for kind, manager in self.resource_managers.items():
            if kind is ResourceManagerType.KV_CACHE_MANAGER:
                manager.update_resources(scheduled_batch, attn_metadata, kv_cache_dtype_byte_size)
            else:
                manager.update_resources(scheduled_batch)

    def free_resources(self, request) -> None:
        for manager in reversed(list(self.resource_managers.values())):
            manager.free_resources(request)


@dataclass
class Mapping:
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    enable_attention_dp: bool = False


class KVCacheManagerV2(BaseResourceManager):
    """Counts each request's blocks (no pages): what the adapter reads of it and what it must leave alone."""

    def __init__(self, kv_cache_config: KvCacheConfig, *, max_batch_size: int, max_seq_len: int, max_num_tokens: int,
                 mapping: Mapping, tokens_per_block: int = 32, num_blocks: int = 1 << 16) -> None:
        self.enable_block_reuse = kv_cache_config.enable_block_reuse
        self.max_batch_size, self.max_seq_len, self.max_num_tokens = max_batch_size, max_seq_len, max_num_tokens
        self.mapping, self.tokens_per_block, self.num_blocks = mapping, tokens_per_block, num_blocks
        self.kv_compression_manages_history = False
        self.is_draft = False
        self.blocks: dict[int, int] = {}

    def prepare_resources(self, scheduled_batch) -> None:
        for r in scheduled_batch.context_requests:
            self.blocks[r.py_request_id] = -(-r.prompt_len // self.tokens_per_block)
        for r in scheduled_batch.generation_requests:
            self.blocks[r.py_request_id] = -(-(len(r.get_tokens(0)) + 1) // self.tokens_per_block)

    def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None) -> None:
        pass

    def free_resources(self, request) -> None:
        self.blocks.pop(request.py_request_id, None)

    def get_max_resource_count(self) -> int:
        return self.num_blocks

    def get_needed_resource_to_completion(self, request) -> int:
        return -(-(request.prompt_len + request.max_new_tokens) // self.tokens_per_block)


class KVCacheCompressionManager(BaseResourceManager):
    uses_iteration_lifecycle = True
    provides_cold_page_codec = False

    def __init__(self, config, *, pretrained_config=None) -> None:
        self.config = config
        self.pretrained_config = pretrained_config
        self.kv_cache_manager = None
        self.draft_kv_cache_manager = None

    def bind_kv_cache_managers(self, kv_cache_manager, draft_kv_cache_manager=None) -> None:
        for manager in (kv_cache_manager, draft_kv_cache_manager):
            if manager is not None and not isinstance(manager, KVCacheManagerV2):
                raise TypeError(f"KV-cache compression requires KVCacheManagerV2, got {type(manager).__name__}")
        self.kv_cache_manager, self.draft_kv_cache_manager = kv_cache_manager, draft_kv_cache_manager
        for manager in (kv_cache_manager, draft_kv_cache_manager):
            if manager is not None:
                manager.kv_compression_manages_history = bool(type(self.config).changes_physical_kv_length)

    @property
    def has_independent_draft_kv_cache(self) -> bool:
        return self.draft_kv_cache_manager is not None

    def get_max_resource_count(self) -> int:
        return 0

    def get_needed_resource_to_completion(self, request) -> int:
        return 0

    def on_request_init(self, request, **kwargs) -> None:
        return None

    def on_context_step_end(self, requests, **kwargs) -> None:
        return None

    def on_generation_step_begin(self, scheduled_batch, **kwargs) -> None:
        return None

    def on_generation_step_end(self, scheduled_batch, **kwargs) -> None:
        return None

    def on_request_finish(self, request, **kwargs) -> None:
        return None

    def prepare_resources(self, scheduled_batch) -> None:
        for request in scheduled_batch.context_requests:
            if request.is_first_context_chunk:
                self.on_request_init(request)
        self.on_generation_step_begin(scheduled_batch)

    def update_resources(self, scheduled_batch) -> None:
        last = list(scheduled_batch.context_requests_last_chunk)
        if last:
            self.on_context_step_end(last)
        self.on_generation_step_end(scheduled_batch)

    def free_resources(self, request) -> None:
        self.on_request_finish(request)


# ---------------------------------------------------------------- attention_backend/interface.py
class PredefinedAttentionMask(str, enum.Enum):
    CAUSAL = "causal"
    FULL = "full"


@dataclass(kw_only=True)
class AttentionMetadata:
    max_num_requests: int
    max_num_tokens: int
    kv_cache_manager: object
    mapping: Optional[Mapping] = None
    seq_lens: Optional[torch.Tensor] = None
    num_contexts: int = 0
    position_ids: Optional[torch.Tensor] = None
    request_ids: Optional[list] = None
    prompt_lens: Optional[list] = None

    def prepare(self) -> None:
        """Hook to be called before the forward step of the model."""


TMetadata = TypeVar("TMetadata", bound=AttentionMetadata)


class AttentionBackend(Generic[TMetadata]):
    Metadata = AttentionMetadata

    def __init__(self, layer_idx: int, num_heads: int, head_dim: int, num_kv_heads: Optional[int] = None,
                 quant_config=None, skip_create_weights_in_init: bool = False, **kwargs) -> None:
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, num_heads, head_dim
        self.num_kv_heads = num_kv_heads or num_heads
        self.quant_config = quant_config

    def forward(self, q, k, v, metadata, *, attention_mask=PredefinedAttentionMask.CAUSAL, **kwargs):
        raise NotImplementedError

    @classmethod
    def support_fused_rope(cls) -> bool:
        return False

    @classmethod
    def support_fused_qkv(cls) -> bool:
        return False

    @classmethod
    def support_mla(cls) -> bool:
        return False


class TrtllmAttention(AttentionBackend):
    def forward(self, q, k, v, metadata, *, attention_mask=PredefinedAttentionMask.CAUSAL, **kwargs):
        raise NotImplementedError("stand-in: TensorRT-LLM's own attention kernels do not run here")


class VanillaAttention(TrtllmAttention):
    pass


# ---------------------------------------------------------------- the module tree
class _Logger:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, message: str) -> None:
        self.warnings.append(message)


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so submodules import
    module.__dict__.update(attrs)
    return module


def _build_modules() -> dict[str, types.ModuleType]:
    logger = _Logger()
    util = _module("tensorrt_llm._torch.pyexecutor._util", logger=logger)
    attn_utils = _module("tensorrt_llm._torch.attention_backend.utils")

    def validate_kv_cache_compression_compatibility(config, kv_cache_config, spec_config) -> None:
        if getattr(kv_cache_config, "enable_block_reuse", False) and not config.supports_block_reuse():
            raise ValueError(f"KV-cache compression '{config.algorithm}' does not support block reuse; "
                             "set KvCacheConfig(enable_block_reuse=False)")
        if spec_config is not None and not config.supports_speculative_decoding():
            raise ValueError(f"KV-cache compression '{config.algorithm}' does not support speculative decoding")

    def create_kv_cache_compression_manager(config, *, pretrained_config=None):
        # one branch per shipped algorithm (triattention, cold-page quantization) in the real factory; none here
        util.logger.warning(f"no KV-cache compression manager is registered for algorithm {config.algorithm!r}")
        return None

    def get_attention_backend(backend_name: str):
        if backend_name == "VANILLA":
            return VanillaAttention
        if backend_name == "TRTLLM":
            return TrtllmAttention
        return TrtllmAttention

    def create_attention(backend_name: str, layer_idx: int, num_heads: int, head_dim: int, num_kv_heads=None,
                         pos_embd_params=None, quant_config=None, q_scaling=None, skip_create_weights_in_init=False,
                         attention_chunk_size=None):
        attn_cls = attn_utils.get_attention_backend(backend_name)  # a module-global lookup, as in the source
        return attn_cls(layer_idx, num_heads, head_dim, num_kv_heads, quant_config=quant_config, q_scaling=q_scaling,
                        pos_embd_params=pos_embd_params, mla_params=None,
                        skip_create_weights_in_init=skip_create_weights_in_init,
                        attention_chunk_size=attention_chunk_size)

    util.validate_kv_cache_compression_compatibility = validate_kv_cache_compression_compatibility
    util.create_kv_cache_compression_manager = create_kv_cache_compression_manager
    attn_utils.get_attention_backend = get_attention_backend
    attn_utils.create_attention = create_attention
    fresh_args = type("TorchLlmArgs", (TorchLlmArgs,), {"__module__": __name__})
    llm_args = _module("tensorrt_llm.llmapi.llm_args", KvCacheCompressionConfig=KvCacheCompressionConfig,
                       KvCacheConfig=KvCacheConfig, TorchLlmArgs=fresh_args,
                       KvCacheCompressionConfigType=KvCacheCompressionConfigType, StrictBaseModel=StrictBaseModel)
    resource_manager = _module(
        "tensorrt_llm._torch.pyexecutor.resource_manager", BaseResourceManager=BaseResourceManager,
        ResourceManager=ResourceManager, ResourceManagerType=ResourceManagerType,
        KVCacheCompressionManager=KVCacheCompressionManager)
    modules = [
        _module("tensorrt_llm"), _module("tensorrt_llm.llmapi", KvCacheConfig=KvCacheConfig), llm_args,
        _module("tensorrt_llm.mapping", Mapping=Mapping), _module("tensorrt_llm._torch"),
        _module("tensorrt_llm._torch.pyexecutor"), resource_manager, util,
        _module("tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2", KVCacheManagerV2=KVCacheManagerV2),
        _module("tensorrt_llm._torch.pyexecutor.scheduler", ScheduledRequests=ScheduledRequests),
        _module("tensorrt_llm._torch.pyexecutor.llm_request", LlmRequest=LlmRequest, LlmRequestState=LlmRequestState),
        _module("tensorrt_llm._torch.attention_backend"),
        _module("tensorrt_llm._torch.attention_backend.interface", AttentionBackend=AttentionBackend,
                AttentionMetadata=AttentionMetadata, PredefinedAttentionMask=PredefinedAttentionMask),
        attn_utils,
    ]
    return {m.__name__: m for m in modules}


def llm_args(**fields):
    """``TorchLlmArgs(**fields)`` of the installed stand-in."""
    return sys.modules["tensorrt_llm.llmapi.llm_args"].TorchLlmArgs(**fields)


@contextlib.contextmanager
def installed():
    """The stand-in's modules in ``sys.modules`` and a fresh import of the adapter; both removed at exit.

    Yields the ``{module name: module}`` dict of the stand-in.
    """
    modules = _build_modules()
    saved = {name: sys.modules.get(name) for name in modules}
    adapter_names = [n for n in sys.modules if n == ADAPTER or n.startswith(ADAPTER + ".")]
    saved_adapter = {n: sys.modules.pop(n) for n in adapter_names}
    sys.modules.update(modules)
    try:
        yield modules
    finally:
        for name in [n for n in sys.modules if n == ADAPTER or n.startswith(ADAPTER + ".")]:
            del sys.modules[name]
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        sys.modules.update(saved_adapter)


# ---------------------------------------------------------------- py_executor.py's iteration
class AttentionModuleStandIn:
    """TensorRT-LLM's ``Attention`` module around the backend: our model's ``backend.forward(layer_idx, q, k, v)``
    becomes ``backends[layer_idx].forward(q, k, v, metadata)`` over flat ``[num_tokens, heads * head_dim]`` tensors."""

    def __init__(self, backends: list, metadata) -> None:
        self.backends, self.metadata = backends, metadata

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        out = self.backends[layer_idx].forward(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1),
                                               v.reshape(num_tokens, -1), self.metadata)
        return out.reshape(num_tokens, num_heads, head_dim)


class StandInPyExecutor:
    """PyExecutor's iteration on one device, greedy, no chunking: the order in which TensorRT-LLM calls the
    resource managers and the attention backend for prefill, decode, finish and abort.

    Args:
        model: our ``LlamaForCausalLM`` (TensorRT-LLM's model in this role).
        llm_args: a ``TorchLlmArgs`` of the installed stand-in (:func:`llm_args`).
        pretrained_config: what the factory is given (a transformers config or its dict).
        max_batch_size, max_seq_len, max_num_tokens: the engine limits the KV cache manager carries.
        mapping: the parallel layout (a :class:`Mapping`).

    Attributes:
        resource_manager, kv_cache_manager, compression_manager, backends; ``errors``: request id -> message
        of requests failed by ``_handle_errors``; ``calls``: the resource-manager calls of each iteration.
    """

    def __init__(self, model, llm_args, pretrained_config, *, max_batch_size: int = 8,
                 max_seq_len: int = 256, max_num_tokens: int = 2048, mapping: Mapping | None = None) -> None:
        util = sys.modules["tensorrt_llm._torch.pyexecutor._util"]
        attn_utils = sys.modules["tensorrt_llm._torch.attention_backend.utils"]
        config = llm_args.kv_cache_compression_config
        compression = None
        if config is not None:  # KvCacheCreator.build_managers: compatibility, factory, KV cache manager, bind
            util.validate_kv_cache_compression_compatibility(config, llm_args.kv_cache_config,
                                                             llm_args.speculative_config)
            compression = util.create_kv_cache_compression_manager(config, pretrained_config=pretrained_config)
        self.kv_cache_manager = KVCacheManagerV2(llm_args.kv_cache_config, max_batch_size=max_batch_size,
                                                 max_seq_len=max_seq_len, max_num_tokens=max_num_tokens,
                                                 mapping=mapping or Mapping(tp_size=llm_args.tensor_parallel_size))
        managers = {ResourceManagerType.KV_CACHE_MANAGER: self.kv_cache_manager}
        if compression is not None and compression.uses_iteration_lifecycle:
            compression.bind_kv_cache_managers(self.kv_cache_manager)
            managers[ResourceManagerType.KV_CACHE_COMPRESSION_MANAGER] = compression
        self.compression_manager = compression
        self.resource_manager = ResourceManager(managers)
        mc = model.config
        self.backends = [attn_utils.create_attention(llm_args.attn_backend, i, mc.num_heads, mc.head_dim,
                                                     mc.num_kv_heads) for i in range(mc.num_layers)]
        self.metadata = type(self.backends[0]).Metadata(max_num_requests=max_batch_size, max_num_tokens=max_num_tokens,
                                                        kv_cache_manager=self.kv_cache_manager)
        self.model, self.max_batch_size, self.max_num_tokens = model, max_batch_size, max_num_tokens
        self.waiting: list[LlmRequest] = []
        self.active: list[LlmRequest] = []
        self.finished: dict[int, LlmRequest] = {}
        self.errors: dict[int, str] = {}
        self.calls: list[tuple] = []
        self._canceled: set[int] = set()
        self._ids = itertools.count()

    def add_request(self, prompt_token_ids: list[int], max_new_tokens: int, *, context_chunk_size=None) -> int:
        request = LlmRequest(next(self._ids), prompt_token_ids, max_new_tokens, context_chunk_size)
        self.waiting.append(request)
        return request.py_request_id

    def cancel(self, request_id: int) -> None:
        self._canceled.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.active)

    def run_until_done(self, max_steps: int = 10_000) -> dict:
        for _ in range(max_steps):
            if not self.has_unfinished():
                return self.finished
            self.step()
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")

    def step(self) -> None:
        self._handle_canceled_requests()
        batch = self._schedule()
        if not batch.batch_size:
            return
        try:
            self.calls.append(("prepare_resources", [r.py_request_id for r in batch.all_requests()]))
            self.resource_manager.prepare_resources(batch)
            logits = self._forward(batch)
            tokens = logits.argmax(-1).tolist()
            self._update_requests(batch, tokens)
        except Exception as exc:  # noqa: BLE001 - PyExecutor's _handle_errors: every active request fails
            self._handle_errors(f"{type(exc).__name__}: {exc}")
        # PyExecutor's order: cancellations and finished requests answered (and freed) first, then
        # update_resources over the scheduled batch as it was, the freed requests still in it
        self._handle_canceled_requests()
        self._handle_responses()
        try:
            self.calls.append(("update_resources", [r.py_request_id for r in batch.all_requests()]))
            self.resource_manager.update_resources(batch, self.metadata, 2)
        except Exception as exc:  # noqa: BLE001
            self._handle_errors(f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ the iteration's parts
    def _handle_canceled_requests(self) -> None:
        self.waiting = [r for r in self.waiting if r.py_request_id not in self._canceled]  # never had resources
        for request in [r for r in self.active if r.py_request_id in self._canceled]:
            request.state, request.finish_reason = LlmRequestState.GENERATION_COMPLETE, "cancelled"
            self._terminate_request(request)
        self._canceled.clear()

    def _schedule(self) -> ScheduledRequests:
        generation = [r for r in self.active if r.state is LlmRequestState.GENERATION_IN_PROGRESS]
        context, tokens = [], len(generation)
        while self.waiting and len(generation) + len(context) < self.max_batch_size and \
                tokens + self.waiting[0].prompt_len <= self.max_num_tokens:
            request = self.waiting.pop(0)
            context.append(request)
            self.active.append(request)
            tokens += request.prompt_len
        return ScheduledRequests(context, generation)

    def _forward(self, batch: ScheduledRequests) -> torch.Tensor:
        ids, positions, seq_lens = [], [], []
        for r in batch.context_requests:
            ids += r.get_tokens(0)
            positions += range(r.prompt_len)
            seq_lens.append(r.prompt_len)
        for r in batch.generation_requests:
            tokens = r.get_tokens(0)
            ids.append(tokens[-1])
            positions.append(len(tokens) - 1)
            seq_lens.append(1)
        md = self.metadata
        md.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        md.num_contexts = len(batch.context_requests)
        md.request_ids = [r.py_request_id for r in batch.all_requests()]
        md.prompt_lens = [r.prompt_len for r in batch.all_requests()]
        md.prepare()
        self.calls.append(("forward", list(md.request_ids)))
        last = torch.tensor(seq_lens).cumsum(0) - 1
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            return self.model(torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                              AttentionModuleStandIn(self.backends, md), logits_indices=last.to(device))

    def _update_requests(self, batch: ScheduledRequests, tokens: list[int]) -> None:
        for request, token in zip(batch.all_requests(), tokens):
            request._tokens.append(int(token))
            if request.state is LlmRequestState.CONTEXT_INIT:
                request.context_current_position = request.prompt_len
                request.state = LlmRequestState.GENERATION_IN_PROGRESS
            if len(request.output_token_ids) >= request.max_new_tokens:
                request.state, request.finish_reason = LlmRequestState.GENERATION_COMPLETE, "length"

    def _handle_responses(self) -> None:
        for request in [r for r in self.active if r.state is LlmRequestState.GENERATION_COMPLETE]:
            self._terminate_request(request)

    def _handle_errors(self, message: str) -> None:
        for request in list(self.active):
            request.state, request.finish_reason = LlmRequestState.GENERATION_COMPLETE, "error"
            self.errors[request.py_request_id] = message
            self._terminate_request(request)

    def _terminate_request(self, request: LlmRequest) -> None:
        self.calls.append(("free_resources", request.py_request_id))
        self.resource_manager.free_resources(request)
        self.active.remove(request)
        self.finished[request.py_request_id] = request
