"""onnxruntime custom ops for the DiffKV plugin nodes (onnxruntime-extensions Python ops).

Route used (stated plainly): the nodes are the composite plugins ``diffkv::DiffKVPageUpdate`` and
``diffkv::DiffKVAttention`` (:mod:`trtllm_diffkv.export.plugin_specs`), run by their implementations in :mod:`trtllm_diffkv.export.plugin_ops`:
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

The per-operation graphs' nodes run the per-operation plugins' implementations on their own inputs (no handle):
``prefill_attention`` / ``decode_attention`` on the torch ops path, and the decode graph's plan nodes
(``decode_decide``, ``page_update``, ``decode_locate``) with the Triton decision / page-manager kernels - on the
CPU under ``TRITON_INTERPRET=1`` - and the moves on the torch ops path (:func:`run_per_op_step`).

onnxruntime-extensions registers Python ops in its own domain (``ai.onnx.contrib``);
:func:`ort_model` returns a copy of the exported model with the plugin nodes moved there.

Errors: an exception escaping a Python op aborts the whole process in onnxruntime-extensions
0.15 (``terminate called after throwing pybind11::error_already_set``, checked here), so the ops
never raise: a failure is recorded under the handle, the page update returns step token 0, the
attention nodes of a failed step return zeros and the state unchanged, and :func:`run_step`
raises ``ValueError`` with the recorded message after the session returns.
"""
from __future__ import annotations

import gc
import weakref

import numpy as np
import torch

from . import plugin_ops
from . import plugin_specs as specs

from .onnx_export import (ATTENTION_OP, PAGE_UPDATE_OP, PHASE_STATE, PLAN_INPUTS, PLUGIN_NAMESPACE, STATE_INPUTS,
                          per_op_input_dtypes)

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
    """``DiffKVPageUpdate`` (:func:`trtllm_diffkv.export.plugin_ops.run_step_page_update`): returns (step token int64 ``[1]``,
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
    """``DiffKVAttention`` (:func:`trtllm_diffkv.export.plugin_ops.run_layer_attention`): returns (out, pool, table, tokens).

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


_ORT_TYPES = {"float32": "dt_float", "int64": "dt_int64", "int32": "dt_int32", "uint8": "dt_uint8", "bool": "dt_bool",
              "float16": "dt_float16"}


def _op_types(plugin: specs.PluginSpec) -> tuple[list, list, dict]:
    """onnxruntime-extensions input types, output types and attribute types of a composite plugin's node (fp32
    activations: the exported graph's; the types from :mod:`trtllm_diffkv.export.plugin_specs`)."""
    from onnxruntime_extensions import PyCustomOpDef as P

    pick = lambda t: getattr(P, _ORT_TYPES["float32" if "float32" in t.dtypes else t.dtypes[0]])  # noqa: E731
    inputs = [pick(t) for t in plugin.inputs]
    outputs = [getattr(P, _ORT_TYPES[plugin.new_outputs[j][0]]) if j in plugin.new_outputs else
               inputs[plugin.aliases.get(j, 0)] for j in range(len(plugin.outputs))]
    attrs = {n: P.dt_string for n in specs.RESERVED_ATTRIBUTES}
    attrs.update({n: {int: P.dt_int64, float: P.dt_float, str: P.dt_string}[t] for n, t in plugin.fields.items()})
    return inputs, outputs, attrs


