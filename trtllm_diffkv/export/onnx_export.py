"""Export a Llama-family model to ONNX with each layer's attention and KV handling as a DiffKV plugin node.

The graph (built and its plugin nodes inserted with onnx-graphsurgeon, opset 17) is one step of
:class:`~trtllm_diffkv.model.llama.LlamaForCausalLM` over packed tokens:

* inputs: ``input_ids`` int64 ``[num_tokens]``, ``positions`` int64 ``[num_tokens]``,
  ``logits_indices`` int64 ``[num_logits]``; the step description ``step_slots``,
  ``step_seq_lens``, ``step_positions`` int64 ``[num_requests]`` and ``step_is_prefill`` bool
  ``[num_requests]`` (as :meth:`PagedDiffKVCache.plan`); the cache state ``kv_pool`` uint8
  ``[num_pages, page_size_bytes]``, ``page_table`` int32 ``[num_rows, max_pages_per_row]``,
  ``tier_tokens`` int32 ``[num_rows, 2]``; ``cache_handle`` int64 ``[1]``.
* one ``DiffKVPageUpdate`` node ``(cache_handle, step_slots, step_seq_lens, step_positions,
  step_is_prefill, page_table, tier_tokens) -> (step_token, page_table, tier_tokens)`` (the step's page
  update: the page manager's reserve / decisions / append / moves of :meth:`PagedDiffKVCache.plan`), whose
  ``step_token`` output feeds every attention node, so it runs first, and whose page table and tier
  counts (aliased) feed the first layer's;
* per layer, the projections, RoPE (cos/sin tables gathered by position) and MLP as standard ONNX
  ops (with ``key_rotation``: the rotated model's folded ``v_proj`` / ``o_proj`` and a per-head MatMul of q
  and k after RoPE, as ``model/rotation.py``), and one ``DiffKVAttention`` node: ``(q [T, H, D], k [T, Hkv, D], v, kv_pool, page_table,
  tier_tokens, cache_handle, step_token) -> (out [T, H, D], kv_pool, page_table, tier_tokens)``: scored prefill
  with prompt compaction into the pool for the step's prompts, paged mixed-precision decode
  attention with the score update for its decode tokens. The pool, table and tier counts pass
  from layer to layer and out of the graph (``kv_pool_out``, ...): TensorRT aliases them in place.
* output: ``logits`` float32 ``[num_logits, vocab_size]`` plus the three state outputs.

Plugin nodes: op type = plugin name, domain = ``diffkv`` (the plugin namespace), attributes
``plugin_namespace="diffkv"``, ``plugin_version="1"`` and exactly the plugin's fields (the layer index,
the model shape and the DiffKV configuration, :func:`~.fields.kv_config_to_fields`) - what TensorRT's ONNX
parser turns into plugin fields. The two node types are the composite plugins
:data:`trtllm_diffkv.export.plugin_specs.STEP_PAGE_UPDATE` and :data:`trtllm_diffkv.export.plugin_specs.LAYER_ATTENTION`, which
``plugins/trt_plugins.py`` registers like the per-operation ones. Weights are fp32 initializers (the
ONNX file holds them; > 2 GB is refused).

Per-operation graphs (``export_onnx(..., graph="per-op", phase="prefill" | "decode")``, :func:`export_per_op`):
the same decoder with one ``diffkv::prefill_attention`` or ``diffkv::decode_attention`` node per layer (the
per-operation plugins of :mod:`trtllm_diffkv.export.plugin_specs`) and the cache state (:data:`STATE_INPUTS`) as graph inputs; no
composite node, no cache handle. Prefill: the step plan's tensors (:data:`PLAN_INPUTS`) are graph inputs, the plan
(prompt reservation) and the prompt commit stay on the host (``ort_ops.run_per_op_step``). Decode: the graph makes
its plan itself (``decode_decide``, ``page_update``, ``decode_locate`` nodes) from the step's slots and positions
and the page manager's state (graph inputs and aliased outputs).

AOT decode graph (``export_onnx(..., graph="aot", phase="decode", manifest=...)``, :func:`export_aot`): the per-operation
decode graph with each DiffKV node replaced by one ``diffkv::aot_<manifest entry>`` node per kernel launch
(``export/aot_graph.py`` records them), the nodes' inputs the tensors the kernels' pointer parameters name.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from trtllm_diffkv.export import plugin_specs as specs

from ..config import DiffKVConfig
from . import EXPORT_GRAPHS  # the graph forms: export/__init__.py
from .fields import kv_config_to_fields

PLUGIN_NAMESPACE = specs.NAMESPACE
PLUGIN_VERSION = specs.VERSION
ATTENTION_OP = specs.LAYER_ATTENTION.name
PAGE_UPDATE_OP = specs.STEP_PAGE_UPDATE.name
OPSET = 17
MAX_ONNX_BYTES = 2 * 1024**3 - 1


class _Builder:
    """Minimal node builder over an onnx-graphsurgeon graph."""

    def __init__(self, gs) -> None:
        self.gs, self.graph, self.count = gs, gs.Graph(opset=OPSET), 0

    def var(self, name: str, dtype, shape: list):
        return self.gs.Variable(name, dtype=dtype, shape=shape)

    def token_inputs(self) -> tuple:
        """The inputs every step graph starts with: ``input_ids``, ``positions`` int64 ``[num_tokens]`` and
        ``logits_indices`` int64 ``[num_logits]``."""
        return (self.var("input_ids", np.int64, ["num_tokens"]), self.var("positions", np.int64, ["num_tokens"]),
                self.var("logits_indices", np.int64, ["num_logits"]))

    def step_inputs(self, phase: str) -> tuple[dict, dict]:
        """A per-operation graph's plan inputs (:data:`PLAN_INPUTS`) and state inputs (:data:`PHASE_STATE`) of ``phase``."""
        plan = {n: self.var(n, dt, list(dims)) for n, (dt, dims) in PLAN_INPUTS[phase].items()}
        state = {n: self.var(n, STATE_INPUTS[n][0], list(STATE_INPUTS[n][1])) for n in PHASE_STATE[phase]}
        return plan, state

    def const(self, name: str, array: np.ndarray):
        return self.gs.Constant(name, np.ascontiguousarray(array))

    def op(self, op: str, inputs: list, attrs: dict | None = None, dtype=None, shape=None, outputs: int = 1,
           domain: str | None = None, name: str | None = None):
        self.count += 1
        outs = [self.gs.Variable(f"{op.lower()}_{self.count}_{i}", dtype=dtype, shape=shape) for i in range(outputs)]
        node = self.gs.Node(op=op, name=name or f"{op}_{self.count}", inputs=inputs, outputs=outs,
                            attrs=attrs or {}, domain=domain)
        self.graph.nodes.append(node)
        return outs[0] if outputs == 1 else outs

    def linear(self, x, weight: torch.Tensor, bias: torch.Tensor | None, name: str):
        y = self.op("MatMul", [x, self.const(f"{name}.weight_t", _np(weight).T)], dtype=np.float32)
        return y if bias is None else self.op("Add", [y, self.const(f"{name}.bias", _np(bias))], dtype=np.float32)

    def rms_norm(self, x, weight: torch.Tensor, eps: float, name: str):
        ms = self.op("ReduceMean", [self.op("Mul", [x, x])], {"axes": [-1], "keepdims": 1})
        inv = self.op("Reciprocal", [self.op("Sqrt", [self.op("Add", [ms, self.const(f"{name}.eps",
                                                                                   np.array(eps, np.float32))])])])
        return self.op("Mul", [self.op("Mul", [x, inv]), self.const(f"{name}.weight", _np(weight))], dtype=np.float32)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


