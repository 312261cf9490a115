"""What the DiffKV adapter relies on in TensorRT-LLM, each fact with the source file and commit it was read at.

The TensorRT-LLM adapter (``trtllm_diffkv/trtllm_backend/``) cannot run here (TensorRT-LLM does not install on
these machines), so its tests drive it through ``tests/trtllm_backend/trtllm_standin.py``. That stand-in is built
from this manifest, and two tests hold the three together (``test_trtllm_manifest.py``): the stand-in agrees with every
structured fact below, and the adapter's classes and calls fit them (keyword names, positional counts, hook names).

Sources were read with the search tool's index of NVIDIA/TensorRT-LLM on 2026-12-07 and 2026-12-08:

* ``commit`` is the 40-hex commit the index named for that file version;
* ``registry:<date>`` marks a package-registry check (pip), not source;
* ``index:<id>`` marks a file version that the index served by its id without naming a commit (a ``find_string``
  hit, which also names no path: ``path`` is then the file the text belongs to, inferred from its imports and
  contents, and ``note`` says so).

A fact that could not be read from source has ``verified=False`` and says why (``why``). The ``data`` of a fact
is what the agreement tests compare; signatures are ``{"positional": [...], "keyword_only": [...], "defaults":
{...}, "var_keyword": bool}`` without ``self``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

UTIL = "tensorrt_llm/_torch/pyexecutor/_util.py"
LLM_ARGS = "tensorrt_llm/llmapi/llm_args.py"
RESOURCE_MANAGER = "tensorrt_llm/_torch/pyexecutor/resource_manager.py"
KVCM_V2 = "tensorrt_llm/_torch/pyexecutor/kv_cache/kv_cache_manager_v2.py"
INTERFACE = "tensorrt_llm/_torch/attention/backends/interface.py"
ATTN_UTILS = "tensorrt_llm/_torch/attention/backends/utils.py"
ATTN_INIT = "tensorrt_llm/_torch/attention/backends/__init__.py"
MODEL_ENGINE = "tensorrt_llm/_torch/pyexecutor/model_engine.py"
CREATOR = "tensorrt_llm/_torch/pyexecutor/py_executor_creator.py"
PY_EXECUTOR = "tensorrt_llm/_torch/pyexecutor/py_executor.py"
CUDA_GRAPH_RUNNER = "tensorrt_llm/_torch/pyexecutor/cuda_graph_runner.py"
ENGINE_METADATA = "tensorrt_llm/_torch/pyexecutor/engine/metadata.py"
DECODER_RUNNER = "tensorrt_llm/_torch/pyexecutor/engine/runners/decoder/runner.py"
MODULES_ATTENTION = "tensorrt_llm/_torch/modules/attention.py"

C_UTIL = "0004396720054fd8e205cbf616f21f0b57c6b412"  # _util.py, llm_args.py and kv_cache_manager_v2.py
C_RESOURCE_MANAGER = "index:57350670334"  # the issue names 0e4d4e1577; the index would not resolve it
C_BASE_RESOURCE_MANAGER = "001541bad83b84ae4c5c4a279e464572d5f690f7"
C_INTERFACE = "1262edbc3809b30af94c3cf2ec2736a14642b821"
C_ATTN_UTILS = "2a3c95e3c43e31f27087d86a9416ede8fbfc6637"
C_ATTN_INIT = "094cc4ac03137208abebf3261b505cf111fad175"
C_MODEL_ENGINE = "index:70433821559"
C_MODEL_ENGINE_OLD = "001e67005b4f64b69b0045456870be48ab7b2cf0"


@dataclass(frozen=True)
class Fact:
    """One fact about TensorRT-LLM's source: where it was read, what it says, whether it was read at all."""

    id: str
    path: str
    commit: str
    statement: str
    data: dict = field(default_factory=dict)
    verified: bool = True
    why: str = ""  # why it could not be verified from source (verified=False)
    note: str = ""


def sig(positional=(), keyword_only=(), defaults=None, var_keyword=False) -> dict:
    """A signature fact's data (parameter names without ``self``)."""
    return {"positional": list(positional), "keyword_only": list(keyword_only), "defaults": dict(defaults or {}),
            "var_keyword": var_keyword}


