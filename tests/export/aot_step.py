"""One decode step of the AOT decode graph's DiffKV launches, replayed as TensorRT would launch them, against the
plugins' JIT implementations on the same state (shared by ``tests/export/test_aot.py`` on the CPU and
``tests/export/test_aot_graph_gpu.py`` on the GPU).

:func:`run_decode_step`: a ``PagedDiffKVCache`` (fp32, 2 layers, 4 / 2 heads, head_dim 64, 3 slots) prefilled with two
prompts; its state becomes the named tensors of ``export/aot_graph.py::dims_of`` twice. On one copy every recorded
launch of the step (``record_decode``: decide, page update, locate + moves, then per layer write, partial, merge,
score) runs as its TensorRT-convention wrapper (``export/trt_abi.py``: the launch's distinct buffers, the int32 extra
args of ``trt_abi.launch_plan`` from the node attributes ``aot_node_attrs`` gives, the outputs = the inputs again)
through ``launch``; on the other the plugins' implementations run (``aot_graph.decode_calls``: ``trtllm_diffkv/export/plugin_ops.py``
with ``use_triton=True``, what ``@trtp.impl`` runs). Both copies and every layer's output are returned.
"""
from __future__ import annotations

import dataclasses

import torch

from trtllm_diffkv.export import trt_abi
from trtllm_diffkv.export.aot_graph import abi_of, decode_calls, dims_of, eval_dim, record_decode
from trtllm_diffkv.export.fields import EngineShape
from trtllm_diffkv.export.onnx_export import aot_node_attrs
from trtllm_diffkv.config import get_preset

L, H, HKV, D, SLOTS, MAX_SEQ, PAGES = 2, 4, 2, 64, 3, 80, 64
STATE = ("kv_pool", "page_table", "tier_tokens", "row_pages", "slot_state", "ring", "ring_state", "key_offsets",
         "error_flags")
PLAN = ("high_delta", "low_delta", "new_index", "move_from", "move_to", "row_ids", "page", "slot", "decode_positions",
        "err_idx")


