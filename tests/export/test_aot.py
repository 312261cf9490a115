"""Ahead-of-time kernels: every specialization an engine needs compiles for sm_80 and sm_90 on this CPU
machine, and the manifest agrees with the kernels' real signatures and the launchers' grids.

The compilation runs once per session in a child process without ``TRITON_INTERPRET``
(:func:`trtllm_diffkv.export.aot.build_kernels`); the in-process checks use the launch recorder only
(no kernel runs).
"""
import hashlib
import json
import re

import pytest

pytest.importorskip("triton")

from trtllm_diffkv.export import aot, launches  # noqa: E402
from trtllm_diffkv.export.fields import EngineShape, kv_config_from_fields, kv_config_to_fields  # noqa: E402
from trtllm_diffkv.config import PRESETS, get_preset  # noqa: E402

TINY = EngineShape(num_layers=3, num_heads=8, num_kv_heads=2, head_dim=64, kv_config=get_preset("diffkv"),
                   dtype="float16", max_batch_size=2, max_seq_len=128)


@pytest.fixture(scope="session")
def aot_dir(tmp_path_factory):
    """The tiny engine's kernels compiled for sm_80 and sm_90 (once per test session)."""
    out = tmp_path_factory.mktemp("aot")
    try:
        aot.build_kernels(TINY, out, targets=(80, 90))
    except RuntimeError as exc:
        if "ptxas" in str(exc).lower():
            pytest.skip(f"cannot assemble here: {exc}")
        raise
    return out


def _manifest(aot_dir):
    return json.loads((aot_dir / "manifest.json").read_text())


def test_every_family_compiles_for_both_targets(aot_dir):
    m = _manifest(aot_dir)
    assert m["targets"] == ["sm_80", "sm_90"]
    assert EngineShape.from_fields(m["engine"]) == TINY
    ops = {k["op"] for k in m["kernels"]}
    assert ops == {"write_high", "write_low_prompt", "write_low_move", "read_high_move", "decode_attention",
                   "prefill_scores", "page_manager", "decode_plan", "write_high_cache", "write_low_prompt_cache"}
    kernels = {k["kernel"].split(":")[1] for k in m["kernels"]}
    assert set(launches.GRIDS) == kernels  # every kernel of the paged path, none forgotten
    for k in m["kernels"]:
        for target in ("sm_80", "sm_90"):
            c = k["compiled"][target]
            cubin = (aot_dir / c["cubin"]).read_bytes()
            assert cubin[:4] == b"\x7fELF", k["name"]
            assert hashlib.sha256(cubin).hexdigest() == c["cubin_sha256"]
            ptx = (aot_dir / c["ptx"]).read_text()
            assert f".target {target}" in ptx and f".entry {c['kernel_name']}(" in ptx
            assert c["shared_bytes"] <= (163 if target == "sm_80" else 227) * 1024
            assert c["num_warps"] == k["options"]["num_warps"]


def test_manifest_signatures_match_the_kernels(aot_dir):
    """Argument names, order, constexpr-ness and the compiled parameter count come from the real kernels."""
    for k in _manifest(aot_dir)["kernels"]:
        spec = launches.KernelSpec(**{f: k[f] for f in ("name", "op", "kernel", "arg_names", "signature", "constexprs",
                                                    "grid", "sizes", "scalars", "options", "select")})
        params = launches.kernel_parameters(spec.jit_function())
        assert k["arg_names"] == [n for n, _, _ in params], k["name"]
        # constexprs: the kernel's, plus engine-fixed ints equal to 1 (the JIT makes those constexpr too)
        ones = {n for n, c, _ in params if not c and n in k["constexprs"]}
        assert ones <= set(launches.ENGINE_INTS.get(k["kernel"].split(":")[1], ())) and \
            all(k["constexprs"][n] == 1 for n in ones), k["name"]
        assert {n for n, c, _ in params if c} | ones == set(k["constexprs"]) == \
            {n for n, t in k["signature"].items() if t == "constexpr"}, k["name"]
        assert k["params"] == [n for n, c, _ in params if not c and n not in ones]
        assert set(k["divisible"]) <= set(k["params"]), k["name"]
        for name in k["params"]:
            assert re.fullmatch(r"\*?(fp16|bf16|fp32|fp64|i1|i8|i16|i32|i64|u8)", k["signature"][name]), \
                (k["name"], name)
        ptx = (aot_dir / k["compiled"]["sm_90"]["ptx"]).read_text()
        entry = ptx[ptx.index(f".entry {k['compiled']['sm_90']['kernel_name']}("):]
        header = entry[:entry.index(")")]
        assert header.count(".param") == len(k["params"]) + k["compiled"]["sm_90"]["extra_params"] == \
            len(k["params"]) + 2  # Triton 3.6: the global and profile scratch pointers
        # pointer params are .u64, 32-bit ints .u32 / .s32, in the manifest's order
        kinds = re.findall(r"\.param \.(\w+)", header)[:len(k["params"])]
        for name, kind in zip(k["params"], kinds):
            t = k["signature"][name]
            assert kind == ("u64" if t.startswith("*") or t == "i64" else "f32" if t == "fp32" else
                            "u32" if t == "i32" else kind), (k["name"], name, kind)


