"""A stand-in for TensorRT-LLM's PyTorch backend (TensorRT-LLM cannot be installed here), built from the manifest.

Every behaviour below is a fact of ``tests/trtllm_backend/trtllm_manifest.py`` (path and commit of the TensorRT-LLM
source it was read from); ``test_trtllm_manifest.py`` fails when the two disagree. The stand-in is strict where TensorRT-LLM
is: base constructors take exactly the source's parameters (an unexpected keyword or positional is a
``TypeError``), the factory is called with the source's keywords, a V1 KV cache manager is refused at bind,
``get_attention_backend`` upper-cases the name and falls back to ``TrtllmAttention``, and ``model_engine`` binds the
name ``get_attention_backend`` when it is imported (``_util`` imports it), so a lookup patched afterwards in
``attention/backends/utils`` alone is not the engine's.

Modules are created on import (a meta-path finder installed by :func:`installed`), as TensorRT-LLM's are:

* ``tensorrt_llm.llmapi.llm_args``: ``KvCacheCompressionConfig`` and the two shipped configs, the discriminated
  ``KvCacheCompressionConfigType``, ``KvCacheConfig``, ``CudaGraphConfig``, ``BaseLlmArgs`` / ``TorchLlmArgs``
  (the fields the adapter's path reads, with the source's defaults: block reuse on, ``use_kv_cache_manager_v2=
  "auto"`` which selects V1, CUDA graphs on, overlap scheduler on). Built fresh per install (the adapter widens
  the union in place).
* ``tensorrt_llm._torch.pyexecutor``: ``resource_manager`` (``BaseResourceManager``, ``ResourceManager``,
  ``KVCacheManager`` V1, ``KVCacheCompressionManager``), ``kv_cache.kv_cache_manager_v2`` (``KVCacheManagerV2``),
  ``model_engine`` (``PyTorchModelEngine``), ``_util`` (the factory, the compatibility check, ``KvCacheCreator``:
  build, estimation run, teardown; ``create_py_executor_instance``: bind and manager order).
* ``tensorrt_llm._torch.attention.backends``: ``interface`` (``AttentionBackend``, ``AttentionMetadata``,
  ``AttentionForwardArgs``, ``merge_attention_forward_args``), ``trtllm``, ``vanilla``, ``utils``.

:func:`create_executor` follows ``py_executor_creator``: the engine (its layers built by ``create_attention``, its
metadata class from its own lookup), the estimation build (the factory with ``estimating_kv_cache=True``), the
dummy-request run through that executor, teardown (``shutdown()``), the final build; each executor's warm-up
(CUDA graph capture of decode batches when ``cuda_graph_config`` is set; an autotuner forward when
``enable_autotuner``) runs dummy requests that bypass the resource managers.

What it does NOT reproduce: TensorRT-LLM's kernels (``TrtllmAttention.forward`` raises), KVCacheManagerV2's pages
(it counts blocks) and admission by free blocks, chunked prefill scheduling, the overlap scheduler, real CUDA
graphs (capture is one forward over the graph metadata), memory measurement, speculative decoding, and the model:
our ``LlamaForCausalLM`` stands in for TensorRT-LLM's, with :class:`AttentionModuleStandIn` in the role of its
``Attention`` module (RoPE applied before the backend, flat ``[tokens, heads * dim]`` tensors).
"""
from __future__ import annotations

import contextlib
import copy
import enum
import importlib
import importlib.abc
import importlib.util
import itertools
import sys
import types
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Generic, List, Literal, Optional, TypeVar, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

ADAPTER = "trtllm_diffkv.trtllm_backend"
LLM_ARGS = "tensorrt_llm.llmapi.llm_args"
UTIL = "tensorrt_llm._torch.pyexecutor._util"
MODEL_ENGINE = "tensorrt_llm._torch.pyexecutor.model_engine"
RESOURCE_MANAGER = "tensorrt_llm._torch.pyexecutor.resource_manager"
KVCM_V2 = "tensorrt_llm._torch.pyexecutor.kv_cache.kv_cache_manager_v2"
ATTN = "tensorrt_llm._torch.attention.backends"
ATTN_INTERFACE = ATTN + ".interface"
ATTN_UTILS = ATTN + ".utils"
WARMUP_REQUEST_ID_BASE = 1 << 40
"""Request ids of warm-up and estimation dummies (TensorRT-LLM's are its own; these never collide with tests')."""


def module(name: str) -> types.ModuleType:
    """The installed stand-in module ``name`` (imported now if it was not)."""
    return importlib.import_module(name)


class _Logger:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, message: str, *args) -> None:
        self.warnings.append(message % args if args else message)