def config_attrs(kv_config: DiffKVConfig) -> dict:
    """:func:`kv_config_to_fields` as ONNX attributes: the thresholds as decimal strings, since ONNX float
    attributes are fp32 and would move ``alpha_low=0.02`` to 0.0199999995 (a different threshold)."""
    return {k: repr(v) if isinstance(v, float) else v for k, v in kv_config_to_fields(kv_config).items()}


def attention_attrs(layer_idx: int, model_config, kv_config: DiffKVConfig, sm_scale: float) -> dict:
    """Attributes of one layer's ``DiffKVAttention`` node (plugin fields in TensorRT)."""
    return {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION, "layer_idx": layer_idx,
            "num_layers": model_config.num_layers, "num_heads": model_config.num_heads,
            "num_kv_heads": model_config.num_kv_heads, "head_dim": model_config.head_dim,
            "sm_scale": float(sm_scale), **config_attrs(kv_config)}


def manager_attrs(model_config, kv_config: DiffKVConfig) -> dict:
    """Attributes of a page-manager node (``DiffKVPageUpdate``, and the decode plan's ``decode_decide``,
    ``page_update``, ``decode_locate``): :data:`trtllm_diffkv.export.plugin_specs.MANAGER_FIELDS` plus the plugin's name attributes."""
    return {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION,
            "num_layers": model_config.num_layers, "num_kv_heads": model_config.num_kv_heads,
            "head_dim": model_config.head_dim, **config_attrs(kv_config)}


def export_onnx(model, kv_config: DiffKVConfig, path: str | Path | None = None, *, max_positions: int | None = None,
                graph: str = "composite", phase: str | None = None, manifest: dict | None = None,
                target: str = "sm_90"):
    """Export ``model`` (``LlamaForCausalLM``) to an ONNX model with DiffKV plugin nodes.

    Args:
        model: the model (any dtype; weights are exported as fp32).
        kv_config: the DiffKV configuration written into every plugin node.
        path: where to save the ``.onnx`` (``None``: only return it).
        max_positions: rows of the RoPE tables (default ``model.config.max_position_embeddings``).
        graph: ``"composite"`` (the module docstring's graph: ``DiffKVPageUpdate`` + one ``DiffKVAttention`` per
            layer on a registered cache) or ``"per-op"`` (:func:`export_per_op`: per-operation plugin nodes, the
            step plan's tensors as graph inputs; one graph per ``phase``).
            ``"aot"`` (:func:`export_aot`: the decode step's DiffKV work as one ``diffkv::aot_<kernel>`` node per
            kernel launch of ``manifest``; ``phase="decode"`` only).
        phase: ``"prefill"`` or ``"decode"`` with ``graph="per-op"``; ``"decode"`` with ``"aot"``; ``None`` with
            ``"composite"``.
        manifest: the engine's kernel manifest (``aot.build_kernels``' ``manifest.json``, or ``{"engine": ...,
            "kernels": [s.to_json() for s in aot.kernel_specs(shape)]}`` uncompiled), for ``graph="aot"``.
        target: the compiled target whose shared memory the AOT nodes state (``graph="aot"``).

    Returns:
        The ``onnx.ModelProto`` (checked with ``onnx.checker`` and run through shape inference).

    Raises:
        ValueError: a configuration that cannot run the model, weights beyond 2 GB, an unknown ``graph``, a
            ``phase`` that does not fit it, or a ``score_pool_tokens`` the graphs do not implement yet (the
            PyTorch paths do).
    """
    if kv_config.score_pool_tokens != 1:
        raise ValueError(f"the ONNX graphs do not implement score_pool_tokens={kv_config.score_pool_tokens} yet; "
                         "build with --no-onnx (the engine directory's PyTorch path runs it) or a configuration "
                         "without it")
    if graph == "per-op":
        return export_per_op(model, kv_config, phase, path, max_positions=max_positions)
    if graph == "aot":
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r}: graph='aot' has a prefill and a decode graph (phase='prefill' or "
                             "'decode')")
        if manifest is None:
            raise ValueError("graph='aot' needs the engine's kernel manifest (manifest=...)")
        export = export_aot if phase == "decode" else export_aot_prefill
        return export(model, kv_config, manifest, path, max_positions=max_positions, target=target)
    if graph != "composite":
        raise ValueError(f"graph={graph!r}: expected one of {list(EXPORT_GRAPHS)}")
    if phase is not None:
        raise ValueError(f"phase={phase!r} is for graph='per-op'; the composite graph runs every step")
    import onnx_graphsurgeon as gs

    cfg = model.config
    model = _check_model(model, kv_config)
    b = _Builder(gs)
    H, D = cfg.num_heads, cfg.head_dim
    var = b.var
    ids, pos, sel = b.token_inputs()
    step = [var(n, np.int64, ["num_requests"]) for n in ("step_slots", "step_seq_lens", "step_positions")]
    step.append(var("step_is_prefill", np.bool_, ["num_requests"]))
    pool = var("kv_pool", np.uint8, ["num_pages", "page_size_bytes"])
    table = var("page_table", np.int32, ["num_rows", "max_pages_per_row"])
    tokens = var("tier_tokens", np.int32, ["num_rows", 2])
    handle = var("cache_handle", np.int64, [1])
    b.graph.inputs = [ids, pos, sel, *step, pool, table, tokens, handle]
    step_token, table, tokens = b.op(PAGE_UPDATE_OP, [handle, *step, table, tokens], manager_attrs(cfg, kv_config),
                                     outputs=3,
                                     domain=PLUGIN_NAMESPACE, name="diffkv_page_update")
    step_token.dtype, step_token.shape = np.int64, [1]
    table.dtype, tokens.dtype = np.int32, np.int32
    table.shape, tokens.shape = ["num_rows", "max_pages_per_row"], ["num_rows", 2]
    state = {"pool": pool, "table": table, "tokens": tokens}

    def attend(i, q, k, v):
        out, state["pool"], state["table"], state["tokens"] = b.op(
            ATTENTION_OP, [q, k, v, state["pool"], state["table"], state["tokens"], handle, step_token],
            attention_attrs(i, cfg, kv_config, D ** -0.5), outputs=4, domain=PLUGIN_NAMESPACE,
            name=f"diffkv_attention_{i}")
        _typed(out, np.float32, ["num_tokens", H, D])
        _typed(state["pool"], np.uint8, ["num_pages", "page_size_bytes"])
        _typed(state["table"], np.int32, ["num_rows", "max_pages_per_row"])
        _typed(state["tokens"], np.int32, ["num_rows", 2])
        return out

    logits = _decoder(b, model, ids, pos, sel, max_positions, attend)
    pool, table, tokens = state["pool"], state["table"], state["tokens"]
    for v, name in ((pool, "kv_pool_out"), (table, "page_table_out"), (tokens, "tier_tokens_out")):
        v.name = name
    b.graph.outputs = [logits, pool, table, tokens]
    return _finish(b, gs, path)


