"""The CUDA C++ decode kernels' ahead-of-time build (``export/cuda_aot.py``) on the CPU machine.

What is checked without a GPU: the PTX entries take their parameters in TensorRT's QDP AOT order (input
pointers, int32 extra args, output pointers) exactly as the manifest lists them; the entries compile to the
same code as the source kernels the NVRTC path compiles (the PTX differs only in how the parameters arrive);
ptxas reports the same registers and spills for an entry as for its source kernel, and none on sm_90 for the
shapes where the source kernel has none; the ``-D`` macros, grid, block and argument values are those
``cuda_decode.launch_partial`` passes to NVRTC (its launch recorded with the compilation and launch stubbed
out); unsupported engines raise ``ValueError`` before anything compiles. The launches themselves are compared
bit for bit on the GPU (``tests/export/test_cuda_aot_gpu.py``). Compilation needs ``nvcc`` (skipped without it).
"""
import contextlib
import hashlib
import json
import re
import shutil
import subprocess
import types
from collections import Counter

import numpy as np
import pytest
import torch

from trtllm_diffkv.export import cuda_aot
from trtllm_diffkv.export.fields import EngineShape
from trtllm_diffkv.config import get_preset
from trtllm_diffkv.kernels.cuda_decode import SOURCE_PATH

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def _shape(preset="diffkv", head_dim=128, num_heads=16, num_kv_heads=4, dtype="float16"):
    return EngineShape(num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       kv_config=get_preset(preset), dtype=dtype, max_batch_size=4, max_seq_len=2048)


SHAPES = {  # name: (engine, most spill bytes ptxas (nvcc 13.0) may give the partial kernel on sm_90; None: unchecked)
    "default-d128-g4": (_shape(), None),  # spills 32 bytes here at the kernel's 168-register cap
    "default-d64-g4": (_shape(head_dim=64), 0),
    # head_dim 128: up to 32 bytes since the group query sums moved to quad shuffles (commit f1521f8: the partial
    # kernel 5041 -> 4295 us per step at Llama-3-8B 48 x 4096 on the H200, docs/PERFORMANCE.md)
    "k8v4-d128-g4": (_shape("k8v4"), 32),
    "default-d128-g8-bf16": (_shape(num_heads=32, dtype="bfloat16"), 32),
}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Each shape's entries built for sm_80 and sm_90, once per module (lazily)."""
    done = {}

    def get(name):
        if name not in done:
            out = tmp_path_factory.mktemp(name)
            entries = cuda_aot.build_cuda_kernels(SHAPES[name][0], out, targets=(80, 90))
            done[name] = (out, entries)
        return done[name]

    return get


def _entry_params(ptx: str, kernel_name: str) -> list[tuple[str, str]]:
    """[(PTX type, parameter name)] of ``.entry kernel_name`` in order."""
    start = ptx.index(f".entry {kernel_name}(")
    head = ptx[start:ptx.index(")", start)]
    return re.findall(r"\.param\s+\.(\w+)\s+(?:\.[^,\n]*\s)?(\w+)\s*(?:,|\n|$)", head + "\n")


