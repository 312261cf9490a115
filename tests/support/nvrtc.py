"""The CUDA decode kernel's register cap as the GPU's compiler settles it, on a machine without a GPU.

On the GPU, CuPy compiles ``kernels/cuda/decode_partial.cu`` with NVRTC and
:func:`trtllm_diffkv.kernels.cuda_decode._spill_free_kernel` picks the cap (blocks per multiprocessor) and the merge
prefetch's form from the compiled kernel's local memory. nvcc's frontend spills differently from NVRTC's at the same
macros, so a CPU check of that choice needs NVRTC itself: the ``nvidia-cuda-nvrtc`` 13.0 wheel (what torch cu130's
CuPy loads on the device; ``build_scripts/setup_env.sh`` installs it on a machine without CUDA), driven through ctypes,
with ptxas's report read from NVRTC's log. At ``2bc6ed1`` this gives the H200's recorded 8 / 56 / 24 bytes
(docs/PERFORMANCE.md). Used by ``tests/kernels/test_cuda_decode_nvrtc.py`` and ``tools/nvrtc_caps.py``.
"""
from __future__ import annotations

import ctypes
import re
import sys
import types
from pathlib import Path
from unittest import mock

NVRTC_VERSION = (13, 0)
"""The NVRTC the device runs (torch 2.11+cu130); the recorded spills are this version's."""
CUPY_SM90_OPTIONS = ("-std=c++17", "-arch=sm_90", "--device-as-default-execution-space", "-ftz=true")
"""What CuPy's ``RawModule`` passes NVRTC for an sm_90 device besides the ``-D`` macros (its ``-std`` is the caller's)."""


def load_nvrtc() -> tuple[ctypes.CDLL | None, str]:
    """``(libnvrtc, "")`` from the ``nvidia-cuda-nvrtc`` wheel on ``sys.path`` (its builtins library loaded first,
    which libnvrtc opens by name), or ``(None, why)`` when absent or not :data:`NVRTC_VERSION`."""
    for base in sys.path:
        lib = Path(base or ".") / "nvidia" / "cu13" / "lib"
        builtins = sorted(p for p in lib.glob("libnvrtc-builtins.so.13.*") if ".alt." not in p.name)
        if (lib / "libnvrtc.so.13").is_file() and builtins:
            ctypes.CDLL(str(builtins[0]), mode=ctypes.RTLD_GLOBAL)
            nvrtc = ctypes.CDLL(str(lib / "libnvrtc.so.13"))
            major, minor = ctypes.c_int(), ctypes.c_int()
            nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
            if (major.value, minor.value) != NVRTC_VERSION:
                return None, f"NVRTC {major.value}.{minor.value}: the recorded spills are NVRTC 13.0's"
            return nvrtc, ""
    return None, "no nvidia-cuda-nvrtc 13 wheel (build_scripts/setup_env.sh installs it)"


def partial_defines(preset: str, head_dim: int, group: int, q_bf16: int = 0) -> dict[str, int]:
    """The partial kernel's macros as ``_resolve_partial`` makes them on an sm_90 device for ``preset`` (a name in
    :data:`~trtllm_diffkv.config.PRESETS`) at ``head_dim``, ``group`` query heads a KV head, the score update on, and
    ``Q_BF16`` for bf16 queries; the cap unpinned (``compile_defines``' preferred ``MIN_BLOCKS``)."""
    from trtllm_diffkv.config import PRESETS
    from trtllm_diffkv.kernels import cuda_decode as cd
    from trtllm_diffkv.memory import PageFormat

    fmt = PageFormat.for_config(PRESETS[preset], head_dim)
    pmax = max(fmt.high_tokens_per_page, fmt.low_tokens_per_page)
    defines = cd.compile_defines(fmt, group, 16, head_dim, pmax, True, shared_limits=cd.SM90_SHARED_LIMITS)
    return {**defines, "Q_BF16": q_bf16}


def stack_bytes(nvrtc: ctypes.CDLL, source: str, defines: dict[str, int],
                function: str = "diffkv_decode_partial") -> int:
    """Stack frame in bytes (the local memory CUDA reports as ``local_size_bytes``) of ``function`` in ``source``,
    compiled by ``nvrtc`` with :data:`CUPY_SM90_OPTIONS` and ``-D`` ``defines``.

    Raises:
        RuntimeError: the source does not compile (NVRTC's log attached), or ``function`` is not in ptxas's report.
    """
    options = [*CUPY_SM90_OPTIONS, "--ptxas-options=-v", *[f"-D{k}={v}" for k, v in sorted(defines.items())]]
    prog = ctypes.c_void_p()
    status = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"decode_partial.cu", 0, None, None)
    if status != 0:
        raise RuntimeError(f"nvrtcCreateProgram failed (nvrtcResult {status})")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = nvrtc.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        text = log.value.decode()
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    if rc != 0:
        raise RuntimeError(f"NVRTC could not compile {function}: {text[-3000:]}")
    parts = text.split(f"Compiling entry function '{function}'")
    found = re.search(r"(\d+) bytes stack frame", parts[1]) if len(parts) > 1 else None
    if found is None:
        raise RuntimeError(f"{function}'s stack frame is not in ptxas's report: {text[-3000:]}")
    return int(found.group(1))


def settled_cap(nvrtc: ctypes.CDLL, defines: dict[str, int], source: str | None = None) -> tuple[int, int, dict]:
    """``(blocks per multiprocessor, local bytes, the chosen macros)`` that ``_spill_free_kernel`` settles on for the
    partial kernel (``diffkv_decode_partial``; not the fused kernel, whose text is ``fused_source()``) at
    ``defines`` (:func:`~trtllm_diffkv.kernels.cuda_decode.compile_defines`' macros, plus ``Q_BF16`` for bf16
    queries), its kernels compiled by ``nvrtc`` from ``source`` (default: this tree's ``decode_partial.cu``; an
    earlier commit's text reproduces that commit where the macros still apply)."""
    from trtllm_diffkv.kernels import cuda_decode as cd

    text = cd.SOURCE_PATH.read_text() if source is None else source

    def kernel(key, arch, shared_bytes=0, device=None):
        chosen = dict(key)
        return types.SimpleNamespace(local_size_bytes=stack_bytes(nvrtc, text, chosen), defines=chosen), None

    cd.clear_compiled_kernels()  # the caches above _kernel hold what the patched one returned: cleared around it
    try:
        with mock.patch.object(cd, "_kernel", kernel):
            partial, _, blocks = cd._spill_free_kernel(tuple(sorted(defines.items())), "sm_90", 0, 0)
    finally:
        cd.clear_compiled_kernels()
    return blocks, partial.local_size_bytes, partial.defines