FACTS: tuple[Fact, ...] = (
    # ------------------------------------------------------------------ the factory and its caller (_util.py)
    Fact("factory.signature", UTIL, C_UTIL,
         "create_kv_cache_compression_manager(config, *, model_engine, kv_cache_config, estimating_kv_cache=False)",
         sig(["config"], ["model_engine", "kv_cache_config", "estimating_kv_cache"],
             {"estimating_kv_cache": False})),
    Fact("factory.call", UTIL, C_UTIL,
         "KvCacheCreator.build_managers calls the factory as a module global of _util with the LLM args' "
         "kv_cache_compression_config positionally and model_engine=, kv_cache_config= (the target's, after "
         "budget splits), estimating_kv_cache= (estimating and not skip_est) as keywords, BEFORE it builds the KV "
         "cache manager",
         {"positional": 1, "keywords": ["model_engine", "kv_cache_config", "estimating_kv_cache"]}),
    Fact("factory.none", UTIL, C_UTIL, "the factory returns None when the config is None (it is always called)",
         {"returns_for_none": None}),
    Fact("factory.helix", UTIL, C_UTIL,
         "the factory raises ValueError when model_engine.mapping.has_cp_helix() (before any algorithm branch)",
         {"raises": "ValueError"}),
    Fact("factory.branch_validates", UTIL, C_UTIL,
         "each shipped algorithm's branch calls validate_kv_cache_compression_compatibility(config, "
         "kv_cache_config, model_engine.spec_config) itself; nothing outside the branches does",
         {"validate_args": ["config", "kv_cache_config", "model_engine.spec_config"]}),
    Fact("factory.model_config", UTIL, C_UTIL,
         "the model's config comes from model_engine.model.model_config.pretrained_config (TriAttention's branch "
         "passes it as pretrained_config=)", {"attribute_path": "model.model_config.pretrained_config"}),
    Fact("factory.unregistered", UTIL, C_UTIL,
         "an algorithm without a branch: logger.warning(...'%s' is not registered..., algorithm) and None",
         {"returns": None}),
    Fact("factory.estimating_cold_page", UTIL, C_UTIL,
         "the cold-page branch returns None while estimating_kv_cache (a method may skip its manager then)"),
    Fact("validate.signature", UTIL, C_UTIL,
         "validate_kv_cache_compression_compatibility(config, kv_cache_config, spec_config): ValueError "
         "'...does not support KV-cache block reuse...' when kv_cache_config.enable_block_reuse and not "
         "config.supports_block_reuse(); ValueError '...does not support speculative decoding...' when spec_config "
         "is not None and not config.supports_speculative_decoding()",
         {**sig(["config", "kv_cache_config", "spec_config"]),
          "messages": ["does not support KV-cache block reuse", "does not support speculative decoding"]}),
    Fact("build_managers.register", UTIL, C_UTIL,
         "the manager is registered as ResourceManagerType.KV_CACHE_COMPRESSION_MANAGER only when "
         "uses_iteration_lifecycle is true", {"resource_key": "KV_CACHE_COMPRESSION_MANAGER"}),
    Fact("kv_manager.selection", UTIL, C_UTIL,
         "_non_hybrid_kv_cache_manager_cls: KVCacheManagerV2 when kv_cache_config.use_kv_cache_manager_v2 is True "
         "(or Gemma4 hybrid), else KVCacheManager (V1)", {"v2_when": True}),
    Fact("teardown.shutdown", UTIL, C_UTIL,
         "KvCacheCreator.teardown_managers pops the compression manager and calls its shutdown() first, then the "
         "KV cache manager's shutdown()", {"order": ["compression.shutdown", "kv_cache_manager.shutdown"]}),
    Fact("bind.call", UTIL, C_UTIL,
         "create_py_executor_instance calls compression_manager.bind_kv_cache_managers(resources[KV_CACHE_MANAGER], "
         "resources.get(DRAFT_KV_CACHE_MANAGER)) positionally, then ResourceManager(resources), moves the KV cache "
         "manager to the end, then the compression manager after it", {"positional": 2,
                                                                       "order_tail": ["KV_CACHE_MANAGER",
                                                                                      "KV_CACHE_COMPRESSION_MANAGER"]}),
    Fact("estimation.dummies", UTIL, C_UTIL,
         "configure_kv_cache_capacity enqueues dummy context requests (prompts of max_seq_len - 1 tokens capped at "
         "max_num_tokens, max_tokens=1) into the estimation PyExecutor, awaits them (an error response raises "
         "RuntimeError), then shuts the executor down; try_prepare_estimation skips estimation for context "
         "parallelism and attn_backend == 'VANILLA'"),
    Fact("estimation.flow", CREATOR, "index:4285525045",
         "build_managers(resources, estimating) -> executor -> configure_kv_cache_capacity(executor) -> "
         "teardown_managers(resources) -> build_managers(resources, False) -> a new executor",
         note="the hit names no path or commit; path inferred (py_executor_creator)"),
    Fact("workspace.lookup", UTIL, C_UTIL,
         "get_attention_workspace_bytes_per_token imports get_attention_backend from attention/backends/utils at "
         "call time and calls runtime_workspace_bytes_per_token(model_config, mapping) on the class"),
    # ------------------------------------------------------------------ llm_args.py
    Fact("config.base", LLM_ARGS, C_UTIL,
         "KvCacheCompressionConfig(StrictBaseModel, extra fields forbidden): algorithm: str (required), "
         "ClassVar changes_physical_kv_length = False, supports_block_reuse() -> False, "
         "supports_speculative_decoding() -> False",
         {"extra": "forbid", "changes_physical_kv_length": False, "supports_block_reuse": False,
          "supports_speculative_decoding": False}),
    Fact("config.union", LLM_ARGS, C_UTIL,
         "KvCacheCompressionConfigType = Annotated[Union[ColdPageQuantizationCompressionConfig, "
         "TriAttentionKvCacheCompressionConfig], Field(discriminator='algorithm')]; a config whose algorithm is "
         "none of the members' tags is refused (YAML mapping and Python instance alike)",
         {"discriminator": "algorithm", "tags": ["quantization_for_cold_page", "triattention"]}),
    Fact("args.compression_field", LLM_ARGS, C_UTIL,
         "BaseLlmArgs.kv_cache_compression_config: Optional[KvCacheCompressionConfigType] = None",
         {"default": None}),
    Fact("args.kv_cache_config", LLM_ARGS, C_UTIL,
         "KvCacheConfig: enable_block_reuse=True, free_gpu_memory_fraction=0.9, "
         "use_kv_cache_manager_v2: bool | Literal['auto'] = 'auto' ('auto': the model's preference, else False)",
         {"enable_block_reuse": True, "free_gpu_memory_fraction": 0.9, "use_kv_cache_manager_v2": "auto"}),
    Fact("args.torch", LLM_ARGS, C_UTIL,
         "TorchLlmArgs: cuda_graph_config default_factory=CudaGraphConfig (CUDA graphs on by default; None turns "
         "them off), disable_overlap_scheduler=False, attn_backend: str = 'TRTLLM'; BaseLlmArgs: "
         "enable_chunked_prefill=False, tensor/pipeline/context_parallel_size=1, enable_attention_dp=False",
         {"cuda_graph_config_default_is_none": False, "disable_overlap_scheduler": False, "attn_backend": "TRTLLM",
          "enable_chunked_prefill": False, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
          "context_parallel_size": 1, "enable_attention_dp": False}),
    Fact("args.from_yaml", LLM_ARGS, C_UTIL,
         "TorchLlmArgs.from_yaml: yaml.safe_load of the file, then cls(**mapping)"),
    # ------------------------------------------------------------------ resource_manager.py
    Fact("base.init", RESOURCE_MANAGER, C_RESOURCE_MANAGER,
         "KVCacheCompressionManager.__init__(self, config): sets config, kv_cache_manager=None, "
         "draft_kv_cache_manager=None", sig(["config"]),
         note="an index version with no commit named (ids 68xxx) has cold-page subclasses calling "
              "super().__init__(config, pretrained_config=...): a newer base may take pretrained_config= too; the "
              "adapter passes it only when the base's signature has it"),
    Fact("base.flags", RESOURCE_MANAGER, C_RESOURCE_MANAGER,
         "class attributes uses_iteration_lifecycle = True, provides_cold_page_codec = False",
         {"uses_iteration_lifecycle": True, "provides_cold_page_codec": False}),
    Fact("base.bind", RESOURCE_MANAGER, C_RESOURCE_MANAGER,
         "bind_kv_cache_managers(kv_cache_manager, draft_kv_cache_manager=None) raises TypeError('KV-cache "
         "compression requires KVCacheManagerV2') unless isinstance(kv_cache_manager, KVCacheManagerV2) (draft "
         "likewise), then sets kv_compression_manages_history = config.changes_physical_kv_length on each",
         {**sig(["kv_cache_manager", "draft_kv_cache_manager"], defaults={"draft_kv_cache_manager": None}),
          "message": "KV-cache compression requires KVCacheManagerV2"}),
    Fact("base.hooks", RESOURCE_MANAGER, C_RESOURCE_MANAGER,
         "five no-op hooks, each (first, **kwargs)",
         {"hooks": {"on_request_init": "request", "on_context_step_end": "requests",
                    "on_generation_step_begin": "scheduled_batch", "on_generation_step_end": "scheduled_batch",
                    "on_request_finish": "request"}}),
    Fact("base.prepare_resources", RESOURCE_MANAGER, C_RESOURCE_MANAGER,
         "prepare_resources(scheduled_batch): on_request_init(request) for each context request whose "
         "is_first_context_chunk, then on_generation_step_begin(scheduled_batch); hooks called positionally",
         sig(["scheduled_batch"])),
    Fact("base.update_resources", RESOURCE_MANAGER, C_RESOURCE_MANAGER,
         "update_resources(scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None): "
         "on_context_step_end(scheduled_batch.context_requests_last_chunk) when that list is not empty, then "
         "on_generation_step_end(scheduled_batch)",
         sig(["scheduled_batch", "attn_metadata", "kv_cache_dtype_byte_size"],
             defaults={"attn_metadata": None, "kv_cache_dtype_byte_size": None})),
    Fact("base.free_resources", RESOURCE_MANAGER, C_RESOURCE_MANAGER,
         "free_resources(request): on_request_finish(request)", sig(["request"])),
    Fact("base.counts", RESOURCE_MANAGER, C_RESOURCE_MANAGER,
         "get_max_resource_count() and get_needed_resource_to_completion(request) return 0",
         {"max_resource_count": 0, "needed_resource_to_completion": 0}),
    Fact("base.shutdown", RESOURCE_MANAGER, C_BASE_RESOURCE_MANAGER,
         "BaseResourceManager.shutdown(self) is a no-op (the compression base adds none in index:57350670334)",
         sig()),
    Fact("resource_manager.calls", RESOURCE_MANAGER, C_RESOURCE_MANAGER,
         "ResourceManager.prepare_resources(batch) calls every manager in order; update_resources(batch, "
         "attn_metadata, kv_cache_dtype_byte_size) passes all three to KV_CACHE_MANAGER, (batch) to the others; "
         "free_resources(request) walks the managers in reverse order", {"free_order": "reversed"}),
    # ------------------------------------------------------------------ kv_cache_manager_v2.py
    Fact("kvcm_v2.attributes", KVCM_V2, C_UTIL,
         "KVCacheManagerV2 keeps mapping, max_seq_len (lowered when the pool cannot hold it), max_batch_size, "
         "max_num_tokens, tokens_per_block, is_draft, is_estimating_kv_cache and kv_compression_manages_history",
         {"attributes": ["mapping", "max_seq_len", "max_batch_size", "max_num_tokens", "tokens_per_block",
                         "is_draft", "is_estimating_kv_cache", "kv_compression_manages_history"]}),
    Fact("kvcm_v2.enable_block_reuse", KVCM_V2, C_UTIL,
         "whether KVCacheManagerV2 exposes enable_block_reuse as an attribute", verified=False,
         why="not found in the part of KVCacheManagerV2.__init__ read (64 k of 213 k characters); the adapter no "
             "longer reads it (reuse is refused by validate_kv_cache_compression_compatibility)"),
    Fact("mapping.fields", UTIL, C_UTIL,
         "Mapping: tp_size, pp_size, cp_size, enable_attention_dp, has_cp_helix(), cp_config (read through their "
         "uses in _util.py and kv_cache_manager_v2.py)",
         {"attributes": ["tp_size", "pp_size", "cp_size", "enable_attention_dp"]}),
    # ------------------------------------------------------------------ attention backends
    Fact("attention.package", ATTN_INIT, C_ATTN_INIT,
         "the attention backends live in tensorrt_llm/_torch/attention/backends/; __init__ exports "
         "AttentionBackend, AttentionForwardArgs, AttentionMetadata, TrtllmAttention(Metadata), "
         "VanillaAttention(Metadata), not get_attention_backend",
         {"package": "tensorrt_llm._torch.attention.backends"}),
    Fact("backend.init", INTERFACE, C_INTERFACE,
         "AttentionBackend.__init__(self, layer_idx, num_heads, head_dim, num_kv_heads=None, quant_config=None, "
         "**kwargs): sets layer_idx, num_heads, head_dim, num_kv_heads (or num_heads), quant_config",
         sig(["layer_idx", "num_heads", "head_dim", "num_kv_heads", "quant_config"],
             defaults={"num_kv_heads": None, "quant_config": None}, var_keyword=True)),
    Fact("backend.forward", INTERFACE, C_INTERFACE,
         "AttentionBackend.forward(self, q, k, v, metadata, forward_args=None, **kwargs) raises NotImplementedError",
         sig(["q", "k", "v", "metadata", "forward_args"], defaults={"forward_args": None}, var_keyword=True)),
    Fact("backend.metadata_attr", INTERFACE, C_INTERFACE,
         "AttentionBackend.Metadata (class attribute) = AttentionMetadata; classmethods support_fused_rope, "
         "support_fused_qkv, support_mla (False), runtime_workspace_bytes_per_token(model_config, mapping) -> 0",
         {"classmethods": ["support_fused_rope", "support_fused_qkv", "support_mla",
                           "runtime_workspace_bytes_per_token"]}),
    Fact("forward_args.fields", INTERFACE, C_INTERFACE,
         "AttentionForwardArgs: a kw_only, slots dataclass; attention_mask=PredefinedAttentionMask.CAUSAL, "
         "is_fused_qkv=False, update_kv_cache=True, attention_window_size=None, among ~40 fields",
         {"attention_mask": "causal", "is_fused_qkv": False, "update_kv_cache": True,
          "attention_window_size": None}),
    Fact("forward_args.merge", INTERFACE, C_INTERFACE,
         "merge_attention_forward_args(forward_args, kwargs): ValueError for keywords that are no field, ValueError "
         "for both forward_args and keywords; else forward_args, or AttentionForwardArgs(**kwargs)",
         sig(["forward_args", "kwargs"])),
    Fact("mask.values", INTERFACE, C_INTERFACE, "PredefinedAttentionMask(str, Enum): CAUSAL='causal', FULL='full'",
         {"CAUSAL": "causal", "FULL": "full"}),
    Fact("metadata.fields", INTERFACE, C_INTERFACE,
         "AttentionMetadata: a kw_only dataclass; max_num_requests and max_num_tokens required; kv_cache_manager, "
         "mapping, request_ids, prompt_lens, seq_lens (CPU tensor property), num_contexts (property), "
         "is_cuda_graph=False; prepare() is the hook called before each forward",
         {"required": ["max_num_requests", "max_num_tokens"],
          "fields": ["kv_cache_manager", "mapping", "request_ids", "prompt_lens", "seq_lens", "num_contexts",
                     "is_cuda_graph"]}),
    Fact("metadata.cuda_graph", INTERFACE, C_INTERFACE,
         "create_cuda_graph_metadata(max_batch_size, sub_cross_metadata=False, max_draft_tokens=0, buffers=None, "
         "encode_only=False): a shallow copy with is_cuda_graph=True, seq_lens all 1 + max_draft_tokens, "
         "num_contexts=0",
         sig(["max_batch_size", "sub_cross_metadata", "max_draft_tokens", "buffers", "encode_only"],
             defaults={"sub_cross_metadata": False, "max_draft_tokens": 0, "buffers": None,
                       "encode_only": False})),
    Fact("lookup.signature", ATTN_UTILS, C_ATTN_UTILS,
         "get_attention_backend(backend_name, sparse_params=None): backend_name.upper(); VANILLA, TRTLLM, FLASHINFER "
         "(when available); anything else: logger.warning('Falling back to TRTLLM attention backend') and "
         "TrtllmAttention", {**sig(["backend_name", "sparse_params"], defaults={"sparse_params": None}),
                             "upper_cases": True, "fallback": "TrtllmAttention"}),
    Fact("create_attention.call", ATTN_UTILS, C_ATTN_UTILS,
         "create_attention looks get_attention_backend up as a module global of utils and calls "
         "attn_cls(layer_idx, num_heads, head_dim, num_kv_heads, **kwargs); it refuses attention_chunk_size unless "
         "the backend name upper-cases to TRTLLM",
         {"positional": 4, "keywords": ["quant_config", "q_scaling", "pos_embd_params", "mla_params",
                                        "skip_create_weights_in_init", "attention_chunk_size", "dtype",
                                        "aux_stream", "sparse_params", "kv_cache_dtype",
                                        "skip_correction_threshold"]}),
    Fact("modules.forward_call", MODULES_ATTENTION, "index:55090639134",
         "the Attention module calls self.attn.forward(q, k, v, attn_metadata, forward_args=AttentionForwardArgs("
         "attention_mask=attention_mask, ...)) with separate q, k, v when the backend does not fuse QKV",
         note="the hit names no path or commit; path inferred"),
    # ------------------------------------------------------------------ model engine, graphs, warmup, executor
    Fact("engine.binds_lookup", MODEL_ENGINE, C_MODEL_ENGINE,
         "model_engine.py does 'from ..attention.backends.utils import get_attention_backend' at import, and "
         "PyTorchModelEngine.__init__ resolves self.attn_backend = get_attention_backend(llm_args.attn_backend, "
         "sparse_params=...) through that module-level name (also at commit 001e67005b, older layout); "
         "_util.py imports model_engine at its own import",
         note="the newest version was a find_string hit (no commit named); path from find_files"),
    Fact("engine.llm_args", MODEL_ENGINE, C_MODEL_ENGINE,
         "PyTorchModelEngine keeps llm_args (self.llm_args = llm_args), mapping and spec_config"),
    Fact("engine.metadata_call", ENGINE_METADATA, "index:71221317741",
         "the attention metadata is built as attention_backend.Metadata(max_num_requests=, max_num_tokens=, "
         "max_num_sequences=, kv_cache_manager=, draft_kv_cache_manager=, mapping=, runtime_features=, "
         "enable_flash_mla=, enable_context_mla_with_cached_kv=, cache_indirection=, num_heads_per_kv=, "
         "sparse_metadata_params=) with attention_backend the engine's class",
         {"keywords": ["max_num_requests", "max_num_tokens", "max_num_sequences", "kv_cache_manager",
                       "draft_kv_cache_manager", "mapping", "runtime_features", "enable_flash_mla",
                       "enable_context_mla_with_cached_kv", "cache_indirection", "num_heads_per_kv",
                       "sparse_metadata_params"]},
         note="the hit names no path or commit; path inferred"),
    Fact("cuda_graph.capture", CUDA_GRAPH_RUNNER, "index:57357512020",
         "the CUDA graph runner captures a decode batch with attn_metadata.create_cuda_graph_metadata("
         "num_sequences_in_batch, False, draft_len, cuda_graph_meta_buffers) (four positionals)",
         {"positional": 4}, note="the hit names no path or commit; path inferred"),
    Fact("warmup.dummies", DECODER_RUNNER, "index:69397826903",
         "warm-up batches (_create_warmup_request) are dummy requests added through the KV cache manager and freed "
         "through kv_cache_manager.free_resources (and the draft and spec managers'), not through "
         "ResourceManager: the compression manager's hooks do not see them",
         note="the hit names no path or commit; path inferred"),
    Fact("warmup.when", PY_EXECUTOR, "",
         "when the model engine's warm-up (autotuner, CUDA graph capture) runs relative to estimation: the stand-in "
         "runs it for every executor it builds (estimation's and the final one)", verified=False,
         why="the call site of model_engine.warmup(...) in the current PyExecutor / creator was not read"),
    Fact("executor.order", PY_EXECUTOR, "index:736889464",
         "each iteration: prepare_resources(batch), forward (metadata.prepare() first), sampling, request updates, "
         "_handle_canceled_requests(), _handle_responses() (finished requests freed), then "
         "update_resources(batch, attn_metadata, kv_cache_dtype_byte_size) over the batch as scheduled",
         note="the hit names no path or commit; path inferred"),
    # ------------------------------------------------------------------ requests
    Fact("request.fields", "tensorrt_llm/_torch/pyexecutor/llm_request.py", "index:448347658",
         "LlmRequest: py_request_id, is_first_context_chunk, context_current_position, context_chunk_size, "
         "get_tokens(0) (read through their uses in TensorRT-LLM's Python: resource_manager.py, "
         "kv_cache_manager_v2.py and a model engine input builder)",
         {"attributes": ["py_request_id", "is_first_context_chunk", "context_current_position",
                         "context_chunk_size"]},
         note="uses read (index:448347658 for get_tokens / context_chunk_size, kv_cache_manager_v2.py at "
              "0004396720 for context_current_position, index:57350670334 for is_first_context_chunk); the "
              "binding's declaration was not"),
    Fact("request.prompt_len_max_new_tokens", "cpp/tensorrt_llm/pybind (LlmRequest binding)", "",
         "LlmRequest.prompt_len and LlmRequest.max_new_tokens", verified=False,
         why="C++ binding attributes; no use of them in TensorRT-LLM's Python source was read"),
    # ------------------------------------------------------------------ versions and packages
    Fact("version.framework", "tensorrt_llm/version.py", "",
         "the KV-cache compression framework at the commits above ships in the 1.4.0rc pre-releases "
         "(documentation for 1.4.0rc1 is published)", verified=False,
         why="version.py at commit 0004396720 is not in the index (the stored version.py is 1.0.0rc4); the "
             "version is the issue's and the published 1.4.0rc1 documentation's"),
    Fact("pypi.placeholder", "PyPI: tensorrt_llm", "registry:2026-12-08",
         "PyPI's newest tensorrt_llm is 1.2.1, a 10 kB sdist whose build backend is wheel-stub (it fetches the real "
         "wheel from NVIDIA's index)", {"pypi_latest": "1.2.1"},
         note="checked 2026-12-08 with pip index versions / pip download; not TensorRT-LLM source"),
    Fact("legacy.plugins", "tensorrt_llm/python_plugin.py", "",
         "TensorRT-LLM PR #15918 deleted the modules trtllm_diffkv/trt/plugins/trtllm_plugins.py imports, so the "
         "legacy plugins work only with TensorRT-LLM <= 1.2.x", verified=False,
         why="taken from the issue; the PR and the deletion were not read"),
)

_BY_ID = {f.id: f for f in FACTS}
assert len(_BY_ID) == len(FACTS), "duplicate fact ids"


def fact(fact_id: str) -> Fact:
    """The fact ``fact_id``.

    Raises:
        KeyError: no such fact.
    """
    return _BY_ID[fact_id]


def unverified() -> list[Fact]:
    """The facts that could not be verified from source."""
    return [f for f in FACTS if not f.verified]
