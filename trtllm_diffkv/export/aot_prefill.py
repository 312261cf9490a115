"""The prefill step's DiffKV kernel launches bound to named graph tensors (the AOT prefill graph's kernel nodes).

One layer of ``paged/prefill.py::prefill_layer`` is: the scored prefill attention (torch SDPA for the output, then three
Triton kernels for the prompt scores: ``_prompt_lse_kernel``, ``_prompt_lse_merge_kernel``, ``_prompt_score_kernel``),
the prompt tiers (element-wise rules, counts, exclusive prefix sums, page-table lookups) and two
``_write_tokens_kernel`` launches (the high and the low tokens into the reserved pages). The AOT prefill graph
(``onnx_export.export_aot`` with ``phase="prefill"``) makes the output and the tiers of standard ONNX operators and the
five kernels AOT nodes; :func:`record_prefill` records those launches for an engine, as ``aot_graph.record_decode`` does
for the decode step:

* the score kernels are recorded for one prompt of the engine's ``max_seq_len`` (the kernels' constexprs depend on the
  step's longest prompt; one variant serves every step: shorter prompts only leave chunks and padded rows empty), their
  grids and chunk count fixed by ``max_seq_len``; the buffers the launcher allocates itself (chunk partials, lse) are
  named scratch tensors (``pf_part_m``, ``pf_part_l``, ``pf_lse``), and ``cu_seqlens`` (which the launcher copies to the
  device) is the graph input of that name;
* the writes are recorded through ``kernels/quant_write.py::write_tokens`` exactly as ``prefill_layer`` calls it, every
  pointer bound to a named tensor by its storage (:func:`.aot_graph.record_launches`'s rule).

Step sizes: ``n`` = prompts, ``B`` = tokens, ``P`` = pool pages (the graph's ``num_prompts``, ``num_tokens``,
``num_pages``).
"""
from __future__ import annotations

from ..kernels.sizes import next_pow2
from .aot_graph import abi_of
from .fields import EngineShape
from .launches import (Launch, Recorder, TensorInfo, cuda_launch_choices, eval_dim, launch_of, spec_name,
                       spec_of_launch, storage_id)