def _check_model(model, kv_config: DiffKVConfig):
    """Refuse a model the graphs cannot hold; returns the model to export: ``model`` or, with ``key_rotation``,
    its rotated copy (``model/rotation.py``: ``v_proj`` / ``o_proj`` folded, ``self_attn.key_rotation`` set, which
    :func:`_decoder` applies to q and k after RoPE)."""
    from ..model.llama import LlamaForCausalLM
    from ..model.rotation import model_for_kv_config

    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"the TensorRT graphs hold Llama-family decoders; {type(model).__name__} runs on the PyTorch "
                         "engines (LLM, generate, serve)")
    cfg = model.config
    kv_config.validate_for_model(cfg.head_dim, cfg.num_heads, cfg.num_kv_heads)
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    if weight_bytes > MAX_ONNX_BYTES:
        raise ValueError(f"the model's fp32 weights take {weight_bytes:,} bytes; one ONNX file holds < 2 GB")
    return model_for_kv_config(model, kv_config)


ENGINE_MAX_SEQ_LEN = "diffkv.max_seq_len"
"""Model metadata key of the AOT graphs: the engine's longest sequence (prompt + generated tokens), which its kernels'
prompt-score variant and scratch are sized for; a runtime refuses longer prompts (``ort_ops.run_per_op_step``)."""


def _finish(b: _Builder, gs, path, metadata: dict | None = None):
    """Clean up, export, check (``onnx.checker``, strict shape inference), optionally save; ``metadata``: model
    metadata properties."""
    import onnx

    b.graph.cleanup().toposort()
    proto = gs.export_onnx(b.graph)
    if metadata:
        onnx.helper.set_model_props(proto, {k: str(v) for k, v in metadata.items()})
    if not any(o.domain == PLUGIN_NAMESPACE for o in proto.opset_import):  # graphsurgeon may have added it
        proto.opset_import.append(onnx.helper.make_opsetid(PLUGIN_NAMESPACE, 1))
    proto.producer_name = "trtllm-diffkv"
    onnx.checker.check_model(proto)
    proto = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    if path is not None:
        onnx.save(proto, str(path))
    return proto


PHASES = ("prefill", "decode")
"""Per-operation graphs: one per step kind (:func:`export_per_op`)."""

PLAN_INPUTS = {
    "prefill": {"cu_seqlens": (np.int32, ["num_prompts_plus_1"]), "req": (np.int64, ["num_tokens"]),
                "token_index": (np.int32, ["num_tokens"]), "score_count": (np.float32, ["num_tokens"]),
                "thr_high": (np.float32, ["num_tokens"]), "thr_low": (np.float32, ["num_tokens"]),
                "window": (np.bool_, ["num_tokens"]), "start": (np.int64, ["num_tokens"]),
                "row_base": (np.int64, ["num_tokens"]), "reserved_pages": (np.int64, ["num_tokens"]),
                "err_idx": (np.int32, ["num_token_heads"])},
    "decode": {"step_slots": (np.int64, ["num_seqs"]), "step_positions": (np.int64, ["num_seqs"])},
}
"""The per-step host inputs of the per-operation graphs besides the tokens (name: dtype, dims). Prefill: the step
plan's tensors, what ``paged/prefill.py::plan_prefill`` builds (``ort_ops.plan_feeds`` maps them). Decode: what a
runtime feeds per step, the decode sequences' slots and the position each writes (= its tokens stored); the decode
graph's own ``decode_decide`` / ``page_update`` / ``decode_locate`` nodes make the plan (``paged/decode.py::plan_device``)."""

STATE_INPUTS = {"kv_pool": (np.uint8, ["num_pages", "page_size_bytes"]),
                "page_table": (np.int32, ["num_rows", "max_pages_per_row"]),
                "tier_tokens": (np.int32, ["num_rows", 2]), "key_offsets": (np.float16, ["num_rows", "head_dim"]),
                "tier_counts": (np.int32, ["num_prompts", "num_layers", "num_kv_heads", 2]),
                "error_flags": (np.int32, ["max_slots"]), "row_pages": (np.int32, ["num_rows", 2]),
                "slot_state": (np.int32, ["max_slots"]), "ring": (np.int32, ["num_pages"]),
                "ring_state": (np.int64, [3]), "prompt_len": (np.int64, ["max_slots"])}
"""The cache state the per-operation graphs read and update: the pool, the page manager's state (``page_table``,
``tier_tokens``; ``row_pages``, ``slot_state``, ``ring``, ``ring_state`` = (start, end, status bits):
``TritonPageManager``'s tensors), the row metadata's key offsets, the prompt tier counts, the error flags, and
the prompt length per slot (read only)."""

PHASE_STATE = {"prefill": ("kv_pool", "page_table", "tier_tokens", "key_offsets", "tier_counts", "error_flags"),
               "decode": ("kv_pool", "page_table", "tier_tokens", "row_pages", "slot_state", "ring", "ring_state",
                          "key_offsets", "error_flags", "prompt_len")}
"""The state inputs of each per-operation graph, in graph-input order."""


def per_op_input_dtypes(phase: str) -> list:
    """numpy dtypes of the ``prefill_attention`` (``phase="prefill"``) or ``decode_attention`` node's inputs, in
    the plugin's order (q/k/v fp32, the state's as :data:`STATE_INPUTS`, prefill's plan as :data:`PLAN_INPUTS`,
    decode's plan int32: the ``decode_locate`` node's outputs).

    Raises:
        ValueError: an unknown phase."""
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r}: expected one of {list(PHASES)}")
    plugin = specs.PREFILL if phase == "prefill" else specs.DECODE
    plan = list(PLAN_INPUTS["prefill"].values())
    out = []
    for t in plugin.inputs:
        if t.name in ("q", "k", "v"):
            out.append(np.float32)
        elif t.name in STATE_INPUTS:
            out.append(STATE_INPUTS[t.name][0])
        else:
            out.append(plan.pop(0)[0] if phase == "prefill" else np.int32)
    return out


