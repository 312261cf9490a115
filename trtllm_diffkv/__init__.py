"""trtllm-diffkv: DiffKV KV-cache compression (SOSP 2025, arXiv:2412.03131) for LLM serving.

Public entry points: :class:`DiffKVConfig` and presets (:mod:`.config`), the
reference quantizer (:mod:`.quant`), the pure policy (:mod:`.policy`), the
reference compressed cache (:mod:`.cache`), models (:mod:`.model`), the page manager
(:mod:`.memory`), the kernels (:mod:`.kernels`), the paged cache (:mod:`.paged`), the in-flight
batching runtime (:mod:`.runtime`), the generation loops (:mod:`.generation`) and the TensorRT-LLM
shaped API :class:`LLM`, :class:`SamplingParams` and :class:`ModelRunner` (:mod:`.llmapi`, imported
on first use: ``import trtllm_diffkv`` stays light). Around the core: the adapters - engine export
(:mod:`.export`), the TensorRT-LLM backend (:mod:`.trtllm_backend`), the servers (:mod:`.serve`) -, evaluation
(:mod:`.evaluation`) and the command line (:mod:`.commands`). The TensorRT plugins are a package of their own,
``trtllm_diffkv_plugins`` (the folder ``plugins/``), which imports this one and is never imported by it.
"""
from .config import PRESETS, DiffKVConfig, TierConfig, get_preset, load_kv_config_file, resolve_kv_config

__version__ = "0.1.0"
__all__ = ["DiffKVConfig", "TierConfig", "PRESETS", "get_preset", "resolve_kv_config", "load_kv_config_file", "LLM",
           "SamplingParams", "ModelRunner", "__version__"]

from .lazy import lazy_exports

_LAZY = {"LLM": ".llmapi", "SamplingParams": ".llmapi", "ModelRunner": ".llmapi"}

__getattr__ = lazy_exports(__name__, _LAZY)
