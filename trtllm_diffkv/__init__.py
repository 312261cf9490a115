"""trtllm-diffkv: DiffKV KV-cache compression (SOSP 2025, arXiv:2412.03131) for LLM serving.

Public entry points: :class:`DiffKVConfig` and presets (:mod:`.config`), the
reference quantizer (:mod:`.quant`), the pure policy (:mod:`.policy`), the
reference compressed cache (:mod:`.cache`), models (:mod:`.model`), the
reference generator (:mod:`.engine`), the page manager (:mod:`.memory`), the
paged cache (:mod:`.paged`), the in-flight batching runtime (:mod:`.runtime`)
and the serving APIs :class:`LLM`, :class:`SamplingParams` and :class:`ModelRunner`
(imported on first use: ``import trtllm_diffkv`` stays light).
"""
from .config import PRESETS, DiffKVConfig, TierConfig, get_preset, load_kv_config_file, resolve_kv_config

__version__ = "0.1.0"
__all__ = ["DiffKVConfig", "TierConfig", "PRESETS", "get_preset", "resolve_kv_config", "load_kv_config_file", "LLM",
           "SamplingParams", "ModelRunner", "__version__"]

_LAZY = {"LLM": ".llm", "SamplingParams": ".runtime.sampling", "ModelRunner": ".runner"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