# ---------------------------------------------------------------- llmapi/llm_args.py (built per install)
def _llm_args_namespace() -> dict:
    class StrictBaseModel(BaseModel):
        model_config = ConfigDict(extra="forbid")

    class KvCacheCompressionConfig(StrictBaseModel):
        changes_physical_kv_length: ClassVar[bool] = False
        algorithm: str

        def supports_block_reuse(self) -> bool:
            return False

        def supports_speculative_decoding(self) -> bool:
            return False

    class ColdPageQuantizationCompressionConfig(KvCacheCompressionConfig):
        algorithm: Literal["quantization_for_cold_page"] = "quantization_for_cold_page"
        quant: Literal["nvfp4"] = "nvfp4"

        def supports_block_reuse(self) -> bool:
            return True

        def supports_speculative_decoding(self) -> bool:
            return True

    class TriAttentionKvCacheCompressionConfig(KvCacheCompressionConfig):
        changes_physical_kv_length: ClassVar[bool] = True
        algorithm: Literal["triattention"] = "triattention"
        eviction_mode: Literal["union", "per_head", "per_layer_perhead"] = "union"
        budget: int = Field(default=2048, gt=0)
        beta: int = Field(default=128, gt=0)
        calibration_path: str = Field(min_length=1)

        def supports_block_reuse(self) -> bool:
            return True

        def supports_speculative_decoding(self) -> bool:
            return self.eviction_mode == "union"

    KvCacheCompressionConfigType = Annotated[
        Union[ColdPageQuantizationCompressionConfig, TriAttentionKvCacheCompressionConfig],
        Field(discriminator="algorithm")]

    class KvCacheConfig(StrictBaseModel):
        enable_block_reuse: bool = True
        max_tokens: Optional[int] = None
        free_gpu_memory_fraction: Optional[float] = Field(default=0.9, ge=0, le=1)
        tokens_per_block: int = 32
        use_kv_cache_manager_v2: Union[bool, Literal["auto"]] = "auto"

    class CudaGraphConfig(StrictBaseModel):
        batch_sizes: Optional[List[int]] = None
        max_batch_size: int = 0
        enable_padding: bool = False

        @model_validator(mode="after")
        def _sizes(self):
            if self.batch_sizes:
                self.batch_sizes = sorted(self.batch_sizes)
                self.max_batch_size = self.max_batch_size or max(self.batch_sizes)
            else:
                top = self.max_batch_size or 128
                self.batch_sizes = sorted({b for b in [*range(1, 32), 32, 64, 128] if b <= top} | {top})
                self.max_batch_size = top
            return self

    class BaseLlmArgs(StrictBaseModel):
        model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
        model: str
        tensor_parallel_size: int = 1
        pipeline_parallel_size: int = 1
        context_parallel_size: int = 1
        enable_attention_dp: bool = False
        kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
        enable_chunked_prefill: bool = False
        kv_cache_compression_config: Optional[KvCacheCompressionConfigType] = None
        speculative_config: Optional[object] = None
        max_batch_size: Optional[int] = 2048
        max_num_tokens: Optional[int] = 8192
        max_seq_len: Optional[int] = None

    class TorchLlmArgs(BaseLlmArgs):
        cuda_graph_config: Optional[CudaGraphConfig] = Field(default_factory=CudaGraphConfig)
        disable_overlap_scheduler: bool = False
        attn_backend: str = "TRTLLM"
        enable_autotuner: bool = True

        @classmethod
        def from_yaml(cls, yaml_path):
            import yaml

            with open(yaml_path) as f:
                mapping = yaml.safe_load(f) or {}
            return cls(**mapping)

    return dict(StrictBaseModel=StrictBaseModel, KvCacheCompressionConfig=KvCacheCompressionConfig,
                ColdPageQuantizationCompressionConfig=ColdPageQuantizationCompressionConfig,
                TriAttentionKvCacheCompressionConfig=TriAttentionKvCacheCompressionConfig,
                KvCacheCompressionConfigType=KvCacheCompressionConfigType, KvCacheConfig=KvCacheConfig,
                CudaGraphConfig=CudaGraphConfig, BaseLlmArgs=BaseLlmArgs, TorchLlmArgs=TorchLlmArgs)


def llm_args(**fields):
    """``TorchLlmArgs(**fields)`` of the installed stand-in (``model`` defaults to ``"local"``)."""
    fields.setdefault("model", "local")
    return module(LLM_ARGS).TorchLlmArgs(**fields)


def kv_cache_config(**fields):
    """``KvCacheConfig(**fields)`` of the installed stand-in."""
    return module(LLM_ARGS).KvCacheConfig(**fields)


# ---------------------------------------------------------------- mapping
@dataclass
class Mapping:
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    enable_attention_dp: bool = False
    cp_config: dict = field(default_factory=dict)

    def has_cp_helix(self) -> bool:
        return self.cp_config.get("cp_type") == "HELIX"

    def has_pp(self) -> bool:
        return self.pp_size > 1


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

    def add_dummy_requests(self, request_ids):
        pass

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
    CROSS_KV_CACHE_MANAGER = "CROSS_KV_CACHE_MANAGER"
    PEFT_CACHE_MANAGER = "PEFT_CACHE_MANAGER"
    SEQ_SLOT_MANAGER = "SEQ_SLOT_MANAGER"
    SPEC_RESOURCE_MANAGER = "SPEC_RESOURCE_MANAGER"
    KV_CACHE_COMPRESSION_MANAGER = "KV_CACHE_COMPRESSION_MANAGER"


class ResourceManager:
    def __init__(self, resource_managers: dict) -> None:
        self.resource_managers = OrderedDict(resource_managers)

    def get_resource_manager(self, kind):
        return self.resource_managers.get(kind)

    def prepare_resources(self, scheduled_batch) -> None:
        for manager in self.resource_managers.values():
            if hasattr(manager, "prepare_resources"):
                manager.prepare_resources(scheduled_batch)

    def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None) -> None:
        for kind, manager in self.resource_managers.items():
            if hasattr(manager, "update_resources"):
                if kind == ResourceManagerType.KV_CACHE_MANAGER:
                    manager.update_resources(scheduled_batch, attn_metadata, kv_cache_dtype_byte_size)
                else:
                    manager.update_resources(scheduled_batch)

    def free_resources(self, request) -> None:
        for manager in reversed(list(self.resource_managers.values())):
            if hasattr(manager, "free_resources"):
                manager.free_resources(request)