def eval_numel(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def preset(name: str):
    """``demote``: the ``diffkv`` preset with recent window 2 and alpha_high 1.5 (tokens move to the low tier)."""
    if name == "demote":
        return dataclasses.replace(get_preset("diffkv"), recent_window_tokens=2, alpha_high=1.5, alpha_low=0.3)
    return get_preset(name)


def engine(kv) -> EngineShape:
    return EngineShape(num_layers=L, num_heads=H, num_kv_heads=HKV, head_dim=D, kv_config=kv, dtype="float32",
                       max_batch_size=SLOTS, max_seq_len=MAX_SEQ)


def run_decode_step(kv, device: str, manifest: dict, launch, target: str = "sm_90"):
    """``(wrappers' tensors, reference tensors, wrappers' outputs, reference outputs, wrappers launched)``.

    ``launch(abi, attrs, inputs, grid, extras)`` runs one wrapper (``abi``: :class:`trt_abi.AbiKernel`, compiled or
    not) on ``inputs`` (its distinct buffers) with ``grid`` and the int32 ``extras``.
    """
    from trtllm_diffkv.export.ort_ops import decode_feeds
    from trtllm_diffkv.kernels import decode_attention as da
    from trtllm_diffkv.engine_config import EngineConfig
    from trtllm_diffkv.paged.cache import PagedDiffKVCache

    shape = engine(kv)
    cache = PagedDiffKVCache(kv, L, H, HKV, D, EngineConfig(max_batch_size=SLOTS, max_seq_len=MAX_SEQ, device=device,
                                                            use_triton=True), num_pages=PAGES)
    g = torch.Generator().manual_seed(1)
    lens = [37, 5]
    cache.plan([0, 2], lens, [0, 0], [True, True])
    for layer in range(L):
        T = sum(lens)
        cache.forward(layer, *(x.to(device) for x in (torch.randn(T, H, D, generator=g) * 2,
                                                        torch.randn(T, HKV, D, generator=g) * 2,
                                                        torch.randn(T, HKV, D, generator=g))))
    cache.end_step()
    n, B, P = 2, 3, PAGES  # two sequences and one padding token
    feeds = decode_feeds(cache, [0, 2], lens)
    feeds["positions"] = torch.tensor(lens + [0], dtype=torch.int64).numpy()
    nparts = da.DecodeWorkspace.allocate(SLOTS, H, HKV, shape.page_format, shape.max_pages_per_row, "meta",
                                         update_scores=kv.compress).num_partitions
    infos = dims_of(shape, nparts)
    assert infos["page_table"].dims[1] == cache.manager.page_table.shape[-1]  # the engine's R is the cache's

    def tensors():
        out = {}
        for name, info in infos.items():
            if info.kind == "layer":
                continue
            dims = [eval_dim(d, n, B, P) for d in info.dims]
            if name in feeds:  # the graph's input (key_offsets of a preset without them: empty, as fed)
                t = torch.from_numpy(feeds[name]).to(device)
                out[name] = (t.reshape(dims) if t.numel() == eval_numel(dims) else t).clone()
            elif info.kind == "const":
                out[name] = torch.tensor(info.value, dtype=getattr(torch, info.dtype), device=device)
            else:
                out[name] = torch.zeros(dims, dtype=getattr(torch, info.dtype), device=device)
        return out

    mine, ref = tensors(), tensors()
    entries = {e["name"]: e for e in manifest["kernels"]}
    compiled = {k["name"]: trt_abi.AbiKernel.from_json(k) for k in manifest.get("trt_abi", [])}
    _, plan, layer_launches = record_decode(shape)
    layer_inputs = [tuple(torch.randn(B, *dims, generator=g).to(device) for dims in ((H, D), (HKV, D), (HKV, D)))
                    for _ in range(L)]
    launched = []

    def replay(launches):
        for rec in launches:
            abi = abi_of(rec, entries[rec.entry], infos)
            abi = compiled.get(abi.name, abi)
            attrs = aot_node_attrs(rec, entries[rec.entry], abi, infos, target)
            inputs = []
            for name in dict.fromkeys(rec.bindings):
                t = mine[name]
                inputs.append(t.view(torch.int64) if t.dtype == torch.float64 else t)  # fp64 as its bits
            grid, extras = trt_abi.launch_plan(attrs, lambda j, axis: int(inputs[j].shape[axis]))
            launch(abi, attrs, inputs, grid, extras)
            launched.append(abi.name)

    def set_layer(T, i):
        T["q"], T["k"], T["v"] = (x.clone() for x in layer_inputs[i])
        T["layer_row_ids"], T["layer_page"], T["layer_slot"] = (T[k][i].clone() for k in ("row_ids", "page", "slot"))
        T["layer_rows"] = T["layer_row_ids"].long()
        T["new_scores"] = torch.zeros_like(T["new_scores"])
        T["out"] = torch.zeros_like(T["out"])

    replay(plan)
    calls = decode_calls(shape, ref, nparts)
    for _, fn in calls[:3]:
        fn()
    outs_mine, outs_ref = [], []
    for i in range(L):
        set_layer(mine, i)
        replay(layer_launches)
        outs_mine.append(mine["out"].clone())
        set_layer(ref, i)
        calls[3][1]()
        outs_ref.append(ref["out"].clone())
    if device == "cuda":
        torch.cuda.synchronize()
    return mine, ref, outs_mine, outs_ref, launched


def check_equal(mine, ref, outs_mine, outs_ref) -> None:
    """Every state and plan tensor and every layer's output: the same bytes."""
    for name in STATE + PLAN:
        a, b = mine[name], ref[name]
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name
    for i, (a, b) in enumerate(zip(outs_mine, outs_ref)):
        assert torch.equal(a, b), f"layer {i} output: max |diff| {float((a - b).abs().max())}"


__all__ = ["run_decode_step", "check_equal", "engine", "preset"]
