"""TensorRT-LLM's base classes, imported once for the adapter (an optional dependency).

Written against NVIDIA/TensorRT-LLM's KV-cache compression framework as read from its source
(``tests/trtllm_backend/trtllm_manifest.py`` lists every fact with its file and commit; docs/RUNTIME.md,
"DiffKV inside TensorRT-LLM's PyTorch backend", says which releases):

* ``tensorrt_llm.llmapi.llm_args.KvCacheCompressionConfig``;
* ``tensorrt_llm._torch.pyexecutor.resource_manager.KVCacheCompressionManager``;
* ``tensorrt_llm._torch.attention.backends.interface``: ``AttentionBackend``, ``AttentionMetadata``,
  ``AttentionForwardArgs``, ``merge_attention_forward_args``, ``PredefinedAttentionMask`` (the older layout
  ``tensorrt_llm._torch.attention_backend`` is tried second, see :data:`ATTENTION_PACKAGES`).

Raises:
    ImportError: TensorRT-LLM (a release with the KV-cache compression framework and ``AttentionForwardArgs``,
        1.4.0rc or later) is not importable; the message says how to install it.
"""
from __future__ import annotations

INSTALL_HINT = ("trtllm_diffkv.trtllm_backend needs TensorRT-LLM 1.4.0rc or later (the KV-cache compression "
                "framework: tensorrt_llm.llmapi.llm_args.KvCacheCompressionConfig, "
                "tensorrt_llm._torch.pyexecutor.resource_manager.KVCacheCompressionManager, and "
                "AttentionForwardArgs). PyPI's tensorrt_llm stops at 1.2.1: use NVIDIA's container "
                "nvcr.io/nvidia/tensorrt-llm/release:1.4.0rc1, or pip install --pre --extra-index-url "
                "https://pypi.nvidia.com 'tensorrt_llm>=1.4.0rc1'; then this package beside it "
                "(pip install --no-deps trtllm-diffkv). See docs/RUNTIME.md")

ATTENTION_PACKAGES = ("tensorrt_llm._torch.attention.backends", "tensorrt_llm._torch.attention_backend")
"""Where TensorRT-LLM keeps its attention backends (``interface``, ``utils``): the current layout first."""


def attention_module(name: str):
    """TensorRT-LLM's attention-backend submodule ``name`` (``"interface"`` or ``"utils"``) in either layout.

    Raises:
        ImportError: in neither (the last error).
    """
    import importlib

    error = None
    for package in ATTENTION_PACKAGES:
        try:
            return importlib.import_module(f"{package}.{name}")
        except ImportError as exc:
            error = exc
    raise error


try:
    from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheCompressionManager
    from tensorrt_llm.llmapi.llm_args import KvCacheCompressionConfig

    _interface = attention_module("interface")
    AttentionBackend, AttentionMetadata = _interface.AttentionBackend, _interface.AttentionMetadata
    AttentionForwardArgs, PredefinedAttentionMask = _interface.AttentionForwardArgs, _interface.PredefinedAttentionMask
    merge_attention_forward_args = _interface.merge_attention_forward_args
except (ImportError, AttributeError) as exc:  # absent, or a release without the framework
    raise ImportError(f"{INSTALL_HINT} ({type(exc).__name__}: {exc})") from exc

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionForwardArgs", "PredefinedAttentionMask",
           "merge_attention_forward_args", "KVCacheCompressionManager", "KvCacheCompressionConfig", "INSTALL_HINT",
           "ATTENTION_PACKAGES", "attention_module"]