def register_ops() -> None:
    """Register the two composite plugins, the per-operation attention plugins (``prefill_attention``,
    ``decode_attention``) and the decode plan's plugins (``decode_decide``, ``page_update``, ``decode_locate``) as
    onnxruntime-extensions Python ops (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from onnxruntime_extensions import PyCustomOpDef as P
    from onnxruntime_extensions import onnx_op

    inputs, outputs, attrs = _op_types(specs.STEP_PAGE_UPDATE)
    onnx_op(op_type=PAGE_UPDATE_OP, inputs=inputs, outputs=outputs, attrs=attrs)(lambda *a, **kw: page_update(*a))
    inputs, outputs, attrs = _op_types(specs.LAYER_ATTENTION)
    onnx_op(op_type=ATTENTION_OP, inputs=inputs, outputs=outputs, attrs=attrs)(attention)
    for phase, plugin in (("prefill", specs.PREFILL), ("decode", specs.DECODE)):
        inputs = [getattr(P, _ORT_TYPES["float32" if t is np.float16 else np.dtype(t).name])  # see ort_model
                  for t in per_op_input_dtypes(phase)]
        outputs = [inputs[plugin.aliases.get(j, 0)] for j in range(len(plugin.outputs))]
        _, _, attrs = _op_types(plugin)
        onnx_op(op_type=plugin.name, inputs=inputs, outputs=outputs, attrs=attrs)(_per_op(plugin))
    for plugin in PLAN_PLUGINS:
        inputs, outputs, attrs = _op_types(plugin)
        onnx_op(op_type=plugin.name, inputs=inputs, outputs=outputs, attrs=attrs)(_plan_op(plugin))
    _REGISTERED = True


# --------------------------------------------------------------------------- per-operation graphs

_PER_OP_ERRORS: list[str] = []
_HALF_INPUTS = {p.name: {i for i, t in enumerate(per_op_input_dtypes(ph)) if t is np.float16}
                for ph, p in (("prefill", specs.PREFILL), ("decode", specs.DECODE))}
"""fp16 inputs (``key_offsets``) of the per-operation nodes, which onnxruntime-extensions' Python ops cannot take
(``Type float16 not supported by python customops api``): :func:`ort_model` casts them to fp32 and the outputs
that alias them back to fp16 around the node (exact both ways), the op converts them to fp16 for the kernels."""


def _per_op(plugin: specs.PluginSpec):
    """The onnxruntime op of ``prefill_attention`` / ``decode_attention``: :func:`trtllm_diffkv.export.plugin_ops.run_prefill` /
    :func:`trtllm_diffkv.export.plugin_ops.run_decode` (torch ops path) on copies of the inputs, the aliased ones returned as the
    updated state. Never raises (module docstring): a failure is recorded, zeros and the input state returned."""
    run = plugin_ops.run_prefill if plugin is specs.PREFILL else plugin_ops.run_decode
    half = _HALF_INPUTS[plugin.name]

    def op(*arrays, **attrs):
        try:
            from .fields import kv_config_from_fields

            fields = {n: attrs[n] for n in plugin.fields}
            inputs = [_t(a).half() if i in half else _t(a) for i, a in enumerate(arrays)]
            out = torch.zeros(inputs[0].shape, dtype=torch.float32)
            run(inputs, out, kv_config_from_fields(fields), fields, use_triton=False)
            return (out.numpy(), *(inputs[plugin.aliases[j]].float().numpy() if plugin.aliases[j] in half else
                                   inputs[plugin.aliases[j]].numpy() for j in range(1, len(plugin.outputs))))
        except Exception as exc:  # noqa: BLE001 - an exception here would abort the process (module docstring)
            _PER_OP_ERRORS.append(f"{plugin.name} layer {attrs.get('layer_idx')}: {type(exc).__name__}: {exc}")
            return (np.zeros(arrays[0].shape, dtype=np.float32),
                    *(arrays[plugin.aliases[j]] for j in range(1, len(plugin.outputs))))
    return op


PLAN_PLUGINS = (specs.DECODE_DECIDE, specs.PAGE_UPDATE, specs.DECODE_LOCATE)
"""The decode graph's plan nodes, in graph order."""