def test_recorded_launch_values_follow_the_page_format():
    """Specs of a second shape (GQA 4, head_dim 128, bf16, K8V4 in both tiers, tiered by alpha_high = 1 so the
    low-tier moves exist): constexprs are the page format's and the kernels' launch rules, not defaults."""
    kv_config = get_preset("k8v4").replace(alpha_high=1.0)
    shape = EngineShape(num_layers=2, num_heads=16, num_kv_heads=4, head_dim=128, kv_config=kv_config,
                        dtype="bfloat16", max_batch_size=4, max_seq_len=1000)
    specs = aot.kernel_specs(shape)
    fmt = shape.page_format
    by_kernel = {}
    for s in specs:
        by_kernel.setdefault(s.kernel.split(":")[1], []).append(s)
    partial = by_kernel["_decode_partial_kernel"][0]
    c = partial.constexprs
    assert (c["GROUP"], c["HEAD_DIM"], c["R"], c["PAGE_BYTES"]) == (4, 128, shape.max_pages_per_row,
                                                                    fmt.page_size_bytes)
    assert (c["H_KB"], c["H_VB"], c["L_KB"], c["L_VB"]) == (8, 4, 8, 4)
    assert c["H_TOKENS"] == fmt.high_tokens_per_page and c["H_KC"] == fmt.high.key_codes.offset_bytes
    assert c["DT"] == "tl.float16" and c["FAST"] is True  # bf16 queries enter fp16 products (decode_attention.py)
    assert partial.signature["q_ptr"] == "*bf16" and partial.signature["pool_ptr"] == "*u8"
    assert launches.eval_grid(partial.grid, {**partial.sizes, "num_seqs": 3}, c)[0] == 3
    write = {s.op: s for s in by_kernel["_write_tokens_kernel"]}
    assert write["write_high"].signature["k_ptr"] == "*bf16" and write["write_low_move"].signature["k_ptr"] == "*fp32"
    assert write["write_high"].constexprs["HAS_OFFSET"] is True and write["write_low_move"].constexprs["HAS_OFFSET"] \
        is False
    assert all(s.options["enable_fp_fusion"] is False for s in by_kernel["_write_tokens_kernel"])
    # prefill variants: one per (padded scoring queries, lse chunks) range, covering 1..max_seq_len once
    def bounds(kernel):
        return sorted(tuple(int(x) for x in s.select.split(" <= max_len <= ")) for s in by_kernel[kernel])

    for kernel in ("_prompt_lse_kernel", "_prompt_lse_merge_kernel", "_prompt_score_kernel"):
        b = bounds(kernel)
        assert b[0][0] == 1 and b[-1][1] == 1000 and all(y[0] == x[1] + 1 for x, y in zip(b, b[1:])), (kernel, b)
    lse = {s.select: s.constexprs["LSE_STRIDE"] for s in by_kernel["_prompt_lse_kernel"]}
    assert lse == {"1 <= max_len <= 16": 16, "17 <= max_len <= 32": 32, "33 <= max_len <= 1000": 64}
    merge = {s.select: s.constexprs["BLOCK_C"] for s in by_kernel["_prompt_lse_merge_kernel"]}
    assert merge["513 <= max_len <= 1000"] == 4 and merge["257 <= max_len <= 512"] == 2  # ceil(n / 256), pow2


