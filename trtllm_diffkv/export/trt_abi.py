"""TensorRT's AOT calling convention for the DiffKV Triton kernels: one wrapper kernel per (manifest entry, binding).

TensorRT launches a ``@trtp.aot_impl`` kernel (``tensorrt.plugin``, TensorRT 10.9+; the convention is the one of
TensorRT's ``samples/python/quickly_deployable_plugins`` AOT sample: ``circ_pad_kernel(x_ptr, <13 x i32>, y_ptr)``
with ``SymIntExprs`` of ``SymInt32``) with exactly this parameter list:

    one device pointer per plugin input, in input order;
    the ``extra_args``: 32-bit integers only (``trtp.SymInt32`` expressions of constants and tensor dims);
    one device pointer per plugin output, in output order.

Our kernels do not fit it as written: they interleave pointers and scalars, take an fp32 scalar (``qk_scale``),
read fp64 data (the decision kernel's alphas: TensorRT has no fp64 tensors), take one buffer under several pointer
types (the page pool as ``uint8``, ``fp16``, ``fp32`` and ``int32`` views: a tensor cannot be a plugin's input
twice), and Triton 3.6 appends two scratch pointers (global and profile scratch) to every kernel.

So for every launch an engine makes, :func:`wrapper_source` generates a Triton kernel ``trt_<name>`` whose
parameters follow the convention and whose body is the original kernel, inlined (Triton inlines ``@triton.jit``
calls):

* inputs: the launch's distinct buffers (:func:`from_bindings`: in first-use order; their dtype is the bound graph
  tensor's, ``fp64`` carried as ``int64`` bits); each pointer parameter of the original kernel gets its buffer,
  reinterpreted (``ptr.to(tl.pointer_type(T), bitcast=True)``) where the types differ;
* extra args: the original's runtime scalars in parameter order, each an ``i32``; an ``fp32`` scalar travels as
  its IEEE bits (``x.to(tl.float32, bitcast=True)`` in the wrapper; :func:`scalar_bits`);
* outputs: one per input, the same buffer (every output is aliased to its input: the kernels update in place),
  unused by the wrapper.

:func:`compile_abi` compiles each wrapper with the original's constexprs, launch options and divisibility hints
(the inputs carry the hint of their first pointer parameter), checks that the two scratch parameters are never read
and cuts them from the PTX entry (:func:`strip_scratch`), so the PTX TensorRT receives declares exactly
``inputs + extras + outputs``; the cubin is that PTX assembled with Triton's own ``ptxas`` step and options. CPU
tests check the entry's parameter list and that the wrapper's instructions are the original's (same multiset,
less the parameter loads of the buffers it no longer receives twice); the GPU test launches the PTX and the cubin
through the CUDA driver with TensorRT's parameter list and compares with the JIT bit for bit.

Node attributes of the AOT graph (``export/onnx_export.py::aot_node_attrs``) carry an :class:`AbiKernel` (``abi``),
so onnxruntime (``trtllm_diffkv/export/plugin_ops.py::run_abi_kernel``) and the TensorRT plugin (``plugins/trt_plugins.py``) launch the
same wrapper with the same argument list, computed by the same function (:func:`launch_plan`).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import numbers
import os
import re
import struct
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .launches import TORCH_TO_TRITON, decode_constexpr, eval_expr, expr_names, kernel_parameters
from ..user_cache import cache_folder
from ..validators import is_int

_TL = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64", "i8": "int8", "i16": "int16",
       "i32": "int32", "i64": "int64", "u8": "uint8", "i1": "int1"}
EXTRA_TYPES = ("i32", "fp32")
"""Kernel scalar types an extra arg can carry (an ``i32`` as itself, an ``fp32`` as its bits)."""
SCRATCH_PARAMS = 2
"""Parameters Triton 3.6 appends to every kernel (global and profile scratch pointers)."""


def abi_dtype(kernel_type: str) -> str:
    """The Triton element type a TensorRT tensor carries for a kernel pointer type (``*fp64`` -> ``i64`` bits:
    TensorRT has no fp64 tensors; others unchanged)."""
    t = kernel_type.lstrip("*")
    return "i64" if t == "fp64" else t


@dataclass
class AbiKernel:
    """The TensorRT-convention wrapper of one manifest entry for one binding of its pointer parameters.

    ``params`` (runtime parameters in order) / ``signature`` / ``constexprs`` / ``options`` / ``divisible`` /
    ``kernel`` are the manifest entry's (``export/aot.py``); ``input_dtypes[j]``: Triton element type of input ``j``; ``input_of[p]``: the input of pointer
    parameter ``p``. ``name`` = ``<entry>__<hash of the binding>``; the wrapper function is ``trt_<name>``.
    """

    name: str
    entry: str
    kernel: str
    params: list
    signature: dict
    constexprs: dict
    options: dict
    divisible: list
    input_dtypes: list
    input_of: dict
    compiled: dict = field(default_factory=dict)

    @property
    def function(self) -> str:
        """The wrapper kernel's name (the PTX entry)."""
        return "trt_" + self.name

    @property
    def pointers(self) -> list[str]:
        """The original kernel's pointer parameters, in parameter order."""
        return [p for p in self.params if self.signature[p].startswith("*")]

    @property
    def extras(self) -> list[str]:
        """The original kernel's runtime scalars, in parameter order (the extra args)."""
        return [p for p in self.params if not self.signature[p].startswith("*")]

    @property
    def wrapper_params(self) -> list[str]:
        """The wrapper's runtime parameters in TensorRT's order: ``in<j>`` (inputs), ``x_<scalar>`` (extra args),
        ``out<j>`` (outputs, one per input)."""
        n_in = len(self.input_dtypes)
        return [f"in{j}" for j in range(n_in)] + [f"x_{p}" for p in self.extras] + [f"out{j}" for j in range(n_in)]

    def to_json(self) -> dict:
        return dict(name=self.name, entry=self.entry, kernel=self.kernel, params=self.params, signature=self.signature,
                    constexprs=self.constexprs, options=self.options, divisible=self.divisible,
                    input_dtypes=self.input_dtypes, input_of=self.input_of, compiled=self.compiled)

    @classmethod
    def from_json(cls, data: dict | str) -> "AbiKernel":
        data = json.loads(data) if isinstance(data, str) else data
        return cls(**{k: data[k] for k in ("name", "entry", "kernel", "params", "signature", "constexprs", "options",
                                           "divisible", "input_dtypes", "input_of")}, compiled=data.get("compiled", {}))


