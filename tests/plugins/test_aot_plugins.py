"""The plugins' plain-Python parts (trtllm_diffkv/export/plugin_specs.py), tested without TensorRT: shape/dtype inference
against what the paged cache's operations really produce, aliasing of the state, plugin-field
serialization, and the manifest lookup the AOT plugins use."""
import numpy as np
import pytest
import torch

from trtllm_diffkv.export import plugin_specs as specs
from trtllm_diffkv.export import aot
from trtllm_diffkv.export.fields import EngineShape, kv_config_to_fields
from trtllm_diffkv.config import get_preset
from trtllm_diffkv.memory import PageFormat


def _dt(t):
    return str(t.dtype).removeprefix("torch.")


def _cache(kv, L=2, H=4, Hkv=2, D=64):
    from trtllm_diffkv.engine_config import EngineConfig
    from trtllm_diffkv.paged.cache import PagedDiffKVCache

    return PagedDiffKVCache(kv, L, H, Hkv, D, EngineConfig(max_batch_size=3, max_seq_len=80, use_triton=False,
                                                           page_manager="cpu"), num_pages=64)


@pytest.mark.parametrize("preset", ["diffkv", "llama3-8b"])
def test_plugin_ops_compute_what_the_paged_cache_computes(preset, monkeypatch):
    """ops.run_prefill / run_decode on the step's tensors (the plugin inputs) == PagedDiffKVCache.forward,
    bit for bit (pool, key offsets, tier counts, outputs); inferred output shapes/dtypes == the real ones.
    The cache writes each layer in its call here, as the plugin does (groups of layers equal that:
    tests/paged/test_chunked_prefill_cache.py)."""
    from trtllm_diffkv.paged import prefill
    from trtllm_diffkv.export import plugin_ops as ops

    monkeypatch.setattr(prefill, "WRITE_GROUP_BYTES", 0)
    kv = get_preset(preset)
    cache = _cache(kv)
    L, H, Hkv, D = 2, 4, 2, 64
    attrs = {"layer_idx": 0, "num_layers": L, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D,
             "sm_scale": cache.sm_scale}
    g = torch.Generator().manual_seed(0)
    lens = [37, 5]
    cache.plan([0, 2], lens, [0, 0], [True, True])
    T = sum(lens)
    qkv = [(torch.randn(T, H, D, generator=g) * 2, torch.randn(T, Hkv, D, generator=g) * 2,
            torch.randn(T, Hkv, D, generator=g)) for _ in range(L)]
    p = cache.planned_step.prefill
    state = [cache.pool.pages(), cache.manager.page_table, cache.manager.tokens, cache.row_meta.key_offsets,
             p.counts, cache.error_flags]
    clones = [t.clone() for t in state]
    inputs = [*qkv[0], p.cu, p.req, p.t, p.count, p.thr_h, p.thr_l, p.window, p.start,
              p.row_base, p.reserved, p.err_idx, *clones[:3], clones[3], clones[4], clones[5]]
    inferred = specs.infer(specs.PREFILL, [tuple(t.shape) for t in inputs], [_dt(t) for t in inputs])
    out = torch.empty_like(qkv[0][0])
    ops.run_prefill(inputs, out, kv, attrs, use_triton=False)
    ref = cache.forward(0, *qkv[0]).clone()
    assert inferred[0] == (tuple(ref.shape), _dt(ref)) and torch.equal(out, ref)
    for a, b in zip(state, clones):
        assert torch.equal(a, b)
    cache.forward(1, *qkv[1])
    cache.end_step()
    # one decode step: the plan's tensors for layer 0 are the decode plugin's inputs
    cache.plan([0, 2], [n + 1 for n in lens], lens, [False, False])
    d = cache.planned_step.decode
    q, k, v = torch.randn(2, H, D, generator=g), torch.randn(2, Hkv, D, generator=g), torch.randn(2, Hkv, D, generator=g)
    state = [cache.pool.pages(), cache.manager.page_table, cache.manager.tokens, cache.row_meta.key_offsets,
             cache.error_flags]
    clones = [t.clone() for t in state]
    inputs = [q, k, v, d.row_ids[0], d.page[0].reshape(-1), d.slot[0].reshape(-1), d.positions,
              d.err_idx, *clones]
    inferred = specs.infer(specs.DECODE, [tuple(t.shape) for t in inputs], [_dt(t) for t in inputs])
    out = torch.empty_like(q)
    ops.run_decode(inputs, out, kv, attrs, use_triton=False)
    ref = cache.forward(0, q, k, v).clone()
    assert inferred[0] == (tuple(ref.shape), _dt(ref)) and inferred[1] == (tuple(clones[0].shape), "uint8")
    assert torch.equal(out, ref)
    for a, b in zip(state, clones):
        assert torch.equal(a, b)  # the new token and every token's updated score, in place


