"""Ahead-of-time build of the CUDA C++ decode kernels (``kernels/cuda/decode_partial.cu``) in TensorRT's AOT plugin ABI.

At run time :mod:`~trtllm_diffkv.kernels.cuda_decode` compiles ``diffkv_decode_partial`` and
``diffkv_decode_scores`` with NVRTC (through CuPy), specialized by ``-D`` macros
(:func:`~trtllm_diffkv.kernels.cuda_decode.compile_defines`). A TensorRT engine has no Python to do that, so
:func:`build_cuda_kernels` compiles the same source for one :class:`~.fields.EngineShape` with ``nvcc`` into PTX
(what ``@trtp.aot_impl`` hands to TensorRT) and cubin (for tests and loaders that take a binary), per target
(sm_80, sm_90).

The calling convention (TensorRT's Quick Deployable Plugin AOT path, ``tensorrt.plugin.aot_impl``, which returns
kernel name, PTX, ``KernelLaunchParams`` and ``SymIntExprs`` extra arguments): TensorRT launches the kernel with

1. one device pointer per plugin *input* tensor, in input order;
2. the *extra args*: 32-bit integers only (``trtp.SymInt32`` expressions), in the order returned;
3. one device pointer per plugin *output* tensor, in output order.

The source kernels interleave differently (pointers, then a float and ints) and TensorRT has no float extra
argument, so each kernel gets an ABI entry (``extern "C" __global__``, the source kernel's own
``__launch_bounds__``) whose parameters are: every buffer the kernel takes, once each, in the source kernel's
order (the plugin inputs); the scalars as ``int`` (a ``float`` travels as its IEEE-754 bits and is
reinterpreted with ``__int_as_float``); then one pointer per buffer the kernel writes (the plugin outputs,
aliased to their inputs: ``TensorDesc.aliased()``, same device address). The entry calls the source kernel's
body, which the build turns into a ``static __device__ __forceinline__`` function by a text substitution of its
``extern "C" __global__ void __launch_bounds__(...)`` head (:func:`aot_source`); the ``.cu`` file itself is not
changed, so the NVRTC path compiles exactly what it compiled before. Written buffers are accessed through the
output pointers, read-only ones through the input pointers (same addresses under the aliasing).

Which buffers are inputs / outputs / extras is read from the source kernel's parameter list
(:func:`kernel_parameters`): every pointer is an input; a pointer to non-``const`` memory is also an output
(except ``page_probs`` / ``page_max`` of the partial kernel without ``STORE_PROBS``, which it does not write);
``int`` / ``float`` parameters are extras.

Compiler flags: those of the NVRTC path, ``cuda_decode._kernel``'s ``-std=c++17`` plus ``-ftz=true``, which
CuPy appends to every NVRTC compilation (``cupy/cuda/compiler.py::_compile_with_cache_cuda``), and the
``-D`` macros of :func:`~trtllm_diffkv.kernels.cuda_decode.compile_defines` derived as
:func:`~trtllm_diffkv.kernels.cuda_decode.launch_partial` derives them (:func:`cuda_kernel_defines`).
``-arch=sm_80`` / ``-arch=sm_90`` (not ``sm_90a``: CuPy asks NVRTC for ``sm_90`` on an H100/H200, and
``sm_90`` PTX stays loadable on later GPUs). Commands (:func:`nvcc_commands`)::

    nvcc -std=c++17 -ftz=true -arch=sm_90 -ptx -D... -o NAME.sm90.ptx NAME.cu
    nvcc -arch=sm_90 -cubin -Xptxas -v -o NAME.sm90.cubin NAME.sm90.ptx

Output files in ``out_dir``: ``NAME.cu`` (the generated source), ``NAME.sm<cc>.ptx`` / ``.cubin`` and
``cuda_kernels.json`` (``{"version": 1, "nvcc_version", "engine": EngineShape.to_fields(), "targets",
"cuda_kernels": [entry, ...]}``). Manifest entry (one per kernel; :func:`build_cuda_kernels` returns the list)::

    {"name": "cuda_decode_partial__<hash>", "op": "decode_attention", "kernel_name": "diffkv_trt_decode_partial",
     "source_kernel": "diffkv_decode_partial", "source": "trtllm_diffkv/kernels/cuda/decode_partial.cu",
     "source_sha256": ..., "defines": {macro: int}, "flags": ["-std=c++17", "-ftz=true"],
     "inputs": [buffer names, in parameter order], "outputs": [buffer names, in parameter order],
     "aliases": {output name: index of the same buffer in inputs},
     "extras": [{"name", "param" (source parameter), "dtype": "int32", "expr" (of sizes), "value"}, ...],
     "buffers": {name: {"dtype", "shape": [expressions of sizes]}},
     "grid": [expressions of sizes and defines], "block": [threads, 1, 1], "shared_mem": 0 (dynamic bytes),
     "sizes": {"num_seqs", "num_heads", "num_kv_heads", "head_dim", "num_partitions", "R", "sm_scale"},
     "compiled": {"sm_90": {"ptx", "cubin", "ptx_sha256", "cubin_sha256", "registers", "spill_stores",
                            "spill_loads", "stack_bytes", "static_shared_bytes", "ptx_version"}}}

``num_seqs`` (the grid's x) is the batch of the step, at most the engine's ``max_batch_size`` (``sizes`` holds
that maximum); every extra is fixed by the engine, the CTAs a row too (``num_slots = 2 * num_partitions``, the
workspace's capacity; the NVRTC path launches :func:`~trtllm_diffkv.kernels.cuda_decode.cuda_num_slots` of them for
each batch, so the two agree bit for bit only where that count is the capacity). Grid expressions are evaluated like the Triton manifest's
(:func:`~trtllm_diffkv.export.launches.eval_grid`: ``cdiv`` and the names of ``sizes`` and ``defines``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .fields import EngineShape

SUPPORTED_TARGETS = (80, 90)
"""Compute capabilities the CUDA kernels are built for (mma.sync m16n8k16 with fp32 accumulation needs sm_80)."""

NVRTC_FLAGS = ("-std=c++17", "-ftz=true")
"""The NVRTC path's code-generation flags: ``cuda_decode._kernel`` passes ``-std=c++17``, CuPy appends
``-ftz=true`` to every compilation. NVRTC's other defaults equal nvcc's (``-fmad=true``, ``-prec-div=true``,
``-prec-sqrt=true``, ``-O3`` for ptxas)."""

MANIFEST_NAME = "cuda_kernels.json"
MANIFEST_VERSION = 1
ENTRY_PREFIX = "diffkv_trt_"
"""ABI entries are named ``diffkv_trt_<kernel without its diffkv_ prefix>`` (``diffkv_trt_decode_partial``)."""
BODY_SUFFIX = "_body"

_HEAD = re.compile(r'extern "C" __global__ void __launch_bounds__\(([^()]*)\)\s*\n(diffkv_decode_(?:partial|scores))\(')
_PARAM = re.compile(r"^(?P<type>.*?)\s*(?P<restrict>__restrict__)?\s*(?P<name>[A-Za-z_]\w*)$")


@dataclass(frozen=True)
class KernelParam:
    """One parameter of a source kernel: ``ctype`` as written (without ``__restrict__``)."""

    name: str
    ctype: str
    restrict: bool

    @property
    def is_pointer(self) -> bool:
        return self.ctype.endswith("*")

    @property
    def writable(self) -> bool:
        """A pointer to non-``const`` memory (the kernel may write through it)."""
        return self.is_pointer and not self.ctype.startswith("const ")


def _source_text() -> str:
    from ..kernels.cuda_decode import SOURCE_PATH

    return SOURCE_PATH.read_text()


def kernel_parameters(source: str, kernel: str) -> list[KernelParam]:
    """The parameter list of ``extern "C" __global__`` ``kernel`` in ``source`` (the ``.cu`` text).

    Raises:
        ValueError: the kernel's head is not found exactly once, or a parameter is not of the form
            ``type [__restrict__] name`` (the source changed in a way this build does not understand).
    """
    heads = [m for m in _HEAD.finditer(source) if m.group(2) == kernel]
    if len(heads) != 1:
        raise ValueError(f"kernel {kernel!r}: found {len(heads)} heads 'extern \"C\" __global__ void "
                         "__launch_bounds__(...)' in the source (expected 1)")
    start = heads[0].end()
    text = source[start:source.index(")", start)]
    params = []
    for raw in text.split(","):
        raw = " ".join(raw.split())
        m = _PARAM.match(raw)
        if not m or not m.group("type"):
            raise ValueError(f"kernel {kernel!r}: cannot read parameter {raw!r}")
        ctype = " ".join(m.group("type").split())
        if ctype not in ("int", "float") and not ctype.endswith("*"):
            raise ValueError(f"kernel {kernel!r}: parameter {raw!r} is neither a pointer nor int/float")
        params.append(KernelParam(m.group("name"), ctype, bool(m.group("restrict"))))
    return params


@dataclass(frozen=True)
class AbiLayout:
    """The TensorRT ABI of one kernel: ``inputs`` (pointer params, source order), ``extras`` ((name, source param):
    int params as they are, float params as ``<name>_bits``), ``outputs`` (written pointer params)."""

    kernel: str
    params: tuple[KernelParam, ...]
    inputs: tuple[str, ...]
    extras: tuple[tuple[str, str], ...]
    outputs: tuple[str, ...]
    launch_bounds: str

    @property
    def entry_name(self) -> str:
        return ENTRY_PREFIX + self.kernel.removeprefix("diffkv_")


def abi_layout(source: str, kernel: str, defines: dict[str, int]) -> AbiLayout:
    """Inputs, int32 extras and outputs of ``kernel``'s TensorRT ABI entry (see the module docstring).

    Raises:
        ValueError: as :func:`kernel_parameters`.
    """
    params = kernel_parameters(source, kernel)
    bounds = next(m.group(1) for m in _HEAD.finditer(source) if m.group(2) == kernel)
    unwritten = set()
    if kernel == "diffkv_decode_partial" and not defines.get("STORE_PROBS"):
        unwritten = {"page_probs", "page_max"}  # only stored with STORE_PROBS
    inputs = tuple(p.name for p in params if p.is_pointer)
    extras = tuple((p.name + ("_bits" if p.ctype == "float" else ""), p.name) for p in params if not p.is_pointer)
    outputs = tuple(p.name for p in params if p.writable and p.name not in unwritten)
    return AbiLayout(kernel, tuple(params), inputs, extras, outputs, bounds)


def aot_source(source: str, layouts: list[AbiLayout]) -> str:
    """``source`` with every ``layouts`` kernel turned into an inlined body plus its TensorRT ABI entry.

    The kernels' heads ``extern "C" __global__ void __launch_bounds__(B)\\nNAME(`` become
    ``static __device__ __forceinline__ void\\nNAME_body(`` (nothing else of the source changes); after the source,
    each entry ``extern "C" __global__ void __launch_bounds__(B) diffkv_trt_<kernel>(inputs..., int extras...,
    outputs...)`` calls its body with the output pointers for written buffers, the input pointers for the others
    and ``__int_as_float`` of a float's bits. Kernels of the source not in ``layouts`` are made bodies too, unused.

    Raises:
        ValueError: the source does not hold the two kernel heads.
    """
    heads = list(_HEAD.finditer(source))
    if sorted(m.group(2) for m in heads) != ["diffkv_decode_partial", "diffkv_decode_scores"]:
        raise ValueError(f"expected the heads of diffkv_decode_partial and diffkv_decode_scores, found "
                         f"{[m.group(2) for m in heads]}")
    text = _HEAD.sub(lambda m: f"static __device__ __forceinline__ void\n{m.group(2)}{BODY_SUFFIX}(", source)
    parts = [text.rstrip("\n"), "",
             "// ---- TensorRT AOT plugin ABI entries (generated by trtllm_diffkv/export/cuda_aot.py): parameters =",
             "// plugin inputs (pointers), int32 extra args, plugin outputs (pointers, aliased to inputs)."]
    for lay in layouts:
        by_name = {p.name: p for p in lay.params}
        restrict = {p.name: " __restrict__" if p.restrict else "" for p in lay.params}  # as the source declares
        decl = [f"{by_name[n].ctype}{restrict[n]} in_{n}" for n in lay.inputs]
        decl += [f"int {extra}" for extra, _ in lay.extras]
        decl += [f"{by_name[n].ctype}{restrict[n]} out_{n}" for n in lay.outputs]
        call = []
        extra_of = {param: extra for extra, param in lay.extras}
        for p in lay.params:
            if p.is_pointer:
                call.append(f"out_{p.name}" if p.name in lay.outputs else f"in_{p.name}")
            elif p.ctype == "float":
                call.append(f"__int_as_float({extra_of[p.name]})")
            else:
                call.append(extra_of[p.name])
        parts += [f'extern "C" __global__ void __launch_bounds__({lay.launch_bounds})',
                  f"{lay.entry_name}(" + ",\n    ".join(decl) + ") {",
                  f"    {lay.kernel}{BODY_SUFFIX}(" + ", ".join(call) + ");", "}", ""]
    return "\n".join(parts)


# --------------------------------------------------------------------------- engine shapes


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def cuda_kernel_defines(shape: EngineShape) -> tuple[dict[str, int], dict]:
    """(``-D`` macros, sizes) of ``shape``'s decode launch, derived as ``cuda_decode.launch_partial`` derives them.

    The workspace is :meth:`DecodeWorkspace.allocate` for ``max_batch_size`` sequences and
    ``max_pages_per_row`` on the ``meta`` device (as ``export/aot.py::_decode_specs``: default partition count),
    ``update_scores`` = the preset tiers its tokens (``DiffKVConfig.tiered``); ``group_pad`` / ``block_d`` are the workspace's last dims,
    ``pmax`` the larger tier's tokens per page, the register cap ``compile_defines``' default. Sizes:
    ``num_seqs`` (the maximum), ``num_heads``, ``num_kv_heads``, ``head_dim``, ``num_partitions``, ``R``,
    ``sm_scale`` (``head_dim ** -0.5``, the engine's softmax scale as in ``_decode_specs``).

    Raises:
        ValueError: a configuration the CUDA kernel does not cover (the message gives
            ``cuda_decode.unsupported_reason``: head_dim other than 64/128, a query:KV ratio above 8, fp32
            activations, tiers with 16/2-bit keys...).
    """
    from ..kernels import decode_attention as da
    from ..kernels.cuda_decode import compile_defines, unsupported_reason

    fmt = shape.page_format
    reason = unsupported_reason(fmt, shape.num_heads, shape.num_kv_heads, _torch_dtype(shape.dtype))
    if reason is not None:
        raise ValueError(f"the CUDA decode kernel does not cover this engine: {reason}")
    B, H, R = shape.max_batch_size, shape.num_kv_heads, shape.max_pages_per_row
    update_scores = bool(shape.kv_config.tiered)
    ws = da.DecodeWorkspace.allocate(B, shape.num_heads, H, fmt, R, "meta", update_scores=update_scores)
    group = shape.num_heads // H
    group_pad, block_d = ws.part_m.shape[-1], ws.part_acc.shape[-1]  # as launch_partial reads them
    pmax = max(fmt.high_tokens_per_page, fmt.low_tokens_per_page)
    # the register path (stages=0): its shared memory is static, so the plugin's launch needs no attribute
    defines = compile_defines(fmt, group, group_pad, block_d, pmax, update_scores, None, 0)
    sizes = dict(num_seqs=B, num_heads=shape.num_heads, num_kv_heads=H, head_dim=shape.head_dim,
                 num_partitions=ws.num_partitions, R=R, sm_scale=shape.head_dim ** -0.5)
    return defines, sizes


def f32_bits(x: float) -> int:
    """The IEEE-754 single-precision bits of ``x`` as a signed int32 (``np.float32(x).view(np.int32)``): how a float
    scalar travels as a TensorRT AOT extra argument (int32 only), reinterpreted by ``__int_as_float`` in the kernel
    (:func:`.trt_abi.scalar_bits`, the Triton wrappers' rule)."""
    from .trt_abi import scalar_bits

    return scalar_bits(x, "fp32")


def _extra_spec(param: str, sizes: dict, defines: dict) -> tuple[str, int]:
    """(expression, value) of one extra argument for ``sizes``."""
    from ..kernels.attn_decode_kernels import LOG2E

    if param == "qk_scale":  # paged_decode_attention: float(sm_scale) * LOG2E, passed as np.float32
        return f"f32_bits(sm_scale * {LOG2E!r})", f32_bits(float(sizes["sm_scale"]) * LOG2E)
    expr = {"num_kv_heads": "num_kv_heads", "num_slots": "2 * num_partitions", "R": "R"}.get(param)
    if expr is None:
        raise ValueError(f"no rule for the extra argument {param!r} (the kernel source gained a scalar)")
    return expr, _eval(expr, sizes, defines)


def _eval(expr: str, sizes: dict, defines: dict) -> int:
    from .launches import eval_grid

    return eval_grid([expr], {k: v for k, v in sizes.items() if isinstance(v, int)}, defines)[0]


GRIDS = {"diffkv_decode_partial": ("num_seqs", "num_kv_heads", "2 * num_partitions"),
         "diffkv_decode_scores": ("num_seqs", "num_kv_heads", "cdiv(R, 2 * SCORE_WARPS)")}
"""Grids as ``cuda_decode.launch_partial`` / ``_launch_scores`` launch them."""
BLOCKS = {"diffkv_decode_partial": "32 * WARPS", "diffkv_decode_scores": "32 * SCORE_WARPS"}

BUFFERS = {
    "q": ("float16", ["num_seqs", "num_heads", "head_dim"]),
    "pool": ("uint8", ["num_pages", "PAGE_BYTES"]),
    "table": ("int32", ["num_rows", "R"]),
    "tier_tokens": ("int32", ["num_rows", "2"]),
    "row_ids": ("int32", ["num_seqs", "num_kv_heads"]),
    "part_m": ("float32", ["max_batch_size", "num_kv_heads", "num_partitions", "2", "GROUP_PAD"]),
    "part_l": ("float32", ["max_batch_size", "num_kv_heads", "num_partitions", "2", "GROUP_PAD"]),
    "part_acc": ("float32", ["max_batch_size", "num_kv_heads", "num_partitions", "2", "GROUP_PAD", "BLOCK_D"]),
    "page_probs": ("float16", ["max_batch_size", "num_kv_heads", "R", "GROUP", "PMAX"]),
    "page_max": ("float32", ["max_batch_size", "num_kv_heads", "R", "GROUP"]),
    "lse": ("float32", ["max_batch_size", "num_kv_heads", "GROUP_PAD"]),
}
"""dtype and shape (expressions of ``sizes``, the engine's ``max_batch_size`` and the ``defines``; ``num_pages``: the
pool's pages, ``num_rows``: page-table rows, ``max_batch_size * num_layers * num_kv_heads`` in an engine) of every
buffer, all contiguous: the ``DecodeWorkspace`` fields and ``paged_decode_attention``'s arguments. q is fp16 (a bf16
engine converts it first, as ``paged_decode_attention`` does). Without ``STORE_PROBS`` page_probs / page_max are
the workspace's 1-element placeholders."""


# --------------------------------------------------------------------------- compilation


def nvcc_path() -> str | None:
    """``nvcc`` on ``PATH`` (``None`` when absent)."""
    return shutil.which("nvcc")


def nvcc_commands(cu: Path, stem: Path, cc: int, defines: dict[str, int], nvcc: str = "nvcc") -> list[list[str]]:
    """The two nvcc commands of one target (argument lists): ``cu`` -> ``<stem>.ptx`` with the NVRTC path's flags
    (:data:`NVRTC_FLAGS`) and ``-D`` macros, then ``<stem>.ptx`` -> ``<stem>.cubin`` with ``-Xptxas -v`` (so the
    cubin is that PTX's code, and ptxas reports registers and spills). ``cc``: 80 or 90 (``-arch=sm_<cc>``)."""
    macros = [f"-D{k}={v}" for k, v in sorted(defines.items())]  # sorted, as launch_partial keys them
    return [[nvcc, *NVRTC_FLAGS, f"-arch=sm_{cc}", "-ptx", *macros, "-o", f"{stem}.ptx", str(cu)],
            [nvcc, f"-arch=sm_{cc}", "-cubin", "-Xptxas", "-v", "-o", f"{stem}.cubin", f"{stem}.ptx"]]


_PTXAS_FN = re.compile(r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                       r"(\d+) bytes spill loads\s*\n[^\n]*Used (\d+) registers([^\n]*)")


def ptxas_info(log: str, function: str) -> dict:
    """Registers, spills, stack and static shared bytes of ``function`` from ``ptxas -v`` output.

    Raises:
        ValueError: no report of ``function`` in ``log``.
    """
    for m in _PTXAS_FN.finditer(log):
        if m.group(1) == function:
            smem = re.search(r"(\d+) bytes smem", m.group(6))
            return dict(registers=int(m.group(5)), spill_stores=int(m.group(3)), spill_loads=int(m.group(4)),
                        stack_bytes=int(m.group(2)), static_shared_bytes=int(smem.group(1)) if smem else 0)
    raise ValueError(f"ptxas reported nothing for {function!r}:\n{log[-2000:]}")


def _run(cmd: list[str], timeout_s: int) -> str:
    """stdout + stderr of ``cmd``.

    Raises:
        RuntimeError: on failure, whose first line is the reason - the last non-empty line of the command's output
            (nvcc / ptxas print the error last), or the exit status when it printed nothing - followed by the command
            and the output's tail; on a timeout, naming the command and the limit.
    """
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... ran past {timeout_s} s") from None
    if res.returncode != 0:
        output = res.stdout + res.stderr
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"{Path(cmd[0]).name} exited with status {res.returncode}, printing nothing"
        raise RuntimeError(f"{reason}\ncommand: {' '.join(cmd[:4])} ... (exit {res.returncode})\n{output[-3000:]}")
    return res.stdout + res.stderr


def nvcc_version(nvcc: str = "nvcc") -> str:
    """``release X.Y, VX.Y.Z`` of ``nvcc --version``."""
    out = _run([nvcc, "--version"], 60)
    m = re.search(r"release [^\n]*", out)
    return m.group(0) if m else out.strip().splitlines()[-1]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_cuda_kernels(shape: EngineShape, out_dir: str | Path, targets=SUPPORTED_TARGETS,
                       timeout_s: int = 600) -> list[dict]:
    """Compile the CUDA decode kernels of ``shape`` in TensorRT's AOT plugin ABI; returns the manifest entries.

    Writes ``out_dir/NAME.cu``, ``NAME.sm<cc>.ptx`` / ``.cubin`` per target and ``out_dir/cuda_kernels.json``
    (module docstring: entry format, ABI, nvcc commands). Everything is compiled in a temporary subdirectory of
    ``out_dir`` (``.cuda_aot.*``, removed afterwards) and moved into ``out_dir`` only when every step succeeded, the
    manifest last: a failed build leaves the files of ``out_dir`` as they were (``out_dir`` itself is created).
    Kernels: ``diffkv_decode_partial`` (always) and ``diffkv_decode_scores`` (when the preset tiers its tokens: the score
    update), each as its ABI entry
    ``diffkv_trt_decode_partial`` / ``diffkv_trt_decode_scores``. Parameter order of an entry: ``inputs``
    (``.u64`` pointers), ``extras`` (``.u32``: int32), ``outputs`` (``.u64`` pointers aliased to inputs) - the
    order in which TensorRT's QDP AOT path passes input pointers, ``extra_args`` and output pointers.

    Args:
        shape: the engine (head_dim 64/128, query:KV ratio 1-8, fp16/bf16, tiers the CUDA kernel covers).
        out_dir: created if missing.
        targets: compute capabilities among :data:`SUPPORTED_TARGETS`.
        timeout_s: per nvcc command.

    Raises:
        ValueError: a configuration the CUDA kernel does not cover (naming why), or a target outside
            :data:`SUPPORTED_TARGETS`.
        RuntimeError: ``nvcc`` is not on ``PATH``, or a compilation failed: the first line is nvcc's / ptxas'
            reason (the last non-empty line of its output), then the command and the output's tail.
    """
    from .aot import check_targets

    check_targets(targets)
    plan = _plan(shape)  # ValueError before looking for nvcc
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH: the CUDA decode kernels' AOT build needs the CUDA toolkit's nvcc")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".cuda_aot.", dir=out))  # moved into out only when everything compiled
    try:
        entries, written = [], []
        for entry, text in plan:
            cu = work / entry["generated_source"]
            cu.write_text(text)
            written.append(cu.name)
            for cc in targets:
                stem = work / f"{entry['name']}.sm{cc}"
                ptx_cmd, cubin_cmd = nvcc_commands(cu, stem, cc, entry["defines"], nvcc)
                _run(ptx_cmd, timeout_s)
                log = _run(cubin_cmd, timeout_s)
                ptx = Path(f"{stem}.ptx").read_bytes()
                cubin = Path(f"{stem}.cubin").read_bytes()
                written += [f"{stem.name}.ptx", f"{stem.name}.cubin"]
                version = re.search(rb"^\.version\s+(\S+)", ptx, re.M)
                entry["compiled"][f"sm_{cc}"] = dict(
                    ptx=f"{stem.name}.ptx", cubin=f"{stem.name}.cubin", ptx_sha256=_sha(ptx),
                    cubin_sha256=_sha(cubin), ptx_version=version.group(1).decode() if version else None,
                    **ptxas_info(log, entry["kernel_name"]))
            entries.append(entry)
        manifest = dict(version=MANIFEST_VERSION, nvcc_version=nvcc_version(nvcc), engine=shape.to_fields(),
                        targets=[f"sm_{cc}" for cc in targets], cuda_kernels=entries)
        (work / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
        for name in written + [MANIFEST_NAME]:  # the manifest last: it lists the others
            os.replace(work / name, out / name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return entries


def cuda_kernel_entries(shape: EngineShape) -> list[dict]:
    """The manifest entries of ``shape`` without compiling (``compiled`` empty): what :func:`build_cuda_kernels`
    fills in. ``diffkv_decode_partial`` always, ``diffkv_decode_scores`` when the preset tiers its tokens.

    Raises:
        ValueError: as :func:`cuda_kernel_defines`.
    """
    return [entry for entry, _ in _plan(shape)]


def _plan(shape: EngineShape) -> list[tuple[dict, str]]:
    """[(manifest entry without ``compiled`` results, generated source)] of ``shape``'s kernels."""
    from ..kernels.cuda_decode import SOURCE_PATH

    defines, sizes = cuda_kernel_defines(shape)
    source = _source_text()
    kernels = ["diffkv_decode_partial"] + (["diffkv_decode_scores"] if defines["STORE_PROBS"] else [])
    repo = Path(__file__).resolve().parents[2]
    src = SOURCE_PATH.resolve()
    plan = []
    for kernel in kernels:
        lay = abi_layout(source, kernel, defines)
        text = aot_source(source, [lay])
        key = json.dumps([text, sorted(defines.items()), NVRTC_FLAGS])
        name = f"cuda_{kernel.removeprefix('diffkv_')}__{_sha(key.encode())[:10]}"
        extras = []
        for extra, param in lay.extras:
            expr, value = _extra_spec(param, sizes, defines)
            extras.append(dict(name=extra, param=param, dtype="int32", expr=expr, value=value))
        entry = dict(
            name=name, op="decode_attention", kernel_name=lay.entry_name, source_kernel=kernel,
            source=str(src.relative_to(repo)) if src.is_relative_to(repo) else str(src),
            source_sha256=_sha(source.encode()), generated_source=f"{name}.cu", defines=dict(defines),
            flags=list(NVRTC_FLAGS), inputs=list(lay.inputs), outputs=list(lay.outputs),
            aliases={o: lay.inputs.index(o) for o in lay.outputs}, extras=extras,
            buffers={n: dict(dtype=BUFFERS[n][0], shape=list(BUFFERS[n][1])) for n in lay.inputs},
            grid=list(GRIDS[kernel]), block=[_eval(BLOCKS[kernel], sizes, defines), 1, 1], shared_mem=0,
            sizes=dict(sizes), compiled={})
        plan.append((entry, text))
    return plan


def launch_args(entry: dict, buffers: dict, num_seqs: int) -> tuple[tuple[int, int, int], tuple[int, int, int], list]:
    """(grid, block, argument values) of one manifest entry in TensorRT's order, for loaders and tests.

    ``buffers`` maps every name of ``entry["inputs"]`` to an object with ``data_ptr()`` (a torch tensor); the
    values are ``numpy.uint64`` pointers (inputs), ``numpy.int32`` extras, ``numpy.uint64`` pointers (outputs: the
    same buffers again). ``num_seqs``: the step's batch (grid x).

    Raises:
        KeyError: a buffer missing from ``buffers``.
        ValueError: ``num_seqs`` outside ``1..sizes["num_seqs"]`` (the workspace's capacity).
    """
    import numpy as np

    if not 1 <= num_seqs <= entry["sizes"]["num_seqs"]:
        raise ValueError(f"num_seqs={num_seqs} outside 1..{entry['sizes']['num_seqs']} (the engine's batch)")
    sizes = {**entry["sizes"], "num_seqs": num_seqs}
    from .launches import eval_grid

    grid = eval_grid(entry["grid"], {k: v for k, v in sizes.items() if isinstance(v, int)}, entry["defines"])
    values = [np.uint64(buffers[n].data_ptr()) for n in entry["inputs"]]
    values += [np.int32(x["value"]) for x in entry["extras"]]
    values += [np.uint64(buffers[n].data_ptr()) for n in entry["outputs"]]
    return tuple(grid), tuple(entry["block"]), values


def main(argv: list[str] | None = None) -> int:
    """``python -m trtllm_diffkv.export.cuda_aot --fields JSON --out DIR [--targets 80,90]``: build, print a
    summary (registers, spills, shared memory per entry and target); exit 0. Errors as :func:`build_cuda_kernels`."""
    parser = argparse.ArgumentParser(description="compile the CUDA decode kernels in TensorRT's AOT plugin ABI")
    parser.add_argument("--fields", required=True, help="EngineShape.to_fields() as JSON")
    parser.add_argument("--out", required=True)
    parser.add_argument("--targets", default="80,90")
    args = parser.parse_args(argv)
    shape = EngineShape.from_fields(json.loads(args.fields))
    entries = build_cuda_kernels(shape, args.out, tuple(int(t) for t in args.targets.split(",")))
    for e in entries:
        for target, c in e["compiled"].items():
            print(f"{e['kernel_name']} {target}: {c['registers']} registers, {c['spill_stores']} bytes spill stores, "
                  f"{c['spill_loads']} bytes spill loads, {c['static_shared_bytes']} bytes smem")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["build_cuda_kernels", "cuda_kernel_entries", "cuda_kernel_defines", "abi_layout", "aot_source",
           "kernel_parameters", "nvcc_commands", "ptxas_info", "launch_args", "f32_bits", "SUPPORTED_TARGETS",
           "NVRTC_FLAGS", "MANIFEST_NAME"]
