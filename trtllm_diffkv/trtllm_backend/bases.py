"""TensorRT-LLM's base classes, imported once for the adapter (an optional dependency).

Written against NVIDIA/TensorRT-LLM's KV-cache compression framework (docs/RUNTIME.md,
"DiffKV inside TensorRT-LLM's PyTorch backend", names the sources and commits read):

* ``tensorrt_llm.llmapi.llm_args.KvCacheCompressionConfig``;
* ``tensorrt_llm._torch.pyexecutor.resource_manager.KVCacheCompressionManager``;
* ``tensorrt_llm._torch.attention_backend.interface``: ``AttentionBackend``, ``AttentionMetadata``,
  ``PredefinedAttentionMask`` (the developer guide on TensorRT-LLM's main links the same classes under
  ``tensorrt_llm/_torch/attention/backends/``: that path is tried first, see :data:`ATTENTION_PACKAGES`).

Raises:
    ImportError: TensorRT-LLM (a release with the KV-cache compression framework) is not
        importable; the message says how to install it.
"""
from __future__ import annotations

INSTALL_HINT = ("trtllm_diffkv.trtllm_backend needs TensorRT-LLM with the KV-cache compression framework "
                "(tensorrt_llm.llmapi.llm_args.KvCacheCompressionConfig, "
                "tensorrt_llm._torch.pyexecutor.resource_manager.KVCacheCompressionManager): install TensorRT-LLM "
                "first (pip install tensorrt_llm, NVIDIA's index), then this package beside it "
                "(pip install trtllm-diffkv --no-deps)")

ATTENTION_PACKAGES = ("tensorrt_llm._torch.attention.backends", "tensorrt_llm._torch.attention_backend")
"""Where TensorRT-LLM keeps its attention backends (``interface``, ``utils``): the newer layout first."""


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
    PredefinedAttentionMask = _interface.PredefinedAttentionMask
except ImportError as exc:  # absent, or a release without the framework
    raise ImportError(f"{INSTALL_HINT} ({type(exc).__name__}: {exc})") from exc

__all__ = ["AttentionBackend", "AttentionMetadata", "PredefinedAttentionMask", "KVCacheCompressionManager",
           "KvCacheCompressionConfig", "INSTALL_HINT", "ATTENTION_PACKAGES", "attention_module"]