def test_grid_formula_mismatch_is_caught():
    """A launch whose grid disagrees with the written formula stops the build (the formula is checked)."""
    import torch

    from trtllm_diffkv.kernels import quant_write as qw

    fmt = TINY.page_format
    meta = lambda *shape, dtype=torch.int32: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
    with launches.Recorder([(qw, "_write_tokens_kernel")]) as rec:
        qw.write_tokens(meta(3, fmt.page_size_bytes, dtype=torch.uint8), fmt, "high", meta(4), meta(4),
                        meta(4, 64, dtype=torch.float16), meta(4, 64, dtype=torch.float16),
                        scores=meta(4, dtype=torch.float32), positions=meta(4))
    kernel, grid, args, kwargs = rec.launches[0]
    assert grid == (4,)
    assert launches.spec_of_launch(rec.launches[0], "write_high", {"n_rows": 4}).grid == ["n_rows"]
    with pytest.raises(AssertionError, match="grid formula"):
        launches.spec_of_launch((kernel, (5,), args, kwargs), "write_high", {"n_rows": 4})


def test_bad_shapes_and_targets_refused(tmp_path):
    with pytest.raises(ValueError, match="head_dim=72"):
        EngineShape(num_layers=1, num_heads=4, num_kv_heads=4, head_dim=72, kv_config=get_preset("diffkv"))
    with pytest.raises(ValueError, match="dtype"):
        EngineShape(num_layers=1, num_heads=4, num_kv_heads=4, head_dim=64, kv_config=get_preset("diffkv"),
                    dtype="float8")
    with pytest.raises(ValueError, match="sm_75"):
        aot.check_targets((80, 75))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_kv_config_fields_round_trip(name):
    cfg = get_preset(name)
    fields = kv_config_to_fields(cfg)
    assert all(isinstance(v, (int, float, str)) for v in fields.values())
    assert kv_config_from_fields(fields) == cfg
    assert kv_config_from_fields(json.loads(json.dumps(fields))) == cfg
    with pytest.raises(ValueError, match="high_key_bits"):
        kv_config_from_fields({k: v for k, v in fields.items() if k != "high_key_bits"})


_JIT_VS_AOT = r'''
import json, os, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.runtime.jit import create_function_from_signature
from trtllm_diffkv.export import aot
from trtllm_diffkv.export.fields import EngineShape

shape, out_dir = EngineShape.from_fields(json.loads(sys.argv[1])), sys.argv[2]
target = GPUTarget("cuda", 90, 32)
backend = CUDABackend(target)
launches, record = [], aot.spec_of_launch
aot.spec_of_launch = lambda launch, *a, **k: (launches.append(launch), record(launch, *a, **k))[1]
specs = aot.kernel_specs(shape, tuple(sys.argv[3].split(",")))
result = {}
for spec, (kernel, grid, args, kwargs) in zip(specs, launches):
    kwargs = dict(kwargs)
    for k in list(kwargs):  # the CUDA-only constexprs the manifest restates (FAST)
        if spec.signature.get(k) == "constexpr":
            kwargs[k] = aot.decode_constexpr(spec.constexprs[k])
    kwargs.update(spec.options, debug=False, instrumentation_mode="")
    # what JITFunction.run does before compiling: bind, specialize, pack (Triton 3.6, runtime/jit.py)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    jit = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
    aot.compile_specs([spec], out_dir, targets=(90,))
    ptx = open(os.path.join(out_dir, spec.compiled["sm_90"]["ptx"])).read()
    result[spec.kernel.split(":")[1]] = (jit.asm["ptx"] == ptx, spec.scalars.get("num_parts"),
                                         spec.constexprs.get("num_parts"))
print(json.dumps(result))
'''


@pytest.mark.parametrize("shape", [TINY, EngineShape(num_layers=2, num_heads=16, num_kv_heads=4, head_dim=128,
                                                     kv_config=get_preset("diffkv"), dtype="float16",
                                                     max_batch_size=4, max_seq_len=300)],
                         ids=["tiny-1-partition", "gpu-test-2-partitions"])