def _make(entry: dict, input_dtypes: list, input_of: dict) -> AbiKernel:
    signature = dict(entry["signature"])
    for p, t in signature.items():
        if t != "constexpr" and not t.startswith("*") and t not in EXTRA_TYPES:
            raise ValueError(f"{entry['name']}: scalar {p} is {t}; TensorRT's extra args carry {EXTRA_TYPES} only")
    key = json.dumps([entry["name"], input_dtypes, input_of], sort_keys=True)
    params = [p for p in entry["params"] if signature[p] != "constexpr"]
    return AbiKernel(name=f"{entry['name']}__{hashlib.sha256(key.encode()).hexdigest()[:6]}", entry=entry["name"],
                     kernel=entry["kernel"], params=params, signature=signature, constexprs=dict(entry["constexprs"]),
                     options=dict(entry["options"]), divisible=list(entry.get("divisible", [])),
                     input_dtypes=list(input_dtypes), input_of=dict(input_of))


def from_launcher(entry: dict) -> AbiKernel:
    """The wrapper of a manifest entry as its launcher binds it (``entry["buffers"]``, ``export/aot.py``: views of one
    tensor, e.g. the pool's four dtype views, are one input; every other pointer its own). An input's dtype is its
    first pointer parameter's (the pool: ``u8``)."""
    pointers = [p for p in entry["params"] if entry["signature"][p].startswith("*")]
    buffers = entry.get("buffers") or list(range(len(pointers)))
    dtypes = {}
    for p, b in zip(pointers, buffers):
        dtypes.setdefault(b, abi_dtype(entry["signature"][p]))
    return _make(entry, [dtypes[b] for b in range(len(dtypes))], dict(zip(pointers, buffers)))