class _BlockCountingKVCacheManager(BaseResourceManager):
    """The shared body of the two KV cache manager stand-ins: blocks per request (no pages), the attributes the
    adapter reads, ``shutdown`` recorded."""

    def __init__(self, kv_cache_config, kv_cache_type="SELF", *, num_layers: int, num_kv_heads: int, head_dim: int,
                 tokens_per_block: int, max_seq_len: int, max_batch_size: int, mapping: Mapping,
                 max_num_tokens: int = 8192, is_draft: bool = False, is_estimating_kv_cache: bool = False,
                 **kwargs) -> None:
        self.mapping, self.tokens_per_block = mapping, tokens_per_block
        self.max_seq_len, self.max_batch_size, self.max_num_tokens = max_seq_len, max_batch_size, max_num_tokens
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.is_draft, self.is_estimating_kv_cache = is_draft, is_estimating_kv_cache
        self.blocks: dict[int, int] = {}
        self.is_shut_down = False

    def add_dummy_requests(self, request_ids, token_nums=None):
        for rid, n in zip(request_ids, token_nums or [1] * len(request_ids)):
            self.blocks[rid] = -(-n // self.tokens_per_block)

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
        return 1 << 16

    def get_needed_resource_to_completion(self, request) -> int:
        return -(-(request.prompt_len + request.max_new_tokens) // self.tokens_per_block)

    def shutdown(self) -> None:
        self.is_shut_down = True


class KVCacheManager(_BlockCountingKVCacheManager):
    """V1 (what ``use_kv_cache_manager_v2="auto"`` selects for a Llama)."""


class KVCacheManagerV2(_BlockCountingKVCacheManager):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv_compression_manages_history = False


class KVCacheCompressionManager(BaseResourceManager):
    uses_iteration_lifecycle = True
    provides_cold_page_codec = False

    def __init__(self, config) -> None:
        self.config = config
        self.kv_cache_manager = None
        self.draft_kv_cache_manager = None

    def bind_kv_cache_managers(self, kv_cache_manager, draft_kv_cache_manager=None) -> None:
        v2 = module(KVCM_V2).KVCacheManagerV2
        if not isinstance(kv_cache_manager, v2):
            raise TypeError("KV-cache compression requires KVCacheManagerV2")
        if draft_kv_cache_manager is not None and not isinstance(draft_kv_cache_manager, v2):
            raise TypeError("draft KV-cache compression requires KVCacheManagerV2")
        self.kv_cache_manager = kv_cache_manager
        self.draft_kv_cache_manager = draft_kv_cache_manager
        kv_cache_manager.kv_compression_manages_history = self.config.changes_physical_kv_length
        if draft_kv_cache_manager is not None:
            draft_kv_cache_manager.kv_compression_manages_history = self.config.changes_physical_kv_length

    @property
    def has_independent_draft_kv_cache(self) -> bool:
        return self.draft_kv_cache_manager is not None

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

    def get_max_resource_count(self) -> int:
        return 0

    def get_needed_resource_to_completion(self, request) -> int:
        return 0

    def prepare_resources(self, scheduled_batch) -> None:
        for request in scheduled_batch.context_requests:
            if request.is_first_context_chunk:
                self.on_request_init(request)
        self.on_generation_step_begin(scheduled_batch)

    def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None) -> None:
        if scheduled_batch.context_requests_last_chunk:
            self.on_context_step_end(scheduled_batch.context_requests_last_chunk)
        self.on_generation_step_end(scheduled_batch)

    def free_resources(self, request) -> None:
        self.on_request_finish(request)


# ---------------------------------------------------------------- attention/backends/interface.py
class PredefinedAttentionMask(str, enum.Enum):
    CAUSAL = "causal"
    FULL = "full"


@dataclass(kw_only=True, slots=True)
class AttentionForwardArgs:
    """A subset of the source's ~40 fields: those the stand-in's modules pass and the adapter reads."""

    output: Optional[torch.Tensor] = None
    attention_mask: PredefinedAttentionMask = PredefinedAttentionMask.CAUSAL
    attention_window_size: Optional[int] = None
    attention_mask_data: Optional[torch.Tensor] = None
    attention_sinks: Optional[torch.Tensor] = None
    is_fused_qkv: bool = False
    update_kv_cache: bool = True


def merge_attention_forward_args(forward_args, kwargs) -> AttentionForwardArgs:
    unknown = sorted(set(kwargs) - set(AttentionForwardArgs.__dataclass_fields__))
    if unknown:
        raise ValueError(f"Unknown attention forward arguments: {unknown}")
    if forward_args is not None:
        if kwargs:
            raise ValueError("Pass attention forward options either through forward_args or as legacy kwargs, "
                             f"not both: {sorted(kwargs)}")
        return forward_args
    return AttentionForwardArgs(**kwargs)


@dataclass(kw_only=True)
class AttentionMetadata:
    max_num_requests: int
    max_num_tokens: int
    max_num_sequences: Optional[int] = None
    kv_cache_manager: object = None
    draft_kv_cache_manager: object = None
    mapping: Optional[Mapping] = None
    runtime_features: object = None
    enable_flash_mla: bool = False
    enable_context_mla_with_cached_kv: bool = False
    is_cuda_graph: bool = False
    seq_lens: Optional[torch.Tensor] = None
    num_contexts: int = 0
    position_ids: Optional[torch.Tensor] = None
    request_ids: Optional[list] = None
    prompt_lens: Optional[list] = None
    cache_indirection: Optional[torch.Tensor] = None
    num_heads_per_kv: Optional[int] = 1
    sparse_metadata_params: object = None
    cuda_graph_buffers: object = None

    def prepare(self) -> None:
        """Hook to be called before the forward step of the model."""

    def create_cuda_graph_metadata(self, max_batch_size: int, sub_cross_metadata: bool = False,
                                   max_draft_tokens: int = 0, buffers=None, encode_only: bool = False):
        if self.is_cuda_graph:
            return self
        graph = copy.copy(self)
        graph.is_cuda_graph, graph.cuda_graph_buffers = True, buffers
        graph.seq_lens = torch.ones(max_batch_size, dtype=torch.int) * (1 + max_draft_tokens)
        graph.num_contexts = 0
        return graph


TMetadata = TypeVar("TMetadata", bound=AttentionMetadata)


class AttentionBackend(Generic[TMetadata]):
    Metadata = AttentionMetadata

    def __init__(self, layer_idx: int, num_heads: int, head_dim: int, num_kv_heads: Optional[int] = None,
                 quant_config=None, **kwargs) -> None:
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, num_heads, head_dim
        self.num_kv_heads = num_kv_heads or self.num_heads
        self.quant_config = quant_config

    def forward(self, q, k, v, metadata, forward_args=None, **kwargs):
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

    @classmethod
    def runtime_workspace_bytes_per_token(cls, model_config, mapping) -> int:
        return 0


@dataclass(kw_only=True)
class TrtllmAttentionMetadata(AttentionMetadata):
    pass


class TrtllmAttention(AttentionBackend):
    Metadata = TrtllmAttentionMetadata

    def forward(self, q, k, v, metadata, forward_args=None, **kwargs):
        raise NotImplementedError("stand-in: TensorRT-LLM's own attention kernels do not run here")


@dataclass(kw_only=True)
class VanillaAttentionMetadata(AttentionMetadata):
    pass


class VanillaAttention(TrtllmAttention):
    Metadata = VanillaAttentionMetadata


# ---------------------------------------------------------------- attention/backends/utils.py
def get_attention_backend(backend_name: str, sparse_params=None):
    backend_name = backend_name.upper()
    if backend_name == "VANILLA":
        return VanillaAttention
    if backend_name == "TRTLLM":
        return TrtllmAttention
    module("tensorrt_llm.logger").logger.warning("Falling back to TRTLLM attention backend")
    return TrtllmAttention


def create_attention(backend_name: str, layer_idx: int, num_heads: int, head_dim: int, num_kv_heads=None,
                     pos_embd_params=None, quant_config=None, q_scaling=None, skip_create_weights_in_init=False,
                     attention_chunk_size=None, sparse_params=None, dtype=None, aux_stream=None,
                     kv_cache_dtype="auto", skip_correction_threshold=0.0):
    if attention_chunk_size is not None and backend_name.upper() != "TRTLLM":
        raise ValueError(f"Backend {backend_name} does not support chunked attention.")
    attn_cls = module(ATTN_UTILS).get_attention_backend(backend_name, sparse_params=sparse_params)  # module global
    kwargs = dict(quant_config=quant_config, q_scaling=q_scaling, pos_embd_params=pos_embd_params, mla_params=None,
                  skip_create_weights_in_init=skip_create_weights_in_init,
                  attention_chunk_size=attention_chunk_size, dtype=dtype, aux_stream=aux_stream,
                  sparse_params=sparse_params, kv_cache_dtype=kv_cache_dtype,
                  skip_correction_threshold=skip_correction_threshold)
    return attn_cls(layer_idx, num_heads, head_dim, num_kv_heads, **kwargs)


# ---------------------------------------------------------------- pyexecutor/model_engine.py
class AttentionModuleStandIn:
    """TensorRT-LLM's ``Attention`` module around the backend: our model's ``backend.forward(layer_idx, q, k, v)``
    becomes ``backends[layer_idx].forward(q, k, v, metadata, forward_args=AttentionForwardArgs(...))`` over flat
    ``[num_tokens, heads * head_dim]`` tensors."""

    def __init__(self, backends: list, metadata) -> None:
        self.backends, self.metadata = backends, metadata

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        out = self.backends[layer_idx].forward(
            q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1), self.metadata,
            forward_args=AttentionForwardArgs(attention_mask=PredefinedAttentionMask.CAUSAL))
        return out.reshape(num_tokens, num_heads, head_dim)


