"""The smallest patch that lets TensorRT-LLM build DiffKV: a factory branch, a backend name, a union member.

TensorRT-LLM has no registration point for a compression method or an attention backend (facts and commits:
``tests/trtllm_backend/trtllm_manifest.py``):

* ``create_kv_cache_compression_manager(config, *, model_engine, kv_cache_config, estimating_kv_cache=False)``
  (``tensorrt_llm/_torch/pyexecutor/_util.py``) has one branch per shipped algorithm; ``build_managers`` calls it
  as a module global of ``_util``, so wrapping that module attribute is seen at call time. The DiffKV branch
  (:func:`create_diffkv_manager`) takes the same keywords, runs TensorRT-LLM's
  ``validate_kv_cache_compression_compatibility`` as the shipped branches do, refuses the settings DiffKV cannot
  serve by name, and reads the model's config from ``model_engine``.
* ``get_attention_backend(backend_name, sparse_params=None)`` (``tensorrt_llm/_torch/attention/backends/utils.py``)
  upper-cases the name and falls back to ``TrtllmAttention``. ``create_attention`` (the layers) looks it up in
  ``utils`` at call time, but ``model_engine.py`` imports the NAME when it is imported (and builds the attention
  metadata from the class it returns), and ``_util`` imports ``model_engine``. :func:`register` therefore wraps
  ``utils.get_attention_backend`` first, then rebinds the name in every already-imported TensorRT-LLM module that
  holds the original function; modules imported later take the wrapped one from ``utils``. ``"diffkv"`` matches in
  any case.
* ``KvCacheCompressionConfigType`` (``tensorrt_llm/llmapi/llm_args.py``) is a discriminated union on
  ``algorithm``: a ``DiffKVCompressionConfig`` is refused by it, as a Python instance (``LLM(...,
  kv_cache_compression_config=...)``) and as a YAML mapping (``trtllm-serve --extra_llm_api_options``) alike.
  :func:`register` adds the DiffKV config to the union of every pydantic model in ``llm_args`` that has a
  ``kv_cache_compression_config`` field (keeping the discriminator) and rebuilds them.

The equivalent source patch::

    # _util.py, create_kv_cache_compression_manager, before the unregistered warning
    if config.algorithm == "diffkv":
        from trtllm_diffkv.trtllm_backend.registration import create_diffkv_manager
        return create_diffkv_manager(config, model_engine=model_engine, kv_cache_config=kv_cache_config,
                                     estimating_kv_cache=estimating_kv_cache)
    # attention/backends/utils.py, get_attention_backend, after backend_name.upper()
    elif backend_name == "DIFFKV":
        from trtllm_diffkv.trtllm_backend import DiffKVAttention
        return DiffKVAttention
    # llmapi/llm_args.py: DiffKVCompressionConfig as a member of KvCacheCompressionConfigType

``trtllm_diffkv.trtllm_backend.config`` calls :func:`register` with its ``DiffKVCompressionConfig`` when it is
imported (its ``register()``, the package's), so every process that builds or unpickles a ``DiffKVCompressionConfig``
(TensorRT-LLM's executor worker included) has the patch. This module never imports the config (it is handed the
class): the arrow runs config -> registration only.
"""
from __future__ import annotations

import functools
import importlib
import sys
import types
from typing import Annotated, Optional, Union, get_args, get_origin

ATTENTION_BACKEND_NAME = "DIFFKV"
ALGORITHM = "diffkv"
_MARK = "_diffkv_wrapped"


def register(config_cls) -> None:
    """Wrap TensorRT-LLM's compression factory and attention-backend lookup, widen the config union (idempotent).

    Args:
        config_cls: ``DiffKVCompressionConfig`` (the factory builds the manager for its instances).

    Raises:
        ImportError: TensorRT-LLM is not importable (``bases.INSTALL_HINT``).
    """
    from . import bases  # the clear ImportError first

    _widen_config_union(importlib.import_module("tensorrt_llm.llmapi.llm_args"), config_cls)
    attn_utils = bases.attention_module("utils")
    lookup = attn_utils.get_attention_backend
    original = lookup.__wrapped__ if getattr(lookup, _MARK, False) else lookup
    if lookup is original:
        attn_utils.get_attention_backend = _wrap_backend_lookup(original)
    util = importlib.import_module("tensorrt_llm._torch.pyexecutor._util")  # imports model_engine: binds the name
    _rebind(original, attn_utils.get_attention_backend)
    if not getattr(util.create_kv_cache_compression_manager, _MARK, False):
        util.create_kv_cache_compression_manager = _wrap_factory(util.create_kv_cache_compression_manager,
                                                                  config_cls)


def create_diffkv_manager(config, *, model_engine, kv_cache_config, estimating_kv_cache: bool = False):
    """The DiffKV branch of TensorRT-LLM's factory: the same keywords, called by ``build_managers``.

    Args:
        config: a :class:`~.config.DiffKVCompressionConfig` (the factory wrapper that :func:`register` installs
            checks the class it was handed; this module never imports it).
        model_engine: TensorRT-LLM's ``PyTorchModelEngine`` (``model.model_config.pretrained_config``,
            ``mapping``, ``spec_config``, ``llm_args``).
        kv_cache_config: the ``KvCacheConfig`` the KV cache manager will be built with.
        estimating_kv_cache: TensorRT-LLM's memory-estimation build: the manager then holds no pool
            (:class:`~.manager.DiffKVCompressionManager`, ``estimating``).

    Returns:
        a :class:`~.manager.DiffKVCompressionManager`.

    Raises:
        ValueError: TensorRT-LLM's ``validate_kv_cache_compression_compatibility`` (block reuse, speculative
            decoding), or a setting DiffKV cannot serve, named: ``use_kv_cache_manager_v2=False``,
            ``cuda_graph_config`` set, the overlap scheduler, chunked prefill, parallel layouts, a model it does
            not serve.
    """
    from .manager import DiffKVCompressionManager

    util = sys.modules["tensorrt_llm._torch.pyexecutor._util"]
    util.validate_kv_cache_compression_compatibility(config, kv_cache_config, model_engine.spec_config)
    _check_settings(getattr(model_engine, "llm_args", None), kv_cache_config)
    return DiffKVCompressionManager(config, pretrained_config=model_engine.model.model_config.pretrained_config,
                                    mapping=model_engine.mapping, estimating=estimating_kv_cache)