@needs_nvcc
@pytest.mark.parametrize("name", list(SHAPES))
def test_entries_take_inputs_extras_outputs_in_manifest_order(builds, name):
    out, entries = builds(name)
    manifest = json.loads((out / cuda_aot.MANIFEST_NAME).read_text())
    assert manifest["cuda_kernels"] == entries
    assert manifest["engine"] == SHAPES[name][0].to_fields()
    scored = SHAPES[name][0].kv_config.tiered  # uniform formats (k8v4) keep no scores: no score kernel
    assert [e["source_kernel"] for e in entries] == ["diffkv_decode_partial"] + ["diffkv_decode_scores"] * scored
    for e in entries:
        assert e["kernel_name"] == "diffkv_trt_" + e["source_kernel"].removeprefix("diffkv_")
        assert len(set(e["inputs"])) == len(e["inputs"])  # each buffer once as an input
        assert set(e["outputs"]) <= set(e["inputs"])
        assert e["aliases"] == {o: e["inputs"].index(o) for o in e["outputs"]}
        assert all(x["dtype"] == "int32" and -2**31 <= x["value"] < 2**31 for x in e["extras"])
        assert e["block"] == [128, 1, 1] and e["shared_mem"] == 0
        for target in ("sm_80", "sm_90"):
            c = e["compiled"][target]
            ptx, cubin = (out / c["ptx"]).read_bytes(), (out / c["cubin"]).read_bytes()
            assert hashlib.sha256(ptx).hexdigest() == c["ptx_sha256"]
            assert hashlib.sha256(cubin).hexdigest() == c["cubin_sha256"]
            assert cubin[:4] == b"\x7fELF"
            text = ptx.decode()
            assert re.search(rf"^\.target\s+{target}\s*$", text, re.M), target
            assert text.count(".entry ") == 1  # only the ABI entry; the source kernel became its inlined body
            params = _entry_params(text, e["kernel_name"])
            kinds = ["ptr" if t in ("u64", "b64") else "i32" if t in ("u32", "b32", "s32") else t for t, _ in params]
            n_in, n_x, n_out = len(e["inputs"]), len(e["extras"]), len(e["outputs"])
            assert kinds == ["ptr"] * n_in + ["i32"] * n_x + ["ptr"] * n_out, (target, params)
    partial = entries[0]
    probs = ["page_probs", "page_max"] * scored  # what the score update reads: written only where scores are kept
    assert partial["inputs"] == ["q", "pool", "table", "tier_tokens", "row_ids", "part_m", "part_l", "part_acc",
                                 "page_probs", "page_max"]
    assert [x["name"] for x in partial["extras"]] == ["qk_scale_bits", "num_kv_heads", "num_slots", "R"]
    assert partial["outputs"] == ["part_m", "part_l", "part_acc", *probs]
    if not scored:
        return
    scores = entries[1]
    assert scores["inputs"] == ["pool", "table", "tier_tokens", "row_ids", "page_probs", "page_max", "lse"]
    assert [x["name"] for x in scores["extras"]] == ["num_kv_heads", "R"]
    assert scores["outputs"] == ["pool"]  # the score segments, updated in place


def _compile_source_kernels(defines: dict, cc: int, tmp_path) -> tuple[str, str]:
    """(PTX, ptxas -v log) of the unmodified .cu with the NVRTC path's flags, as nvcc compiles it."""
    stem = tmp_path / f"source.sm{cc}"
    ptx_cmd, cubin_cmd = cuda_aot.nvcc_commands(SOURCE_PATH, stem, cc, defines)
    for cmd in (ptx_cmd, cubin_cmd):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
    return (tmp_path / f"source.sm{cc}.ptx").read_text(), res.stdout + res.stderr


def _instructions(ptx: str, kernel: str, param_names: list[str], float_bits: dict[str, str]) -> list[str]:
    """The entry's instructions with parameters named (``<q>``), loads of parameters dropped, a float rebuilt
    from its bits (``mov.b32 %f, <x_bits>``) named as the float, registers reduced to their class, labels and
    shared-array manglings dropped."""
    start = ptx.index(f".entry {kernel}(")
    end = ptx.find(".entry ", start + 1)
    head, body = ptx[start:end if end > 0 else len(ptx)].split(")", 1)
    pmap = dict(zip(re.findall(r"\.param\s+\.\w+\s+(\w+)", head), param_names))
    alias, out = {}, []
    for line in body.splitlines():
        s = line.strip()
        if not s or s.startswith((".reg", "//", "{", "}", ".visible")) or s.endswith(":"):
            continue
        m = re.match(r"ld\.param\.\w+\s+(%\w+),\s*\[(\w+)\];", s)
        if m:
            alias[m.group(1)] = f"<{pmap[m.group(2)]}>"
            continue
        s = re.sub(r"%\w+", lambda r: alias.get(r.group(0), r.group(0)), s)
        m = re.match(r"mov\.b32\s+(%\w+),\s*<(\w+)>;", s)
        if m and m.group(2) in float_bits:
            alias[m.group(1)] = f"<{float_bits[m.group(2)]}>"
            continue
        s = re.sub(r"%(rd|rs|fd|f|r|p)\d+", r"%\1", s)
        s = re.sub(r"\$L__BB\d+_\d+", "$L", s)
        s = re.sub(r"_ZZ\w*?E\d+(\w+)", r"\1", s)
        out.append(s)
    return out


_ORDERED = re.compile(r"^(@!?%p\s+)?(ld\.|st\.|mma\.|movmatrix\.|fma\.|mul\.f|add\.f|sub\.f|max\.f|min\.f|ex2\.|cvt\.|"
                      r"shfl\.|bar\.|atom\.|red\.|div\.f|rcp\.|neg\.f|abs\.f|selp\.f|setp\.\w+\.f)")