def test_page_update_op_is_append_decode():
    """ops.run_page_update on the manager's state tensors == TritonPageManager.append_decode (interpreter)."""
    from trtllm_diffkv.export import plugin_ops as ops
    from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4
    from trtllm_diffkv.memory.triton_page_manager import TritonPageManager

    patch_interpreter_for_numpy_2_4()
    kv = get_preset("diffkv")
    fmt = PageFormat.for_config(kv, 64)
    L, Hkv = 2, 2
    mgr = TritonPageManager(fmt, 40, 3, L, Hkv, 80, device="cpu")
    slots = torch.tensor([0, 2])
    mgr.reserve_prompt(slots, torch.tensor([40, 7]))
    mgr.commit_prompt(slots, torch.full((2, L, Hkv), 30, dtype=torch.int32), torch.full((2, L, Hkv), 6, dtype=torch.int32))
    state = [mgr.page_table, mgr.tokens, mgr.pages, mgr.slot_state, mgr.ring, mgr.ring_state]
    clones = [t.clone() for t in state]
    dh = torch.tensor([[[1, 1], [1, 0]], [[1, 1], [0, 1]]], dtype=torch.int32)
    dl = 1 - dh
    ops.run_page_update([slots, dh, dl, *clones], kv, {"head_dim": 64, "num_layers": L, "num_kv_heads": Hkv})
    mgr.append_decode(slots, dh, dl)
    for a, b in zip(state, clones):
        assert torch.equal(a, b)
    assert int(mgr.tokens.sum()) == 2 * L * Hkv * 37  # one token more per row


@pytest.mark.parametrize("plugin", list(specs.PLUGINS.values()), ids=lambda p: p.name)
def test_state_outputs_alias_inputs_of_the_same_name(plugin):
    for j, i in plugin.aliases.items():
        assert plugin.outputs[j] == plugin.inputs[i].name
    assert plugin.full_name.startswith("diffkv::")


def test_bad_inputs_named():
    state = [(3, 9), (6, 5), (6, 2), (6, 64), (4,)]
    state_dt = ["uint8", "int32", "int32", "float16", "int32"]
    with pytest.raises(ValueError, match="input q is int32"):
        specs.infer(specs.DECODE, [(4, 8, 64), (4, 2, 64), (4, 2, 64), (4, 2)] + [(8,)] * 4 + state,
                    ["int32"] + ["float16"] * 2 + ["int32"] * 5 + state_dt)
    with pytest.raises(ValueError, match="disagree"):
        specs.infer(specs.DECODE, [(4, 8, 64), (4, 3, 64), (4, 3, 64), (4, 3)] + [(12,)] * 4 + state,
                    ["float16"] * 3 + ["int32"] * 5 + state_dt)
    with pytest.raises(ValueError, match="12 inputs, expected 13"):
        specs.infer(specs.DECODE, [(4, 8, 64)] * 12, ["float16"] * 12)


@pytest.mark.parametrize("preset", ["diffkv", "llama3-8b", "fp16"])
def test_plugin_fields_round_trip_exactly(preset):
    fields = {"layer_idx": 3, "num_heads": 32, "sm_scale": 128 ** -0.5, **kv_config_to_fields(get_preset(preset))}
    items = specs.to_plugin_fields(fields)
    assert all(isinstance(a, np.ndarray) for _, a, _ in items)
    back = specs.from_plugin_fields(items)
    assert back == fields and back["alpha_low"] == get_preset(preset).alpha_low  # float64, not rounded to fp32


def test_select_kernel_picks_the_prefill_variant_for_the_longest_prompt():
    shape = EngineShape(num_layers=1, num_heads=8, num_kv_heads=2, head_dim=64, kv_config=get_preset("diffkv"),
                        max_batch_size=2, max_seq_len=600)
    manifest = {"kernels": [s.to_json() for s in aot.kernel_specs(shape, ("prefill", "write"))]}
    assert specs.select_kernel(manifest, "_prompt_lse_kernel", {"max_len": 20})["constexprs"]["LSE_STRIDE"] == 32
    merge = specs.select_kernel(manifest, "_prompt_lse_merge_kernel", {"max_len": 513})
    assert merge["constexprs"]["BLOCK_C"] == 4  # ceil(513 / 256) = 3 chunks, padded to 4
    assert specs.select_kernel(manifest, "_write_tokens_kernel", {}, op="write_low_move")["signature"]["k_ptr"] == "*fp32"
    with pytest.raises(LookupError):
        specs.select_kernel(manifest, "_write_tokens_kernel", {})  # three write variants: op must be given