class PyTorchModelEngine:
    """The engine's parts the adapter meets: ``llm_args``, ``mapping``, ``spec_config``, ``model.model_config``
    (``pretrained_config``), the backend class from the name ``model_engine`` bound at import, the layers' backends
    from ``create_attention``, the metadata from ``attn_backend.Metadata(...)`` with the source's keywords, and the
    warm-up dummies (which bypass the resource managers)."""

    def __init__(self, *, model, llm_args, mapping: Mapping, pretrained_config, max_batch_size: int,
                 max_num_tokens: int, max_seq_len: int) -> None:
        self.llm_args, self.mapping, self.spec_config = llm_args, mapping, llm_args.speculative_config
        self.net = model
        self.model = types.SimpleNamespace(model_config=types.SimpleNamespace(
            pretrained_config=pretrained_config, quant_config=None, attn_backend=llm_args.attn_backend))
        self.batch_size, self.max_num_tokens, self.max_seq_len = max_batch_size, max_num_tokens, max_seq_len
        self.attn_backend = module(MODEL_ENGINE).get_attention_backend(llm_args.attn_backend)  # the bound name
        mc = model.config
        self.backends = [module(ATTN_UTILS).create_attention(llm_args.attn_backend, i, mc.num_heads, mc.head_dim,
                                                             mc.num_kv_heads) for i in range(mc.num_layers)]
        self.attn_metadata = None
        self.kv_cache_manager_key = ResourceManagerType.KV_CACHE_MANAGER
        self.warmup_forwards = 0
        self._dummy_ids = itertools.count(WARMUP_REQUEST_ID_BASE)

    def metadata(self, resource_manager):
        if self.attn_metadata is None:
            mc = self.net.config
            self.attn_metadata = self.attn_backend.Metadata(
                max_num_requests=self.batch_size, max_num_tokens=self.max_num_tokens,
                max_num_sequences=self.batch_size, kv_cache_manager=resource_manager.get_resource_manager(
                    self.kv_cache_manager_key), draft_kv_cache_manager=None, mapping=self.mapping,
                runtime_features=None, enable_flash_mla=False, enable_context_mla_with_cached_kv=False,
                cache_indirection=None, num_heads_per_kv=mc.num_heads // mc.num_kv_heads, sparse_metadata_params=None)
        return self.attn_metadata

    def forward(self, scheduled_requests: ScheduledRequests, resource_manager, metadata=None) -> torch.Tensor:
        ids, positions, seq_lens = [], [], []
        for r in scheduled_requests.context_requests:
            ids += r.get_tokens(0)
            positions += range(r.prompt_len)
            seq_lens.append(r.prompt_len)
        for r in scheduled_requests.generation_requests:
            tokens = r.get_tokens(0)
            ids.append(tokens[-1])
            positions.append(len(tokens) - 1)
            seq_lens.append(1)
        md = metadata if metadata is not None else self.metadata(resource_manager)
        md.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        md.num_contexts = len(scheduled_requests.context_requests)
        md.request_ids = [r.py_request_id for r in scheduled_requests.all_requests()]
        md.prompt_lens = [r.prompt_len for r in scheduled_requests.all_requests()]
        md.prepare()
        last = torch.tensor(seq_lens).cumsum(0) - 1
        device = next(self.net.parameters()).device
        with torch.inference_mode():
            return self.net(torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                            AttentionModuleStandIn(self.backends, md), logits_indices=last.to(device))

    def warmup(self, resource_manager) -> None:
        """CUDA graph capture of decode batches (``cuda_graph_config``) and an autotuner forward
        (``enable_autotuner``), over dummy requests added to and freed from the KV cache manager directly."""
        kv = resource_manager.get_resource_manager(self.kv_cache_manager_key)
        graphs = self.llm_args.cuda_graph_config
        if graphs is not None:
            for batch_size in [b for b in graphs.batch_sizes if b <= self.batch_size]:
                dummies = [LlmRequest(next(self._dummy_ids), [1, 2], 1) for _ in range(batch_size)]
                kv.add_dummy_requests([r.py_request_id for r in dummies], [2] * batch_size)
                try:
                    graph_md = self.metadata(resource_manager).create_cuda_graph_metadata(batch_size, False, 0, None)
                    self.forward(ScheduledRequests((), dummies), resource_manager, metadata=graph_md)
                    self.warmup_forwards += 1
                finally:
                    for r in dummies:
                        kv.free_resources(r)
        if self.llm_args.enable_autotuner:
            n = max(1, min(self.max_num_tokens, self.max_seq_len - 1))
            dummy = LlmRequest(next(self._dummy_ids), [(7 * i) % 97 + 1 for i in range(n)], 1)
            kv.add_dummy_requests([dummy.py_request_id], [n])
            try:
                self.forward(ScheduledRequests([dummy], ()), resource_manager)
                self.warmup_forwards += 1
            finally:
                kv.free_resources(dummy)


# ---------------------------------------------------------------- pyexecutor/_util.py
def validate_kv_cache_compression_compatibility(config, kv_cache_config, spec_config) -> None:
    if kv_cache_config.enable_block_reuse and not config.supports_block_reuse():
        raise ValueError(f"KV-cache compression algorithm {config.algorithm!r} does not support KV-cache block reuse. "
                         "Set KvCacheConfig.enable_block_reuse=False.")
    if spec_config is None:
        return
    if not config.supports_speculative_decoding():
        raise ValueError(f"KV-cache compression algorithm {config.algorithm!r} does not support speculative "
                         "decoding with its current configuration")


def create_kv_cache_compression_manager(config, *, model_engine, kv_cache_config, estimating_kv_cache=False):
    if config is None:
        return None
    if model_engine.mapping.has_cp_helix():
        raise ValueError("KV-cache compression does not support HELIX context parallelism.")
    util = module(UTIL)
    if config.algorithm == "quantization_for_cold_page":
        if estimating_kv_cache:
            return None
        util.validate_kv_cache_compression_compatibility(config, kv_cache_config, model_engine.spec_config)
        raise NotImplementedError("stand-in: TensorRT-LLM's cold-page quantization does not run here")
    if config.algorithm == "triattention":
        util.validate_kv_cache_compression_compatibility(config, kv_cache_config, model_engine.spec_config)
        raise NotImplementedError("stand-in: TensorRT-LLM's TriAttention does not run here")
    util.logger.warning("KV-cache compression algorithm '%s' is not registered; running without a compression "
                        "manager.", config.algorithm)
    return None


def get_attention_workspace_bytes_per_token(model_config, mapping) -> int:
    lookup = module(ATTN_UTILS).get_attention_backend  # imported at call time, as in the source
    return lookup(model_config.attn_backend).runtime_workspace_bytes_per_token(model_config, mapping)


class KvCacheCreator:
    """``build_managers`` (the factory first, then the KV cache manager the config selects), the estimation run and
    ``teardown_managers``. ``calls`` records the factory's arguments and the teardown order."""

    def __init__(self, *, model_engine: PyTorchModelEngine, llm_args, max_batch_size: int, max_num_tokens: int,
                 max_seq_len: int) -> None:
        self._model_engine, self._llm_args = model_engine, llm_args
        self._max_batch_size, self._max_num_tokens, self._max_seq_len = max_batch_size, max_num_tokens, max_seq_len
        self._skip_est = False
        self.calls: list[tuple] = []

    def _kv_cache_manager_cls(self):
        use_v2 = self._llm_args.kv_cache_config.use_kv_cache_manager_v2 is True
        return module(KVCM_V2).KVCacheManagerV2 if use_v2 else module(RESOURCE_MANAGER).KVCacheManager

    def try_prepare_estimation(self) -> bool:
        if self._skip_est:
            return False
        if "cp_type" in self._model_engine.mapping.cp_config:
            return False
        return self._model_engine.model.model_config.attn_backend != "VANILLA"

    def build_managers(self, resources: dict, estimating_kv_cache: bool = False) -> None:
        config = self._llm_args.kv_cache_compression_config
        estimating = estimating_kv_cache and not self._skip_est
        self.calls.append(("factory", config, estimating))
        compression = module(UTIL).create_kv_cache_compression_manager(
            config, model_engine=self._model_engine, kv_cache_config=self._llm_args.kv_cache_config,
            estimating_kv_cache=estimating)
        mc = self._model_engine.net.config
        kv = self._kv_cache_manager_cls()(
            self._llm_args.kv_cache_config, "SELF", num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim, tokens_per_block=self._llm_args.kv_cache_config.tokens_per_block,
            max_seq_len=self._max_seq_len, max_batch_size=self._max_batch_size, mapping=self._model_engine.mapping,
            max_num_tokens=self._max_num_tokens, is_estimating_kv_cache=estimating)
        resources[ResourceManagerType.KV_CACHE_MANAGER] = kv
        resources[ResourceManagerType.DRAFT_KV_CACHE_MANAGER] = None
        if compression is not None and compression.uses_iteration_lifecycle:
            resources[ResourceManagerType.KV_CACHE_COMPRESSION_MANAGER] = compression

    def teardown_managers(self, resources: dict) -> None:
        compression = resources.pop(ResourceManagerType.KV_CACHE_COMPRESSION_MANAGER, None)
        if compression is not None:
            self.calls.append(("shutdown", "compression"))
            compression.shutdown()
        self.calls.append(("shutdown", "kv_cache_manager"))
        resources[ResourceManagerType.KV_CACHE_MANAGER].shutdown()
        del resources[ResourceManagerType.KV_CACHE_MANAGER]
        del resources[ResourceManagerType.DRAFT_KV_CACHE_MANAGER]

    def configure_kv_cache_capacity(self, py_executor) -> None:
        """The dummy context requests (prompts of ``max_seq_len - 1`` tokens, capped at ``max_num_tokens``, one new
        token each) through the estimation executor; an error response raises; the executor is shut down."""
        get_attention_workspace_bytes_per_token(self._model_engine.model.model_config, self._model_engine.mapping)
        remaining, length = self._max_num_tokens, min(self._max_num_tokens, max(1, self._max_seq_len - 1))
        ids = itertools.count(WARMUP_REQUEST_ID_BASE // 2)
        while remaining > 0:
            n = min(length, remaining)
            py_executor.enqueue(LlmRequest(next(ids), [(3 * i) % 89 + 1 for i in range(n)], 1))
            remaining -= n
        py_executor.is_warmup = True
        try:
            py_executor.run_until_done()
            if py_executor.errors:
                raise RuntimeError(next(iter(py_executor.errors.values())))
        finally:
            py_executor.is_warmup = False
            py_executor.shutdown()


def create_py_executor_instance(*, resources: dict, model_engine: PyTorchModelEngine, max_batch_size: int,
                                max_num_tokens: int) -> "StandInPyExecutor":
    """Bind (two positionals), order the managers (KV cache manager, then the compression manager, last), build
    the executor, warm the engine up."""
    compression = resources.get(ResourceManagerType.KV_CACHE_COMPRESSION_MANAGER)
    if compression is not None:
        compression.bind_kv_cache_managers(resources[ResourceManagerType.KV_CACHE_MANAGER],
                                           resources.get(ResourceManagerType.DRAFT_KV_CACHE_MANAGER))
    resource_manager = ResourceManager(resources)
    resource_manager.resource_managers.move_to_end(ResourceManagerType.KV_CACHE_MANAGER, last=True)
    if ResourceManagerType.KV_CACHE_COMPRESSION_MANAGER in resource_manager.resource_managers:
        resource_manager.resource_managers.move_to_end(ResourceManagerType.KV_CACHE_COMPRESSION_MANAGER, last=True)
    executor = StandInPyExecutor(resource_manager, model_engine, max_batch_size=max_batch_size,
                                 max_num_tokens=max_num_tokens)
    model_engine.warmup(resource_manager)
    return executor


# ---------------------------------------------------------------- the module tree (created on import)
def _fill(**attrs):
    def exec_module(mod: types.ModuleType) -> None:
        mod.__dict__.update(attrs)
    return exec_module


def _exec_llmapi(mod):
    args = module(LLM_ARGS)
    mod.KvCacheConfig, mod.CudaGraphConfig = args.KvCacheConfig, args.CudaGraphConfig


def _exec_backends(mod):
    for name in ("interface", "trtllm", "vanilla"):
        module(f"{ATTN}.{name}")
    mod.__dict__.update(AttentionBackend=AttentionBackend, AttentionForwardArgs=AttentionForwardArgs,
                        AttentionMetadata=AttentionMetadata, TrtllmAttention=TrtllmAttention,
                        TrtllmAttentionMetadata=TrtllmAttentionMetadata, VanillaAttention=VanillaAttention,
                        VanillaAttentionMetadata=VanillaAttentionMetadata)


def _exec_model_engine(mod):
    utils = module(ATTN_UTILS)
    mod.get_attention_backend = utils.get_attention_backend  # 'from ..attention.backends.utils import ...'
    mod.PyTorchModelEngine = PyTorchModelEngine


def _exec_util(mod):
    module(MODEL_ENGINE)  # 'from .model_engine import PyTorchModelEngine'
    mod.__dict__.update(
        logger=module("tensorrt_llm.logger").logger,
        validate_kv_cache_compression_compatibility=validate_kv_cache_compression_compatibility,
        create_kv_cache_compression_manager=create_kv_cache_compression_manager, KvCacheCreator=KvCacheCreator,
        create_py_executor_instance=create_py_executor_instance,
        get_attention_workspace_bytes_per_token=get_attention_workspace_bytes_per_token,
        ResourceManagerType=ResourceManagerType)


def _modules() -> dict:
    """``{module name: (is_package, exec_module)}`` of the stand-in tree."""
    pkg = _fill()
    return {
        "tensorrt_llm": (True, pkg),
        "tensorrt_llm.llmapi": (True, _exec_llmapi),
        LLM_ARGS: (False, _fill(**_llm_args_namespace())),
        "tensorrt_llm.mapping": (False, _fill(Mapping=Mapping)),
        "tensorrt_llm.logger": (False, _fill(logger=_Logger())),
        "tensorrt_llm._torch": (True, pkg),
        "tensorrt_llm._torch.pyexecutor": (True, pkg),
        RESOURCE_MANAGER: (False, _fill(BaseResourceManager=BaseResourceManager, ResourceManager=ResourceManager,
                                        ResourceManagerType=ResourceManagerType, KVCacheManager=KVCacheManager,
                                        KVCacheCompressionManager=KVCacheCompressionManager)),
        "tensorrt_llm._torch.pyexecutor.kv_cache": (True, pkg),
        KVCM_V2: (False, _fill(KVCacheManagerV2=KVCacheManagerV2)),
        "tensorrt_llm._torch.pyexecutor.llm_request": (False, _fill(LlmRequest=LlmRequest,
                                                                    LlmRequestState=LlmRequestState)),
        "tensorrt_llm._torch.pyexecutor.scheduler": (False, _fill(ScheduledRequests=ScheduledRequests)),
        MODEL_ENGINE: (False, _exec_model_engine),
        UTIL: (False, _exec_util),
        "tensorrt_llm._torch.attention": (True, pkg),
        ATTN: (True, _exec_backends),
        ATTN_INTERFACE: (False, _fill(AttentionBackend=AttentionBackend, AttentionMetadata=AttentionMetadata,
                                      AttentionForwardArgs=AttentionForwardArgs,
                                      PredefinedAttentionMask=PredefinedAttentionMask,
                                      merge_attention_forward_args=merge_attention_forward_args)),
        ATTN + ".trtllm": (False, _fill(TrtllmAttention=TrtllmAttention,
                                        TrtllmAttentionMetadata=TrtllmAttentionMetadata)),
        ATTN + ".vanilla": (False, _fill(VanillaAttention=VanillaAttention,
                                         VanillaAttentionMetadata=VanillaAttentionMetadata)),
        ATTN_UTILS: (False, _fill(get_attention_backend=get_attention_backend, create_attention=create_attention)),
    }


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, modules: dict) -> None:
        self.modules = modules

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=self.modules[fullname][0])

    def create_module(self, spec):
        return None

    def exec_module(self, mod) -> None:
        self.modules[mod.__name__][1](mod)