def export_per_op(model, kv_config: DiffKVConfig, phase: str, path: str | Path | None = None, *,
                  max_positions: int | None = None):
    """Export one step kind of ``model`` with the per-operation plugins as nodes.

    ``phase="prefill"`` (a step of prompts only): per layer one ``diffkv::prefill_attention`` node
    (:data:`trtllm_diffkv.export.plugin_specs.PREFILL`) ``(q, k, v, cu_seqlens, req, token_index, score_count, thr_high, thr_low,
    window, start, row_base, reserved_pages, err_idx, kv_pool, page_table, tier_tokens, key_offsets, tier_counts,
    error_flags) -> (out, kv_pool, key_offsets, tier_counts, error_flags)``, the step plan's tensors
    (:data:`PLAN_INPUTS`) graph inputs: the prompt's plan (reservation) and commit stay on the host
    (``ort_ops.run_per_op_step``).

    ``phase="decode"`` (a step of decode tokens only) is self-contained for the plan: its host inputs are the
    tokens (``input_ids``, ``positions`` int64 ``[num_tokens]``: the sequences, then any padding), ``logits_indices``,
    ``step_slots`` / ``step_positions`` int64 ``[num_seqs]`` and the state (:data:`PHASE_STATE`); the plan is three
    nodes (``paged/decode.py::plan_device``):

    * ``diffkv::decode_decide (step_slots, step_positions, kv_pool, page_table, tier_tokens, prompt_len) ->
      (high_delta, low_delta, new_index, move_from, move_to)`` - the DiffKV decisions of every row;
    * ``diffkv::page_update (step_slots, high_delta, low_delta, page_table, tier_tokens, row_pages, slot_state, ring,
      ring_state) -> (the six, in place)`` - one ``append_decode``;
    * ``diffkv::decode_locate (step_slots, step_positions, positions, new_index, move_from, move_to, page_table,
      kv_pool) -> (kv_pool, row_ids, dest_page, dest_slot, decode_positions, err_idx)`` - the moves to the low tier
      in the pool and the new tokens' slots;

    then per layer one ``diffkv::decode_attention`` node (:data:`trtllm_diffkv.export.plugin_specs.DECODE`) ``(q, k, v, row_ids[l],
    dest_page[l], dest_slot[l], decode_positions, err_idx, kv_pool, page_table, tier_tokens, key_offsets,
    error_flags) -> (out, kv_pool, error_flags)`` on the updated page table and tier counts.

    Outputs: ``logits`` and ``<state>_out`` for every state the nodes update (chained node to node).

    Args:
        model, kv_config, path, max_positions: as :func:`export_onnx`.
        phase: ``"prefill"`` or ``"decode"``.

    Returns:
        The checked ``onnx.ModelProto`` (``onnx.checker``, strict shape inference).

    Raises:
        ValueError: an unknown phase, a configuration that cannot run the model, weights beyond 2 GB.
    """
    import onnx_graphsurgeon as gs

    if phase not in PHASES:
        raise ValueError(f"phase={phase!r}: expected one of {list(PHASES)} with graph='per-op'")
    cfg = model.config
    model = _check_model(model, kv_config)
    b = _Builder(gs)
    H, D = cfg.num_heads, cfg.head_dim
    ids, pos, sel = b.token_inputs()
    plan, state = b.step_inputs(phase)
    given = dict(state)
    b.graph.inputs = [ids, pos, sel, *plan.values(), *state.values()]
    plugin = specs.PREFILL if phase == "prefill" else specs.DECODE
    updated = [plugin.inputs[plugin.aliases[j]].name for j in range(1, len(plugin.outputs))]
    attrs = lambda i: attention_attrs(i, cfg, kv_config, D ** -0.5)  # noqa: E731

    if phase == "prefill":
        layer_plan = lambda i: list(plan.values())  # noqa: E731
    else:
        located = _decode_plan_nodes(b, cfg, kv_config, plan, state, pos)

        def layer_plan(i):
            index = b.gs.Constant(f"plan.layer{i}", np.array(i, np.int64))  # a scalar: Gather drops the layer axis
            per_layer = [b.op("Gather", [located[n], index], {"axis": 0}) for n in ("row_ids", "dest_page", "dest_slot")]
            return [*per_layer, located["decode_positions"], located["err_idx"]]

    def attend(i, q, k, v):
        s = [state[t.name] for t in plugin.inputs[14 if phase == "prefill" else 8:]]
        outs = b.op(plugin.name, [q, k, v, *layer_plan(i), *s], attrs(i), outputs=len(plugin.outputs),
                    domain=PLUGIN_NAMESPACE, name=f"diffkv_{plugin.name}_{i}")
        _typed(outs[0], np.float32, ["num_tokens", H, D])
        for name, o in zip(updated, outs[1:]):
            _typed(o, STATE_INPUTS[name][0], list(STATE_INPUTS[name][1]))
            state[name] = o
        return outs[0]

    logits = _decoder(b, model, ids, pos, sel, max_positions, attend)
    changed = [n for n in PHASE_STATE[phase] if state[n] is not given[n]]
    for name in changed:
        state[name].name = f"{name}_out"
    b.graph.outputs = [logits, *(state[n] for n in changed)]
    return _finish(b, gs, path)


def _decode_plan_nodes(b: _Builder, cfg, kv_config: DiffKVConfig, plan: dict, state: dict, positions) -> dict:
    """The decode graph's plan: ``decode_decide -> page_update -> decode_locate`` (:func:`export_per_op`). Updates
    ``state`` (page manager state, pool) with the nodes' outputs; returns ``decode_locate``'s plan tensors by name."""
    L, Hkv = cfg.num_layers, cfg.num_kv_heads
    attrs = manager_attrs(cfg, kv_config)
    slots, seq_pos = plan["step_slots"], plan["step_positions"]
    spec = specs.DECODE_DECIDE
    decided = b.op(spec.name, [slots, seq_pos, *(state[t.name] for t in spec.inputs[2:])], attrs,
                   outputs=len(spec.outputs), domain=PLUGIN_NAMESPACE, name="diffkv_decode_decide")
    dims = {0: ["num_seqs", L, Hkv], 1: ["num_seqs", L, Hkv], 2: ["num_seq_rows"], 3: ["num_seq_rows"],
            4: ["num_seq_rows"]}
    for j, o in enumerate(decided):
        _typed(o, np.dtype(spec.new_outputs[j][0]).type, dims[j])
    spec = specs.PAGE_UPDATE
    manager = [t.name for t in spec.inputs[3:]]
    outs = b.op(spec.name, [slots, decided[0], decided[1], *(state[n] for n in manager)], attrs,
                outputs=len(spec.outputs), domain=PLUGIN_NAMESPACE, name="diffkv_page_update")
    for name, o in zip(manager, outs):
        _typed(o, STATE_INPUTS[name][0], list(STATE_INPUTS[name][1]))
        state[name] = o
    spec = specs.DECODE_LOCATE
    outs = b.op(spec.name, [slots, seq_pos, positions, *decided[2:], state["page_table"], state["kv_pool"]], attrs,
                outputs=len(spec.outputs), domain=PLUGIN_NAMESPACE, name="diffkv_decode_locate")
    _typed(outs[0], np.uint8, list(STATE_INPUTS["kv_pool"][1]))
    state["kv_pool"] = outs[0]
    dims = {1: [L, "num_tokens", Hkv], 2: [L, "num_token_heads"], 3: [L, "num_token_heads"], 4: ["num_token_heads"],
            5: ["num_token_heads"]}
    for j in range(1, len(outs)):
        _typed(outs[j], np.int32, dims[j])
    return dict(zip(spec.outputs[1:], outs[1:]))


def _rope(b: _Builder, x, cos, sin, head_dim: int, name: str):
    """``x * cos + rotate_half(x) * sin`` (rotate-half layout, as ``model/rope.py``)."""
    half = head_dim // 2
    c = lambda tag, v: b.const(f"{name}.{tag}", np.array(v, np.int64))  # noqa: E731
    x1 = b.op("Slice", [x, c("s0", [0]), c("e0", [half]), c("ax0", [-1])])
    x2 = b.op("Slice", [x, c("s1", [half]), c("e1", [head_dim]), c("ax1", [-1])])
    rot = b.op("Concat", [b.op("Neg", [x2]), x1], {"axis": -1})
    return b.op("Add", [b.op("Mul", [x, cos]), b.op("Mul", [rot, sin])], dtype=np.float32)


def _rotate_heads(b: _Builder, x, rotation: torch.Tensor, name: str):
    """``x [T, n, D]`` -> ``x[:, h] @ rotation[h]`` per head (``rotation`` ``[n, D, D]``; as ``model/llama.py``'s
    ``einsum("nhd,hde->nhe")``), a batched MatMul between two transposes."""
    xt = b.op("Transpose", [x], {"perm": [1, 0, 2]})
    y = b.op("MatMul", [xt, b.const(f"{name}.matrices", _np(rotation))])
    return b.op("Transpose", [y], {"perm": [1, 0, 2]}, dtype=np.float32)


