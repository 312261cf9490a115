"""onnxruntime custom ops for the DiffKV plugin nodes (onnxruntime-extensions Python ops).

Route used (stated plainly): the nodes are the composite plugins ``diffkv::DiffKVPageUpdate`` and
``diffkv::DiffKVAttention`` (:mod:`plugins.specs`), run by their implementations in :mod:`plugins.ops`:
the cache state of record is a Python :class:`~trtllm_diffkv.paged.cache.PagedDiffKVCache` registered
under an integer handle (:func:`register_cache`); the graph's ``cache_handle`` input selects it.
``DiffKVPageUpdate`` runs :meth:`PagedDiffKVCache.plan` (page manager reserve, decode decisions, one
``append_decode``, moves to the low tier) and ``DiffKVAttention`` runs :meth:`PagedDiffKVCache.forward`
for its layer (scored prefill + compaction into the pool, paged decode attention + score update) - on
the CPU, the torch ops path (``paged/torch_ops.py``).
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

import numpy as np
import torch

from plugins import ops as plugin_ops
from plugins import specs

from .onnx_export import ATTENTION_OP, PAGE_UPDATE_OP, PLUGIN_NAMESPACE

_REGISTERED = False
_ERRORS: dict[int, str] = {}
register_cache = plugin_ops.register_cache
unregister_cache = plugin_ops.unregister_cache


def _state_out(cache):
    return (cache.pool.pages().cpu().numpy().copy(), cache.manager.page_table.cpu().numpy().copy(),
            cache.manager.tokens.cpu().numpy().copy())


def _handle(handle: np.ndarray) -> int:
    return int(np.asarray(handle).reshape(-1)[0])


def _record(handle: np.ndarray, exc: Exception) -> None:
    _ERRORS.setdefault(_handle(handle), str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}")


def _t(a: np.ndarray) -> torch.Tensor:
    """A torch tensor owning a copy of ``a`` (the aliased outputs are written into it)."""
    return torch.from_numpy(np.array(a, copy=True))


def page_update(handle, slots, seq_lens, positions, is_prefill, table, tokens):
    """``DiffKVPageUpdate`` (:func:`plugins.ops.run_step_page_update`): returns (step token int64 ``[1]``,
    page_table, tier_tokens); a failure returns token 0 and the input state (error recorded). Never raises."""
    try:
        token = torch.zeros(1, dtype=torch.int64)
        state = [_t(table), _t(tokens)]
        plugin_ops.run_step_page_update([_t(handle), _t(slots), _t(seq_lens), _t(positions), _t(is_prefill), *state],
                                        token)
        return token.numpy(), state[0].numpy(), state[1].numpy()
    except Exception as exc:  # noqa: BLE001 - an exception here would abort the process (module docstring)
        _record(handle, exc)
        return np.zeros(1, dtype=np.int64), table, tokens


def attention(q, k, v, pool, table, tokens, handle, step_token, *, layer_idx: int, **_fields):
    """``DiffKVAttention`` (:func:`plugins.ops.run_layer_attention`): returns (out, pool, table, tokens).

    A failed step (token 0) or a failure here returns zeros and the input state (error recorded). Never raises.
    """
    try:
        out = torch.empty(q.shape, dtype=torch.float32)
        state = [_t(pool), _t(table), _t(tokens)]
        plugin_ops.run_layer_attention([_t(q), _t(k), _t(v), *state, _t(handle), _t(step_token)], out,
                                       {"layer_idx": int(layer_idx)})
        return (out.numpy(), *(t.numpy() for t in state))
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


_ORT_TYPES = {"float32": "dt_float", "int64": "dt_int64", "int32": "dt_int32", "uint8": "dt_uint8", "bool": "dt_bool"}


def _op_types(plugin: specs.PluginSpec) -> tuple[list, list, dict]:
    """onnxruntime-extensions input types, output types and attribute types of a composite plugin's node (fp32
    activations: the exported graph's; the types from :mod:`plugins.specs`)."""
    from onnxruntime_extensions import PyCustomOpDef as P

    pick = lambda t: getattr(P, _ORT_TYPES["float32" if "float32" in t.dtypes else t.dtypes[0]])  # noqa: E731
    inputs = [pick(t) for t in plugin.inputs]
    outputs = [inputs[plugin.aliases.get(j, 0)] for j in range(len(plugin.outputs))]
    attrs = {n: P.dt_string for n in specs.RESERVED_ATTRIBUTES}
    attrs.update({n: {int: P.dt_int64, float: P.dt_float, str: P.dt_string}[t] for n, t in plugin.fields.items()})
    return inputs, outputs, attrs


def register_ops() -> None:
    """Register the two composite plugins as onnxruntime-extensions Python ops (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from onnxruntime_extensions import onnx_op

    inputs, outputs, attrs = _op_types(specs.STEP_PAGE_UPDATE)
    onnx_op(op_type=PAGE_UPDATE_OP, inputs=inputs, outputs=outputs, attrs=attrs)(lambda *a, **kw: page_update(*a))
    inputs, outputs, attrs = _op_types(specs.LAYER_ATTENTION)
    onnx_op(op_type=ATTENTION_OP, inputs=inputs, outputs=outputs, attrs=attrs)(attention)
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