def dims_of_prefill(shape: EngineShape) -> dict[str, TensorInfo]:
    """The named tensors one prefill layer's launches bind (symbolic dims in ``n``, ``B``, ``P``)."""
    from ..kernels.prefill_attention import LSE_CHUNK_TOKENS

    H, Hq, D = shape.num_kv_heads, shape.num_heads, shape.head_dim
    rows = shape.max_batch_size * shape.num_layers * H
    s_pad = max(16, next_pow2(min(shape.kv_config.prompt_score_window_tokens, shape.max_seq_len)))
    chunks = -(-shape.max_seq_len // LSE_CHUNK_TOKENS)
    th = f"B*{H}"
    return {
        "kv_pool": TensorInfo(("P", shape.page_format.page_size_bytes), "uint8", "input"),
        "key_offsets": TensorInfo((rows, D), "float16", "input"),
        "error_flags": TensorInfo((shape.max_batch_size,), "int32", "input"),
        "cu_seqlens": TensorInfo(("n+1",), "int32", "input"),
        "err_idx": TensorInfo((th,), "int32", "input"),
        "q": TensorInfo(("B", Hq, D), "float32", "layer"), "k": TensorInfo(("B", H, D), "float32", "layer"),
        "v": TensorInfo(("B", H, D), "float32", "layer"),
        "sums": TensorInfo(("B", H), "float32", "scratch"),
        "pf_part_m": TensorInfo(("n", Hq, chunks, s_pad), "float32", "scratch"),
        "pf_part_l": TensorInfo(("n", Hq, chunks, s_pad), "float32", "scratch"),
        "pf_lse": TensorInfo(("n", Hq, s_pad), "float32", "scratch"),
        **{f"w_{x}_{tier}": TensorInfo((th,), "int32", "layer") for x in ("page", "slot") for tier in ("high", "low")},
        "w_rows": TensorInfo((th,), "int64", "layer"), "w_pos": TensorInfo((th,), "int32", "layer"),
    }


_SCORE_BINDINGS = {"q_ptr": "q", "k_ptr": "k", "cu_ptr": "cu_seqlens", "part_m_ptr": "pf_part_m",
                   "part_l_ptr": "pf_part_l", "lse_ptr": "pf_lse", "score_ptr": "sums"}
"""The score kernels' pointer parameters -> named tensors (the launcher copies ``cu_seqlens`` and allocates the
partials itself, so they are bound by parameter name)."""


def record_prefill(shape: EngineShape, n: int = 2, B: int = 9, P: int = 40):
    """``(tensors, launches)``: :func:`dims_of_prefill` and one layer's five launches (lse, merge, score, write high,
    write low) as :class:`~.aot_graph.Launch` es whose names are manifest entries of ``shape``.

    Raises:
        UnboundArgument: a write-kernel pointer no named tensor provides.
    """
    import torch

    from ..kernels import prefill_attention as pa
    from ..kernels import quant_write as qw

    infos = dims_of_prefill(shape)
    cfg, fmt, H, D = shape.kv_config, shape.page_format, shape.num_kv_heads, shape.head_dim
    sym = {"num_seqs": "n", "num_heads": shape.num_heads, "num_kv_heads": H, "max_len": shape.max_seq_len}
    launches = []
    # the score kernels: one prompt of max_seq_len tokens (the variant every step uses)
    Tm = shape.max_seq_len
    meta = lambda *s, dt=torch.float32: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    q, k = meta(Tm, shape.num_heads, D), meta(Tm, H, D)
    fake_f = type("F", (), {"scaled_dot_product_attention": staticmethod(lambda q, k, v, **kw: torch.empty_like(q))})
    saved, pa.F = pa.F, fake_f
    try:
        with Recorder([(pa, "_prompt_lse_kernel"), (pa, "_prompt_lse_merge_kernel"),
                            (pa, "_prompt_score_kernel")]) as rec:
            pa.scored_prefill_attention(q, k, meta(Tm, H, D), torch.tensor([0, Tm], dtype=torch.int32),
                                        sm_scale=D ** -0.5, num_scoring_queries=cfg.prompt_score_window_tokens,
                                        out=torch.empty_like(q), score_sums=meta(Tm, H))
    finally:
        pa.F = saved
    sizes = {"num_seqs": 1, "num_heads": shape.num_heads, "num_kv_heads": H, "max_len": Tm}
    for launch in rec.launches:
        spec = cuda_launch_choices(spec_of_launch(launch, "prefill_scores", sizes))
        spec.name = spec_name(spec)
        pointers = [p for p in spec.params if spec.signature[p].startswith("*")]
        launches.append(Launch("prefill_attention", spec.name, spec, pointers, [_SCORE_BINDINGS[p] for p in pointers],
                               {p: spec.scalars[p] for p in spec.params if p not in pointers}, dict(sym)))
    # the writes, as prefill_layer makes them
    tensors, names = {}, {}
    for name, info in infos.items():
        t = torch.empty([eval_dim(d, n, B, P) for d in info.dims], dtype=getattr(torch, info.dtype), device="meta")
        tensors[name], names[storage_id(t)] = t, name
    T = tensors
    centered = cfg.compress and cfg.center_keys
    with Recorder([(qw, "_write_tokens_kernel")]) as rec:
        for tier in ("high", "low"):
            qw.write_tokens(T["kv_pool"], fmt, tier, T[f"w_page_{tier}"], T[f"w_slot_{tier}"], T["k"].reshape(-1, D),
                            T["v"].reshape(-1, D), key_offsets=T["key_offsets"] if centered else None,
                            offset_rows=T["w_rows"] if centered else None, scores=T["sums"].reshape(-1),
                            positions=T["w_pos"], error_flags=T["error_flags"], error_index=T["err_idx"])
    write_sizes = lambda kernel, node: {"n_rows": f"B*{H}"}  # noqa: E731
    for launch, tier in zip(rec.launches, ("high", "low")):
        w = launch_of("prefill_attention", launch, names, write_sizes, (n, B, P))
        w.spec.op = f"write_{tier}_prompt"
        launches.append(w)
    return infos, launches


def prefill_graph_abi(shape: EngineShape, entries: dict) -> list:
    """The wrappers the AOT prefill graph of ``shape`` launches (``[]`` for an engine whose activations are not fp32,
    the graph's), as ``aot_graph.decode_graph_abi`` for the decode graph."""
    if shape.dtype != "float32":
        return []
    infos, launches = record_prefill(shape)
    return [abi_of(launch, entries[launch.entry], infos) for launch in launches if launch.entry in entries]


__all__ = ["dims_of_prefill", "record_prefill", "prefill_graph_abi"]