def _plan_op(plugin: specs.PluginSpec):
    """The onnxruntime op of a decode-plan node: :func:`trtllm_diffkv.export.plugin_ops.run_decode_decide`,
    :func:`trtllm_diffkv.export.plugin_ops.run_page_update` or :func:`trtllm_diffkv.export.plugin_ops.run_decode_locate` (Triton kernels: on the CPU under
    ``TRITON_INTERPRET=1``; the moves' read/write on the torch ops path) on copies of the inputs, the aliased ones
    returned as the updated state. Never raises (module docstring): a failure is recorded, zeros and the input
    state returned."""

    def op(*arrays, **attrs):
        fields = {n: attrs[n] for n in plugin.fields}
        try:
            shapes = specs.infer(plugin, [a.shape for a in arrays], [a.dtype.name for a in arrays], fields)
        except Exception:  # noqa: BLE001 - reported by the run below
            shapes = [((1,), "int32")] * len(plugin.outputs)
        try:
            from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4

            from .fields import kv_config_from_fields

            patch_interpreter_for_numpy_2_4()  # a no-op unless TRITON_INTERPRET=1
            cfg = kv_config_from_fields(fields)
            inputs = [_t(a) for a in arrays]
            outputs = [inputs[plugin.aliases[j]] if j in plugin.aliases else
                       torch.zeros(shape, dtype=getattr(torch, dtype)) for j, (shape, dtype) in enumerate(shapes)]
            if plugin is specs.DECODE_DECIDE:
                plugin_ops.run_decode_decide(inputs, outputs, cfg, fields)
            elif plugin is specs.PAGE_UPDATE:
                plugin_ops.run_page_update(inputs, cfg, fields)
            else:
                plugin_ops.run_decode_locate(inputs, outputs, cfg, fields, use_triton=False)
            return tuple(o.numpy() for o in outputs)
        except Exception as exc:  # noqa: BLE001 - an exception here would abort the process (module docstring)
            _PER_OP_ERRORS.append(f"{plugin.name}: {type(exc).__name__}: {exc}")
            return tuple(arrays[plugin.aliases[j]] if j in plugin.aliases else
                         np.zeros(shape, dtype=np.dtype(dtype)) for j, (shape, dtype) in enumerate(shapes))
    return op


def decode_feeds(cache, slots, step_positions) -> dict[str, np.ndarray]:
    """The decode graph's plan and state inputs (:data:`~.onnx_export.PLAN_INPUTS` ``["decode"]``,
    :data:`~.onnx_export.PHASE_STATE` ``["decode"]``) from a ``PagedDiffKVCache`` (copies, numpy): the slots and
    positions int64 ``[n]``, the pool, the page manager's state (a ``CpuPageManager``'s ring counters as
    ``ring_state`` = (start, end, status)), key offsets, error flags and prompt lengths."""
    man = cache.manager
    np_ = lambda t: t.detach().cpu().numpy().copy()  # noqa: E731
    state = {"kv_pool": cache.pool.pages(), "page_table": man.page_table, "tier_tokens": man.tokens,
             "row_pages": man.pages, "slot_state": man.slot_state, "ring": man.ring,
             "ring_state": torch.tensor(man.snapshot_counters(), dtype=torch.int64),
             "key_offsets": cache.row_meta.key_offsets, "error_flags": cache.error_flags,
             "prompt_len": cache.prompt_len_device}
    feeds = {"step_slots": np.asarray(slots, dtype=np.int64), "step_positions": np.asarray(step_positions, dtype=np.int64)}
    for name in PHASE_STATE["decode"]:
        feeds[name] = np_(state[name]).astype(STATE_INPUTS[name][0], copy=False)
    return feeds


def _check_decode_step(cache, num_tokens: int, slots, seq_lens, step_positions) -> None:
    """The host checks ``cache.plan`` makes for a decode-only step (the graph plans it); raises as ``plan`` does."""
    import os

    from ..paged.cache import OutOfPagesError

    if cache.planned_step is not None:
        raise ValueError("a step is already planned on the cache; run it and end_step(), or discard it, first")
    n = len(slots)
    if not n or len(seq_lens) != n or len(step_positions) != n:
        raise ValueError("slots, seq_lens and positions must have the same nonzero length")
    if len(set(int(s) for s in slots)) != n:
        raise ValueError(f"slots must be distinct, got {list(slots)}")
    if num_tokens < n:
        raise ValueError(f"{num_tokens} tokens for {n} decode requests (one token each, then any padding)")
    for i, (slot, total, first) in enumerate(zip(slots, seq_lens, step_positions)):
        cache.check_request(i, int(slot), int(total), int(first), False)
    need, free = cache.decode_pages_needed(n), cache.manager.free_pages()
    if need > free:
        raise OutOfPagesError(f"the step needs up to {need} free pages, {free} are free")
    if cache.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the decode graph's plan nodes run Triton kernels: on the CPU set TRITON_INTERPRET=1 before "
                         "importing trtllm_diffkv")


