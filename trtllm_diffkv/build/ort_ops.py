"""onnxruntime custom ops for the DiffKV plugin nodes (onnxruntime-extensions Python ops).

Route used (stated plainly): the cache state of record is a Python
:class:`~trtllm_diffkv.paged.cache.PagedDiffKVCache` registered under an integer handle
(:func:`register_cache`); the graph's ``cache_handle`` input selects it. The nodes call the
cache's own code: ``DiffKVPageUpdate`` runs :meth:`PagedDiffKVCache.plan` (page manager reserve,
decode decisions, one ``append_decode``, moves to the low tier) and ``DiffKVAttention`` runs
:meth:`PagedDiffKVCache.forward` for its layer (scored prefill + compaction into the pool, paged
decode attention + score update) - on the CPU, the torch ops path (``paged/torch_ops.py``).
The ``kv_pool`` / ``page_table`` / ``tier_tokens`` graph inputs are checked against the cache's
shapes and dtypes; the nodes' state outputs are copies of the cache's tensors after the layer, so
the graph's ``*_out`` outputs hold the real pool bytes and page table after the step (onnxruntime
cannot alias an input in place as TensorRT does; the copies are what it costs here).

onnxruntime-extensions registers Python ops in its own domain (``ai.onnx.contrib``);
:func:`ort_model` returns a copy of the exported model with the plugin nodes moved there.

Errors: an exception escaping a Python op aborts the whole process in onnxruntime-extensions
0.15 (``terminate called after throwing pybind11::error_already_set``, checked here), so the ops
never raise: a failure is recorded under the handle, the page update returns step token 0, the
attention nodes of a failed step return zeros and the state unchanged, and :func:`run_step`
raises ``ValueError`` with the recorded message after the session returns.
"""
from __future__ import annotations

import itertools
import threading

import numpy as np
import torch

from .onnx_export import ATTENTION_OP, PAGE_UPDATE_OP, PLUGIN_NAMESPACE

_CACHES: dict = {}
_LOCK = threading.Lock()
_NEXT = itertools.count(1)
_REGISTERED = False
_ERRORS: dict[int, str] = {}


def register_cache(cache) -> int:
    """Make ``cache`` reachable from the graph; returns its handle (feed it as ``cache_handle`` int64 ``[1]``)."""
    with _LOCK:
        handle = next(_NEXT)
        _CACHES[handle] = cache
    return handle


def unregister_cache(handle: int) -> None:
    """Forget a handle (its cache is not touched)."""
    with _LOCK:
        _CACHES.pop(int(handle), None)


def _cache(handle: np.ndarray):
    try:
        return _CACHES[_handle(handle)]
    except KeyError:
        raise ValueError(f"cache_handle {_handle(handle)} is not registered (register_cache)") from None


def _check_state(cache, pool, table, tokens) -> None:
    want = ((tuple(cache.pool.pages().shape), np.uint8), (tuple(cache.manager.page_table.shape), np.int32),
            (tuple(cache.manager.tokens.shape), np.int32))
    for name, arr, (shape, dtype) in zip(("kv_pool", "page_table", "tier_tokens"), (pool, table, tokens), want):
        if tuple(arr.shape) != shape or arr.dtype != dtype:
            raise ValueError(f"{name} is {arr.dtype} {tuple(arr.shape)}; the cache's is {np.dtype(dtype)} {shape}")


def _state_out(cache):
    return (cache.pool.pages().cpu().numpy().copy(), cache.manager.page_table.cpu().numpy().copy(),
            cache.manager.tokens.cpu().numpy().copy())


def _handle(handle: np.ndarray) -> int:
    return int(np.asarray(handle).reshape(-1)[0])


def _record(handle: np.ndarray, exc: Exception) -> None:
    _ERRORS.setdefault(_handle(handle), str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}")


def page_update(handle, slots, seq_lens, positions, is_prefill, table, tokens) -> np.ndarray:
    """``DiffKVPageUpdate``: :meth:`PagedDiffKVCache.plan` of the step; returns the step token int64 ``[1]``
    (1 planned, 0 failed: the error is recorded under the handle). Never raises."""
    try:
        cache = _cache(handle)
        cache.plan(slots.tolist(), seq_lens.tolist(), positions.tolist(), [bool(x) for x in is_prefill])
        return np.array([1], dtype=np.int64)
    except Exception as exc:  # noqa: BLE001 - an exception here would abort the process (module docstring)
        _record(handle, exc)
        return np.array([0], dtype=np.int64)