@needs_nvcc
@pytest.mark.parametrize("name", ["default-d128-g4", "k8v4-d128-g4"])
def test_entries_compile_to_the_nvrtc_kernels_code(builds, name, tmp_path):
    """Same instructions as the source kernels (nvcc, the NVRTC path's flags and macros): the multiset of all
    instructions (registers reduced to their class) and the order of every floating-point, matrix, memory and
    shuffle instruction agree; only the parameter loads differ (and the float scale's bits moved to a float).
    ptxas: the same registers, spills, stack and shared memory (sm_80 and sm_90)."""
    out, entries = builds(name)
    source = SOURCE_PATH.read_text()
    defines = entries[0]["defines"]
    for cc in (80, 90):
        src_ptx, src_log = _compile_source_kernels(defines, cc, tmp_path)
        for e in entries:
            lay = cuda_aot.abi_layout(source, e["source_kernel"], defines)
            ours = _instructions((out / e["compiled"][f"sm_{cc}"]["ptx"]).read_text(), e["kernel_name"],
                                 [*lay.inputs, *(x for x, _ in lay.extras), *lay.outputs],
                                 {x: p for x, p in lay.extras if x != p})
            theirs = _instructions(src_ptx, e["source_kernel"], [p.name for p in lay.params], {})
            assert len(ours) == len(theirs) > 100
            assert Counter(ours) == Counter(theirs), (Counter(ours) - Counter(theirs), Counter(theirs) - Counter(ours))
            ordered = lambda xs: [x for x in xs if _ORDERED.match(x)]  # noqa: E731
            assert ordered(ours) == ordered(theirs)
            info = {k: v for k, v in e["compiled"][f"sm_{cc}"].items()
                    if k in ("registers", "spill_stores", "spill_loads", "stack_bytes", "static_shared_bytes")}
            assert info == cuda_aot.ptxas_info(src_log, e["source_kernel"]), (cc, e["source_kernel"])


@needs_nvcc
@pytest.mark.parametrize("name", list(SHAPES))
def test_no_spills_on_sm90(builds, name):
    """Spills on sm_90 within each shape's bound (none for the score kernel, nvcc 13.0); the register cap holds on
    both targets."""
    _, entries = builds(name)
    for e in entries:
        for target, c in e["compiled"].items():
            threads = e["block"][0]
            min_blocks = e["defines"]["MIN_BLOCKS"] if e["source_kernel"] == "diffkv_decode_partial" else 1
            assert c["registers"] * threads * min_blocks <= 65536, (target, c)
        sm90 = e["compiled"]["sm_90"]
        bound = 0 if e["source_kernel"] == "diffkv_decode_scores" else SHAPES[name][1]
        if bound is not None:
            assert sm90["spill_stores"] <= bound and sm90["spill_loads"] <= bound, (e["kernel_name"], sm90)


class _Recorder:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def __call__(self, grid, block, args, shared_mem=0):
        self.log.append((self.name, tuple(grid), tuple(block), tuple(args), shared_mem))