def _run_decode_graph(session, cache, input_ids, positions, logits_indices, slots, seq_lens,
                      step_positions) -> np.ndarray:
    """:func:`run_per_op_step` of a decode step: the graph plans it (no ``cache.plan``)."""
    from ..memory.page_manager import PageTableSnapshot

    i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    _check_decode_step(cache, len(input_ids), slots, seq_lens, step_positions)
    feeds = {"input_ids": i64(input_ids), "positions": i64(positions), "logits_indices": i64(logits_indices),
             **decode_feeds(cache, slots, step_positions)}
    outs = _run_graph(session, feeds)
    status_in, status = int(feeds["ring_state"][2]), int(outs["ring_state_out"][2])
    if status & ~status_in:
        raise ValueError(f"the page update refused the step (status bits {status}); the cache is unchanged")
    man, shape = cache.manager, (cache.max_slots, cache.num_layers, cache.num_kv_heads)
    t = lambda name: torch.from_numpy(outs[f"{name}_out"])  # noqa: E731
    start, end, status = (int(x) for x in outs["ring_state_out"])
    man.load_snapshot(PageTableSnapshot(ring=t("ring"), ring_start=start, ring_end=end,
                                        page_table=t("page_table").reshape(*shape, -1),
                                        pages=t("row_pages").reshape(*shape, 2), tokens=t("tier_tokens").reshape(*shape, 2),
                                        slot_state=t("slot_state"), status=status))
    cache.pool.pages().copy_(t("kv_pool"))
    cache.error_flags.copy_(t("error_flags"))
    cache.finish_graph_step(slots, seq_lens, step_positions, len(input_ids))  # seq_len bookkeeping
    return outs["logits"]


def _run_graph(session, feeds: dict) -> dict:
    """``{output name: array}`` of one run of a per-operation / AOT graph (:func:`check_feeds` first).

    Raises:
        ValueError: as :func:`check_feeds`, or the first error a plugin op recorded during the run (the ops never
            raise into onnxruntime)."""
    check_feeds(session, feeds)
    _PER_OP_ERRORS.clear()
    outs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    if _PER_OP_ERRORS:
        raise ValueError(_PER_OP_ERRORS[0])
    return outs


def check_feeds(session, feeds: dict) -> None:
    """Refuse feeds whose fixed dims differ from the graph's (an engine built for other sizes: its slots, rows or
    pages per row), which onnxruntime would otherwise meet with an abort of the process while planning buffers.

    Raises:
        ValueError: naming the input, its dims and the graph's.
    """
    for arg in session.get_inputs():
        if arg.name not in feeds:
            continue
        got = tuple(np.shape(feeds[arg.name]))
        want = tuple(arg.shape)
        if len(got) != len(want) or any(isinstance(w, int) and w != g for w, g in zip(want, got)):
            raise ValueError(f"input {arg.name} has dims {list(got)}; the graph's are {list(want)} (an engine built for "
                             "other sizes)")


def step_phase(is_prefill) -> str:
    """``"prefill"`` (every request brings its prompt) or ``"decode"`` (none does).

    Raises:
        ValueError: a mixed step (the per-operation graphs are one per step kind), or no requests.
    """
    flags = [bool(x) for x in is_prefill]
    if not flags:
        raise ValueError("a step needs at least one request")
    if all(flags):
        return "prefill"
    if not any(flags):
        return "decode"
    raise ValueError("the per-operation graphs run prefill-only or decode-only steps; split a mixed step")