def _import_trt_plugins(monkeypatch, trtp):
    """plugins/trt_plugins.py imported against the stand-in module ``trtp`` (then forgotten again)."""
    import importlib
    import sys
    import types

    tensorrt = types.ModuleType("tensorrt")
    tensorrt.plugin = trtp
    tensorrt.int32, tensorrt.int64 = "trt.int32", "trt.int64"
    monkeypatch.setitem(sys.modules, "tensorrt", tensorrt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.delitem(sys.modules, "trtllm_diffkv_plugins.trt_plugins", raising=False)
    try:
        return importlib.import_module("trtllm_diffkv_plugins.trt_plugins")
    finally:  # do not leave the module imported against the stand-in
        sys.modules.pop("trtllm_diffkv_plugins.trt_plugins", None)
        import trtllm_diffkv_plugins as plugins

        plugins.__dict__.pop("trt_plugins", None)


def test_trt_plugins_registers_every_spec_with_its_inputs_and_fields(monkeypatch):
    """plugins/trt_plugins.py imported against a stand-in for ``tensorrt.plugin`` that enforces TensorRT's own
    validation and calling convention (``tests/plugins/trtp_standin.py``; TensorRT cannot be installed here): it registers
    descriptor and impl for exactly the plugins of specs.PLUGINS (the exported graph's composite nodes included), each
    with the spec's inputs in order, its fields as attributes and its output count, and the descriptor's outputs alias
    the inputs specs states; impl takes TensorRT's positional call (tensors, attribute values, outputs) and hands the
    ops the attributes by name."""
    import inspect

    import trtp_standin

    trtp, plugins_ = trtp_standin.module()
    mod = _import_trt_plugins(monkeypatch, trtp)
    Desc = trtp_standin.TensorDesc
    assert mod.split_call(("t0", "t1", 3, "x", ("o",), 0), 2, ["a", "b"]) == (["t0", "t1"], {"a": 3, "b": "x"}, ("o",))
    registered = {name: p.desc for name, p in plugins_.items()}
    impls = {name: p.impl for name, p in plugins_.items() if p.impl is not None}
    assert set(registered) == set(impls) == set(specs.PLUGINS)
    assert {"diffkv::DiffKVAttention", "diffkv::DiffKVPageUpdate", "diffkv::decode_decide",
            "diffkv::decode_locate"} <= set(registered)
    for name, plugin in specs.PLUGINS.items():
        params = inspect.signature(registered[name]).parameters
        inputs = [p for p in params.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        assert [p.name for p in inputs] == [t.name for t in plugin.inputs], name
        assert {p.name: p.annotation for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY} == \
            plugin.fields, name
        assert plugins_[name].num_outputs == len(plugin.outputs), name
        fields = {"num_layers": 3, "num_kv_heads": 2}
        descs = [Desc((7 + i, 3, 5, 2), i) for i in range(len(plugin.inputs))]
        outs = registered[name](*descs, **fields)
        inferred = specs.infer(plugin, [d.shape_expr[:t.rank] for d, t in zip(descs, plugin.inputs)],
                               [t.dtypes[0] for t in plugin.inputs], fields) if plugin.new_outputs else None
        assert outs == tuple(("aliased", plugin.aliases[j]) if j in plugin.aliases else
                             ("new", inferred[j][0], f"trt.{inferred[j][1]}") if j in plugin.new_outputs else
                             ("like", 0) for j in range(len(plugin.outputs))), name


def prompted_cache(preset: str):
    """(kv config, a cache after one prompted step of two sequences (lens 37 and 5; 2 layers, 4 / 2 heads, head_dim
    64), the lens). ``demote``: the ``diffkv`` preset with recent window 2, alpha_high 1.5, alpha_low 0.3 (moves tokens
    to the low tier on the next decode step)."""
    import dataclasses

    kv = dataclasses.replace(get_preset("diffkv"), recent_window_tokens=2, alpha_high=1.5, alpha_low=0.3) \
        if preset == "demote" else get_preset(preset)
    cache = _cache(kv)
    L, H, Hkv, D = 2, 4, 2, 64
    g = torch.Generator().manual_seed(1)
    lens = [37, 5]
    cache.plan([0, 2], lens, [0, 0], [True, True])
    for layer in range(L):
        T = sum(lens)
        cache.forward(layer, torch.randn(T, H, D, generator=g) * 2, torch.randn(T, Hkv, D, generator=g) * 2,
                      torch.randn(T, Hkv, D, generator=g))
    cache.end_step()
    return kv, cache, lens


@pytest.mark.parametrize("preset", ["demote", "fp16"])
def test_decode_plan_ops_compute_what_plan_computes(preset):
    """ops.run_decode_decide -> run_page_update -> run_decode_locate (the decode graph's plan nodes; the Triton
    kernels under the interpreter, the moves on the torch ops path) on copies of a cache's state == the cache's own
    decode plan (``PagedDiffKVCache.plan``: torch decisions, CpuPageManager, moves), bit for bit: the pool (moves to
    the low tier), the whole page-manager state, and the decode_attention nodes' plan tensors. ``demote`` (recent
    window 2, alpha_high 1.5) moves tokens in this step."""
    from trtllm_diffkv.export import plugin_ops as ops
    from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4

    patch_interpreter_for_numpy_2_4()
    kv, cache, lens = prompted_cache(preset)
    L, Hkv, D = 2, 2, 64
    man = cache.manager
    slots, positions, tokens_pos = torch.tensor([0, 2]), torch.tensor(lens), torch.tensor(lens + [0])  # + 1 padding
    state = dict(pool=cache.pool.pages().clone(), table=man.page_table.clone(), tokens=man.tokens.clone(),
                 pages=man.pages.clone(), slot_state=man.slot_state.clone(), ring=man.ring.clone(),
                 ring_state=torch.tensor(man.snapshot_counters(), dtype=torch.int64))
    attrs = {"num_layers": L, "num_kv_heads": Hkv, "head_dim": D}
    n, G, B = 2, L * Hkv, 3
    decided = [torch.zeros(n, L, Hkv, dtype=torch.int32), torch.zeros(n, L, Hkv, dtype=torch.int32),
               *(torch.zeros(n * G, dtype=torch.int64) for _ in range(3))]
    ops.run_decode_decide([slots, positions, state["pool"], state["table"], state["tokens"], cache.prompt_len_device],
                          decided, kv, attrs)
    ops.run_page_update([slots, decided[0], decided[1], state["table"], state["tokens"], state["pages"],
                         state["slot_state"], state["ring"], state["ring_state"]], kv, attrs)
    located = [state["pool"], torch.zeros(L, B, Hkv, dtype=torch.int32), torch.zeros(L, B * Hkv, dtype=torch.int32),
               torch.zeros(L, B * Hkv, dtype=torch.int32), torch.zeros(B * Hkv, dtype=torch.int32),
               torch.zeros(B * Hkv, dtype=torch.int32)]
    ops.run_decode_locate([slots, positions, tokens_pos, *decided[2:], state["table"], state["pool"]], located, kv,
                          attrs, use_triton=False)
    cache.plan([0, 2], [n + 1 for n in lens], lens, [False, False], pad_to=B)
    d = cache.planned_step.decode
    assert torch.equal(state["pool"], cache.pool.pages())
    for name, ref in (("table", man.page_table), ("tokens", man.tokens), ("pages", man.pages),
                      ("slot_state", man.slot_state), ("ring", man.ring)):
        assert torch.equal(state[name], ref), name
    assert state["ring_state"].tolist() == list(man.snapshot_counters())
    assert torch.equal(located[1], d.row_ids) and torch.equal(located[2], d.page.reshape(L, -1))
    assert torch.equal(located[3], d.slot.reshape(L, -1))
    assert torch.equal(located[4], d.positions) and torch.equal(located[5], d.err_idx)
    if preset == "demote":
        assert int((decided[3] >= 0).sum()) > 0  # moves to the low tier in this step


def test_register_aot_plugins_returns_the_wrappers_launch(monkeypatch, tmp_path):
    """plugins/trt_plugins.py's ``register_aot_plugins`` against the stand-in for ``tensorrt.plugin`` that enforces
    TensorRT's validation and calling convention (``tests/plugins/trtp_standin.py``: its ``cdiv`` refuses two ints; dims are
    ints here; TensorRT cannot be installed): one ``diffkv::aot_<wrapper>`` per wrapper of the
    manifest, its inputs and the AOT graph's node attributes as fields, every output aliased; registering the same
    manifest again is a no-op and another PTX under a registered name is refused (TensorRT refuses a second definition);
    for every node of the AOT prefill and decode graphs its ``aot_impl`` returns the compiled wrapper's name and PTX, ``num_warps * 32`` threads, the
    compiled shared memory, and the grid and int32 extra args ``trt_abi.launch_plan`` gives for the node's input dims
    (the launch onnxruntime's ops make)."""
    import json

    import onnx

    from conftest import tiny_llama
    from trtllm_diffkv.export import onnx_export, trt_abi
    from trtllm_diffkv.export.aot_graph import decode_graph_abi
    from trtllm_diffkv.export.aot_prefill import prefill_graph_abi

    model, kv = tiny_llama(), get_preset("diffkv")
    c = model.config
    shape = EngineShape(num_layers=c.num_layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                        head_dim=c.head_dim, kv_config=kv, dtype="float32", max_batch_size=4, max_seq_len=64)
    entries = [s.to_json() for s in aot.kernel_specs(shape)]
    by_name = {e["name"]: e for e in entries}
    wrappers = {k.name: k for k in [*prefill_graph_abi(shape, by_name), *decode_graph_abi(shape, by_name)]}
    for j, k in enumerate(wrappers.values()):  # stand-in compiled entries (the PTX's text is not read by TensorRT here)
        (tmp_path / f"w{j}.ptx").write_text(f"// ptx of {k.function}")
        k.compiled["sm_90"] = dict(kernel_name=k.function, ptx=f"w{j}.ptx", num_warps=4 + j % 2, shared_bytes=64 * j)
    manifest = {"engine": shape.to_fields(), "kernels": entries, "trt_abi": [k.to_json() for k in wrappers.values()]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))

    import trtp_standin

    trtp, plugins_ = trtp_standin.module()
    trt_plugins = _import_trt_plugins(monkeypatch, trtp)
    names = trt_plugins.register_aot_plugins(tmp_path / "manifest.json", "sm_90")
    registered = {n: p.desc for n, p in plugins_.items()}
    aot_impls = {n: p.aot_impl for n, p in plugins_.items() if p.aot_impl is not None}
    assert names == [f"diffkv::aot_{n}" for n in wrappers] and set(aot_impls) == set(names)
    nodes = [n for ph in ("prefill", "decode") for n in onnx_export.aot_nodes(onnx_export.export_onnx(
        model, kv, max_positions=64, graph="aot", phase=ph, manifest=manifest))]
    assert {f"diffkv::{n.op_type}" for n in nodes} == set(names)
    assert trt_plugins.register_aot_plugins(tmp_path / "manifest.json", "sm_90") == names  # again: skipped
    (tmp_path / "w0.ptx").write_text("// another build")
    with pytest.raises(ValueError, match="already registered with another PTX"):
        trt_plugins.register_aot_plugins(tmp_path / "manifest.json", "sm_90")
    for node in nodes:
        name = f"diffkv::{node.op_type}"
        abi = wrappers[node.op_type.removeprefix("aot_")]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()
                 if k not in ("plugin_namespace", "plugin_version")}
        assert plugins_[name].attrs == list(onnx_export.AOT_ATTRS) == list(attrs)
        assert plugins_[name].num_outputs == len(plugins_[name].tensors) == len(node.input)
        dims = json.loads(attrs["dims"])
        step = dict(n=3, B=4, P=97)
        shapes = [[7] * 3 for _ in node.input]  # the dims a node reads its step sizes from, the rest arbitrary
        for sym, (j, axis, div) in dims.items():
            shapes[j][axis] = step[sym] * div
        descs = [trtp_standin.TensorDesc(s, j) for j, s in enumerate(shapes)]
        assert registered[name](*descs, **attrs) == tuple(("aliased", j) for j in range(len(descs)))
        kernel_name, ptx, launch, extras = plugins_[name].call_aot_impl(descs, attrs, tuple(descs))
        c = abi.compiled["sm_90"]
        grid, want = trt_abi.launch_plan(attrs, lambda j, axis: shapes[j][axis])
        assert (kernel_name, ptx) == (abi.function, f"// ptx of {abi.function}")
        assert (launch.grid_x, launch.grid_y, launch.grid_z) == grid and launch.block_x == 32 * c["num_warps"]
        assert launch.shared_mem == c["shared_bytes"] and extras == tuple(("i32", e) for e in want)
