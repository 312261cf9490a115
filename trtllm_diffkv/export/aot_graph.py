"""The decode step as a sequence of kernel launches bound to named graph tensors (the AOT decode graph's nodes).

:func:`record_decode` runs the decode plugins' own implementations (``trtllm_diffkv/export/plugin_ops.py``: ``run_decode_decide``,
``run_page_update``, ``run_decode_locate``, ``run_decode`` with ``use_triton=True``, i.e. what ``@trtp.impl`` runs) on
``meta`` tensors of an engine's shapes, with the Triton kernels replaced by the launch recorder of
:mod:`.aot` (as :func:`.aot.kernel_specs` records them). Every tensor those implementations would allocate for
themselves (the decisions' outputs, the page manager's scan scratch, the moves, the decode workspace, ...) is
passed in as a named tensor (:data:`TENSORS`, the ``scratch`` arguments of ``trtllm_diffkv/export/plugin_ops.py``), so each pointer
argument of each launch is bound to a named tensor: a graph input, a graph-made scratch buffer, an initializer,
or a per-layer slice. A pointer argument that is not (or is a view at an offset) stops the recording
(:class:`UnboundArgument`).

Each launch becomes a :class:`Launch`: the manifest entry's name (the same ``<kernel>__<hash>`` as
:func:`.aot.kernel_specs` gives for the engine: same recorder, same CUDA launch choices, same specialization), the
tensor bound to every pointer parameter, every runtime scalar (the recorded value, or for the per-call ones an
expression of the sizes, :data:`.launches.STEP_SCALARS`) and the sizes as expressions of the step's sequence count ``n``
(``step_slots``' length), token count ``B`` (``positions``' length: sequences then padding) and pool size ``P``.
"""
from __future__ import annotations

from .fields import EngineShape
from .launches import Launch, Recorder, TensorInfo, eval_dim, launch_of, storage_id
from ..kernels.sizes import next_pow2

SYMBOLS = {"n": "num_seqs", "B": "num_tokens", "P": "num_pages"}
"""Step sizes: decode sequences, tokens (the bucket), pool pages; the ONNX dim names of the graph tensors."""


