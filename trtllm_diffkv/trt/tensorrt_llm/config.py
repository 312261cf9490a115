"""``DiffKVCompressionConfig``: DiffKV's entry in TensorRT-LLM's ``kv_cache_compression_config``.

A :class:`KvCacheCompressionConfig` subclass (``tensorrt_llm/llmapi/llm_args.py``, a pydantic model)
with ``algorithm = "diffkv"``. The method's own fields select the DiffKV policy (a preset of
:data:`trtllm_diffkv.config.PRESETS`, or a calibration file holding the thresholds and tier
formats) and size DiffKV's page pool, which DiffKV owns beside TensorRT-LLM's KV cache manager.

Usage::

    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi import KvCacheConfig
    from trtllm_diffkv.trt.tensorrt_llm import DiffKVCompressionConfig  # registers the method (registration.py)

    llm = LLM(model_dir, attn_backend="DIFFKV", disable_overlap_scheduler=True, enable_chunked_prefill=False,
              kv_cache_config=KvCacheConfig(enable_block_reuse=False),
              kv_cache_compression_config=DiffKVCompressionConfig(preset="llama3-8b", kv_memory_fraction=0.5))
"""
from __future__ import annotations

import json
import os
from typing import ClassVar, Literal, Optional

from pydantic import Field, model_validator

from ...config import DiffKVConfig, get_preset
from ._bases import KvCacheCompressionConfig

CALIBRATION_MODEL_KEYS = ("num_layers", "num_heads", "num_kv_heads", "head_dim")
"""Model facts a calibration file may carry; each one present must equal the served model's."""


class DiffKVCompressionConfig(KvCacheCompressionConfig):
    """DiffKV (Zhang et al., SOSP 2025): per-(request, layer, KV head) tiers K8V4 / K4V2 / pruned.

    Fields:
        algorithm: ``"diffkv"`` (selects this config and :class:`~.manager.DiffKVCompressionManager`).
        preset: a preset name (``trtllm_diffkv.config.PRESETS``: ``"default"``, ``"llama3-8b"``,
            ``"qwen2.5-7b"``, ``"fp16"``, ...); ``None`` with no ``calibration_path``: ``"default"``.
        calibration_path: a JSON file of the flat DiffKV fields (``trtllm_diffkv.trt.fields``:
            ``high_key_bits`` ... ``alpha_high``, ``alpha_low``, ...), optionally with the model facts
            :data:`CALIBRATION_MODEL_KEYS` it was calibrated for. Produced offline
            (``examples/calibrate_thresholds.py``, paper section 6); loaded and checked against the
            model when the manager is built, never computed while serving. Not with ``preset``.
        kv_memory_bytes, kv_memory_fraction: DiffKV's page pool budget, bookkeeping included (one of
            them; a fraction of the free GPU memory when the manager is bound; on the CPU give bytes).
        high_tokens_per_page: tokens per page in the high tier (``PageFormat.for_config``), >= 1.
        dtype: the attention dtype of the cache output (``"auto"``: the model's ``torch_dtype``;
            else float32 on the CPU, bfloat16 on CUDA).

    Capabilities (TensorRT-LLM's admission predicates, checked by
    ``validate_kv_cache_compression_compatibility`` before the manager is built):
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
        """The :class:`DiffKVConfig`: the preset's, or the calibration file's (read now).

        Raises:
            FileNotFoundError: ``calibration_path`` does not exist.
            ValueError: the file is not a JSON object of DiffKV fields, or a field is missing or out of range.
        """
        if self.calibration_path is None:
            return get_preset(self.preset or "default")
        return kv_config_from_file(self.calibration_path)

    def check_calibration_model(self, model_config) -> None:
        """Refuse a calibration file made for another model shape (no-op for a preset).

        Raises:
            ValueError: a :data:`CALIBRATION_MODEL_KEYS` value in the file differs from ``model_config``'s.
        """
        if self.calibration_path is None:
            return
        facts = _read_json(self.calibration_path).get("model", {})
        for key in CALIBRATION_MODEL_KEYS:
            if key in facts and facts[key] != getattr(model_config, key):
                raise ValueError(f"calibration file {self.calibration_path} was made for {key}={facts[key]}, "
                                 f"the model has {key}={getattr(model_config, key)}")


def kv_config_from_file(path: str) -> DiffKVConfig:
    """A :class:`DiffKVConfig` from a JSON calibration file (the flat fields of ``build.fields``).

    Raises:
        FileNotFoundError, ValueError: as :meth:`DiffKVCompressionConfig.to_kv_config`.
    """
    from ..fields import kv_config_from_fields

    return kv_config_from_fields(_read_json(path))


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"DiffKV calibration file {path!r} does not exist")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"DiffKV calibration file {path!r} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"DiffKV calibration file {path!r} must hold a JSON object, got {type(data).__name__}")
    return data


def _register() -> None:
    from .registration import register

    register(DiffKVCompressionConfig)


_register()  # wherever this config is built or unpickled, TensorRT-LLM knows "diffkv" and "DIFFKV"
