"""The smallest patch that lets TensorRT-LLM build DiffKV: a factory branch and an attention backend name.

TensorRT-LLM has no registration point for either (read from its sources, docs/RUNTIME.md):
``create_kv_cache_compression_manager`` (``tensorrt_llm/_torch/pyexecutor/_util.py``) is one branch per
algorithm and returns ``None`` with a warning for any other, and ``get_attention_backend``
(``tensorrt_llm/_torch/attention_backend/utils.py``) is an if-chain that falls back to ``TrtllmAttention``.
:func:`register` wraps both module functions in place (both are looked up through their module at call
time: ``KvCacheCreator`` calls the factory as a module global; ``create_attention`` does the same with
``get_attention_backend``); the equivalent source patch is two branches::

    # _util.py, create_kv_cache_compression_manager(config, *, pretrained_config)
    if config.algorithm == "diffkv":
        from trtllm_diffkv.trtllm_backend import DiffKVCompressionManager
        return DiffKVCompressionManager(config, pretrained_config=pretrained_config)
    # attention_backend/utils.py, get_attention_backend(backend_name)
    elif backend_name == "DIFFKV":
        from trtllm_diffkv.trtllm_backend import DiffKVAttention
        return DiffKVAttention

A third, for YAML only (``trtllm-serve --extra_llm_api_options``): ``DiffKVCompressionConfig`` in
``llm_args.KvCacheCompressionConfigType``, so a ``{algorithm: diffkv, ...}`` mapping parses to it (the
Python API passes an instance and needs no change). :func:`register` does it by widening the
``kv_cache_compression_config`` field of the pydantic argument models that have one and rebuilding them.

``trtllm_diffkv.trtllm_backend.config`` calls :func:`register` with its ``DiffKVCompressionConfig`` when it is
imported (its ``register()``, the package's), so every process that builds or unpickles a ``DiffKVCompressionConfig``
(TensorRT-LLM's executor worker included) has the patch. This module never imports the config (it is handed the
class): the arrow runs config -> registration only.
"""
from __future__ import annotations

import functools
import importlib
from typing import Optional, Union

ATTENTION_BACKEND_NAME = "DIFFKV"
ALGORITHM = "diffkv"
_MARK = "_diffkv_wrapped"


def register(config_cls) -> None:
    """Wrap TensorRT-LLM's compression factory and attention-backend lookup, widen the config field (idempotent).

    Args:
        config_cls: ``DiffKVCompressionConfig`` (the factory builds the manager for its instances).

    Raises:
        ImportError: TensorRT-LLM is not importable (``bases.INSTALL_HINT``).
    """
    from . import bases  # the clear ImportError first

    _extend_config_field(importlib.import_module("tensorrt_llm.llmapi.llm_args"), config_cls)
    util = importlib.import_module("tensorrt_llm._torch.pyexecutor._util")
    attn_utils = bases.attention_module("utils")
    if not getattr(util.create_kv_cache_compression_manager, _MARK, False):
        util.create_kv_cache_compression_manager = _wrap_factory(util.create_kv_cache_compression_manager,
                                                                  config_cls)
    if not getattr(attn_utils.get_attention_backend, _MARK, False):
        attn_utils.get_attention_backend = _wrap_backend_lookup(attn_utils.get_attention_backend)


def _extend_config_field(llm_args, config_cls) -> None:
    """``kv_cache_compression_config`` of every pydantic model in ``llm_args`` also accepts ``config_cls``."""
    from pydantic import BaseModel

    for model in [v for v in vars(llm_args).values() if isinstance(v, type) and issubclass(v, BaseModel)]:
        field = model.model_fields.get("kv_cache_compression_config")
        if field is None or model.__dict__.get(_MARK, False):
            continue
        field.annotation = Optional[Union[config_cls, field.annotation]]
        model.model_rebuild(force=True)
        setattr(model, _MARK, True)


def _wrap_factory(factory, config_cls):
    @functools.wraps(factory)
    def create_kv_cache_compression_manager(config, *args, **kwargs):
        if getattr(config, "algorithm", None) != ALGORITHM:
            return factory(config, *args, **kwargs)
        from .manager import DiffKVCompressionManager

        if not isinstance(config, config_cls):
            raise TypeError(f"algorithm 'diffkv' needs a DiffKVCompressionConfig, got {type(config).__name__}")
        return DiffKVCompressionManager(config, *args, **kwargs)

    setattr(create_kv_cache_compression_manager, _MARK, True)
    return create_kv_cache_compression_manager


def _wrap_backend_lookup(lookup):
    @functools.wraps(lookup)
    def get_attention_backend(backend_name, *args, **kwargs):
        if backend_name == ATTENTION_BACKEND_NAME:
            from .attention import DiffKVAttention

            return DiffKVAttention
        return lookup(backend_name, *args, **kwargs)

    setattr(get_attention_backend, _MARK, True)
    return get_attention_backend