def _is_ours(name: str) -> bool:
    return name == "tensorrt_llm" or name.startswith("tensorrt_llm.") or name == ADAPTER or \
        name.startswith(ADAPTER + ".")


@contextlib.contextmanager
def installed():
    """The stand-in importable as ``tensorrt_llm`` and a fresh import of the adapter; both removed at exit.

    Nothing is imported until someone imports it (``_util`` importing ``model_engine`` included)."""
    saved = {n: sys.modules.pop(n) for n in [n for n in sys.modules if _is_ours(n)]}
    finder = _StandInFinder(_modules())
    sys.meta_path.insert(0, finder)
    try:
        yield finder
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if _is_ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)


@contextlib.contextmanager
def adapter_installed():
    """:func:`installed`, with the adapter imported and registered; yields the adapter package."""
    with installed():
        adapter = importlib.import_module(ADAPTER)
        adapter.register()
        yield adapter


def pretrained_config_of(model_config, **changes) -> dict:
    """The ``config.json`` of our :class:`ModelConfig`: what TensorRT-LLM's engine holds as
    ``model.model_config.pretrained_config`` (a transformers config there; its dict here), with ``changes``."""
    mc = model_config
    hf = dict(architectures=[mc.architecture], model_type="llama", vocab_size=mc.vocab_size,
              hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_layers,
              num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads, head_dim=mc.head_dim,
              rms_norm_eps=mc.rms_norm_eps, rope_theta=mc.rope_theta,
              max_position_embeddings=mc.max_position_embeddings, hidden_act="silu", torch_dtype="float32")
    hf.update(changes)
    return hf