def _typed(var, dtype, shape) -> None:
    """Set a plugin output's dtype and shape (ONNX shape inference does not know the plugin ops)."""
    var.dtype, var.shape = dtype, shape


def _decoder(b: _Builder, model, ids, pos, sel, max_positions: int | None, attend):
    """The Llama decoder over packed tokens with ``attend(layer, q, k, v) -> out [T, H, D]`` as each layer's
    attention (q/k after RoPE); returns the ``logits`` variable ``[num_logits, vocab_size]``."""
    cfg = model.config
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    n_pos = max_positions or cfg.max_position_embeddings
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(torch.arange(n_pos, device=model.device), torch.float32)
    cos_t = b.op("Unsqueeze", [b.op("Gather", [b.const("rope.cos", _np(cos)), pos]), b.const("axis1", np.array([1]))])
    sin_t = b.op("Unsqueeze", [b.op("Gather", [b.const("rope.sin", _np(sin)), pos]), b.const("axis1_", np.array([1]))])
    x = b.op("Gather", [b.const("model.embed_tokens.weight", _np(model.model.embed_tokens.weight)), ids],
             dtype=np.float32)
    for i, layer in enumerate(model.model.layers):
        p, a = f"model.layers.{i}", layer.self_attn
        h = b.rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps, f"{p}.input_layernorm")
        heads = {}
        for name, n in (("q", H), ("k", Hkv), ("v", Hkv)):
            proj = getattr(a, f"{name}_proj")
            y = b.linear(h, proj.weight, proj.bias, f"{p}.self_attn.{name}_proj")
            y = b.op("Reshape", [y, b.const(f"{p}.{name}_shape", np.array([-1, n, D], np.int64))], dtype=np.float32)
            heads[name] = _rope(b, y, cos_t, sin_t, D, f"{p}.{name}") if name != "v" else y
        if a.key_rotation is not None:  # a rotated model (_check_model): q, k rotated per KV head after RoPE
            r = a.key_rotation.detach().float().cpu()
            heads["k"] = _rotate_heads(b, heads["k"], r, f"{p}.k_rotation")
            heads["q"] = _rotate_heads(b, heads["q"], r.repeat_interleave(H // Hkv, 0), f"{p}.q_rotation")
        out = attend(i, heads["q"], heads["k"], heads["v"])
        out = b.op("Reshape", [out, b.const(f"{p}.o_shape", np.array([-1, H * D], np.int64))])
        x = b.op("Add", [x, b.linear(out, a.o_proj.weight, None, f"{p}.self_attn.o_proj")], dtype=np.float32)
        h = b.rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                       f"{p}.post_attention_layernorm")
        m = layer.mlp
        gate = b.linear(h, m.gate_proj.weight, None, f"{p}.mlp.gate_proj")
        act = b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate])]), b.linear(h, m.up_proj.weight, None,
                                                                                f"{p}.mlp.up_proj")])
        x = b.op("Add", [x, b.linear(act, m.down_proj.weight, None, f"{p}.mlp.down_proj")], dtype=np.float32)
    x = b.op("Gather", [x, sel], {"axis": 0})
    x = b.rms_norm(x, model.model.norm.weight, model.model.norm.eps, "model.norm")
    logits = b.linear(x, model.lm_head.weight, None, "lm_head")
    logits.name, logits.shape = "logits", ["num_logits", cfg.vocab_size]
    return logits


def plugin_nodes(proto) -> list:
    """The DiffKV plugin nodes of an exported model (``NodeProto`` in graph order)."""
    return [n for n in proto.graph.node if n.domain == PLUGIN_NAMESPACE]


# --------------------------------------------------------------------------- AOT decode graph

AOT_OP_PREFIX = "aot_"
"""Op type of an AOT node: ``aot_<manifest entry name>`` (domain ``diffkv``: the plugin ``diffkv::aot_<name>`` that
``plugins/trt_plugins.py::register_aot_plugins`` registers for the entry)."""
AOT_ATTRS = {"kernel_name": str, "kernel": str, "abi": str, "grid": str, "num_warps": int, "num_stages": int,
             "shared_mem": int, "constexprs": str, "sizes": str, "dims": str, "extras": str, "bind_dtypes": str}
"""Attributes of an AOT node besides ``plugin_namespace`` / ``plugin_version`` (:func:`aot_node_attrs`), and their
types: the TensorRT plugin's fields (``plugins/trt_plugins.py::register_aot_plugins``)."""
AOT_INT_ATTRS = tuple(k for k, t in AOT_ATTRS.items() if t is int)
AOT_STATE_OUTPUTS = ("kv_pool", "page_table", "tier_tokens", "row_pages", "slot_state", "ring", "ring_state",
                     "error_flags")
"""The state the AOT decode graph outputs (``<name>_out``): what the per-operation decode graph outputs."""


def _dim_name(d):
    from .aot_graph import SYMBOLS

    if isinstance(d, int):
        return d
    if d in SYMBOLS:
        return SYMBOLS[d]
    if "+" in d:
        sym, k = d.split("+")
        return f"{SYMBOLS[sym]}_plus_{k}"
    sym, k = d.split("*")
    return f"{SYMBOLS[sym]}_x{k}"


def _size_source(infos: dict, inputs: list, sym: str) -> list:
    """``[input index, axis, divisor]``: where a node reads step size ``sym`` (an input whose dim is ``sym`` or
    ``sym*k``)."""
    for j, name in enumerate(inputs):
        for axis, d in enumerate(infos[name].dims):
            if d == sym:
                return [j, axis, 1]
            if isinstance(d, str) and d.startswith(f"{sym}*"):
                return [j, axis, int(d.split("*")[1])]
    raise ValueError(f"no input of the node carries the size {sym}")


def aot_node_attrs(launch, entry: dict, abi, infos: dict, target: str) -> dict:
    """Attributes of one AOT node, whose inputs are the launch's distinct buffers (``abi``, a
    :class:`.trt_abi.AbiKernel`: its inputs in order): the manifest entry's name (``kernel_name``), the kernel
    (``"module:function"``), ``abi`` (the wrapper, JSON), grid (expressions of ``sizes``), warps, stages, shared memory
    (the compiled wrapper's for ``target``; the entry's when the wrapper is not compiled; -1 for an uncompiled
    manifest), constexprs, the sizes (expressions of the step sizes ``n``, ``B``, ``P``; ``dims``: where each is read,
    ``[input, axis, divisor]``), the extra args (``extras``: ``[param, int32 value or expression of the sizes]``,
    an fp32 scalar as its bits: :func:`.trt_abi.scalar_bits`) and the inputs' graph dtypes (``bind_dtypes``).
    Lists and dicts are JSON strings (:data:`AOT_INT_ATTRS` are ints): onnxruntime-extensions' Python ops read
    string, int and float attributes only; the same strings are the TensorRT plugin's fields."""
    import json

    from .trt_abi import scalar_bits

    inputs = list(dict.fromkeys(launch.bindings))
    used = sorted({s for v in launch.sizes.values() if isinstance(v, str) for s in ("n", "B", "P") if s in v})
    compiled = abi.compiled.get(target) or entry.get("compiled", {}).get(target)
    extras = [[p, v if isinstance(v, str) else scalar_bits(v, abi.signature[p])]
              for p, v in ((p, launch.scalars[p]) for p in abi.extras)]
    return {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION,
            "kernel_name": entry["name"], "kernel": entry["kernel"],
            "abi": json.dumps({k: v for k, v in abi.to_json().items() if k != "compiled"}, sort_keys=True),
            "grid": json.dumps(list(entry["grid"])),
            "num_warps": int(entry["options"]["num_warps"]), "num_stages": int(entry["options"]["num_stages"]),
            "shared_mem": int(compiled["shared_bytes"]) if compiled else -1,
            "constexprs": json.dumps(entry["constexprs"], sort_keys=True),
            "sizes": json.dumps(launch.sizes), "dims": json.dumps({s: _size_source(infos, inputs, s) for s in used}),
            "extras": json.dumps(extras),
            "bind_dtypes": json.dumps([_graph_dtype(infos[b].dtype) for b in inputs])}


