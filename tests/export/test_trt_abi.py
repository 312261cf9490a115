"""The TensorRT-convention wrappers' helpers (``export/trt_abi.py``), the onnxruntime op that launches them
(``trtllm_diffkv/export/plugin_ops.py::run_abi_kernel``), the target check (``export/aot.py::check_targets``) and the CUDA kernels' build
directory on a failed nvcc step (``export/cuda_aot.py``), on the CPU (Triton's interpreter, a fake ``nvcc``).

The wrappers here are of a small synthetic kernel written to a temporary module (``_kernel_module``), so the tests do
not depend on the DiffKV kernels' parameter lists.
"""
import json
import os
import select
import sys
import textwrap
import traceback
import uuid

import numpy as np
import pytest
import torch

from trtllm_diffkv.export import aot, cuda_aot, trt_abi
from trtllm_diffkv.export.fields import EngineShape
from trtllm_diffkv.config import get_preset

_KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def add_kernel({x}, {y}, {n}, {scale}, {block}: tl.constexpr):
    offs = tl.program_id(0) * {block} + tl.arange(0, {block})
    m = offs < {n}
    a = tl.load({x} + offs, mask=m)
    b = tl.load({y} + offs, mask=m)
    tl.store({x} + offs, a + b * {scale}, mask=m)