# ---------------------------------------------------------------- py_executor.py's iteration and the creator
class StandInPyExecutor:
    """PyExecutor's iteration on one device, greedy, no chunking: the order in which TensorRT-LLM calls the
    resource managers and the model for prefill, decode, finish and abort.

    Attributes:
        resource_manager, model_engine; ``errors``: request id -> message of requests failed by ``_handle_errors``;
        ``calls``: the resource-manager calls and forwards of each iteration; ``finished``.
    """

    def __init__(self, resource_manager: ResourceManager, model_engine: PyTorchModelEngine, *, max_batch_size: int,
                 max_num_tokens: int) -> None:
        self.resource_manager, self.model_engine = resource_manager, model_engine
        self.max_batch_size, self.max_num_tokens = max_batch_size, max_num_tokens
        self.waiting: list[LlmRequest] = []
        self.active: list[LlmRequest] = []
        self.finished: dict[int, LlmRequest] = {}
        self.errors: dict[int, str] = {}
        self.calls: list[tuple] = []
        self.is_warmup = False
        self.is_shut_down = False
        self._canceled: set[int] = set()
        self._ids = itertools.count()

    @property
    def kv_cache_manager(self):
        return self.resource_manager.get_resource_manager(ResourceManagerType.KV_CACHE_MANAGER)

    @property
    def compression_manager(self):
        return self.resource_manager.get_resource_manager(ResourceManagerType.KV_CACHE_COMPRESSION_MANAGER)

    @property
    def metadata(self):
        return self.model_engine.metadata(self.resource_manager)

    @property
    def backends(self) -> list:
        return self.model_engine.backends

    def enqueue(self, request: LlmRequest) -> int:
        self.waiting.append(request)
        return request.py_request_id

    def add_request(self, prompt_token_ids: list[int], max_new_tokens: int, *, context_chunk_size=None) -> int:
        return self.enqueue(LlmRequest(next(self._ids), prompt_token_ids, max_new_tokens, context_chunk_size))

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

    def shutdown(self) -> None:
        self.is_shut_down = True

    def step(self) -> None:
        self._handle_canceled_requests()
        batch = self._schedule()
        if not batch.batch_size:
            return
        try:
            self.calls.append(("prepare_resources", [r.py_request_id for r in batch.all_requests()]))
            self.resource_manager.prepare_resources(batch)
            self.calls.append(("forward", [r.py_request_id for r in batch.all_requests()]))
            logits = self.model_engine.forward(batch, self.resource_manager)
            self._update_requests(batch, logits.argmax(-1).tolist())
        except Exception as exc:  # noqa: BLE001 - PyExecutor's _handle_errors: every active request fails
            self._handle_errors(f"{type(exc).__name__}: {exc}")
        # PyExecutor's order: cancellations and finished requests answered (and freed) first, then update_resources
        # over the scheduled batch as it was, the freed requests still in it
        self._handle_canceled_requests()
        self._handle_responses()
        try:
            self.calls.append(("update_resources", [r.py_request_id for r in batch.all_requests()]))
            self.resource_manager.update_resources(batch, self.model_engine.attn_metadata, 2)
        except Exception as exc:  # noqa: BLE001
            self._handle_errors(f"{type(exc).__name__}: {exc}")

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