def _graph_dtype(dtype: str) -> str:
    """The graph dtype of a bound tensor: ``float64`` data travels as ``int64`` bits (TensorRT has no fp64)."""
    return "int64" if dtype == "float64" else dtype


def _aot_engine(model, kv_config: DiffKVConfig, manifest: dict):
    """The manifest's engine, checked against the model, ``kv_config`` and the fp32 graph (``ValueError`` else)."""
    from .fields import EngineShape

    cfg = model.config
    _check_model(model, kv_config)  # the exporters rotate their model themselves (_check_model's return value)
    engine = EngineShape.from_fields(manifest["engine"])
    want = (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv_config, "float32")
    got = (engine.num_layers, engine.num_heads, engine.num_kv_heads, engine.head_dim, engine.kv_config, engine.dtype)
    if got != want:
        raise ValueError(f"the manifest's engine {got[:4]}, {got[5]} does not fit the model {want[:4]} with this "
                         "kv_config and the fp32 graph (build the kernels with dtype='float32')")
    return engine


def _engine_dims(state: dict, engine) -> None:
    """Fix the dims of the state inputs the engine sizes (slots, rows, pages per row, ...) in an AOT graph: its
    kernels' scratch is sized for that engine, so a cache of other sizes must be refused at the graph's inputs (the
    key offsets too when the preset centers keys; without centering they stay symbolic: such a cache feeds an empty
    tensor)."""
    rows = engine.max_batch_size * engine.num_layers * engine.num_kv_heads
    fixed = {"num_rows": rows, "max_pages_per_row": engine.max_pages_per_row, "max_slots": engine.max_batch_size,
             "num_layers": engine.num_layers, "num_kv_heads": engine.num_kv_heads,
             "page_size_bytes": engine.page_format.page_size_bytes}
    centered = engine.kv_config.compress and engine.kv_config.center_keys
    fixed["head_dim"] = engine.head_dim
    for name, var in state.items():
        if name != "key_offsets" or centered:
            var.shape = [fixed.get(d, d) if isinstance(d, str) else d for d in var.shape]


class _AotNodes:
    """The AOT graphs' kernel nodes: ``cur`` maps each named tensor (``aot_graph.TensorInfo``) to its latest graph
    tensor; :meth:`get` makes a missing one (an initializer, or per-step zeros sized from ``step``'s ``[1]`` int64
    size tensors); :meth:`emit` adds a launch's node (its wrapper: the manifest's compiled one when present) and
    advances ``cur`` to the node's outputs.

    Raises (constructor):
        LookupError: a launch without a manifest entry (naming it).
    """

    def __init__(self, b: _Builder, infos: dict, manifest: dict, launches: list, target: str, cur: dict, step: dict):
        from .aot_graph import abi_of
        from .trt_abi import AbiKernel

        self.b, self.infos, self.target, self.cur, self.step, self.count = b, infos, target, cur, step, 0
        self.entries = {e["name"]: e for e in manifest["kernels"]}
        compiled = {k["name"]: AbiKernel.from_json(k) for k in manifest.get("trt_abi", [])}
        self.abis = {}
        for launch in launches:
            if launch.entry not in self.entries:
                raise LookupError(f"{launch.node}: {launch.entry} ({launch.spec.kernel}) is not in the engine's "
                                  "manifest")
            abi = abi_of(launch, self.entries[launch.entry], infos)
            self.abis[id(launch)] = compiled.get(abi.name, abi)

    def shape_of(self, dims):
        b, parts = self.b, []
        for d in dims:
            if isinstance(d, int):
                parts.append(b.const(f"aot.dim{b.count}_{len(parts)}", np.array([d], np.int64)))
                b.count += 1
            elif "*" in d:
                sym, k = d.split("*")
                parts.append(b.op("Mul", [self.step[sym], b.const(f"aot.k{b.count}", np.array([int(k)], np.int64))]))
            else:
                parts.append(self.step[d])
        return b.op("Concat", parts, {"axis": 0})

    def get(self, name):
        if name not in self.cur:
            info = self.infos[name]
            dt = np.dtype(info.dtype)
            if info.kind == "const":  # fp64 data as its int64 bits (_graph_dtype)
                self.cur[name] = self.b.const(f"aot.{name}", np.array(info.value, dtype=dt).view(
                    np.dtype(_graph_dtype(dt.name))))
            elif info.kind == "scratch":
                zero = self.b.gs.Constant(f"aot.{name}.zero.{self.b.count}", np.zeros(1, dt))
                self.cur[name] = self.b.op("ConstantOfShape", [self.shape_of(info.dims)], {"value": zero},
                                           dtype=dt.type, shape=[_dim_name(d) for d in info.dims])
            else:
                raise KeyError(f"{name}: no graph tensor (a per-layer tensor outside a layer)")
        return self.cur[name]

    def emit(self, launch):
        entry, abi = self.entries[launch.entry], self.abis[id(launch)]
        names = list(dict.fromkeys(launch.bindings))  # the distinct buffers: the wrapper's inputs
        outs = self.b.op(AOT_OP_PREFIX + abi.name, [self.get(nm) for nm in names],
                         aot_node_attrs(launch, entry, abi, self.infos, self.target),
                         outputs=len(names), domain=PLUGIN_NAMESPACE, name=f"aot_{self.count}_{launch.node}")
        self.count += 1
        outs = outs if isinstance(outs, list) else [outs]
        for nm, o in zip(names, outs):
            info = self.infos[nm]
            _typed(o, np.dtype(_graph_dtype(info.dtype)).type, [_dim_name(d) for d in info.dims])
            self.cur[nm] = o