def _check_settings(llm_args, kv_cache_config) -> None:
    """Refuse, by name, the LLM settings DiffKV cannot serve (``llm_args`` may be absent: then only the KV config)."""
    if getattr(kv_cache_config, "use_kv_cache_manager_v2", "auto") is False:
        raise ValueError("DiffKV needs TensorRT-LLM's KV cache manager V2 (the compression framework binds only V2): "
                         "set KvCacheConfig(use_kv_cache_manager_v2=True)")
    if llm_args is None:
        return
    if getattr(llm_args, "cuda_graph_config", None) is not None:
        raise ValueError("DiffKV plans every step on the host, which a CUDA graph replay skips: set "
                         "cuda_graph_config=None (TensorRT-LLM captures decode graphs by default)")
    if getattr(llm_args, "disable_overlap_scheduler", True) is False:
        raise ValueError("DiffKV plans a step after the previous one ended; TensorRT-LLM's overlap scheduler plans "
                         "ahead: set disable_overlap_scheduler=True")
    if getattr(llm_args, "enable_chunked_prefill", False):
        raise ValueError("DiffKV scores the whole prompt with its last 64 queries at once: set "
                         "enable_chunked_prefill=False")


def _widen_config_union(llm_args, config_cls) -> None:
    """``kv_cache_compression_config`` of every pydantic model in ``llm_args`` also accepts ``config_cls``.

    A discriminated union (``Annotated[Union[...], Field(discriminator=...)]``) stays discriminated, with
    ``config_cls`` as one more member; ``llm_args.KvCacheCompressionConfigType`` becomes the widened union too.
    """
    from pydantic import BaseModel

    for model in [v for v in vars(llm_args).values() if isinstance(v, type) and issubclass(v, BaseModel)]:
        field = model.model_fields.get("kv_cache_compression_config")
        if field is None or model.__dict__.get(_MARK, False):
            continue
        field.annotation = Optional[_with_member(field.annotation, config_cls)]
        model.model_rebuild(force=True)
        setattr(model, _MARK, True)
    if hasattr(llm_args, "KvCacheCompressionConfigType"):
        llm_args.KvCacheCompressionConfigType = _with_member(llm_args.KvCacheCompressionConfigType, config_cls)


def _with_member(annotation, member):
    """``annotation`` (``Optional`` / ``Annotated`` / ``Union`` of config classes) with ``member`` added, keeping an
    ``Annotated`` discriminator."""
    from pydantic import Field
    from pydantic.fields import FieldInfo

    members, discriminator = [], None

    def walk(a) -> None:
        nonlocal discriminator
        if get_origin(a) is Annotated:
            inner, *metadata = get_args(a)
            for m in metadata:
                if isinstance(m, FieldInfo) and m.discriminator is not None:
                    discriminator = m.discriminator
            walk(inner)
        elif get_origin(a) in (Union, types.UnionType):
            for x in get_args(a):
                walk(x)
        elif a is not type(None) and a not in members:
            members.append(a)

    walk(annotation)
    if member not in members:
        members.append(member)
    union = Union[tuple(members)]
    return Annotated[union, Field(discriminator=discriminator)] if discriminator else union


def _rebind(original, wrapped) -> None:
    """Every imported TensorRT-LLM module holding ``original`` as ``get_attention_backend`` gets ``wrapped``
    (``model_engine`` binds the name at its import)."""
    for name, mod in list(sys.modules.items()):
        if (name == "tensorrt_llm" or name.startswith("tensorrt_llm.")) and mod is not None and \
                mod.__dict__.get("get_attention_backend") is original:
            mod.get_attention_backend = wrapped


def _wrap_factory(factory, config_cls):
    @functools.wraps(factory)
    def create_kv_cache_compression_manager(config, *args, **kwargs):
        if getattr(config, "algorithm", None) != ALGORITHM:
            return factory(config, *args, **kwargs)
        if not isinstance(config, config_cls):
            raise TypeError(f"algorithm 'diffkv' needs a DiffKVCompressionConfig, got {type(config).__name__}")
        return create_diffkv_manager(config, *args, **kwargs)

    setattr(create_kv_cache_compression_manager, _MARK, True)
    return create_kv_cache_compression_manager


def _wrap_backend_lookup(lookup):
    @functools.wraps(lookup)
    def get_attention_backend(backend_name, *args, **kwargs):
        if isinstance(backend_name, str) and backend_name.upper() == ATTENTION_BACKEND_NAME:
            sparse = args[0] if args else kwargs.get("sparse_params")
            if sparse is not None:
                raise ValueError("attn_backend='DIFFKV' does not combine with sparse attention "
                                 "(sparse_attention_config)")
            from .attention import DiffKVAttention

            return DiffKVAttention
        return lookup(backend_name, *args, **kwargs)

    setattr(get_attention_backend, _MARK, True)
    return get_attention_backend