def create_executor(model, llm_args, pretrained_config, *, max_batch_size: int = 8, max_seq_len: int = 256,
                    max_num_tokens: int = 2048) -> StandInPyExecutor:
    """``py_executor_creator``'s order: the engine, the estimation build and run (when ``try_prepare_estimation``),
    teardown, the final build and executor. The returned executor carries ``creator`` (its ``calls``: factory
    arguments and teardown order) and ``estimation_managers`` (the resources of the estimation build)."""
    util = module(UTIL)
    engine = module(MODEL_ENGINE).PyTorchModelEngine(
        model=model, llm_args=llm_args, mapping=Mapping(
            tp_size=llm_args.tensor_parallel_size, pp_size=llm_args.pipeline_parallel_size,
            cp_size=llm_args.context_parallel_size, enable_attention_dp=llm_args.enable_attention_dp),
        pretrained_config=pretrained_config, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
        max_seq_len=max_seq_len)
    creator = util.KvCacheCreator(model_engine=engine, llm_args=llm_args, max_batch_size=max_batch_size,
                                  max_num_tokens=max_num_tokens, max_seq_len=max_seq_len)
    sizes = dict(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens)
    estimating = creator.try_prepare_estimation()
    resources: dict = {}
    creator.build_managers(resources, estimating)
    estimation_managers = dict(resources)
    executor = util.create_py_executor_instance(resources=resources, model_engine=engine, **sizes)
    if estimating:
        creator.configure_kv_cache_capacity(executor)
        creator.teardown_managers(resources)
        creator.build_managers(resources, False)
        engine.attn_metadata = None
        executor = util.create_py_executor_instance(resources=resources, model_engine=engine, **sizes)
    executor.creator, executor.estimation_managers = creator, estimation_managers
    return executor
