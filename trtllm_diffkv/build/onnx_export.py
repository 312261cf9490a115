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
  ops, and one ``DiffKVAttention`` node: ``(q [T, H, D], k [T, Hkv, D], v, kv_pool, page_table,
  tier_tokens, cache_handle, step_token) -> (out [T, H, D], kv_pool, page_table, tier_tokens)``: scored prefill
  with prompt compaction into the pool for the step's prompts, paged mixed-precision decode
  attention with the score update for its decode tokens. The pool, table and tier counts pass
  from layer to layer and out of the graph (``kv_pool_out``, ...): TensorRT aliases them in place.
* output: ``logits`` float32 ``[num_logits, vocab_size]`` plus the three state outputs.

Plugin nodes: op type = plugin name, domain = ``diffkv`` (the plugin namespace), attributes
``plugin_namespace="diffkv"``, ``plugin_version="1"`` and exactly the plugin's fields (the layer index,
the model shape and the DiffKV configuration, :func:`~.fields.kv_config_to_fields`) - what TensorRT's ONNX
parser turns into plugin fields. The two node types are the composite plugins
:data:`plugins.specs.STEP_PAGE_UPDATE` and :data:`plugins.specs.LAYER_ATTENTION`, which
``plugins/trt_plugins.py`` registers like the per-operation ones. Weights are fp32 initializers (the
ONNX file holds them; > 2 GB is refused).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from plugins import specs

from ..config import DiffKVConfig
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


def export_onnx(model, kv_config: DiffKVConfig, path: str | Path | None = None, *, max_positions: int | None = None):
    """Export ``model`` (``LlamaForCausalLM``) to an ONNX model with DiffKV plugin nodes.

    Args:
        model: the model (any dtype; weights are exported as fp32).
        kv_config: the DiffKV configuration written into every plugin node.
        path: where to save the ``.onnx`` (``None``: only return it).
        max_positions: rows of the RoPE tables (default ``model.config.max_position_embeddings``).

    Returns:
        The ``onnx.ModelProto`` (checked with ``onnx.checker`` and run through shape inference).

    Raises:
        ValueError: a configuration that cannot run the model, or weights beyond 2 GB.
    """
    import onnx
    import onnx_graphsurgeon as gs

    cfg = model.config
    kv_config.validate_for_model(cfg.head_dim, cfg.num_heads, cfg.num_kv_heads)
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    if weight_bytes > MAX_ONNX_BYTES:
        raise ValueError(f"the model's fp32 weights take {weight_bytes:,} bytes; one ONNX file holds < 2 GB")
    b = _Builder(gs)
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    var = lambda name, dtype, shape: gs.Variable(name, dtype=dtype, shape=shape)  # noqa: E731
    ids, pos, sel = var("input_ids", np.int64, ["num_tokens"]), var("positions", np.int64, ["num_tokens"]), \
        var("logits_indices", np.int64, ["num_logits"])
    step = [var(n, np.int64, ["num_requests"]) for n in ("step_slots", "step_seq_lens", "step_positions")]
    step.append(var("step_is_prefill", np.bool_, ["num_requests"]))
    pool = var("kv_pool", np.uint8, ["num_pages", "page_size_bytes"])
    table = var("page_table", np.int32, ["num_rows", "max_pages_per_row"])
    tokens = var("tier_tokens", np.int32, ["num_rows", 2])
    handle = var("cache_handle", np.int64, [1])
    b.graph.inputs = [ids, pos, sel, *step, pool, table, tokens, handle]
    update_attrs = {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION,
                    "num_layers": cfg.num_layers, "num_kv_heads": Hkv, "head_dim": D, **config_attrs(kv_config)}
    step_token, table, tokens = b.op(PAGE_UPDATE_OP, [handle, *step, table, tokens], update_attrs, outputs=3,
                                     domain=PLUGIN_NAMESPACE, name="diffkv_page_update")
    step_token.dtype, step_token.shape = np.int64, [1]
    table.dtype, tokens.dtype = np.int32, np.int32
    table.shape, tokens.shape = ["num_rows", "max_pages_per_row"], ["num_rows", 2]
    n_pos = max_positions or cfg.max_position_embeddings
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(torch.arange(n_pos, device=model.device), torch.float32)
    cos_t = b.op("Unsqueeze", [b.op("Gather", [b.const("rope.cos", _np(cos)), pos]), b.const("axis1", np.array([1]))])
    sin_t = b.op("Unsqueeze", [b.op("Gather", [b.const("rope.sin", _np(sin)), pos]), b.const("axis1_", np.array([1]))])
    x = b.op("Gather", [b.const("model.embed_tokens.weight", _np(model.model.embed_tokens.weight)), ids],
             dtype=np.float32)
    sm_scale = D ** -0.5
    for i, layer in enumerate(model.model.layers):
        p, a = f"model.layers.{i}", layer.self_attn
        h = b.rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps, f"{p}.input_layernorm")
        heads = {}
        for name, n in (("q", H), ("k", Hkv), ("v", Hkv)):
            proj = getattr(a, f"{name}_proj")
            y = b.linear(h, proj.weight, proj.bias, f"{p}.self_attn.{name}_proj")
            y = b.op("Reshape", [y, b.const(f"{p}.{name}_shape", np.array([-1, n, D], np.int64))], dtype=np.float32)
            heads[name] = _rope(b, y, cos_t, sin_t, D, f"{p}.{name}") if name != "v" else y
        out, pool, table, tokens = b.op(
            ATTENTION_OP, [heads["q"], heads["k"], heads["v"], pool, table, tokens, handle, step_token],
            attention_attrs(i, cfg, kv_config, sm_scale), outputs=4, domain=PLUGIN_NAMESPACE,
            name=f"diffkv_attention_{i}")
        out.dtype, out.shape = np.float32, ["num_tokens", H, D]
        pool.dtype, table.dtype, tokens.dtype = np.uint8, np.int32, np.int32
        pool.shape, table.shape, tokens.shape = ["num_pages", "page_size_bytes"], ["num_rows", "max_pages_per_row"], \
            ["num_rows", 2]
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
    for v, name in ((pool, "kv_pool_out"), (table, "page_table_out"), (tokens, "tier_tokens_out")):
        v.name = name
    b.graph.outputs = [logits, pool, table, tokens]
    b.graph.cleanup().toposort()
    proto = gs.export_onnx(b.graph)
    proto.opset_import.append(onnx.helper.make_opsetid(PLUGIN_NAMESPACE, 1))
    proto.producer_name = "trtllm-diffkv"
    onnx.checker.check_model(proto)
    proto = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    if path is not None:
        onnx.save(proto, str(path))
    return proto


def _rope(b: _Builder, x, cos, sin, head_dim: int, name: str):
    """``x * cos + rotate_half(x) * sin`` (rotate-half layout, as ``model/rope.py``)."""
    half = head_dim // 2
    c = lambda tag, v: b.const(f"{name}.{tag}", np.array(v, np.int64))  # noqa: E731
    x1 = b.op("Slice", [x, c("s0", [0]), c("e0", [half]), c("ax0", [-1])])
    x2 = b.op("Slice", [x, c("s1", [half]), c("e1", [head_dim]), c("ax1", [-1])])
    rot = b.op("Concat", [b.op("Neg", [x2]), x1], {"axis": -1})
    return b.op("Add", [b.op("Mul", [x, cos]), b.op("Mul", [rot, sin])], dtype=np.float32)


def plugin_nodes(proto) -> list:
    """The DiffKV plugin nodes of an exported model (``NodeProto`` in graph order)."""
    return [n for n in proto.graph.node if n.domain == PLUGIN_NAMESPACE]