def from_bindings(entry: dict, pointers: list[str], bindings: list[str], bind_dtypes: dict[str, str]) -> AbiKernel:
    """The wrapper of a launch whose pointer parameters ``pointers`` are bound to the named buffers ``bindings``
    (``export/aot_graph.py::Launch``); ``bind_dtypes``: buffer name -> torch dtype name (``float64`` travels as
    ``int64``). Inputs: the distinct buffers in first-use order."""
    unique = list(dict.fromkeys(bindings))
    dtypes = [abi_dtype(TORCH_TO_TRITON[bind_dtypes[b]]) for b in unique]
    return _make(entry, dtypes, {p: unique.index(b) for p, b in zip(pointers, bindings)})


def scalar_bits(value, kernel_type: str) -> int:
    """The int32 extra arg of a scalar: an ``i32`` itself (range checked), an ``fp32`` its IEEE bits as a signed
    int32 (rounded to fp32 first, as Triton passes a Python float to an ``fp32`` parameter; ``inf`` and ``nan`` give
    their bits).

    Args:
        value: an ``i32``: an integral number (``numbers.Integral``: ``int``, ``bool``, numpy integers); an
            ``fp32``: a real number (``numbers.Real``). Strings are refused, not parsed.
        kernel_type: ``"i32"`` or ``"fp32"`` (:data:`EXTRA_TYPES`).

    Raises:
        ValueError: an ``i32`` value that is not integral (``3.7``, ``"12"``) or outside int32; an ``fp32`` value that
            is not a real number, or finite but beyond the fp32 range after rounding (``1e39``); a type
            :data:`EXTRA_TYPES` does not hold.
    """
    if kernel_type == "fp32":
        if not isinstance(value, numbers.Real):
            raise ValueError(f"{value!r} is not a real number (fp32 extra arg)")
        try:
            return struct.unpack("<i", struct.pack("<f", float(value)))[0]
        except OverflowError:
            raise ValueError(f"{value!r} is beyond the fp32 range (fp32 extra arg)") from None
    if kernel_type == "i32":
        if not isinstance(value, numbers.Integral):
            raise ValueError(f"{value!r} is not an integer (int32 extra arg)")
        if not -2**31 <= int(value) < 2**31:
            raise ValueError(f"{value} does not fit an int32 extra arg")
        return int(value)
    raise ValueError(f"no extra-arg form for a {kernel_type} scalar")


