"""``DiffKVCompressionConfig``: DiffKV's entry in TensorRT-LLM's ``kv_cache_compression_config``.

A :class:`KvCacheCompressionConfig` subclass (``tensorrt_llm/llmapi/llm_args.py``, a pydantic model)
with ``algorithm = "diffkv"``. The method's own fields select the DiffKV policy (a preset of
:data:`trtllm_diffkv.config.PRESETS`, or a calibration file holding the thresholds and tier
formats) and size DiffKV's page pool, which DiffKV owns beside TensorRT-LLM's KV cache manager.

Usage (TensorRT-LLM 1.4.0rc or later; docs/RUNTIME.md)::

    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi import KvCacheConfig
    from trtllm_diffkv.trtllm_backend import DiffKVCompressionConfig  # registers the method (registration.py)

    llm = LLM(model_dir, attn_backend="DIFFKV", disable_overlap_scheduler=True, enable_chunked_prefill=False,
              cuda_graph_config=None,
              kv_cache_config=KvCacheConfig(enable_block_reuse=False, use_kv_cache_manager_v2=True,
                                            free_gpu_memory_fraction=0.1),
              kv_cache_compression_config=DiffKVCompressionConfig(preset="llama3-8b", kv_memory_fraction=0.8))

Each setting is required: the compression framework binds only KVCacheManagerV2 (``use_kv_cache_manager_v2``
defaults to ``"auto"``, V1 for Llama); DiffKV plans each step on the host, which a CUDA graph replay skips
(``cuda_graph_config`` is on by default); the overlap scheduler plans a step before the previous one ended; block
reuse is on by default. Each is refused by name before DiffKV's pool is allocated: by the DiffKV factory branch
(``registration.py``), or, for a V1 manager that ``"auto"`` chose, when the manager is bound.
"""
from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field, model_validator

from ..config import DiffKVConfig, get_preset, load_kv_config_file
from . import registration
from .bases import KvCacheCompressionConfig


class DiffKVCompressionConfig(KvCacheCompressionConfig):
    """DiffKV (Zhang et al., SOSP 2025): per-(request, layer, KV head) tiers K8V4 / K4V2 / pruned.

    Fields:
        algorithm: ``"diffkv"`` (selects this config and :class:`~.manager.DiffKVCompressionManager`).
        preset: a preset name (``trtllm_diffkv.config.PRESETS``: ``"default"``, ``"llama3-8b"``,
            ``"qwen2.5-7b"``, ``"fp16"``, ...); ``None`` with no ``calibration_path``: ``"default"``.
        calibration_path: a kv-config JSON file as ``trtllm-diffkv calibrate`` writes it
            (:func:`trtllm_diffkv.config.load_kv_config_file`, docs/CALIBRATION.md; the model shape it was
            calibrated for is checked against the served model). Produced offline (paper section 6);
            loaded when the manager is built, never computed while serving. Not with ``preset``.
        kv_memory_bytes, kv_memory_fraction: DiffKV's page pool budget, bookkeeping included (one of
            them; a fraction of the free GPU memory when the manager is bound; on the CPU give bytes).
        high_tokens_per_page: tokens per page in the high tier (``PageFormat.for_config``), >= 1.
        dtype: the attention dtype of the cache output (``"auto"``: the model's ``torch_dtype``;
            else float32 on the CPU, bfloat16 on CUDA).

    Capabilities (TensorRT-LLM's admission predicates; the DiffKV factory branch runs TensorRT-LLM's
    ``validate_kv_cache_compression_compatibility`` on them before it builds the manager, as each shipped
    method's branch does):
        ``changes_physical_kv_length = True``: every (layer, KV head) keeps its own number of
        tokens (paper section 4), so the physical KV length is not the logical one.

    Raises:
        pydantic.ValidationError (a ValueError): both ``preset`` and ``calibration_path``, an unknown
            preset, both budgets, a non-positive size, an unknown dtype.
    """

    algorithm: Literal["diffkv"] = "diffkv"
    preset: Optional[str] = None
    calibration_path: Optional[str] = None
    kv_memory_bytes: Optional[int] = Field(default=None, gt=0)
    kv_memory_fraction: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    high_tokens_per_page: int = Field(default=32, ge=1)
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"

    changes_physical_kv_length: ClassVar[bool] = True

    @model_validator(mode="after")
    def _check_choice(self):
        if self.preset is not None and self.calibration_path is not None:
            raise ValueError("give one of preset and calibration_path, not both")
        if self.kv_memory_bytes is not None and self.kv_memory_fraction is not None:
            raise ValueError("give one of kv_memory_bytes and kv_memory_fraction, not both")
        if self.preset is not None:
            get_preset(self.preset)  # ValueError naming the known presets
        return self

    def supports_block_reuse(self) -> bool:
        """False: a prompt's stored tokens are not a reusable prefix.

        DiffKV tiers and prunes every prompt token by the attention the LAST 64 prompt queries give
        it (paper section 5.1), per (layer, KV head), and stores the kept tokens quantized in its own
        pages. A shared prefix therefore holds different tokens, at different precisions, for two
        prompts that continue differently, and TensorRT-LLM's reuse of prefix blocks would serve one
        request another's compaction.
        """
        return False

    def supports_speculative_decoding(self) -> bool:
        """False: every decode step appends exactly one token per request.

        The decode plan (``PagedDiffKVCache.plan``) writes one token per request and demotes or prunes
        older tokens in the same step; drafted tokens that are later rejected cannot be taken back
        (a demoted or pruned token is gone), and the page manager has no rewind.
        """
        return False

    def to_kv_config(self) -> DiffKVConfig:
        """The :class:`DiffKVConfig`: the preset's, or the kv-config file's (read now, by
        :func:`~trtllm_diffkv.config.load_kv_config_file`: the files ``trtllm-diffkv calibrate`` writes;
        a file made for another model shape is refused by ``validate_for_model`` at the manager).

        Raises:
            FileNotFoundError: ``calibration_path`` does not exist.
            ValueError: not a kv-config file, an unknown key or a value out of range, naming the field.
        """
        if self.calibration_path is None:
            return get_preset(self.preset or "default")
        return load_kv_config_file(self.calibration_path)


def register() -> None:
    """Register DiffKV with TensorRT-LLM (:func:`.registration.register` with :class:`DiffKVCompressionConfig`;
    idempotent: importing this module already did).

    Raises:
        ImportError: TensorRT-LLM is not importable (the message says how to install it).
    """
    registration.register(DiffKVCompressionConfig)


register()  # wherever this config is built or unpickled, TensorRT-LLM knows "diffkv" and "DIFFKV"