def export_aot(model, kv_config: DiffKVConfig, manifest: dict, path: str | Path | None = None, *,
               max_positions: int | None = None, target: str = "sm_90"):
    """The decode step with its DiffKV work as one ``diffkv::aot_<kernel>`` node per kernel launch.

    The per-operation decode graph (:func:`export_per_op` ``phase="decode"``: same graph inputs and ``*_out``
    outputs) with each DiffKV node replaced by the launches its implementation makes (``export/aot_graph.py``:
    ``trtllm_diffkv/export/plugin_ops.py`` with ``use_triton=True`` recorded on ``meta`` tensors), in launch order:
    ``decode_decide`` -> ``_decide_kernel``; ``page_update`` -> ``_count_kernel``, ``_decode_apply_kernel`` (the fused
    scan); ``decode_locate`` -> ``_locate_kernel`` (+ ``_read_tokens_kernel``, ``_write_tokens_kernel`` for the moves
    of a tiered preset); per layer ``decode_attention`` -> ``_write_tokens_kernel`` (the new token), then
    ``_decode_partial_kernel``, ``_decode_merge_kernel`` (+ ``_decode_score_kernel`` when scores are updated).

    Each node is a launch in TensorRT's AOT calling convention (``export/trt_abi.py``): op type
    ``aot_<wrapper name>`` (``<manifest entry>__<binding hash>``), domain ``diffkv``, attributes
    :func:`aot_node_attrs`; inputs: the distinct tensors its pointer parameters name, in first-use order (the pool's
    four dtype views are one input); outputs: one per input, the same tensor after the launch (aliased in place),
    which the next node reading it takes. Tensors the implementations would allocate themselves are graph tensors:
    zeros made per step by ``ConstantOfShape`` (the decisions, the page manager's scan scratch and claim counters,
    the moves' rows, the new tokens' scores, the attention output, the decode workspace for ``max_batch_size``
    sequences) and the alphas (an ``int64 [2]`` initializer holding the fp64 bits: TensorRT has no fp64); the
    per-layer plan tensors are ``Gather`` slices (and a ``Cast`` of the row ids to int64: the key-offset rows), as in
    the per-operation graph. The manifest's compiled wrappers (``manifest["trt_abi"]``) give the nodes' shared memory.

    Args:
        model, kv_config, path, max_positions: as :func:`export_onnx`.
        manifest: the engine's manifest; its engine must be this model's shape, ``kv_config`` and ``dtype="float32"``
            (the graph's activations).
        target: whose compiled shared memory the nodes carry.

    Raises:
        ValueError: an engine that does not fit the model / configuration / fp32 graph.
        LookupError: a recorded launch without a manifest entry (naming it).
    """
    import onnx
    import onnx_graphsurgeon as gs

    from .aot_graph import record_decode

    engine = _aot_engine(model, kv_config, manifest)
    model = _check_model(model, kv_config)
    infos, plan, layer = record_decode(engine)
    b = _Builder(gs)
    ids, pos, sel = b.token_inputs()
    plan_in, state = b.step_inputs("decode")
    _engine_dims(state, engine)
    b.graph.inputs = [ids, pos, sel, *plan_in.values(), *state.values()]
    one = lambda x: b.op("Shape", [x], {"start": 0, "end": 1})  # noqa: E731 - [1] int64
    g = _AotNodes(b, infos, manifest, plan + layer, target, {"positions": pos, **plan_in, **state},
                  {"n": one(plan_in["step_slots"]), "B": one(pos), "P": one(state["ring"])})
    cur, emit = g.cur, g.emit
    for launch in plan:
        emit(launch)

    def attend(i, q, k, v):
        for name in ("new_scores", "out"):  # fresh per layer (the implementation allocates them per call)
            cur.pop(name, None)
        cur.update(q=q, k=k, v=v)
        index = b.gs.Constant(f"aot.layer{i}", np.array(i, np.int64))
        for name in ("row_ids", "page", "slot"):
            cur[f"layer_{name}"] = b.op("Gather", [cur[name], index], {"axis": 0})
        cur["layer_rows"] = b.op("Cast", [cur["layer_row_ids"]], {"to": onnx.TensorProto.INT64})
        for launch in layer:
            emit(launch)
        out = cur["out"]
        for name in ("q", "k", "v", "layer_row_ids", "layer_page", "layer_slot", "layer_rows"):
            cur.pop(name)
        return out

    logits = _decoder(b, model, ids, pos, sel, max_positions, attend)
    outs = []
    for name in AOT_STATE_OUTPUTS:
        cur[name].name = f"{name}_out"
        outs.append(cur[name])
    b.graph.outputs = [logits, *outs]
    return _finish(b, gs, path, {ENGINE_MAX_SEQ_LEN: engine.max_seq_len})