def plan_feeds(cache, phase: str) -> dict[str, np.ndarray]:
    """The plan and state inputs of the per-operation prefill graph from a ``PagedDiffKVCache`` whose prefill step
    is planned (``cache.plan``) and whose layers have not run: :data:`~.onnx_export.PLAN_INPUTS` ``["prefill"]`` from
    the step's prefill tensors, the state of :data:`~.onnx_export.PHASE_STATE` ``["prefill"]`` from the cache
    (copies, numpy). (The decode graph plans its step itself: :func:`decode_feeds`.)

    Raises:
        ValueError: ``phase`` other than ``"prefill"``, or no prefill step planned.
    """
    if phase != "prefill":
        raise ValueError(f"phase={phase!r}: plan_feeds is for the prefill graph; the decode graph takes decode_feeds")
    step = cache.planned_step
    part = None if step is None else step.prefill
    if part is None or step.next_layer:
        raise ValueError(f"no planned {phase} step whose layers have not run")
    np_ = lambda t: t.detach().cpu().numpy().copy()  # noqa: E731
    plan = [part.cu, part.req, part.t, part.count, part.thr_h, part.thr_l, part.window, part.start, part.row_base,
            part.reserved, part.err_idx]
    state = {"kv_pool": cache.pool.pages(), "page_table": cache.manager.page_table,
             "tier_tokens": cache.manager.tokens, "key_offsets": cache.row_meta.key_offsets,
             "error_flags": cache.error_flags, "tier_counts": part.counts}
    feeds = {}
    for (name, (dtype, _)), t in zip(PLAN_INPUTS[phase].items(), plan):
        feeds[name] = np_(t).astype(dtype, copy=False)
    for name in PHASE_STATE[phase]:
        feeds[name] = np_(state[name]).astype(STATE_INPUTS[name][0], copy=False)
    return feeds


def run_per_op_step(sessions: dict, cache, input_ids, positions, logits_indices, slots, seq_lens, step_positions,
                    is_prefill) -> np.ndarray:
    """One step through the per-operation graphs (:func:`~.onnx_export.export_per_op`); returns the logits
    ``[num_logits, vocab_size]`` float32. ``cache`` (a ``PagedDiffKVCache``) holds the state of record.

    Prefill (``sessions["prefill"]``): ``cache.plan`` (prompt reservation), the graph on :func:`plan_feeds`, its
    ``*_out`` outputs copied back into the cache, the step's layers marked run (the graph ran them), then the
    cache's own step end (``PagedDiffKVCache.end_step``: the prompts' ``commit_prompt`` with the graph's tier
    counts).

    Decode (``sessions["decode"]``): no host plan. The host checks the step as ``cache.plan`` would (active slots,
    positions, free pages), feeds the slots, positions and the cache's state (:func:`decode_feeds`); the graph's
    ``decode_decide`` / ``page_update`` / ``decode_locate`` nodes plan the step and the layers run; then the
    ``*_out`` state (pool, page manager, error flags) is copied back and the host's sequence lengths advance.
    ``input_ids`` / ``positions`` may be longer than ``slots`` (padding tokens after the sequences: their row ids
    are -1, their outputs zeros).

    Raises:
        ValueError: a mixed step, a step the cache refuses, a prompt longer than an AOT graph's engine holds
            (:data:`~.onnx_export.ENGINE_MAX_SEQ_LEN`), feeds of other sizes than the graph's (:func:`check_feeds`),
            a plugin op failed or the page update refused the step
            (prefill: the step is discarded, ``cache.discard_step``; decode: the cache is unchanged).
        OutOfPagesError: too few free pages for a decode step (nothing changed).
    """
    phase = step_phase(is_prefill)
    if phase == "decode":
        return _run_decode_graph(sessions[phase], cache, input_ids, positions, logits_indices, slots, seq_lens,
                                 step_positions)
    from .onnx_export import ENGINE_MAX_SEQ_LEN

    limit = sessions[phase].get_modelmeta().custom_metadata_map.get(ENGINE_MAX_SEQ_LEN)
    longest = max(int(n) for n in seq_lens)
    if limit is not None and longest > int(limit):
        raise ValueError(f"a prompt of {longest} tokens; the AOT prefill graph's engine holds {limit} (its "
                         "prompt-score kernels are sized for it)")
    cache.plan(slots, seq_lens, step_positions, is_prefill)
    try:
        i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
        feeds = {"input_ids": i64(input_ids), "positions": i64(positions), "logits_indices": i64(logits_indices),
                 **plan_feeds(cache, phase)}
        outs = _run_graph(sessions[phase], feeds)
        step = cache.planned_step
        targets = {"kv_pool": cache.pool.pages(), "key_offsets": cache.row_meta.key_offsets,
                   "error_flags": cache.error_flags, "tier_counts": step.prefill.counts}
        for name, t in targets.items():
            if f"{name}_out" in outs:
                t.copy_(torch.from_numpy(outs[f"{name}_out"]))
        step.next_layer = cache.num_layers  # the graph ran every layer
        cache.end_step()
    except BaseException:
        cache.discard_step()
        raise
    return outs["logits"]