def dims_of(shape: EngineShape, num_partitions: int) -> dict[str, TensorInfo]:
    """:data:`TENSORS` for ``shape``: every tensor the decode step's launches bind, with symbolic dims."""
    L, H, Hq, D = shape.num_layers, shape.num_kv_heads, shape.num_heads, shape.head_dim
    G, R, S = L * H, shape.max_pages_per_row, shape.max_batch_size
    fmt, cfg = shape.page_format, shape.kv_config
    rows = S * G
    group = Hq // H
    gp, bd = max(16, next_pow2(group)), next_pow2(D)
    pmax = max(fmt.high_tokens_per_page, fmt.low_tokens_per_page)
    Bmax = shape.max_batch_size
    ws_rows = (Bmax, H)
    m = f"n*{G}"
    t = {
        # graph inputs (the per-operation decode graph's)
        "step_slots": TensorInfo(("n",), "int64", "input"), "step_positions": TensorInfo(("n",), "int64", "input"),
        "positions": TensorInfo(("B",), "int64", "input"),
        "kv_pool": TensorInfo(("P", fmt.page_size_bytes), "uint8", "input"),
        "page_table": TensorInfo((rows, R), "int32", "input"), "tier_tokens": TensorInfo((rows, 2), "int32", "input"),
        "row_pages": TensorInfo((rows, 2), "int32", "input"), "slot_state": TensorInfo((S,), "int32", "input"),
        "ring": TensorInfo(("P",), "int32", "input"), "ring_state": TensorInfo((3,), "int64", "input"),
        "key_offsets": TensorInfo((rows, D), "float16", "input"), "error_flags": TensorInfo((S,), "int32", "input"),
        "prompt_len": TensorInfo((S,), "int64", "input"),
        # decode_decide
        "alphas": TensorInfo((2,), "float64", "const", (cfg.alpha_high, cfg.alpha_low)),
        "high_delta": TensorInfo(("n", L, H), "int32", "scratch"), "low_delta": TensorInfo(("n", L, H), "int32", "scratch"),
        "new_index": TensorInfo((m,), "int64", "scratch"), "move_from": TensorInfo((m,), "int64", "scratch"),
        "move_to": TensorInfo((m,), "int64", "scratch"),
        # page_update: TritonPageManager's scratch (claim: all zero between calls)
        "block_sum": TensorInfo((_max_blocks(rows),), "int64", "scratch"),
        "block_flag": TensorInfo((_max_blocks(rows),), "int32", "scratch"),
        "block_off": TensorInfo((_max_blocks(rows),), "int64", "scratch"),
        "ctrl": TensorInfo((8,), "int64", "scratch"), "claim": TensorInfo((S,), "int32", "scratch"),
        # decode_locate
        "rows": TensorInfo((L, "B", H), "int64", "scratch"), "row_ids": TensorInfo((L, "B", H), "int32", "scratch"),
        "page": TensorInfo((L, f"B*{H}"), "int32", "scratch"), "slot": TensorInfo((L, f"B*{H}"), "int32", "scratch"),
        "decode_positions": TensorInfo((f"B*{H}",), "int32", "scratch"),
        "err_idx": TensorInfo((f"B*{H}",), "int32", "scratch"),
        **{f"move_{k}": TensorInfo((m,), "int32", "scratch") for k in ("src_page", "src_slot", "dst_page", "dst_slot")},
        "move_keys": TensorInfo((m, D), "float32", "scratch"), "move_values": TensorInfo((m, D), "float32", "scratch"),
        "move_score": TensorInfo((m,), "float32", "scratch"), "move_pos": TensorInfo((m,), "int32", "scratch"),
        # decode_attention, per layer: the decoder's q/k/v, the plan's per-layer slices, the output
        "q": TensorInfo(("B", Hq, D), "float32", "layer"), "k": TensorInfo(("B", H, D), "float32", "layer"),
        "v": TensorInfo(("B", H, D), "float32", "layer"), "layer_row_ids": TensorInfo(("B", H), "int32", "layer"),
        "layer_rows": TensorInfo(("B", H), "int64", "layer"), "layer_page": TensorInfo((f"B*{H}",), "int32", "layer"),
        "layer_slot": TensorInfo((f"B*{H}",), "int32", "layer"),
        "new_scores": TensorInfo((f"B*{H}",), "float32", "scratch"), "out": TensorInfo(("B", Hq, D), "float32", "scratch"),
        # the decode workspace (DecodeWorkspace for max_batch_size sequences, shared by the layers)
        "ws_part_m": TensorInfo((*ws_rows, num_partitions, 2, gp), "float32", "scratch"),
        "ws_part_l": TensorInfo((*ws_rows, num_partitions, 2, gp), "float32", "scratch"),
        "ws_part_acc": TensorInfo((*ws_rows, num_partitions, 2, gp, bd), "float32", "scratch"),
        "ws_page_probs": TensorInfo((*ws_rows, R, group, pmax) if cfg.tiered else (1,), "float16", "scratch"),
        "ws_page_max": TensorInfo((*ws_rows, R, group) if cfg.tiered else (1,), "float32", "scratch"),
        "ws_lse": TensorInfo((*ws_rows, gp), "float32", "scratch"),
    }
    return t



