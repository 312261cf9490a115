"""DiffKV inside TensorRT-LLM's PyTorch backend: a KV-cache compression method (optional adapter).

- :class:`DiffKVCompressionConfig` (:mod:`.config`): ``kv_cache_compression_config`` for ``LLM`` / ``trtllm-serve``.
- :class:`DiffKVCompressionManager` (:mod:`.manager`): the five compression hooks driving DiffKV's page pool.
- :class:`DiffKVAttention`, :class:`DiffKVAttentionMetadata` (:mod:`.attention`): the ``"DIFFKV"`` attention backend
  (any case).
- :func:`register` (:mod:`.config`, which calls it on import; the patch is :mod:`.registration`'s): the smallest
  patch (factory branch, backend name, config union member).

Importing a name needs TensorRT-LLM 1.4.0rc or later (its KV-cache compression framework; an ``ImportError`` says
how to install it otherwise). NOT RUN against TensorRT-LLM, which cannot be installed on this project's machines:
the tests drive it through ``tests/trtllm_backend/trtllm_standin.py``, a stand-in built from the facts of
``tests/trtllm_backend/trtllm_manifest.py`` (each read from TensorRT-LLM's source at a recorded commit).
"""
_LAZY = {
    "DiffKVCompressionConfig": ".config", "DiffKVCompressionManager": ".manager",
    "DiffKVAttention": ".attention", "DiffKVAttentionMetadata": ".attention", "register": ".config",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