def test_defines_and_arguments_are_launch_partials(monkeypatch):
    """``cuda_decode.launch_partial`` (and ``_launch_scores``, the separate score update) recorded on CPU tensors with NVRTC and the stream
    stubbed out: the macros it compiles with, its grid, block and every argument (by the source kernel's
    parameter names) equal the manifest's defines and :func:`cuda_aot.launch_args` in TensorRT's order."""
    from trtllm_diffkv.kernels import cuda_decode as cd
    from trtllm_diffkv.kernels.attn_decode_kernels import LOG2E
    from trtllm_diffkv.kernels.decode_attention import DecodeWorkspace

    shape = _shape()
    defines, sizes = cuda_aot.cuda_kernel_defines(shape)
    compiled, launches = [], []
    monkeypatch.setattr(cd, "device_shared_limits", lambda device: cd.SM90_SHARED_LIMITS)
    monkeypatch.setattr(cd, "_kernel", lambda d, *rest: (compiled.append(dict(d)),
                                                         (_Recorder(launches, "diffkv_decode_partial"),
                                                          _Recorder(launches, "diffkv_decode_scores")))[1])
    monkeypatch.setattr(cd, "_stream", lambda ptr, device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fmt, B, H, R = shape.page_format, shape.max_batch_size, shape.num_kv_heads, shape.max_pages_per_row
    num_seqs = B - 1  # a step smaller than the engine's batch
    ws = DecodeWorkspace.allocate(B, shape.num_heads, H, fmt, R, "cpu", num_partitions=sizes["num_partitions"])
    bufs = dict(q=torch.zeros(num_seqs, shape.num_heads, shape.head_dim, dtype=torch.float16),
                pool=torch.zeros(5, fmt.page_size_bytes, dtype=torch.uint8),
                table=torch.zeros(B * H * shape.num_layers, R, dtype=torch.int32),
                tier_tokens=torch.zeros(B * H * shape.num_layers, 2, dtype=torch.int32),
                row_ids=torch.zeros(num_seqs, H, dtype=torch.int32), part_m=ws.part_m, part_l=ws.part_l,
                part_acc=ws.part_acc, page_probs=ws.page_probs, page_max=ws.page_max, lse=ws.lse)
    cd.launch_partial(bufs["q"], bufs["pool"], fmt, bufs["table"], bufs["tier_tokens"], bufs["row_ids"], ws,
                      float(sizes["sm_scale"]) * LOG2E, True, None, 0)  # its merge (the NVRTC path's scores) not launched
    # (stages=0: the AOT build is the register path, whose shared memory is static: the manifest's shared_mem 0)
    cd._launch_scores(_Recorder(launches, "diffkv_decode_scores"), bufs["q"], bufs["pool"], bufs["table"],
                      bufs["tier_tokens"], bufs["row_ids"], ws, num_seqs, H, 0)
    assert compiled == [defines]
    entries = {e["source_kernel"]: e for e in cuda_aot.cuda_kernel_entries(shape)}
    source = SOURCE_PATH.read_text()
    assert [name for name, *_ in launches] == list(entries)
    for kernel, grid, block, args, shared_mem in launches:
        entry = entries[kernel]
        got_grid, got_block, values = cuda_aot.launch_args(entry, bufs, num_seqs)
        assert (got_grid, got_block) == (grid, block)
        assert shared_mem == entry["shared_mem"] == 0
        by_name = dict(zip([p.name for p in cuda_aot.kernel_parameters(source, kernel)], args))
        n_in, n_x = len(entry["inputs"]), len(entry["extras"])
        for name, value in zip(entry["inputs"], values[:n_in]):
            assert value == by_name[name], name
        for x, value in zip(entry["extras"], values[n_in:n_in + n_x]):
            want = by_name[x["param"]]
            if isinstance(want, np.float32):
                want = np.array([want], dtype=np.float32).view(np.int32)[0]
            assert isinstance(value, np.int32) and value == want, x
        for name, value in zip(entry["outputs"], values[n_in + n_x:]):
            assert value == by_name[name], name


def test_the_source_changes_only_in_the_kernel_heads():
    """The build's text substitution: the NVRTC source is unchanged but for the two heads (now inlined bodies)."""
    source = SOURCE_PATH.read_text()
    text = cuda_aot.aot_source(source, [])
    head = 'extern "C" __global__ void __launch_bounds__('
    restored = text.replace("static __device__ __forceinline__ void\ndiffkv_decode_partial_body(",
                            head + "WARPS * 32, MIN_BLOCKS)\ndiffkv_decode_partial(")
    restored = restored.replace("static __device__ __forceinline__ void\ndiffkv_decode_scores_body(",
                                head + "SCORE_WARPS * 32)\ndiffkv_decode_scores(")
    assert restored.startswith(source.rstrip("\n"))
    assert cuda_aot.f32_bits(1.0) == 0x3F800000 and cuda_aot.f32_bits(-2.0) == -0x40000000


@pytest.mark.parametrize("shape,match", [
    (lambda: _shape(head_dim=96), "head_dim=96"),
    (lambda: _shape(head_dim=256), "head_dim=256"),
    (lambda: _shape(num_heads=32, num_kv_heads=2), "ratio 32/2"),
    (lambda: _shape(dtype="float32"), "float32"),
    (lambda: _shape("fp16"), "key_bits=16"),
])
def test_unsupported_engines_raise_before_compiling(shape, match, tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_aot, "_run", lambda *a, **k: pytest.fail("nvcc ran"))
    with pytest.raises(ValueError, match="the CUDA decode kernel does not cover this engine") as info:
        cuda_aot.build_cuda_kernels(shape(), tmp_path)
    assert match in str(info.value)
    assert not any(tmp_path.iterdir())


def test_bad_target_and_missing_nvcc(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="sm_75"):
        cuda_aot.build_cuda_kernels(_shape(), tmp_path, targets=(75,))
    monkeypatch.setattr(cuda_aot, "nvcc_path", lambda: None)
    with pytest.raises(RuntimeError, match="nvcc is not on PATH"):
        cuda_aot.build_cuda_kernels(_shape(), tmp_path)


def test_launch_args_refuses_a_batch_above_the_engines():
    entry = dict(sizes=dict(num_seqs=4), grid=["num_seqs"], defines={}, inputs=[], extras=[], outputs=[],
                 block=[1, 1, 1])
    with pytest.raises(ValueError, match="num_seqs=5"):
        cuda_aot.launch_args(entry, {}, 5)