def export_aot_prefill(model, kv_config: DiffKVConfig, manifest: dict, path: str | Path | None = None, *,
                       max_positions: int | None = None, target: str = "sm_90"):
    """The prefill step with its DiffKV work as standard ONNX operators and one ``diffkv::aot_<wrapper>`` node per
    kernel launch: what ``paged/prefill.py::prefill_layer`` does per layer, with the per-operation prefill graph's
    inputs and outputs (:func:`export_per_op` ``phase="prefill"``: the step plan's tensors as graph inputs; the
    prompts' reservation before and commit after the step stay on the host, as for that graph).

    Per layer: the causal attention of the packed prompts (``MatMul``/``Softmax`` under the mask "same prompt
    (``req``), key position <= query position (``token_index``)"; grouped KV heads expanded), the prompt scores (the
    AOT nodes of ``_prompt_lse_kernel``, ``_prompt_lse_merge_kernel``, ``_prompt_score_kernel``: the engine's
    ``max_seq_len`` variant, ``export/aot_prefill.py``), the key offsets of a centering preset (each prompt's mean key
    per KV head, ``ScatterElements`` + ``ScatterND``), the tiers (importance = score sum / ``score_count`` against
    ``thr_high`` / ``thr_low``, the ``window`` tokens high), the tier counts (``ScatterElements`` add into
    ``tier_counts``), each tier's token index in its row (exclusive ``CumSum`` less the prompt start's), its page (the
    high tier from the left of the row, the low tier from the last reserved page leftwards, ``GatherND`` on the page
    table) and slot, then the AOT nodes of the two ``_write_tokens_kernel`` launches (high, low).

    Args and Raises: as :func:`export_aot`.
    """
    import onnx
    import onnx_graphsurgeon as gs

    from .aot_prefill import record_prefill

    cfg = model.config
    engine = _aot_engine(model, kv_config, manifest)
    model = _check_model(model, kv_config)
    infos, launches = record_prefill(engine)
    scores, writes = launches[:3], launches[3:]
    L, Hq, H, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    fmt, R, cfgkv = engine.page_format, engine.max_pages_per_row, kv_config
    b = _Builder(gs)
    ids, pos, sel = b.token_inputs()
    plan, state = b.step_inputs("prefill")
    _engine_dims(state, engine)
    b.graph.inputs = [ids, pos, sel, *plan.values(), *state.values()]
    given = dict(state)
    I64, I32, F32, F16 = onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    c = lambda name, value, dt=np.int64: b.const(f"pf.{name}.{b.count}", np.array(value, dt))  # noqa: E731
    op = b.op
    one = lambda x: op("Shape", [x], {"start": 0, "end": 1})  # noqa: E731 - [1] int64
    n = op("Sub", [one(plan["cu_seqlens"]), c("one", [1])])
    g = _AotNodes(b, infos, manifest, launches, target,
                  {"kv_pool": state["kv_pool"], "key_offsets": state["key_offsets"], "error_flags": state["error_flags"],
                   "cu_seqlens": plan["cu_seqlens"], "err_idx": plan["err_idx"]},
                  {"n": n, "B": one(ids), "P": one(state["kv_pool"])})
    cur = g.cur
    req, tok = plan["req"], plan["token_index"]
    col_ = lambda x: op("Unsqueeze", [x, c("ax1", [1])])  # noqa: E731 - [T] -> [T, 1]
    same = op("Equal", [col_(req), op("Unsqueeze", [req, c("ax0", [0])])])
    causal = op("LessOrEqual", [op("Unsqueeze", [tok, c("ax0", [0])]), col_(tok)])
    mask = op("And", [same, causal])  # [T query, T key]
    th = op("Concat", [one(ids), c("h", [H])], {"axis": 0})  # [T, H]
    w_pos = op("Reshape", [op("Expand", [col_(tok), th]), c("flat", [-1])])
    cur["w_pos"] = w_pos
    count, thr_h, thr_l = (col_(plan[k]) for k in ("score_count", "thr_high", "thr_low"))
    window = col_(plan["window"])
    start, row_base = plan["start"], col_(plan["row_base"])
    reserved = col_(plan["reserved_pages"])
    starts = op("Slice", [plan["cu_seqlens"], c("s0", [0]), c("s1", [-1])])  # [n] int32: each prompt's first token
    lens = op("Cast", [op("Sub", [op("Slice", [plan["cu_seqlens"], c("s1", [1]), c("big", [2**62])]), starts])],
              {"to": F32})
    tier_counts = state["tier_counts"]
    centered = cfgkv.compress and cfgkv.center_keys
    group = Hq // H

    def attention(q, k, v):
        qh = op("Transpose", [q], {"perm": [1, 0, 2]})  # [Hq, T, D]
        kv = []
        for x in (k, v):
            x = op("Unsqueeze", [op("Transpose", [x], {"perm": [1, 0, 2]}), c("ax1", [1])])  # [H, 1, T, D]
            x = op("Expand", [x, c("grp", [1, group, 1, 1])])
            kv.append(op("Reshape", [x, c("hq", [Hq, -1, D])]))
        s = op("Mul", [op("MatMul", [qh, op("Transpose", [kv[0]], {"perm": [0, 2, 1]})]),
                       c("scale", D ** -0.5, np.float32)])
        s = op("Where", [mask, s, c("ninf", -np.inf, np.float32)])
        o = op("MatMul", [op("Softmax", [s], {"axis": -1}), kv[1]])
        return op("Transpose", [o], {"perm": [1, 0, 2]}, dtype=np.float32, shape=["num_tokens", Hq, D])

    def attend(i, q, k, v):
        nonlocal tier_counts
        out = attention(q, k, v)
        cur.pop("sums", None)  # fresh per layer
        cur.update(q=q, k=k, v=v)
        for launch in scores:
            g.emit(launch)
        sums = cur["sums"]
        rows = op("Add", [row_base, c("heads", i * H + np.arange(H))])  # [T, H] int64
        cur["w_rows"] = op("Reshape", [rows, c("flat", [-1])])
        if centered:  # each prompt's mean key per KV head, into its rows' key offsets
            zeros = op("ConstantOfShape", [op("Concat", [n, c("hd", [H, D])], {"axis": 0})],
                       {"value": gs.Constant(f"pf.z{b.count}", np.zeros(1, np.float32))})
            idx = op("Expand", [op("Unsqueeze", [req, c("ax12", [1, 2])]), op("Shape", [k])])
            mean = op("Div", [op("ScatterElements", [zeros, idx, k], {"axis": 0, "reduction": "add"}),
                              op("Unsqueeze", [lens, c("ax12", [1, 2])])])
            first_rows = op("Gather", [rows, op("Cast", [starts], {"to": I64})], {"axis": 0})  # [n, H]
            cur["key_offsets"] = op("ScatterND", [cur["key_offsets"], op("Unsqueeze", [first_rows, c("ax2", [2])]),
                                                  op("Cast", [mean], {"to": F16})], dtype=np.float16,
                                    shape=list(STATE_INPUTS["key_offsets"][1]))
        if cfgkv.tiered:
            importance = op("Div", [sums, count])
            high = op("Or", [op("Greater", [importance, thr_h]), window])
            low = op("And", [op("Not", [high]), op("GreaterOrEqual", [importance, thr_l])])
        else:
            high = op("ConstantOfShape", [th], {"value": gs.Constant(f"pf.t{b.count}", np.ones(1, np.bool_))})
            low = op("Not", [high])
        for ti, (tier, chosen) in enumerate((("high", high), ("low", low))):
            per_page = fmt.tier(tier).tokens_per_page
            chosen32 = op("Cast", [chosen], {"to": I32})
            zeros = op("ConstantOfShape", [op("Concat", [n, c("hh", [H])], {"axis": 0})],
                       {"value": gs.Constant(f"pf.zi{b.count}", np.zeros(1, np.int32))})
            per_prompt = op("ScatterElements", [zeros, op("Expand", [col_(req), th]), chosen32],
                            {"axis": 0, "reduction": "add"})  # [n, H]
            onehot = np.zeros((1, L, 1, 2), np.int32)
            onehot[0, i, 0, ti] = 1
            tier_counts = op("Add", [tier_counts, op("Mul", [op("Unsqueeze", [per_prompt, c("ax13", [1, 3])]),
                                                             c("onehot", onehot, np.int32)])], dtype=np.int32,
                             shape=list(STATE_INPUTS["tier_counts"][1]))
            chosen64 = op("Cast", [chosen], {"to": I64})
            excl = op("CumSum", [chosen64, c("ax0s", 0)], {"exclusive": 1})
            index = op("Sub", [excl, op("Gather", [excl, start], {"axis": 0})])  # [T, H] tier index in the row
            col = op("Div", [index, c("pp", per_page)])
            if tier == "high":
                col = op("Clip", [col, c("zero", 0), c("rmax", R - 1)])
            else:  # before the commit the low pages are the last reserved ones
                col = op("Max", [op("Sub", [op("Sub", [reserved, c("one1", 1)]), col]), c("zero", 0)])
            at = op("Concat", [op("Unsqueeze", [rows, c("ax2", [2])]), op("Unsqueeze", [col, c("ax2", [2])])],
                    {"axis": 2})
            page = op("Where", [chosen, op("GatherND", [state["page_table"], at]), c("none", -1, np.int32)])
            cur[f"w_page_{tier}"] = op("Reshape", [page, c("flat", [-1])])
            cur[f"w_slot_{tier}"] = op("Reshape", [op("Cast", [op("Mod", [index, c("pp", per_page)])], {"to": I32}),
                                                   c("flat", [-1])])
        for launch in writes:
            g.emit(launch)
        for name in ("q", "k", "v", "w_rows", "w_page_high", "w_page_low", "w_slot_high", "w_slot_low"):
            cur.pop(name)
        return out

    logits = _decoder(b, model, ids, pos, sel, max_positions, attend)
    final = {"kv_pool": cur["kv_pool"], "key_offsets": cur["key_offsets"], "tier_counts": tier_counts,
             "error_flags": cur["error_flags"]}
    outs = []
    for name in PHASE_STATE["prefill"]:
        if name in final:  # the per-op prefill graph's outputs (its plugin updates all four, some in place unchanged)
            t = final[name] if final[name] is not given[name] else op("Identity", [given[name]])
            _typed(t, STATE_INPUTS[name][0], list(given[name].shape))
            t.name = f"{name}_out"
            outs.append(t)
    b.graph.outputs = [logits, *outs]
    return _finish(b, gs, path, {ENGINE_MAX_SEQ_LEN: engine.max_seq_len})


def aot_nodes(proto) -> list:
    """The AOT nodes of an exported model (``NodeProto`` in graph order)."""
    return [n for n in proto.graph.node if n.domain == PLUGIN_NAMESPACE and n.op_type.startswith(AOT_OP_PREFIX)]