'''


@pytest.fixture
def make_kernel(tmp_path, monkeypatch):
    """``make_kernel(**names) -> AbiKernel``: the wrapper of ``add_kernel(x_ptr, y_ptr, n, scale, BLOCK)`` (``x`` +=
    ``y * scale``; parameters renamed by ``names``), bound as its launcher binds it (two inputs), in a fresh module
    (a fresh wrapper source: nothing cached by an earlier test)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(trt_abi, "_MODULES", {})
    made = []

    def make(**names):
        p = {**dict(x="x_ptr", y="y_ptr", n="n", scale="scale", block="BLOCK"), **names}
        module = f"_trt_abi_test_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{module}.py").write_text(_KERNEL.format(**p))
        made.append(module)
        entry = dict(name="add", kernel=f"{module}:add_kernel",
                     params=[p["x"], p["y"], p["n"], p["scale"], p["block"]],
                     signature={p["x"]: "*fp32", p["y"]: "*fp32", p["n"]: "i32", p["scale"]: "fp32",
                                p["block"]: "constexpr"},
                     constexprs={p["block"]: 16}, options=dict(num_warps=1, num_stages=1), divisible=[])
        return trt_abi.from_launcher(entry)

    yield make
    for module in made:
        sys.modules.pop(module, None)


# --------------------------------------------------------------------------- launch_plan


def _attrs(grid, sizes, dims, constexprs=None, extras=()):
    return dict(grid=json.dumps(grid), sizes=json.dumps(sizes), dims=json.dumps(dims),
                constexprs=json.dumps(constexprs or {}), extras=json.dumps(list(extras)))


def _trtp_cdiv(a, b):
    """TensorRT's ``trtp.cdiv`` as far as these tests need it: refuses two ints (``tensorrt/plugin/_top_level.py``),
    else a symbolic result."""
    if isinstance(a, int) and isinstance(b, int):
        raise ValueError("Both arguments cannot be 'int's")
    return ("cdiv", a, b)


class _Dim:
    """A symbolic dim (TensorRT's shape expression, as far as ``launch_plan`` uses it)."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


def test_cdiv_of_two_ints_is_computed_not_passed_to_trtp():
    """The score kernel's grid ``cdiv(R, POS_PER_PROG)`` is all ints (``R`` an engine constant): computed here, as
    ``trtp.cdiv`` refuses two ints; a symbolic operand still goes to the given ``cdiv``."""
    b = _Dim("B")
    attrs = _attrs(["num_seqs", "num_kv_heads", "cdiv(R, POS_PER_PROG)"],
                   {"num_seqs": "B", "num_kv_heads": 4, "R": 40, "M": "B"},
                   {"B": [0, 0, 1]}, {"POS_PER_PROG": 16}, [["m", "cdiv(M, 2)"], ["r", "cdiv(R, 7)"]])
    grid, extras = trt_abi.launch_plan(attrs, lambda j, axis: b, cdiv=_trtp_cdiv)
    assert grid == (b, 4, 3)
    assert extras[1] == 6 and extras[0][0] == "cdiv" and extras[0][2] == 2
    assert trt_abi.eval_expr("cdiv(7, 2)", {}, _trtp_cdiv) == 4
    assert trt_abi.eval_expr("cdiv(8, 2)", {}, _trtp_cdiv) == 4
    assert trt_abi.eval_expr("cdiv(x, 2)", {"x": b}, _trtp_cdiv) == ("cdiv", b, 2)
    assert trt_abi.eval_expr("cdiv(x, 2)", {"x": np.int64(7)}, _trtp_cdiv) == 4  # numpy integers are integers
    # with ints only, the same as without a cdiv
    grid, _ = trt_abi.launch_plan(attrs, lambda j, axis: 5, cdiv=_trtp_cdiv)
    assert grid == trt_abi.launch_plan(attrs, lambda j, axis: 5)[0] == (5, 4, 3)


def test_a_step_size_missing_from_dims_is_refused():
    """A size that reads a step symbol the node's ``dims`` do not give raises (it used to be 0: an empty grid)."""
    attrs = _attrs(["num_seqs", "cdiv(R, 16)"], {"num_seqs": "B", "R": "P"}, {"B": [0, 0, 1]})
    with pytest.raises(ValueError, match=r"size R = .P. uses the step size P\b"):
        trt_abi.launch_plan(attrs, lambda j, axis: 3)
    with pytest.raises(ValueError, match=r"step size n\b"):  # a grid reading one directly
        trt_abi.launch_plan(_attrs(["cdiv(n, 4)"], {}, {"B": [0, 0, 1]}), lambda j, axis: 3)
    # symbols no expression uses need no dim; a dim with a divisor
    assert trt_abi.launch_plan(_attrs(["num_seqs", 2], {"num_seqs": "B"}, {"B": [0, 1, 3]}),
                               lambda j, axis: 12) == ((4, 2, 1), [])


# --------------------------------------------------------------------------- scalar_bits


@pytest.mark.parametrize("value, kernel_type", [(3.7, "i32"), ("12", "i32"), (3.0, "i32"), (None, "i32"),
                                                (1e39, "fp32"), (-1e39, "fp32"), ("1.5", "fp32")])
def test_scalar_bits_refuses_what_the_type_cannot_carry(value, kernel_type):
    with pytest.raises(ValueError):
        trt_abi.scalar_bits(value, kernel_type)


def test_scalar_bits_takes_integers_and_fp32_limits():
    assert trt_abi.scalar_bits(True, "i32") == 1 and trt_abi.scalar_bits(np.int64(-5), "i32") == -5
    assert trt_abi.scalar_bits(2**31 - 1, "i32") == 2**31 - 1
    f32 = lambda bits: np.int32(bits).view(np.float32)  # noqa: E731
    fmax = float(np.finfo(np.float32).max)
    assert f32(trt_abi.scalar_bits(fmax, "fp32")) == np.float32(fmax)
    assert f32(trt_abi.scalar_bits(np.float32(0.5), "fp32")) == 0.5 and f32(trt_abi.scalar_bits(2, "fp32")) == 2
    assert f32(trt_abi.scalar_bits(float("-inf"), "fp32")) == -np.inf
    assert np.isnan(f32(trt_abi.scalar_bits(float("nan"), "fp32")))


# --------------------------------------------------------------------------- wrapper_source, strip_scratch


@pytest.mark.parametrize("names, clash", [
    (dict(block="in0"), "in0"),  # a constexpr named like an input
    (dict(block="out1"), "out1"),  # ... like an output
    (dict(block="x_scale"), "x_scale"),  # ... like the extra arg of scalar `scale`
    (dict(block="_body0"), "_body0"),  # ... like the imported original kernel
    (dict(block="tl"), "tl"),
    (dict(y="in1"), "in1"),  # a runtime parameter
])
def test_wrapper_source_refuses_parameters_named_like_generated_names(make_kernel, names, clash):
    k = make_kernel(**names)
    with pytest.raises(ValueError, match=rf"add_kernel.*parameter '{clash}' collides"):
        trt_abi.wrapper_source([k])


def test_wrapper_source_of_a_plain_kernel(make_kernel):
    src = trt_abi.wrapper_source([make_kernel()])
    assert "def trt_add__" in src and "(in0, in1, x_n, x_scale, out0, out1, BLOCK: tl.constexpr)" in src


def test_strip_scratch_checks_the_parameter_count():
    ptx = (".visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .u32 k_param_1,\n\t.param .u64 k_param_2,"
           "\n\t.param .u64 k_param_3\n)\n{\n\tld.param.b64 %rd1, [k_param_0];\n\tret;\n}\n")
    assert trt_abi.ptx_entry_params(trt_abi.strip_scratch(ptx, "k", 2), "k") == [".u64", ".u32"]
    for keep in (1, 3):
        with pytest.raises(ValueError, match=rf"declares 4 parameters, expected {keep} \+ 2"):
            trt_abi.strip_scratch(ptx, "k", keep)


# --------------------------------------------------------------------------- load_wrappers, compile_abi


def _wait(fd, what):
    if not select.select([fd], [], [], 60)[0]:
        raise TimeoutError(what)
    os.read(fd, 1)


def test_load_wrappers_from_forked_processes(make_kernel, tmp_path, monkeypatch):
    """A parent and its forked child write the same wrapper module at the same time (both write their temporary
    file before either renames it): both import it, and no temporary file is left."""
    k = make_kernel()
    folder = tmp_path / "cache"
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    real_replace = os.replace
    pid = os.fork()
    child = pid == 0

    def gated_replace(src, dst, *args, **kwargs):
        if child:  # our temporary file is written: tell the parent, rename after it
            os.write(to_parent_w, b"x")
            _wait(to_child_r, "parent did not rename")
            return real_replace(src, dst, *args, **kwargs)
        _wait(to_parent_r, "child did not reach its rename")
        try:
            return real_replace(src, dst, *args, **kwargs)
        finally:
            os.write(to_child_w, b"x")

    monkeypatch.setattr(os, "replace", gated_replace)
    if child:
        code = 1
        try:
            module = trt_abi.load_wrappers([k], folder)
            code = 0 if hasattr(module, k.function) else 2
        except BaseException:  # noqa: BLE001 - reported through the exit status
            traceback.print_exc()
        finally:
            os._exit(code)
    try:
        module = trt_abi.load_wrappers([k], folder)
    finally:
        _, status = os.waitpid(pid, 0)
    assert hasattr(module, k.function)
    assert os.waitstatus_to_exitcode(status) == 0, "the child failed to write or import the wrappers"
    assert [p.name for p in folder.iterdir() if p.is_file()] == [module.__file__.rsplit("/", 1)[1]]


def test_load_wrappers_tolerates_a_concurrent_writer(make_kernel, tmp_path, monkeypatch):
    """The rename fails (FileNotFoundError) but the target already holds the source (another writer won): fine;
    a target with other text is an error. No temporary file is left either way."""
    k = make_kernel()
    folder = tmp_path / "cache"
    src = trt_abi.wrapper_source([k])
    real_replace = os.replace

    def lost_race(text):
        def replace(a, b, *args, **kwargs):
            real_replace(a, b, *args, **kwargs)
            with open(b, "w") as f:
                f.write(text)
            raise FileNotFoundError(a)
        return replace

    monkeypatch.setattr(os, "replace", lost_race("# someone else's\n"))
    with pytest.raises(FileNotFoundError):
        trt_abi.load_wrappers([k], folder)
    files = [p for p in folder.iterdir() if p.is_file()]
    assert [p.suffix for p in files] == [".py"] and files[0].read_text() == "# someone else's\n"
    files[0].unlink()
    monkeypatch.setattr(os, "replace", lost_race(src))
    module = trt_abi.load_wrappers([k], folder)
    assert hasattr(module, k.function) and [p.suffix for p in folder.iterdir() if p.is_file()] == [".py"]


def test_compile_abi_leaves_only_trt_abi_py_in_the_engine_dir(make_kernel, tmp_path, monkeypatch):
    """The wrappers are imported from load_wrappers' default folder (``<cache_root()>/trt_abi``, here
    ``$XDG_CACHE_HOME/trtllm-diffkv/trt_abi``: the one cache root, not a ``~/.cache`` of its own), not from a copy
    inside the engine directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TRTLLM_DIFFKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    k = make_kernel()
    out = tmp_path / "engine"
    trt_abi.compile_abi([k], out, ())
    assert [p.name for p in out.iterdir()] == ["trt_abi.py"]
    assert (out / "trt_abi.py").read_text() == trt_abi.wrapper_source([k])
    cached = list((tmp_path / "xdg" / "trtllm-diffkv" / "trt_abi").glob("trt_abi_*.py"))
    assert len(cached) == 1 and cached[0].read_text() == trt_abi.wrapper_source([k])


# --------------------------------------------------------------------------- run_abi_kernel


def _node(k, n_extra="N", scale=0.5):
    return dict(abi=json.dumps(k.to_json()), grid=json.dumps(["cdiv(N, BLOCK)"]), sizes=json.dumps({"N": "n"}),
                dims=json.dumps({"n": [0, 0, 1]}), constexprs=json.dumps(k.constexprs),
                extras=json.dumps([["n", n_extra], ["scale", trt_abi.scalar_bits(scale, "fp32")]]),
                num_warps=1, num_stages=1)


def test_run_abi_kernel_launches_the_wrapper(make_kernel):
    from trtllm_diffkv.export import plugin_ops as ops

    k = make_kernel()
    x, y = torch.arange(40, dtype=torch.float32), torch.ones(40)
    ops.run_abi_kernel([x, y], _node(k))
    assert torch.equal(x, torch.arange(40, dtype=torch.float32) + 0.5) and torch.equal(y, torch.ones(40))


def test_run_abi_kernel_checks_its_inputs(make_kernel):
    from trtllm_diffkv.export import plugin_ops as ops

    k = make_kernel()
    attrs = _node(k)
    x, y = torch.zeros(40), torch.zeros(40)
    with pytest.raises(ValueError, match="1 tensors for a wrapper of 2 inputs"):
        ops.run_abi_kernel([x], attrs)
    with pytest.raises(ValueError, match="3 tensors for a wrapper of 2 inputs"):
        ops.run_abi_kernel([x, y, y.clone()], attrs)
    with pytest.raises(ValueError, match="input 1 is torch.complex64"):
        ops.run_abi_kernel([x, torch.zeros(40, dtype=torch.complex64)], attrs)
    with pytest.raises(ValueError, match="input 0 is torch.float16, the wrapper takes fp32"):
        ops.run_abi_kernel([x.half(), y], attrs)
    # two inputs merged into one buffer (an optimizer's common-subexpression elimination of two zero tensors)
    with pytest.raises(ValueError, match="inputs 0 and 1 share memory"):
        ops.run_abi_kernel([x, x], attrs)
    with pytest.raises(ValueError, match="inputs 0 and 1 share memory"):
        ops.run_abi_kernel([x, x.view(8, 5).view(40)], attrs)
    assert torch.equal(x, torch.zeros(40))  # nothing ran


# --------------------------------------------------------------------------- check_targets


def test_check_targets_refuses_duplicates():
    aot.check_targets((80, 90))
    with pytest.raises(ValueError, match="sm_90 listed more than once"):
        aot.check_targets((90, 90))
    with pytest.raises(ValueError, match="sm_80 listed more than once"):
        aot.check_targets([80, 90, 80])


# --------------------------------------------------------------------------- cuda_aot with a fake nvcc


_FAKE_NVCC = '''#!{python}
import sys
args = sys.argv[1:]
if "--version" in args:
    print("Cuda compilation tools, release 13.0, V13.0.48")
    sys.exit(0)