def test_decode_kernels_compile_to_the_jit_paths_ptx(shape, tmp_path):
    """The manifest's decode kernels (partial, merge, score) compile to exactly the PTX Triton's JIT compiles for
    the same launch on CUDA: its specialization (``tt.divisibility=16`` on aligned pointers and multiple-of-16
    ints, ints equal to 1 as constexprs) is recorded and used (H200: without it the AOT decode output differed
    from the JIT's in some bytes; the PTX differed in the layouts, hence in the reduction order). The JIT's
    bind / specialize / pack steps run in a child process without ``TRITON_INTERPRET`` (sm_90, no GPU)."""
    result = _jit_vs_aot(shape, ("decode",), tmp_path)
    assert set(result) == {"_decode_partial_kernel", "_decode_merge_kernel", "_decode_score_kernel"}
    assert all(same for same, _, _ in result.values()), result
    parts = result["_decode_partial_kernel"]
    assert (parts[2] == 1) if shape is TINY else (parts[1] == 2)  # 1 partition: a constexpr, as in the JIT


def _jit_vs_aot(shape, ops, tmp_path) -> dict:
    """``{kernel: (AOT PTX == JIT PTX, num_parts scalar, num_parts constexpr)}`` for the families ``ops`` of
    ``shape`` (sm_90), from :data:`_JIT_VS_AOT` run in a child process without ``TRITON_INTERPRET``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "jit_vs_aot.py"
    script.write_text(_JIT_VS_AOT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(aot.__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, str(script), json.dumps(shape.to_fields()), str(tmp_path / "k"),
                          ",".join(ops)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("preset", ["diffkv", "fp16"])
def test_decision_kernels_compile_to_the_jit_paths_ptx(preset, tmp_path):
    """The decode plan's kernels (``_decide_kernel``, ``_locate_kernel``) in the manifest compile to exactly the
    PTX Triton's JIT compiles for the launches ``paged/decode.py::plan_device`` makes (``diffkv``: decisions
    and moves; ``fp16``: ``COMPRESS=False`` / ``MOVES=False``), specialization included (sm_90, no GPU)."""
    shape = EngineShape(num_layers=2, num_heads=16, num_kv_heads=4, head_dim=128, kv_config=get_preset(preset),
                        dtype="float16", max_batch_size=4, max_seq_len=300)
    result = _jit_vs_aot(shape, ("decision",), tmp_path)
    assert set(result) == {"_decide_kernel", "_locate_kernel"}
    assert all(same for same, _, _ in result.values()), result


@pytest.mark.parametrize("preset", ["diffkv", "fp16"])
def test_decision_specs_follow_the_plan(preset):
    """The recorded decision launches carry the preset's choices, the page format's offsets and the engine's ints
    (as the runtime scalars the manifest states), with grids over the step's rows and the bucket's items."""
    from trtllm_diffkv.kernels import decision_kernel as dk

    kv = get_preset(preset)
    shape = EngineShape(num_layers=3, num_heads=8, num_kv_heads=2, head_dim=64, kv_config=kv, dtype="float16",
                        max_batch_size=4, max_seq_len=128)
    fmt = shape.page_format
    decide, locate = aot.kernel_specs(shape, ("decision",))
    assert decide.kernel.endswith(":_decide_kernel") and locate.kernel.endswith(":_locate_kernel")
    assert decide.op == locate.op == "decode_plan"
    assert decide.constexprs == {"H_TOKENS": fmt.high_tokens_per_page, "L_TOKENS": fmt.low_tokens_per_page,
                                 "BLOCK": dk.BLOCK_TOKENS, "COMPRESS": kv.compress, "ROWS": dk.ROWS_PER_PROGRAM,
                                 "WINDOWS": False, "NUM_KV_HEADS": 1}  # no sliding-window layers in an engine
    assert decide.scalars == {"G": 6, "R": shape.max_pages_per_row, "PAGE_BYTES": fmt.page_size_bytes,
                              "H_SC": fmt.high.score.offset_bytes, "H_PO": fmt.high.position.offset_bytes,
                              "L_SC": fmt.low.score.offset_bytes, "L_PO": fmt.low.position.offset_bytes,
                              "W": max(kv.recent_window_tokens, 1), "S": kv.prompt_score_window_tokens}
    assert decide.signature["alpha_ptr"] == "*fp64" and decide.signature["new_ptr"] == "*i64"
    assert locate.constexprs == {"P_HIGH": fmt.high_tokens_per_page, "P_LOW": fmt.low_tokens_per_page,
                                 "MOVES": kv.compress, "BLOCK": dk.LOCATE_BLOCK}
    assert locate.signature["src_page_out"] == ("*i32" if kv.compress else "*i64")  # fp16: slots stand in
    assert launches.eval_grid(decide.grid, {**decide.sizes, "num_seqs": 3}, decide.constexprs) == (3, 6)  # rows of 3 seqs
    assert launches.eval_grid(locate.grid, {**locate.sizes, "bucket": 100}, locate.constexprs) == (3,)  # 600 items
    assert set(locate.divisible) == {n for n in locate.params if n.endswith("_ptr") or n.endswith("_out")}


@pytest.mark.parametrize("preset", ["diffkv", "fp16"])
def test_decode_plan_plugins_kernels_are_in_the_aot_set(preset):
    """Every kernel a decode-plan plugin node launches (trtllm_diffkv/export/plugin_specs.py PLAN_KERNELS: decode_decide, page_update,
    decode_locate) has a manifest entry of its op in the engine's AOT set (the moves' kernels: compressing presets)."""
    from trtllm_diffkv.export import plugin_specs as specs

    shape = EngineShape(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64, kv_config=get_preset(preset),
                        max_batch_size=2, max_seq_len=96)
    have = {(s.kernel.split(":")[1], s.op) for s in aot.kernel_specs(shape)}
    for node, kernels in specs.PLAN_KERNELS.items():
        for kernel in kernels:
            moves = kernel[1] in ("read_high_move", "write_low_move")
            assert (kernel in have) == (not moves or get_preset(preset).compress), (node, kernel)


def test_cache_write_variants_and_step_scalars_follow_the_launchers():
    """The paged cache passes the key-offset rows as int64 (prefill and decode): those write launches have their own
    entries (``write_high_cache``, ``write_low_prompt_cache``; the int32 ones stay for direct callers). The per-call
    scalars (``launches.STEP_SCALARS``) are recorded as expressions that give the recorded values, and a wrong expression
    stops the build (as a wrong grid formula does)."""
    import torch

    from trtllm_diffkv.memory import triton_page_manager as tpm

    specs = {(s.op, s.kernel.split(":")[1]): s for s in aot.kernel_specs(TINY)}
    assert specs[("write_high_cache", "_write_tokens_kernel")].signature["off_row_ptr"] == "*i64"
    assert specs[("write_high", "_write_tokens_kernel")].signature["off_row_ptr"] == "*i32"
    apply = next(s for s in aot.kernel_specs(TINY, ("page_manager",)) if s.kernel.endswith(":_decode_apply_kernel"))
    assert apply.step_scalars == {"n_items": "num_slots * rows_per_slot",
                                  "num_blocks": "cdiv(num_slots * rows_per_slot, BLOCK)", "num_pages": "num_pages"}
    assert launches.eval_grid([apply.step_scalars["n_items"]], {**apply.sizes, "num_slots": 7}, apply.constexprs) == (42,)
    mgr = tpm.TritonPageManager(TINY.page_format, 64, 2, 3, 2, 128, device="meta")
    meta = lambda *shape, dtype=torch.int32: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
    with launches.Recorder([(tpm, k) for k in ("_count_kernel", "_scan_kernel", "_decode_apply_kernel")]) as rec:
        mgr.append_decode(meta(2, dtype=torch.int64), meta(2, 3, 2), meta(2, 3, 2))
    sizes = {"num_slots": 2, "rows_per_slot": 6}
    assert launches.spec_of_launch(rec.launches[0], "page_manager", sizes).step_scalars == {"n_items": "num_slots * rows_per_slot"}
    saved = launches.STEP_SCALARS["_count_kernel"]
    launches.STEP_SCALARS["_count_kernel"] = {"n_items": "num_slots"}
    try:
        with pytest.raises(AssertionError, match="scalar n_items"):
            launches.spec_of_launch(rec.launches[0], "page_manager", sizes)
    finally:
        launches.STEP_SCALARS["_count_kernel"] = saved


# --------------------------------------------------------------------------- TensorRT's calling convention


def _ptx_instructions(ptx: str, kernel_name: str):
    """Multiset of the entry's floating-point and memory instructions (opcodes): the arithmetic on values and every
    global / shared access. Integer address arithmetic is left out: where one buffer reaches the wrapper once instead
    of under several pointer types (the pool's views), the compiler may share an address computation."""
    import collections

    body = ptx[ptx.index(f".entry {kernel_name}("):]
    ops = collections.Counter(m.group(1) for m in re.finditer(r"^\s+([a-z][a-z0-9._]*)\s", body, re.M))
    return collections.Counter({op: k for op, k in ops.items()
                                if not op.startswith("ld.param") and
                                (re.search(r"\.(f16|bf16|f32|f64|f16x2|bf16x2)\b", op) or
                                 op.startswith(("ld.", "st.", "atom.", "red.", "mma", "cvt", "shfl", "bar")))})


def test_trt_abi_wrappers_follow_tensorrts_calling_convention(aot_dir):
    """Every manifest entry has its TensorRT-convention wrapper (``manifest["trt_abi"]``, ``export/trt_abi.py``),
    compiled for both targets: the PTX entry declares exactly the inputs (``.u64``), the int32 extra args (``.u32``)
    and the outputs (``.u64``, one per input) - Triton's scratch parameters cut - the pool's dtype views are one
    input, TensorRT types only (no fp64), the cubin is an ELF of that PTX, warps and shared memory are the entry's,
    and the wrapper's instructions are the original kernel's (same multiset of floating-point and memory opcodes: the
    same code, inlined; the GPU test checks the outputs bit for bit)."""
    from trtllm_diffkv.export import trt_abi

    m = _manifest(aot_dir)
    wrappers = {k["name"]: trt_abi.AbiKernel.from_json(k) for k in m["trt_abi"]}
    for entry in m["kernels"]:
        abi = wrappers[trt_abi.from_launcher(entry).name]  # KeyError: an entry without its wrapper
        n, x = len(abi.input_dtypes), len(abi.extras)
        assert sorted(set(abi.input_of.values())) == list(range(n)) and "fp64" not in abi.input_dtypes
        if entry["kernel"].endswith(("_write_tokens_kernel", "_read_tokens_kernel")):
            assert len({abi.input_of[p] for p in abi.pointers if p.startswith("pool_")}) == 1
        for target in ("sm_80", "sm_90"):
            c, orig = abi.compiled[target], entry["compiled"][target]
            ptx = (aot_dir / c["ptx"]).read_text()
            assert trt_abi.ptx_entry_params(ptx, c["kernel_name"]) == c["params"] == \
                [".u64"] * n + [".u32"] * x + [".u64"] * n, abi.name
            cubin = (aot_dir / c["cubin"]).read_bytes()
            assert cubin[:4] == b"\x7fELF" and hashlib.sha256(cubin).hexdigest() == c["cubin_sha256"]
            assert (c["num_warps"], c["shared_bytes"]) == (orig["num_warps"], orig["shared_bytes"]), abi.name
            original = (aot_dir / orig["ptx"]).read_text()
            assert _ptx_instructions(ptx, c["kernel_name"]) == _ptx_instructions(original, orig["kernel_name"]), \
                f"{abi.name} ({target}): the wrapper's code differs from the kernel's"
    assert (aot_dir / "trt_abi.py").read_text() == trt_abi.wrapper_source(list(wrappers.values()))


def test_strip_scratch_cuts_only_unread_parameters():
    from trtllm_diffkv.export import trt_abi

    ptx = (".visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .u32 k_param_1,\n\t.param .u64 k_param_2,"
           "\n\t.param .u64 k_param_3\n)\n{\n\tld.param.b64 %rd1, [k_param_0];\n\tret;\n}\n")
    out = trt_abi.strip_scratch(ptx, "k", 2)
    assert trt_abi.ptx_entry_params(out, "k") == [".u64", ".u32"] and out.endswith("ret;\n}\n")
    with pytest.raises(ValueError, match="k_param_3 .scratch. is read"):
        trt_abi.strip_scratch(ptx.replace("[k_param_0]", "[k_param_3]"), "k", 2)


def test_scalar_bits_are_the_int32_extra_args():
    """An fp32 scalar travels as its IEEE bits (signed int32: negative values and the fp32 rounding of a Python float
    included), an int32 as itself; others refused."""
    import numpy as np

    from trtllm_diffkv.export import trt_abi

    for value in (0.125 * 1.4426950408889634, -3.5, 1e-40, float("inf")):
        bits = trt_abi.scalar_bits(value, "fp32")
        assert -2**31 <= bits < 2**31 and np.int32(bits).view(np.float32) == np.float32(value)
    assert trt_abi.scalar_bits(-7, "i32") == -7
    with pytest.raises(ValueError, match="int32"):
        trt_abi.scalar_bits(2**31, "i32")
    with pytest.raises(ValueError, match="i64"):
        trt_abi.scalar_bits(3, "i64")


class _Sym:
    """A stand-in for TensorRT's symbolic dims (``trtp`` shape expressions: + - * // with an int or an expression on
    the right; no reflected operators, no other Python operation), evaluated later with concrete dims."""

    def __init__(self, fn):
        self.fn = fn

    @staticmethod
    def lift(x):
        return x if isinstance(x, _Sym) else _Sym(lambda env, x=x: x)

    def _op(self, other, f):
        other = _Sym.lift(other)
        return _Sym(lambda env: f(self.fn(env), other.fn(env)))

    def __add__(self, o):
        return self._op(o, lambda a, b: a + b)

    def __sub__(self, o):
        return self._op(o, lambda a, b: a - b)

    def __mul__(self, o):
        return self._op(o, lambda a, b: a * b)

    def __floordiv__(self, o):
        return self._op(o, lambda a, b: a // b)


def _sym_cdiv(a, b):
    """TensorRT's ``trtp.cdiv``: refuses two ints (``tensorrt/plugin/_top_level.py``)."""
    if isinstance(a, int) and isinstance(b, int):
        raise ValueError("Both arguments cannot be 'int's")
    return (_Sym.lift(a) + (b - 1)) // b


def test_launch_plan_is_the_same_with_symbolic_dims():
    """``trt_abi.launch_plan`` (grid and extra args of an AOT node) evaluated on stand-in symbolic dims (what
    ``aot_impl`` gets from TensorRT) and then on concrete dims == evaluated on the concrete dims directly, for every
    node of a compressing preset's AOT decode graph at several step sizes."""
    import onnx
    from conftest import tiny_llama

    from trtllm_diffkv.export import onnx_export, trt_abi

    model, kv = tiny_llama(), get_preset("diffkv")
    c = model.config
    shape = EngineShape(num_layers=c.num_layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                        head_dim=c.head_dim, kv_config=kv, dtype="float32", max_batch_size=4, max_seq_len=64)
    manifest = {"engine": shape.to_fields(), "kernels": [s.to_json() for s in aot.kernel_specs(shape)]}
    proto = onnx_export.export_onnx(model, kv, max_positions=64, graph="aot", phase="decode", manifest=manifest)
    nodes = onnx_export.aot_nodes(proto)
    assert nodes
    for node in nodes:
        attrs = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        where = {(j, axis): (s, div) for s, (j, axis, div) in json.loads(attrs["dims"]).items()}
        # the dim a node reads a step size from (input j, axis): that size times its divisor
        sym = lambda j, axis: _Sym(lambda env, s=where[j, axis]: env[s[0]] * s[1])  # noqa: E731
        sgrid, sextras = trt_abi.launch_plan(attrs, sym, cdiv=_sym_cdiv)
        for n, B, P in ((1, 1, 40), (3, 4, 97), (4, 4, 512)):
            env = dict(n=n, B=B, P=P)
            grid, extras = trt_abi.launch_plan(attrs, lambda j, axis: env[where[j, axis][0]] * where[j, axis][1])
            assert [_Sym.lift(g).fn(env) for g in sgrid] == list(grid), node.name
            assert [_Sym.lift(e).fn(env) for e in sextras] == extras, node.name
            assert all(isinstance(e, int) and -2**31 <= e < 2**31 for e in extras)


@pytest.mark.parametrize("name", ["demote", "fp16"])
def test_decode_step_through_the_wrappers_equals_the_plugins(name):
    """One decode step of the AOT decode graph's launches, each run as its TensorRT-convention wrapper with the
    argument list TensorRT passes (``trtllm_diffkv/export/plugin_ops.py::run_abi_kernel``, the onnxruntime op; Triton's interpreter) ==
    the plugins' implementations (``@trtp.impl``'s path) on the same prefilled cache state: every state and plan
    tensor and both layers' outputs, byte for byte (``tests/export/aot_step.py``; on the GPU through the CUDA driver:
    ``tests/export/test_aot_graph_gpu.py``). ``demote`` moves tokens to the low tier in this step."""
    import aot_step

    from trtllm_diffkv.export import plugin_ops as ops

    kv = aot_step.preset(name)
    manifest = {"kernels": [s.to_json() for s in aot.kernel_specs(aot_step.engine(kv))]}
    mine, ref, outs_mine, outs_ref, launched = aot_step.run_decode_step(
        kv, "cpu", manifest, lambda abi, attrs, inputs, grid, extras: ops.run_abi_kernel(inputs, attrs))
    aot_step.check_equal(mine, ref, outs_mine, outs_ref)
    assert len(launched) == (6 if kv.compress else 4) + aot_step.L * (4 if kv.compress else 3)
    if name == "demote":
        assert int((mine["move_from"] >= 0).sum()) > 0  # the step moved tokens


_EDGE7 = [(hd, heads) for hd in (64, 80, 96, 128, 256) for heads in ((8, 8), (28, 4), (40, 8), (12, 2), (8, 1),
                                                                    (32, 1))]


def test_trt_abi_wrappers_for_every_head_dim_and_group():
    """Edge case 7 for the TensorRT-convention wrappers: for head_dim 64/80/96/128/256 and query:KV heads 8:8, 28:4,
    40:8, 12:2, 8:1, 32:1 (fp32 engines: the AOT graphs' bindings too), every manifest entry gets a wrapper, the
    generated module imports (its names do not collide), each wrapper's parameter list is inputs + int32 extras +
    outputs with the pool's views as one input; a configuration the engine refuses is refused with a message."""
    from trtllm_diffkv.export import trt_abi

    for hd, (hq, hkv) in _EDGE7:
        try:
            shape = EngineShape(num_layers=1, num_heads=hq, num_kv_heads=hkv, head_dim=hd,
                                kv_config=get_preset("diffkv"), dtype="float32", max_batch_size=2, max_seq_len=64)
            entries = [s.to_json() for s in aot.kernel_specs(shape)]
        except ValueError as exc:  # refused at configuration time, by name
            assert str(exc), (hd, hq, hkv)
            continue
        wrappers = aot.abi_kernels(shape, entries)
        assert {w.entry for w in wrappers} == {e["name"] for e in entries}, (hd, hq, hkv)
        module = trt_abi.load_wrappers(wrappers)
        for w in wrappers:
            assert callable(getattr(module, w.function))
            n = len(w.input_dtypes)
            assert w.wrapper_params[:n] == [f"in{j}" for j in range(n)] and len(w.wrapper_params) == 2 * n + \
                len(w.extras)
            if w.kernel.endswith(("_write_tokens_kernel", "_read_tokens_kernel")):
                assert len({w.input_of[p] for p in w.pointers if p.startswith("pool_")}) == 1


def test_trt_abi_wrapper_compiles_to_the_same_code_at_head_dim_80_group_7(tmp_path):
    """Edge case 7, compiled: the decode family's wrappers of a non-power-of-two head_dim and group (80, 28:4) compile
    for sm_90 to the kernels' floating-point and memory instructions, their PTX entries in TensorRT's convention."""
    from trtllm_diffkv.export import trt_abi

    shape = EngineShape(num_layers=1, num_heads=28, num_kv_heads=4, head_dim=80, kv_config=get_preset("diffkv"),
                        dtype="float16", max_batch_size=2, max_seq_len=64)
    try:
        manifest = aot.build_kernels(shape, tmp_path, targets=(90,), ops=("decode",))
    except RuntimeError as exc:
        if "ptxas" in str(exc).lower():
            pytest.skip(f"cannot assemble here: {exc}")
        raise
    entries = {e["name"]: e for e in manifest["kernels"]}
    assert len(manifest["trt_abi"]) == len(entries) == 3
    for data in manifest["trt_abi"]:
        w = trt_abi.AbiKernel.from_json(data)
        c, orig = w.compiled["sm_90"], entries[w.entry]["compiled"]["sm_90"]
        ptx = (tmp_path / c["ptx"]).read_text()
        n = len(w.input_dtypes)
        assert trt_abi.ptx_entry_params(ptx, c["kernel_name"]) == [".u64"] * n + [".u32"] * len(w.extras) + \
            [".u64"] * n
        assert _ptx_instructions(ptx, c["kernel_name"]) == \
            _ptx_instructions((tmp_path / orig["ptx"]).read_text(), orig["kernel_name"]), w.name