_AOT_OPS: dict[str, tuple] = {}
"""AOT op types registered in this process: their input dtypes (onnxruntime-extensions registrations are global)."""
_SESSIONS = weakref.WeakSet()
"""The live sessions :func:`ort_session` made: registering a new Python op while one lives makes its next run
crash the process (onnxruntime-extensions 0.15: segmentation fault, checked), so :func:`register_aot_ops` refuses."""


def _aot_attr(node, name):
    import onnx

    value = onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == name))
    return value.decode() if isinstance(value, bytes) else value


def _aot_half(node) -> set:
    """fp16 inputs of an AOT node (``key_offsets``): cast to fp32 around the node, as for the per-op nodes."""
    import json

    return {j for j, d in enumerate(json.loads(_aot_attr(node, "bind_dtypes"))) if d == "float16"}


def register_aot_ops(proto) -> None:
    """Register the AOT nodes of ``proto`` (``graph="aot"``) as onnxruntime-extensions Python ops: one per op type
    (``aot_<wrapper>``), each running :func:`trtllm_diffkv.export.plugin_ops.run_abi_kernel` (the node's TensorRT-convention wrapper
    through Triton's JIT with the argument list TensorRT would pass; on the CPU under ``TRITON_INTERPRET=1``).

    Raises:
        ValueError: an op type already registered with other input dtypes, or a new op type while a session made by
            :func:`ort_session` is alive (registering then would crash that session's next run: make the AOT graph's
            session first).
    """
    import json

    from onnxruntime_extensions import PyCustomOpDef as P
    from onnxruntime_extensions import onnx_op

    from .onnx_export import AOT_INT_ATTRS, aot_nodes

    for node in aot_nodes(proto):
        dtypes = tuple("float32" if d == "float16" else d for d in json.loads(_aot_attr(node, "bind_dtypes")))
        known = _AOT_OPS.get(node.op_type)
        if known is not None:
            if known != dtypes:
                raise ValueError(f"{node.op_type}: registered with inputs {known}, this node has {dtypes}")
            continue
        gc.collect()
        if len(_SESSIONS):
            raise ValueError(f"{node.op_type} is a new Python op and {len(_SESSIONS)} onnxruntime session(s) are alive: "
                             "registering it would crash them (onnxruntime-extensions); make the AOT graph's session "
                             "first, or drop the others")
        types = [getattr(P, _ORT_TYPES[d]) for d in dtypes]
        attrs = {a.name: P.dt_int64 if a.name in AOT_INT_ATTRS else P.dt_string for a in node.attribute}
        onnx_op(op_type=node.op_type, inputs=types, outputs=types, attrs=attrs)(_aot_op(node.op_type))
        _AOT_OPS[node.op_type] = dtypes