out = args[args.index("-o") + 1]
if "-ptx" in args:
    open(out, "w").write(".version 8.7\\n.target sm_90\\n")
    sys.exit(0)
if "-cubin" in args:
    if {fail}:
        print("ptxas info    : 0 bytes gmem", file=sys.stderr)
        print("ptxas fatal   : Unresolved extern function 'oops'", file=sys.stderr)
        print("", file=sys.stderr)
        sys.exit(255)
    open(out, "wb").write(b"\\x7fELF fake")
    for fn in ("diffkv_trt_decode_partial", "diffkv_trt_decode_scores"):
        print("ptxas info    : Function properties for " + fn)
        print("    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
        print("ptxas info    : Used 128 registers, used 1 barriers, 380 bytes cmem[0]")
    sys.exit(0)
sys.exit(3)
'''


def _fake_nvcc(tmp_path, monkeypatch, fail):
    bin_dir = tmp_path / f"bin_{int(fail)}"
    bin_dir.mkdir()
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(_FAKE_NVCC.format(python=sys.executable, fail=fail))
    nvcc.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")


def _cuda_shape():
    return EngineShape(num_layers=2, num_heads=16, num_kv_heads=4, head_dim=128, kv_config=get_preset("diffkv"),
                       dtype="float16", max_batch_size=4, max_seq_len=2048)


def test_failed_nvcc_step_leaves_the_output_dir_unchanged(tmp_path, monkeypatch):
    """ptxas fails: nothing of the build lands in ``out_dir`` (what was there stays), and the error's first line is
    ptxas' reason (the last non-empty line it printed)."""
    _fake_nvcc(tmp_path, monkeypatch, fail=True)
    out = tmp_path / "out"
    out.mkdir()
    (out / "cuda_kernels.json").write_text("{\"previous\": 1}")
    with pytest.raises(RuntimeError) as info:
        cuda_aot.build_cuda_kernels(_cuda_shape(), out, targets=(90,))
    first, second = str(info.value).splitlines()[:2]
    assert first == "ptxas fatal   : Unresolved extern function 'oops'"
    assert second.startswith("command: ") and "-cubin" in second and "(exit 255)" in second
    assert [p.name for p in out.iterdir()] == ["cuda_kernels.json"]
    assert (out / "cuda_kernels.json").read_text() == "{\"previous\": 1}"


def test_successful_build_moves_everything_in(tmp_path, monkeypatch):
    _fake_nvcc(tmp_path, monkeypatch, fail=False)
    out = tmp_path / "out"
    entries = cuda_aot.build_cuda_kernels(_cuda_shape(), out, targets=(80, 90))
    names = sorted(p.name for p in out.iterdir())
    expect = sorted([cuda_aot.MANIFEST_NAME] + [e["generated_source"] for e in entries]
                    + [f"{e['name']}.sm{cc}.{ext}" for e in entries for cc in (80, 90) for ext in ("ptx", "cubin")])
    assert names == expect and len(entries) == 2
    manifest = json.loads((out / cuda_aot.MANIFEST_NAME).read_text())
    assert manifest["targets"] == ["sm_80", "sm_90"]
    assert manifest["cuda_kernels"][0]["compiled"]["sm_90"]["registers"] == 128
    for e in entries:
        for c in e["compiled"].values():
            assert (out / c["ptx"]).exists() and (out / c["cubin"]).read_bytes().startswith(b"\x7fELF")


def test_nvcc_failure_without_output_names_the_exit_status(tmp_path):
    script = tmp_path / "quiet"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        sys.exit(7)
        """))
    script.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"^quiet exited with status 7, printing nothing\ncommand: "):
        cuda_aot._run([str(script), "-x"], 30)