def attention(q, k, v, pool, table, tokens, handle, step_token, *, layer_idx: int, **_fields):
    """``DiffKVAttention``: :meth:`PagedDiffKVCache.forward` for ``layer_idx``; returns (out, pool, table, tokens).

    A failed step (token 0) or a failure here returns zeros and the input state (error recorded). Never raises.
    """
    try:
        if int(step_token.reshape(-1)[0]) != 1:
            raise ValueError("the step's page update failed")
        cache = _cache(handle)
        _check_state(cache, pool, table, tokens)
        as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(cache.device, cache.dtype)  # noqa: E731
        out = cache.forward(int(layer_idx), as_t(q), as_t(k), as_t(v))
        return (out.float().cpu().numpy(), *_state_out(cache))
    except Exception as exc:  # noqa: BLE001 - an exception here would abort the process (module docstring)
        _record(handle, exc)
        return np.zeros(q.shape, dtype=np.float32), pool, table, tokens


def run_step(session, cache, handle: int, input_ids, positions, logits_indices, slots, seq_lens, step_positions,
             is_prefill) -> list[np.ndarray]:
    """Run one step of the exported graph; returns ``[logits, kv_pool_out, page_table_out, tier_tokens_out]``.

    Raises:
        ValueError: a plugin op failed (the first recorded message: an unknown handle, a step the
            cache refuses, ...); a failed step leaves the cache as ``plan`` left it.
    """
    _ERRORS.pop(int(handle), None)
    outs = session.run(None, step_feeds(cache, handle, input_ids, positions, logits_indices, slots, seq_lens,
                                        step_positions, is_prefill))
    error = _ERRORS.pop(int(handle), None)
    if error is not None:
        raise ValueError(error)
    return outs


def _attr_types():
    from onnxruntime_extensions import PyCustomOpDef as P

    from ..config import get_preset
    from .onnx_export import config_attrs

    ints = {"layer_idx", "num_layers", "num_heads", "num_kv_heads", "head_dim"}
    attrs = {"plugin_namespace": P.dt_string, "plugin_version": P.dt_string, "sm_scale": P.dt_float}
    attrs.update({k: P.dt_int64 for k in ints})
    for k, v in config_attrs(get_preset("default")).items():
        attrs[k] = P.dt_string if isinstance(v, str) else P.dt_int64
    return attrs


def register_ops() -> None:
    """Register the two Python ops with onnxruntime-extensions (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from onnxruntime_extensions import PyCustomOpDef as P
    from onnxruntime_extensions import onnx_op

    attrs = _attr_types()
    update_attrs = {k: v for k, v in attrs.items() if k not in ("layer_idx", "num_heads", "sm_scale")}
    onnx_op(op_type=PAGE_UPDATE_OP, inputs=[P.dt_int64] * 4 + [P.dt_bool, P.dt_int32, P.dt_int32],
            outputs=[P.dt_int64], attrs=update_attrs)(lambda *a, **kw: page_update(*a))
    onnx_op(op_type=ATTENTION_OP,
            inputs=[P.dt_float] * 3 + [P.dt_uint8, P.dt_int32, P.dt_int32, P.dt_int64, P.dt_int64],
            outputs=[P.dt_float, P.dt_uint8, P.dt_int32, P.dt_int32], attrs=attrs)(attention)
    _REGISTERED = True


def ort_model(proto):
    """A copy of an exported model whose plugin nodes are in onnxruntime-extensions' domain."""
    import onnx
    from onnxruntime_extensions import default_opset_domain

    model = onnx.ModelProto()
    model.CopyFrom(proto)
    for node in model.graph.node:
        if node.domain == PLUGIN_NAMESPACE:
            node.domain = default_opset_domain()
    for opset in model.opset_import:
        if opset.domain == PLUGIN_NAMESPACE:
            opset.domain = default_opset_domain()
    return model


def ort_session(proto):
    """An ``onnxruntime.InferenceSession`` (CPU) running ``proto`` with the DiffKV ops registered."""
    import onnxruntime as ort
    from onnxruntime_extensions import get_library_path

    register_ops()
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    options.intra_op_num_threads = 1
    return ort.InferenceSession(ort_model(proto).SerializeToString(), options, providers=["CPUExecutionProvider"])


def step_feeds(cache, handle: int, input_ids, positions, logits_indices, slots, seq_lens, step_positions,
               is_prefill) -> dict[str, np.ndarray]:
    """The graph inputs of one step (the cache's current state as ``kv_pool`` / ``page_table`` / ``tier_tokens``)."""
    i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    pool, table, tokens = _state_out(cache)
    return {"input_ids": i64(input_ids), "positions": i64(positions), "logits_indices": i64(logits_indices),
            "step_slots": i64(slots), "step_seq_lens": i64(seq_lens), "step_positions": i64(step_positions),
            "step_is_prefill": np.asarray(is_prefill, dtype=np.bool_), "kv_pool": pool, "page_table": table,
            "tier_tokens": tokens, "cache_handle": i64([handle])}
