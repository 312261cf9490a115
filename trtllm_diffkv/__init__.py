"""trtllm-diffkv: DiffKV KV-cache compression (SOSP 2025, arXiv:2412.03131) for LLM serving.

Public entry points: :class:`DiffKVConfig` and presets (:mod:`.config`), the
reference quantizer (:mod:`.quant`), the pure policy (:mod:`.policy`), the
reference compressed cache (:mod:`.cache`), models (:mod:`.model`), the
reference generator (:mod:`.engine`) and the page manager (:mod:`.memory`).
"""
from .config import PRESETS, DiffKVConfig, TierConfig, get_preset

__version__ = "0.1.0"
__all__ = ["DiffKVConfig", "TierConfig", "PRESETS", "get_preset", "__version__"]