def _max_blocks(rows: int) -> int:
    from ..memory.triton_page_manager import DECODE_BLOCK, ROW_BLOCK

    return -(-rows // min(ROW_BLOCK, DECODE_BLOCK))


def record_decode(shape: EngineShape, n: int | None = None, B: int | None = None, P: int = 40):
    """Record the decode step's launches for ``shape`` (``n`` sequences, ``B`` tokens, ``P`` pool pages: these only
    set the recorded grids and scalars; the sizes are kept as expressions). Returns ``(tensors, plan, layer)``:
    :func:`dims_of`'s tensors, the plan's launches (decide, page update, locate, moves) and one layer's launches
    (write the new token, decode partial / merge / score), the latter bound to the per-layer names.

    Raises:
        UnboundArgument: a pointer argument no named tensor provides.
        ValueError: a step that needs the page manager's separate scan launch (more block sums than one chunk).
    """
    import torch

    from ..kernels import decision_kernel as dk
    from ..kernels import decode_attention as da
    from ..kernels import quant_write as qw
    from ..memory import triton_page_manager as tpm

    B = B or shape.max_batch_size
    n = n or max(1, B - 1)
    H, G = shape.num_kv_heads, shape.num_layers * shape.num_kv_heads
    if -(-shape.max_batch_size * G // tpm.DECODE_BLOCK) > tpm.SCAN_CHUNK:
        raise ValueError(f"{shape.max_batch_size} sequences x {G} rows need the page manager's separate scan launch, "
                         "which the AOT decode graph does not have")
    ws = da.DecodeWorkspace.allocate(shape.max_batch_size, shape.num_heads, H, shape.page_format,
                                     shape.max_pages_per_row, "meta", update_scores=shape.kv_config.tiered)
    infos = dims_of(shape, ws.num_partitions)
    tensors, names = {}, {}
    for name, info in infos.items():
        t = torch.empty([eval_dim(d, n, B, P) for d in info.dims], dtype=getattr(torch, info.dtype), device="meta")
        tensors[name], names[storage_id(t)] = t, name
    T = tensors
    targets = [(dk, "_decide_kernel"), (dk, "_locate_kernel"), (qw, "_write_tokens_kernel"),
               (qw, "_read_tokens_kernel"), (tpm, "_count_kernel"), (tpm, "_scan_kernel"),
               (tpm, "_decode_apply_kernel"), (da, "_decode_partial_kernel"), (da, "_decode_merge_kernel"),
               (da, "_decode_score_kernel")]
    recorded = []
    for node, fn in decode_calls(shape, T, ws.num_partitions):
        with Recorder(targets) as rec:
            fn()
        recorded.extend((node, launch) for launch in rec.launches)
    n_plan = sum(node != "decode_attention" for node, _ in recorded)
    sizes_of = _sizes(shape, ws.num_partitions)
    launches = [launch_of(node, launch, names, sizes_of, (n, B, P)) for node, launch in recorded]
    return infos, launches[:n_plan], launches[n_plan:]


def decode_calls(shape: EngineShape, T: dict, num_partitions: int):
    """The decode step's plugin implementations (``trtllm_diffkv/export/plugin_ops.py`` with ``use_triton=True``, what ``@trtp.impl``
    runs) on the named tensors ``T`` (:func:`dims_of`'s names; ``q``/``k``/``v``, ``out``, ``new_scores`` and the
    ``layer_*`` slices are one layer's), as ``[(node, call)]`` in order: ``decode_decide``, ``page_update``,
    ``decode_locate``, then one layer's ``decode_attention``. :func:`record_decode` records their launches on ``meta``
    tensors; the GPU test runs them on real ones (the JIT reference of the AOT graph's launches)."""
    from trtllm_diffkv.export import plugin_ops as ops

    from ..kernels import decode_attention as da

    cfg = shape.kv_config
    attrs = {"num_layers": shape.num_layers, "num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads,
             "head_dim": shape.head_dim, "sm_scale": shape.head_dim ** -0.5, "layer_idx": 0}
    dec = [T[k] for k in ("high_delta", "low_delta", "new_index", "move_from", "move_to")]
    moves = tuple(T[f"move_{k}"] for k in ("src_page", "src_slot", "dst_page", "dst_slot"))
    workspace = da.DecodeWorkspace(num_partitions, T["ws_part_m"], T["ws_part_l"], T["ws_part_acc"],
                                   T["ws_page_probs"], T["ws_page_max"], T["ws_lse"])
    return [
        ("decode_decide", lambda: ops.run_decode_decide(
            [T["step_slots"], T["step_positions"], T["kv_pool"], T["page_table"], T["tier_tokens"], T["prompt_len"]],
            dec, cfg, attrs, alphas=T["alphas"])),
        ("page_update", lambda: ops.run_page_update(
            [T["step_slots"], T["high_delta"], T["low_delta"], T["page_table"], T["tier_tokens"], T["row_pages"],
             T["slot_state"], T["ring"], T["ring_state"]], cfg, attrs,
            scratch={k: T[k] for k in ("block_sum", "block_flag", "block_off", "ctrl", "claim")})),
        ("decode_locate", lambda: ops.run_decode_locate(
            [T["step_slots"], T["step_positions"], T["positions"], T["new_index"], T["move_from"], T["move_to"],
             T["page_table"], T["kv_pool"]],
            [T["kv_pool"], T["row_ids"], T["page"], T["slot"], T["decode_positions"], T["err_idx"]], cfg, attrs,
            use_triton=True, scratch=dict(rows=T["rows"], moves=moves, keys=T["move_keys"], values=T["move_values"],
                                          score=T["move_score"], pos=T["move_pos"]))),
        ("decode_attention", lambda: ops.run_decode(
            [T["q"], T["k"], T["v"], T["layer_row_ids"], T["layer_page"], T["layer_slot"], T["decode_positions"],
             T["err_idx"], T["kv_pool"], T["page_table"], T["tier_tokens"], T["key_offsets"], T["error_flags"]],
            T["out"], cfg, attrs, use_triton=True,
            scratch=dict(rows=T["layer_rows"], scores=T["new_scores"], workspace=workspace))),
    ]


def _sizes(shape: EngineShape, num_partitions: int):
    """``(kernel, node) -> {size name: expression of n, B, P | int}`` (the sizes :data:`.launches.GRIDS` and
    :data:`.launches.STEP_SCALARS` use)."""
    L, H = shape.num_layers, shape.num_kv_heads
    G = L * H

    def sizes(kernel: str, node: str) -> dict:
        if kernel in ("_write_tokens_kernel", "_read_tokens_kernel"):
            return {"n_rows": f"n*{G}" if node == "decode_locate" else f"B*{H}"}
        if kernel.startswith("_decode_") and node == "decode_attention":
            return {"num_seqs": "B", "num_kv_heads": H, "num_partitions": num_partitions,
                    "R": shape.max_pages_per_row}
        if kernel == "_decide_kernel":
            return {"num_seqs": "n", "rows_per_slot": G}
        if kernel == "_locate_kernel":
            return {"num_seqs": "n", "bucket": "B", "rows_per_slot": G}
        if kernel == "_count_kernel":
            return {"num_slots": "n", "rows_per_slot": G}
        return {"num_slots": "n", "rows_per_slot": G, "num_pages": "P"}
    return sizes



def abi_of(launch: Launch, entry: dict, infos: dict):
    """The TensorRT-convention wrapper (:class:`.trt_abi.AbiKernel`) of a recorded launch: its inputs are the distinct
    named tensors it binds, in first-use order (``float64`` carried as ``int64``)."""
    from . import trt_abi

    return trt_abi.from_bindings(entry, launch.pointers, launch.bindings, {b: infos[b].dtype for b in launch.bindings})


def decode_graph_abi(shape: EngineShape, entries: dict) -> list:
    """The wrappers the AOT decode graph of ``shape`` launches (``[]`` when the graph cannot be recorded for it:
    :func:`record_decode`'s ``ValueError``, or an engine whose activations are not fp32, the graph's)."""
    if shape.dtype != "float32":
        return []
    try:
        infos, plan, layer = record_decode(shape)
    except ValueError:
        return []
    return [abi_of(launch, entries[launch.entry], infos) for launch in plan + layer if launch.entry in entries]