def wrapper_source(kernels: list[AbiKernel]) -> str:
    """Python source of a module defining ``trt_<name>`` for every kernel (see the module docstring).

    The generated names are ``in<j>`` / ``out<j>`` (inputs, outputs), ``x_<scalar>`` (extra args), ``_body<k>`` (the
    imported original kernels), ``triton`` and ``tl``; the wrapper's body passes the original's constexprs by their
    own names.

    Raises:
        ValueError: a parameter of an original kernel is named like a generated name of its wrapper (naming the
            kernel and the parameter): a constexpr would clash with the wrapper's parameter or shadow the imported
            kernel / ``tl``; a runtime parameter is refused as well, so that every name of the generated source
            means one thing.
    """
    lines = ["# Generated by trtllm_diffkv.export.trt_abi: TensorRT-convention wrappers (inputs, i32 extras, outputs).",
             "import triton", "import triton.language as tl"]
    bodies = {}
    for k in kernels:
        if k.kernel not in bodies:
            bodies[k.kernel] = f"_body{len(bodies)}"
            module, fn = k.kernel.split(":")
            lines.append(f"from {module} import {fn} as {bodies[k.kernel]}")
    for k in kernels:
        module, fn = k.kernel.split(":")
        params = kernel_parameters(getattr(importlib.import_module(module), fn))
        constexpr_names = [p for p, _, _ in params if k.signature.get(p, "constexpr") == "constexpr"]
        generated = k.wrapper_params
        reserved = set(generated) | set(bodies.values()) | {"triton", "tl"}
        for p, _, _ in params:
            if p in reserved:
                raise ValueError(f"{k.kernel} ({k.name}): parameter {p!r} collides with a name the TensorRT-convention "
                                 f"wrapper generates ({sorted(reserved)})")
        head = generated + [f"{p}: tl.constexpr" for p in constexpr_names]
        args = []
        for p, _, _ in params:
            t = k.signature.get(p, "constexpr")
            if t == "constexpr":
                args.append(p)
            elif t.startswith("*"):
                j, want = k.input_of[p], t[1:]
                args.append(f"in{j}" if k.input_dtypes[j] == want
                            else f"in{j}.to(tl.pointer_type(tl.{_TL[want]}), bitcast=True)")
            else:
                args.append(f"x_{p}" if t == "i32" else f"x_{p}.to(tl.float32, bitcast=True)")
        lines += ["", "", "@triton.jit", f"def {k.function}({', '.join(head)}):",
                  f"    {bodies[k.kernel]}({', '.join(args)})"]
    return "\n".join(lines) + "\n"


_MODULES: dict[str, object] = {}


def load_wrappers(kernels: list[AbiKernel], directory: str | Path | None = None):
    """Import the wrappers of ``kernels`` (the module :func:`wrapper_source` writes; Triton reads a kernel's source
    from its file). ``directory``: where the file goes (default: ``<cache_root()>/trt_abi``,
    :mod:`trtllm_diffkv.user_cache`); the file is named by the source's hash (``trt_abi_<digest>.py``), and a module
    imported once in this process is reused whatever ``directory`` a later call names (the cache is keyed by the
    digest).

    The file is written to a unique temporary file in ``directory`` (``tempfile.mkstemp``: processes forked from one
    another, or several builds sharing the folder, never write the same temporary file) and renamed over the target;
    a writer that finds its rename failing while the target already holds this source (another process won) is
    content.

    Raises:
        ValueError: as :func:`wrapper_source`, or as :func:`~trtllm_diffkv.user_cache.cache_root`.
        OSError: the file cannot be written (other than a concurrent writer having written it).
    """
    src = wrapper_source(kernels)
    digest = hashlib.sha256(src.encode()).hexdigest()[:16]
    if digest in _MODULES:
        return _MODULES[digest]
    if directory:
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
    else:
        folder = cache_folder("trt_abi")
    path = folder / f"trt_abi_{digest}.py"
    if not _holds(path, src):
        _write_replace(path, src)
    name = f"_trtllm_diffkv_trt_abi_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _MODULES[digest] = module
    return module


def _holds(path: Path, text: str) -> bool:
    """Whether the file ``path`` exists and holds ``text``."""
    try:
        return path.read_text(encoding="utf-8") == text
    except FileNotFoundError:
        return False