def _aot_op(op_type: str):
    """The onnxruntime op of an AOT node: :func:`trtllm_diffkv.export.plugin_ops.run_abi_kernel` on copies of the inputs (fp16 ones
    arrive as fp32, see :func:`ort_model`); returns every input after the launch (the aliased outputs). Never raises
    (module docstring): a failure is recorded and the inputs returned."""

    def op(*arrays, **attrs):
        import json

        try:
            from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4

            patch_interpreter_for_numpy_2_4()  # a no-op unless TRITON_INTERPRET=1
            half = [d == "float16" for d in json.loads(attrs["bind_dtypes"])]
            tensors = [_t(a).half() if h else _t(a) for a, h in zip(arrays, half)]
            plugin_ops.run_abi_kernel(tensors, attrs)
            return tuple((t.float() if h else t).numpy() for t, h in zip(tensors, half))
        except Exception as exc:  # noqa: BLE001 - an exception here would abort the process (module docstring)
            _PER_OP_ERRORS.append(f"{op_type} ({attrs.get('kernel')}): {type(exc).__name__}: {exc}")
            return tuple(arrays)
    return op


def ort_model(proto):
    """A copy of an exported model whose plugin nodes are in onnxruntime-extensions' domain."""
    import onnx
    from onnxruntime_extensions import default_opset_domain

    model = onnx.ModelProto()
    model.CopyFrom(proto)
    nodes = []
    for node in model.graph.node:
        if node.domain == PLUGIN_NAMESPACE:
            node.domain = default_opset_domain()
        aot = node.op_type.startswith("aot_") and node.domain == default_opset_domain()
        half = _aot_half(node) if aot else \
            _HALF_INPUTS.get(node.op_type, set()) if node.domain == default_opset_domain() else set()
        after = []
        for i in sorted(half):  # fp16 -> fp32 around the node (per-operation graphs: key_offsets)
            name = node.input[i]
            nodes.append(onnx.helper.make_node("Cast", [name], [f"{node.name}.in{i}.fp32"], to=onnx.TensorProto.FLOAT))
            node.input[i] = f"{node.name}.in{i}.fp32"
        plugin = specs.PLUGINS.get(f"{PLUGIN_NAMESPACE}::{node.op_type}")
        for j, out in enumerate(node.output):
            if (j in half) if aot else (plugin is not None and plugin.aliases.get(j) in half):
                node.output[j] = f"{node.name}.out{j}.fp32"
                after.append(onnx.helper.make_node("Cast", [node.output[j]], [out], to=onnx.TensorProto.FLOAT16))
        nodes += [node, *after]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    for opset in model.opset_import:
        if opset.domain == PLUGIN_NAMESPACE:
            opset.domain = default_opset_domain()
    return model


def ort_session(proto):
    """An ``onnxruntime.InferenceSession`` (CPU) running ``proto`` with the DiffKV ops registered."""
    import onnxruntime as ort
    from onnxruntime_extensions import get_library_path

    register_ops()
    register_aot_ops(proto)
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(ort_model(proto).SerializeToString(), options, providers=["CPUExecutionProvider"])
    _SESSIONS.add(session)
    return session


def step_feeds(cache, handle: int, input_ids, positions, logits_indices, slots, seq_lens, step_positions,
               is_prefill) -> dict[str, np.ndarray]:
    """The graph inputs of one step (the cache's current state as ``kv_pool`` / ``page_table`` / ``tier_tokens``)."""
    i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    pool, table, tokens = _state_out(cache)
    return {"input_ids": i64(input_ids), "positions": i64(positions), "logits_indices": i64(logits_indices),
            "step_slots": i64(slots), "step_seq_lens": i64(seq_lens), "step_positions": i64(step_positions),
            "step_is_prefill": np.asarray(is_prefill, dtype=np.bool_), "kv_pool": pool, "page_table": table,
            "tier_tokens": tokens, "cache_handle": i64([handle])}
