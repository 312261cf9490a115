"""The partial kernel's spills as the GPU's compiler makes them, on the CPU machine.

On the GPU, CuPy compiles ``cuda/decode_partial.cu`` with NVRTC, and ``_spill_free_kernel`` steps the ring's
register cap down while the kernel uses more than ``LOCAL_BYTES_TOLERATED`` bytes of local memory. nvcc's frontend
spills differently from NVRTC's at the same macros (Llama-3-8B's shape at 4 CTAs, with the merge prefetch at the end
of the CTA: nvcc 13.0 spills 4 bytes, NVRTC 13.0 16), so the nvcc tests in ``test_cuda_decode.py`` did not see that
Llama's kernel ran at 3 CTAs a multiprocessor instead of 4 (found on an H100 by
``tests/kernels/test_attention_gpu.py::test_the_ring_runs_a_kernel_without_local_memory``). Here NVRTC (the
``nvidia-cuda-nvrtc`` 13.0 wheel, which ``build_scripts/setup_env.sh`` installs on a machine without CUDA) writes
the PTX and ptxas reports the stack frame: at ``2bc6ed1`` this gives the H200's recorded 8 / 56 / 24 bytes
(docs/PERFORMANCE.md). Skipped without that NVRTC or without ptxas.
"""
import ctypes
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trtllm_diffkv.config import PRESETS
from trtllm_diffkv.kernels import cuda_decode as cd
from trtllm_diffkv.memory import PageFormat


def _nvrtc():
    """The pip wheel's ``libnvrtc.so.13`` (ctypes, its builtins library loaded first), or skip."""
    for base in sys.path:
        lib = Path(base or ".") / "nvidia" / "cu13" / "lib"
        builtins = sorted(p for p in lib.glob("libnvrtc-builtins.so.13.*") if ".alt." not in p.name)
        if (lib / "libnvrtc.so.13").is_file() and builtins:
            ctypes.CDLL(str(builtins[0]), mode=ctypes.RTLD_GLOBAL)  # what libnvrtc dlopens by name
            nv = ctypes.CDLL(str(lib / "libnvrtc.so.13"))
            major, minor = ctypes.c_int(), ctypes.c_int()
            nv.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
            if (major.value, minor.value) != (13, 0):
                pytest.skip(f"NVRTC {major.value}.{minor.value}: the recorded spills are NVRTC 13.0's")
            return nv
    pytest.skip("no nvidia-cuda-nvrtc 13 wheel (build_scripts/setup_env.sh installs it)")


def _nvrtc_ptx(nv, source: str, options: list[str]) -> str:
    prog = ctypes.c_void_p()
    assert nv.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"decode_partial.cu", 0, None, None) == 0
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = nv.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetProgramLog(prog, log)
        assert rc == 0, log.value.decode()[-3000:]
        nv.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode()
    finally:
        nv.nvrtcDestroyProgram(ctypes.byref(prog))


def nvrtc_stack_bytes(preset: str, head_dim: int, group: int, min_blocks: int | None, tmp_path, **macros) -> int:
    """Stack frame (local memory) of ``diffkv_decode_partial`` compiled as on an sm_90 GPU: NVRTC with CuPy's flags
    (``-std=c++17 -ftz=true``, the device's arch; PTX here) at :func:`compile_defines`' macros, then ptxas."""
    nv = _nvrtc()
    if shutil.which("ptxas") is None:
        pytest.skip("ptxas is not on PATH")
    fmt = PageFormat.for_config(PRESETS[preset], head_dim)
    pmax = max(fmt.high_tokens_per_page, fmt.low_tokens_per_page)
    defines = cd.compile_defines(fmt, group, 16, head_dim, pmax, True, min_blocks=min_blocks,
                                 shared_limits=cd.SM90_SHARED_LIMITS)
    defines.update(macros)
    options = ["-std=c++17", "-arch=compute_90", "-ftz=true", *[f"-D{k}={v}" for k, v in sorted(defines.items())]]
    ptx = tmp_path / "partial.ptx"
    ptx.write_text(_nvrtc_ptx(nv, cd.SOURCE_PATH.read_text(), options))
    res = subprocess.run(["ptxas", "-v", "-arch=sm_90", str(ptx), "-o", str(tmp_path / "partial.cubin")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    text = re.split(r"Compiling entry function 'diffkv_decode_partial'", res.stdout + res.stderr)[1]
    return int(re.search(r"(\d+) bytes stack frame", text).group(1))


@pytest.mark.parametrize("preset,head_dim,group", [("llama3-8b", 128, 4), ("default", 64, 3)])
def test_the_measured_shapes_keep_their_preferred_cap_under_nvrtc(preset, head_dim, group, tmp_path):
    """Llama-3-8B's shape (4 CTAs a multiprocessor) and the default model's (6) compile within
    ``LOCAL_BYTES_TOLERATED`` at the cap :func:`compile_defines` prefers, with the merge prefetch on (its default), so
    ``_spill_free_kernel`` keeps that cap on the GPU (NVRTC 13.0: 8 and 0 bytes; 16 for Llama's before the prefetch
    loaded its row's bounds again)."""
    assert cd.MERGE_PREFETCH == 1
    fmt = PageFormat.for_config(PRESETS[preset], head_dim)
    preferred = cd.compile_defines(fmt, group, 16, head_dim, max(fmt.high_tokens_per_page, fmt.low_tokens_per_page),
                                   True, shared_limits=cd.SM90_SHARED_LIMITS)["MIN_BLOCKS"]
    assert preferred == (4 if head_dim == 128 else 6)
    assert nvrtc_stack_bytes(preset, head_dim, group, None, tmp_path) <= cd.LOCAL_BYTES_TOLERATED