def _write_replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a unique temporary file of its folder, renamed over it (readers never see
    a partial file); the temporary file is removed whatever happens."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the module is no secret
        try:
            os.replace(tmp, path)
        except FileNotFoundError:
            if not _holds(path, text):  # a concurrent writer (or cleaner) and not our text: a real failure
                raise
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def compile_signature(k: AbiKernel) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` for ``triton.compile(ASTSource(...))`` of the wrapper: inputs and outputs
    typed ``*<input dtype>``, extras ``i32``; ``tt.divisibility=16`` on an input (and its output) whose first pointer
    parameter has it, and on an extra whose scalar has it (as the manifest entry's ``divisible``)."""
    n_in = len(k.input_dtypes)
    names = k.wrapper_params
    signature = {f"in{j}": "*" + d for j, d in enumerate(k.input_dtypes)}
    signature.update({f"x_{p}": "i32" for p in k.extras})
    signature.update({f"out{j}": "*" + d for j, d in enumerate(k.input_dtypes)})
    constexprs = {p: decode_constexpr(v) for p, v in k.constexprs.items()}
    signature.update({p: "constexpr" for p in constexprs})
    first = {}
    for p in k.pointers:  # an input takes the hint of the first pointer parameter bound to it
        first.setdefault(k.input_of[p], p)
    attrs = {}
    for j in range(n_in):
        if first.get(j) in k.divisible:
            attrs[(names.index(f"in{j}"),)] = [["tt.divisibility", 16]]
            attrs[(names.index(f"out{j}"),)] = [["tt.divisibility", 16]]
    for p in k.extras:
        if p in k.divisible:
            attrs[(names.index(f"x_{p}"),)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def ptx_entry_params(ptx: str, kernel_name: str) -> list[str]:
    """The PTX entry's parameter types (``".u64"``, ``".u32"``, ``".f32"``...), in order."""
    start = ptx.index(f".entry {kernel_name}(")
    header = ptx[start:ptx.index(")", start)]
    return re.findall(r"\.param\s+(\.\w+)", header)


def strip_scratch(ptx: str, kernel_name: str, keep: int) -> str:
    """The PTX with the entry's parameters past the first ``keep`` removed (Triton's scratch pointers).

    Raises:
        ValueError: the entry does not declare exactly ``keep`` + :data:`SCRATCH_PARAMS` parameters (naming both
            counts: the wrapper's parameters are not what was compiled, or Triton appends another number), or a
            removed parameter is read in the body (the kernel uses scratch memory).
    """
    start = ptx.index(f".entry {kernel_name}(")
    end = ptx.index(")", start)
    header = ptx[start:end]
    decls = re.findall(r"\n\s*\.param[^\n]*", header)
    if len(decls) != keep + SCRATCH_PARAMS:
        raise ValueError(f"{kernel_name}: the PTX entry declares {len(decls)} parameters, expected {keep} + "
                         f"{SCRATCH_PARAMS} scratch = {keep + SCRATCH_PARAMS}")
    for decl in decls[keep:]:
        pname = decl.strip().rstrip(",").split()[-1]
        if re.search(rf"\[{re.escape(pname)}\]", ptx[end:]):
            raise ValueError(f"{kernel_name}: parameter {pname} (scratch) is read by the kernel")
    kept = "".join(decls[:keep]).rstrip(",")
    return ptx[:start] + f".entry {kernel_name}(" + kept + "\n" + ptx[end:]


def compile_abi(kernels: list[AbiKernel], out_dir: str | Path, targets) -> None:
    """Compile every wrapper for every target into ``out_dir`` (``trt_abi.py`` = the wrappers' source,
    ``<name>.trt.sm<cc>.ptx`` with the scratch parameters cut, ``.cubin`` = that PTX assembled by Triton's ptxas step
    with the kernel's options) and fill ``kernel.compiled["sm_<cc>"]`` (kernel_name, ptx, cubin, shared_bytes,
    num_warps, params: the entry's parameter types, cubin_sha256). The wrappers compiled are imported from
    :func:`load_wrappers`' default folder (the same source as ``trt_abi.py``), so ``out_dir`` receives nothing else.

    Raises:
        ValueError: as :func:`wrapper_source` (a kernel parameter named like a generated name).
        RuntimeError: a wrapper fails to compile (naming it and the target), or uses scratch memory.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trt_abi.py").write_text(wrapper_source(kernels))
    module = load_wrappers(kernels)
    for k in kernels:
        signature, constexprs, attrs = compile_signature(k)
        for cc in targets:
            target = GPUTarget("cuda", cc, 32)
            src = ASTSource(fn=getattr(module, k.function), signature=signature, constexprs=constexprs, attrs=attrs)
            try:
                compiled = triton.compile(src, target=target, options=dict(k.options))
                md = compiled.metadata
                if md.global_scratch_size or md.profile_scratch_size:
                    raise ValueError("uses scratch memory, which TensorRT's convention cannot pass")
                ptx = strip_scratch(compiled.asm["ptx"], md.name, len(k.wrapper_params))
                backend = make_backend(target)
                cubin = backend.make_cubin(ptx, {}, backend.parse_options(dict(k.options)), cc)
            except Exception as exc:  # noqa: BLE001 - report which kernel and target
                raise RuntimeError(f"{k.name} (TensorRT convention) failed for sm_{cc}: {str(exc)[:400]}") from exc
            stem = f"{k.name}.trt.sm{cc}"
            (out / f"{stem}.ptx").write_text(ptx)
            (out / f"{stem}.cubin").write_bytes(cubin)
            k.compiled[f"sm_{cc}"] = dict(kernel_name=md.name, ptx=f"{stem}.ptx", cubin=f"{stem}.cubin",
                                          shared_bytes=int(md.shared), num_warps=int(md.num_warps),
                                          params=ptx_entry_params(ptx, md.name),
                                          cubin_sha256=hashlib.sha256(cubin).hexdigest())


STEP_SYMBOLS = ("n", "B", "P")
"""The step sizes an AOT node's size expressions may use (``export/onnx_export.py::aot_node_attrs``: tokens, batch,
page-table width), each read from an input dim (``attrs["dims"]``)."""


def launch_plan(attrs: dict, dim, cdiv=None) -> tuple[tuple, list]:
    """``(grid (3 values), extra args)`` of an AOT node: its step sizes read from input dims (``attrs["dims"]``:
    ``{symbol: [input, axis, divisor]}``, ``dim(input, axis)`` gives the dim), its sizes and grid evaluated with them
    and the constexprs, its extras (``attrs["extras"]``: ``[param, value or expression]``) likewise (the grid and
    extras see the step sizes, the int constexprs and the sizes, later ones shadowing earlier).

    The same function serves onnxruntime (``dim`` gives ints) and TensorRT's ``aot_impl`` (``dim`` gives
    ``trtp`` shape expressions, ``cdiv=trtp.cdiv``; a ``cdiv`` of two ints, such as a grid of constants, is computed
    here: :func:`eval_expr`).

    Raises:
        ValueError: an expression reads a step size (:data:`STEP_SYMBOLS`) that nothing binds (naming the symbol and
            the expression): a size one that ``attrs["dims"]`` does not give, the grid or an extra one that neither
            ``attrs["dims"]`` nor an int constexpr or a size of that name gives. (Symbols no expression reads need
            no dim.)
    """
    get = lambda key: json.loads(attrs[key]) if isinstance(attrs[key], str) else attrs[key]  # noqa: E731
    steps = {s: dim(j, axis) // div if div != 1 else dim(j, axis) for s, (j, axis, div) in get("dims").items()}

    def evaluate(what, expr, scope):
        missing = sorted((expr_names(expr) & set(STEP_SYMBOLS)) - scope.keys())
        if missing:
            raise ValueError(f"{what} = {expr!r} uses the step size {', '.join(missing)}, which the node's dims "
                             f"(attrs['dims']: {sorted(steps)}) do not give")
        return eval_expr(expr, scope, cdiv)

    constexprs = {k: v for k, v in get("constexprs").items() if is_int(v)}
    sizes = {k: evaluate(f"size {k}", v, steps) for k, v in get("sizes").items()}
    scope = {**steps, **constexprs, **sizes}
    grid = [evaluate(f"grid[{i}]", g, scope) for i, g in enumerate(get("grid"))]
    grid += [1] * (3 - len(grid))
    extras = [evaluate(f"extra {p}", v, scope) for p, v in get("extras")]
    return tuple(grid), extras
