"""A kernel launch as the engine export records it: the low pieces the exporter's modules share.

The AOT kernel set (:mod:`.aot`), the AOT decode and prefill graphs (:mod:`.aot_graph`, :mod:`.aot_prefill`), the
TensorRT-convention wrappers (:mod:`.trt_abi`) and the plugin ops (:mod:`.plugin_ops`) build on this module, which
imports none of them (tests/layout: no import circle).

* expressions: :func:`eval_expr` (the grids, sizes and scalars of the manifest and the graphs; ``cdiv`` available),
  :func:`expr_names`; :data:`TORCH_TO_TRITON`;
* a recorded launch: :class:`Recorder` replaces kernels by recorders of ``kernel[grid](*args, **kwargs)``;
  :func:`launch_signature` and :func:`jit_specialization` read a recorded launch as Triton's JIT specializes it;
  :func:`spec_of_launch` makes it a :class:`KernelSpec` (a manifest entry, checked against :data:`GRIDS` and
  :data:`STEP_SCALARS`), :func:`cuda_launch_choices` adds what the launchers choose only for CUDA tensors and
  :func:`spec_name` names it; :func:`encode_constexpr` / :func:`decode_constexpr` carry constexprs through JSON;
* a launch bound to named graph tensors: :class:`Launch`, :class:`TensorInfo` (a named tensor with symbolic dims,
  :func:`eval_dim`), :func:`launch_of` (binds a recorded launch's pointer arguments to the names, by
  :func:`storage_id`).
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import numbers
from dataclasses import dataclass, field

TORCH_TO_TRITON = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64", "int8": "i8",
                   "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8", "bool": "i1"}
"""Triton element type of each torch dtype (the manifest's pointer types)."""


def _cdiv(cdiv=None):
    """Ceil division for the expressions: exact integer ceil division (an ``int``) when both operands are integers
    (``numbers.Integral``), else ``cdiv(a, b)`` (``trtp.cdiv`` refuses two ints: ``ValueError("Both arguments cannot
    be 'int's")``, TensorRT's ``tensorrt/plugin/_top_level.py``), else ``(a + b - 1) // b`` when no ``cdiv`` is
    given."""

    def ceil_div(a, b):
        if isinstance(a, numbers.Integral) and isinstance(b, numbers.Integral):
            return -(-int(a) // int(b))
        return cdiv(a, b) if cdiv is not None else (a + b - 1) // b

    return ceil_div


def expr_names(expr) -> set[str]:
    """The names an expression reads (empty for a non-string: a value)."""
    if not isinstance(expr, str):
        return set()
    return {node.id for node in ast.walk(ast.parse(expr, mode="eval")) if isinstance(node, ast.Name)}


def eval_expr(expr, names: dict, cdiv=None):
    """An expression of the manifest / graph (``"cdiv(n * 18, BLOCK)"``, ``"B*3"``, or an int) with ``names``
    bound; values may be ints or symbolic dims (TensorRT's ``trtp`` expressions). ``cdiv(a, b)`` is integer ceil
    division when both are integers, ``cdiv(a, b)`` of the given function otherwise (``trtp.cdiv``, which refuses
    two ints), ``(a + b - 1) // b`` without one."""
    if not isinstance(expr, str):
        return expr
    scope = dict(names)
    scope["cdiv"] = _cdiv(cdiv)
    return eval(expr, {"__builtins__": {}}, scope)  # noqa: S307 - our own expressions


DEFAULT_NUM_WARPS, DEFAULT_NUM_STAGES = 4, 3  # Triton's CUDA defaults when a launch passes none
_OPTION_KEYS = ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion")

ENGINE_INTS = {
    "_write_tokens_kernel": ("PAGE_BYTES", "KC", "KM", "VC", "VM", "SC", "PO"),
    "_read_tokens_kernel": ("PAGE_BYTES", "KC", "KM", "VC", "VM", "SC", "PO"),
    "_decode_partial_kernel": ("num_kv_heads", "num_parts"),
    "_decode_merge_kernel": ("num_kv_heads", "num_parts"),
    "_decode_score_kernel": ("num_kv_heads",),
    "_prompt_lse_kernel": ("num_scoring", "num_heads", "num_kv_heads"),
    "_prompt_lse_merge_kernel": ("num_heads",),
    "_prompt_score_kernel": ("num_scoring", "num_heads", "num_kv_heads"),
    "_count_kernel": ("G", "S", "R", "P_HIGH", "P_LOW", "P_MIN"),
    "_reserve_apply_kernel": ("G", "S", "R", "P_MIN"),
    "_commit_apply_kernel": ("G", "S", "R", "P_HIGH", "P_LOW"),
    "_decode_apply_kernel": ("G", "S", "R", "P_HIGH", "P_LOW"),
    "_release_apply_kernel": ("G", "S", "R"),
    "_decide_kernel": ("G", "R", "PAGE_BYTES", "H_SC", "H_PO", "L_SC", "L_PO", "W", "S"),
    "_locate_kernel": ("G", "H", "R"),
}
"""Runtime integer arguments fixed by the engine (model shape, page format, workspace partitions), which the
AOT kernels specialize exactly as Triton's JIT does for the recorded value (:func:`jit_specialization`).
Other integers (row and item counts, chunk counts, strides, pool size) vary per call: compiled unspecialized."""

GRIDS = {
    "_write_tokens_kernel": ("n_rows",),
    "_read_tokens_kernel": ("n_rows",),
    "_decode_partial_kernel": ("num_seqs", "num_kv_heads", "num_partitions * NCHUNK"),
    "_decode_merge_kernel": ("num_seqs", "num_kv_heads"),
    "_decode_score_kernel": ("num_seqs", "num_kv_heads", "cdiv(R, POS_PER_PROG)"),
    "_prompt_lse_kernel": ("num_seqs", "num_heads", "cdiv(max_len, CHUNK)"),
    "_prompt_lse_merge_kernel": ("num_seqs", "num_heads"),
    "_prompt_score_kernel": ("num_seqs", "num_kv_heads", "cdiv(max_len, BLOCK_N)"),
    "_count_kernel": ("cdiv(num_slots * rows_per_slot, BLOCK)",),
    "_scan_kernel": ("1",),
    "_reserve_apply_kernel": ("cdiv(num_slots * rows_per_slot, BLOCK)",),
    "_commit_apply_kernel": ("cdiv(num_slots * rows_per_slot, BLOCK)",),
    "_decode_apply_kernel": ("cdiv(num_slots * rows_per_slot, BLOCK)",),
    "_release_apply_kernel": ("cdiv(num_slots * rows_per_slot, BLOCK)",),
    "_decide_kernel": ("num_seqs", "cdiv(rows_per_slot, ROWS)"),
    "_locate_kernel": ("cdiv(bucket * rows_per_slot, BLOCK)",),
}
"""Grid of every kernel as expressions of named sizes and constexprs (checked against recorded launches)."""


_BLOCKS = "cdiv(num_slots * rows_per_slot, BLOCK)"
STEP_SCALARS = {
    "_count_kernel": {"n_items": "num_slots * rows_per_slot"},
    "_reserve_apply_kernel": {"n_items": "num_slots * rows_per_slot", "num_blocks": _BLOCKS, "num_pages": "num_pages"},
    "_commit_apply_kernel": {"n_items": "num_slots * rows_per_slot", "num_blocks": _BLOCKS, "num_pages": "num_pages"},
    "_decode_apply_kernel": {"n_items": "num_slots * rows_per_slot", "num_blocks": _BLOCKS, "num_pages": "num_pages"},
    "_release_apply_kernel": {"n_items": "num_slots * rows_per_slot", "num_blocks": _BLOCKS, "num_pages": "num_pages"},
    "_locate_kernel": {"n": "num_seqs", "B": "bucket"},
}
"""Runtime scalars that change per call, as expressions of the named sizes and constexprs (as :data:`GRIDS`;
checked against every recorded launch). The manifest's ``scalars`` hold the recorded values; ``step_scalars`` these
expressions, which a launch evaluates for its own sizes (``export/trt_abi.py::launch_plan``, the AOT graph's
nodes). ``_scan_kernel``'s ``num_blocks`` has none: the scan launch is only needed past one chunk of block sums,
which the AOT decode graph refuses (``export/aot_graph.py``)."""


def eval_grid(grid: list[str] | tuple[str, ...], sizes: dict, constexprs: dict) -> tuple[int, ...]:
    """Evaluate grid expressions with ``sizes`` and ``constexprs`` (``cdiv`` available; nothing else:
    :func:`eval_expr`)."""
    names = {**{k: v for k, v in constexprs.items() if isinstance(v, int)}, **sizes}
    return tuple(int(eval_expr(expr, names)) for expr in grid)


# --------------------------------------------------------------------------- specs


@dataclass
class KernelSpec:
    """One kernel specialization of an engine: a manifest entry (its fields: :mod:`.aot`)."""

    name: str
    op: str
    kernel: str
    arg_names: list[str]
    signature: dict[str, str]
    constexprs: dict
    grid: list[str]
    sizes: dict
    scalars: dict
    options: dict
    select: str | None = None
    divisible: list[str] = field(default_factory=list)
    compiled: dict = field(default_factory=dict)
    step_scalars: dict = field(default_factory=dict)
    buffers: list = field(default_factory=list)

    @property
    def params(self) -> list[str]:
        """Runtime arguments in the compiled kernel's parameter order (constexprs removed)."""
        return [n for n in self.arg_names if self.signature[n] != "constexpr"]

    def to_json(self) -> dict:
        """The manifest entry (all fields plus ``params``)."""
        return {**dataclasses.asdict(self), "params": self.params}

    def jit_function(self):
        """The ``triton.JITFunction`` this spec compiles."""
        import importlib

        module, attr = self.kernel.split(":")
        return getattr(importlib.import_module(module), attr)


def encode_constexpr(value):
    """JSON form of a constexpr (Triton dtypes as ``"tl.float16"``)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return "tl." + {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(value.name, value.name)
    if hasattr(value, "value"):  # tl.constexpr
        return encode_constexpr(value.value)
    raise TypeError(f"cannot encode constexpr {value!r}")


def decode_constexpr(value):
    """Inverse of :func:`encode_constexpr` (``"tl.float16"`` -> ``tl.float16``)."""
    if isinstance(value, str) and value.startswith("tl."):
        import triton.language as tl

        return getattr(tl, value[3:])
    return value


def _arg_type(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + TORCH_TO_TRITON[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton argument type for {type(value).__name__}")


class Recorder:
    """Replaces kernels in their launcher modules by objects that record ``kernel[grid](*args, **kwargs)``."""

    def __init__(self, targets: list[tuple[object, str]]) -> None:
        self.targets, self.saved, self.launches = targets, [], []

    def __enter__(self):
        for module, attr in self.targets:
            original = getattr(module, attr)
            self.saved.append((module, attr, original))
            setattr(module, attr, _Fake(original, self.launches))
        return self

    def __exit__(self, *exc) -> None:
        for module, attr, original in reversed(self.saved):
            setattr(module, attr, original)


class _Fake:
    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.kernel, tuple(int(g) for g in grid), args, kwargs))
        return launch


def jit_specialization(launch) -> dict[str, str]:
    """``{runtime argument: "D" | "1"}`` of a launch as Triton's JIT specializes it (``native_specialize_impl``,
    the function ``JITFunction.run`` calls), for pointers and the :data:`ENGINE_INTS` integers.

    ``"D"``: ``tt.divisibility=16`` (a pointer 16-byte aligned, an integer a multiple of 16); ``"1"``: an integer
    equal to 1, which the JIT turns into the constexpr 1. Pointers of the ``meta`` tensors the specs are recorded
    on count as aligned (``data_ptr() == 0``): the AOT kernels require 16-byte aligned buffers, as torch's CUDA
    allocator and TensorRT hand out (the JIT compiles such launches with the same hint). Without these hints the
    compiler picks other layouts (vector widths, reduction order), so the outputs differ in rounding.
    """
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    kernel, _, args, kwargs = launch
    name = getattr(kernel, "fn", kernel).__name__
    params = kernel_parameters(kernel)
    bound = {**dict(zip([n for n, _, _ in params], args)), **kwargs}
    out = {}
    for pname, is_constexpr, default in params:
        value = bound.get(pname, default)
        if is_constexpr or isinstance(value, (bool, float)):
            continue
        if not hasattr(value, "data_ptr") and pname not in ENGINE_INTS.get(name, ()):
            continue
        kind, attr = native_specialize_impl(CUDABackend, value, False, True, True)[:2]
        if kind == "constexpr":
            out[pname] = "1"
        elif attr:
            out[pname] = attr
    return out


def launch_signature(launch) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, runtime scalars, options) of one recorded launch ``(kernel, grid, args, kwargs)``.

    An :data:`ENGINE_INTS` integer equal to 1 is a constexpr, as in the JIT (:func:`jit_specialization`).
    """
    kernel, grid, args, kwargs = launch
    params = kernel_parameters(kernel)
    names = [n for n, _, _ in params]
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    ones = {n for n, v in jit_specialization(launch).items() if v == "1"}
    signature, constexprs, scalars = {}, {}, {}
    for pname, is_constexpr, default in params:
        value = bound[pname] if pname in bound else default
        if is_constexpr or pname in ones:
            signature[pname] = "constexpr"
            constexprs[pname] = encode_constexpr(value)
        else:
            signature[pname] = _arg_type(value)
            if not signature[pname].startswith("*"):
                scalars[pname] = value
    options = {k: kwargs[k] for k in _OPTION_KEYS if k in kwargs}
    options.setdefault("num_warps", DEFAULT_NUM_WARPS)
    options.setdefault("num_stages", DEFAULT_NUM_STAGES)
    return signature, constexprs, scalars, options


def spec_of_launch(launch, op: str, sizes: dict, select: str | None = None) -> KernelSpec:
    """A :class:`KernelSpec` from one recorded launch (kernel, grid, args, kwargs)."""
    kernel, grid = launch[0], launch[1]
    fn = getattr(kernel, "fn", kernel)
    signature, constexprs, scalars, options = launch_signature(launch)
    name = fn.__name__
    expected = eval_grid(GRIDS[name], sizes, constexprs)
    if expected != grid:  # the hand-written formula must describe what the launcher did
        raise AssertionError(f"{name}: grid formula {GRIDS[name]} gives {expected}, the launcher used {grid}")
    divisible = [n for n, v in jit_specialization(launch).items() if v == "D"]
    step_scalars = {p: e for p, e in STEP_SCALARS.get(name, {}).items() if p in scalars}
    for param, expr in step_scalars.items():  # the hand-written expressions must give the recorded values
        got = eval_grid([expr], sizes, constexprs)[0]
        if got != scalars[param]:
            raise AssertionError(f"{name}: scalar {param} = {expr} gives {got}, the launcher passed {scalars[param]}")
    return KernelSpec(name="", op=op, kernel=f"{fn.__module__}:{name}", arg_names=list(signature),
                      signature=signature, constexprs=constexprs, grid=list(GRIDS[name]), sizes=dict(sizes),
                      scalars=scalars, options=options, select=select, divisible=divisible, step_scalars=step_scalars,
                      buffers=_buffers(launch, signature))


def _buffers(launch, signature: dict) -> list[int]:
    """For each pointer parameter of a recorded launch, in order: the index of its buffer among the launch's distinct
    buffers (views of one tensor - the pool's ``uint8``/``fp16``/``fp32``/``int32`` views - are one buffer), in
    first-use order: the binding TensorRT's calling convention needs (``export/trt_abi.py``)."""
    kernel, _, args, kwargs = launch
    bound = {**dict(zip([n for n, _, _ in kernel_parameters(kernel)], args)), **kwargs}
    seen, out = {}, []
    for p, t in signature.items():
        if t.startswith("*"):
            key = storage_id(bound[p])
            out.append(seen.setdefault(key, len(seen)))
    return out


def kernel_parameters(fn) -> list[tuple[str, bool, object]]:
    """``[(name, is_constexpr, default)]`` of a kernel's Python function, in order (JIT or interpreter)."""
    import inspect

    fn = getattr(fn, "fn", fn)
    return [(p.name, str(p.annotation).endswith("constexpr"), p.default)
            for p in inspect.signature(fn).parameters.values()]


def cuda_launch_choices(spec: KernelSpec) -> KernelSpec:
    """The launch choices the launchers make only for CUDA tensors (recorded on ``meta`` tensors).

    * write/read kernels: ``enable_fp_fusion=False`` (``quant_write._launch_options``: bit-identical rounding);
    * decode partial: ``FAST`` = the PTX code conversion for fp16 products, and the register cap
      ``DEFAULT_MAX_REGISTERS`` at 4 warps with at most 16 stacked rows (``paged_decode_attention``).
    """
    name = spec.kernel.split(":")[1]
    if name in ("_write_tokens_kernel", "_read_tokens_kernel"):
        spec.options["enable_fp_fusion"] = False
    if name == "_decode_partial_kernel":
        from ..kernels import decode_attention as da

        c = spec.constexprs
        c["FAST"] = bool(da.FAST_CONVERT and c["DT"] == "tl.float16")
        if spec.options.get("num_warps", 4) == 4 and max(c["H_NG"], c["L_NG"]) * c["GP2"] <= 16:
            spec.options["maxnreg"] = da.DEFAULT_MAX_REGISTERS
    return spec


def spec_name(spec: KernelSpec) -> str:
    """``<kernel>__<hash>``: the manifest name of a spec (hash of kernel, signature, constexprs, options and
    specialization: what the compiled code depends on)."""
    key = json.dumps([spec.kernel, spec.signature, spec.constexprs, spec.options, spec.divisible], sort_keys=True)
    return f"{spec.kernel.split(':')[1].strip('_')}__{hashlib.sha256(key.encode()).hexdigest()[:10]}"


# --------------------------------------------------------------------------- launches bound to graph tensors


class UnboundArgument(RuntimeError):
    """A launch's pointer argument that no named tensor provides (or a view of one at an offset)."""


@dataclass
class TensorInfo:
    """A named tensor of the AOT decode graph: ``dims`` (ints and expressions of ``n``, ``B``, ``P``), torch dtype
    name, kind (``input``: a graph input; ``scratch``: zeros made by the graph each step; ``const``: an initializer
    with ``value``; ``layer``: a per-layer tensor of the decoder or a per-layer slice of a plan tensor)."""

    dims: tuple
    dtype: str
    kind: str
    value: object = None


@dataclass
class Launch:
    """One kernel launch of the decode step (one AOT node)."""

    node: str  # the per-operation plugin it belongs to: decode_decide, page_update, decode_locate, decode_attention
    entry: str  # manifest entry name
    spec: KernelSpec
    pointers: list[str]  # pointer parameters, in kernel-parameter order
    bindings: list[str]  # the named tensor of each
    scalars: dict  # runtime scalar: value or expression (of sizes / constexprs)
    sizes: dict = field(default_factory=dict)  # size name: expression of n, B, P, or int


def storage_id(t) -> int:
    """Identity of a tensor's storage (views of one tensor, dtype views included, share it; ``meta`` tensors
    have no addresses)."""
    return t.untyped_storage()._cdata


def eval_dim(dim, n: int, B: int, P: int) -> int:
    """A dim of :class:`TensorInfo` for concrete step sizes."""
    return dim if isinstance(dim, int) else int(eval_expr(dim, {"n": n, "B": B, "P": P}))


_OPS = {("_write_tokens_kernel", "decode_locate"): "write_low_move", ("_read_tokens_kernel", "decode_locate"):
        "read_high_move", ("_write_tokens_kernel", "decode_attention"): "write_high"}
_FAMILY = {"decode_attention": "decode_attention", "decode_decide": "decode_plan", "decode_locate": "decode_plan",
           "page_update": "page_manager", "prefill_attention": "write_high"}


def launch_of(node: str, launch, names: dict, sizes_of, nbp: tuple) -> Launch:
    """The :class:`Launch` of one recorded launch ``(kernel, grid, args, kwargs)`` made by the plugin implementation
    ``node``: its manifest entry (the spec of :func:`spec_of_launch` with :func:`cuda_launch_choices`, named by
    :func:`spec_name`), every pointer argument bound to the named tensor it is (``names``: :func:`storage_id` ->
    name), the runtime scalars (the per-call ones as their :data:`STEP_SCALARS` expressions) and the sizes
    ``sizes_of(kernel name, node)`` (expressions of ``n``, ``B``, ``P``; checked at ``nbp = (n, B, P)``).

    Raises:
        UnboundArgument: a pointer argument that is no named tensor, or a view of one at an offset.
    """
    kernel, _grid, args, kwargs = launch
    fn_name = getattr(kernel, "fn", kernel).__name__
    params = [p for p, _, _ in kernel_parameters(kernel)]
    bound = {**dict(zip(params, args)), **kwargs}
    sym = sizes_of(fn_name, node)
    n, B, P = nbp
    sizes = {k: eval_dim(v, n, B, P) for k, v in sym.items()}
    select = None
    if "FUSED" in kwargs:
        select = "num_blocks <= CHUNK" if kwargs["FUSED"] else "num_blocks > CHUNK"
    op = _OPS.get((fn_name, node), _FAMILY[node])
    meta_launch = (kernel, _grid, args, kwargs)
    spec = cuda_launch_choices(spec_of_launch(meta_launch, op, sizes, select))
    spec.name = spec_name(spec)
    pointers, bindings = [], []
    for p in spec.params:
        if not spec.signature[p].startswith("*"):
            continue
        value = bound[p]
        key = storage_id(value)
        if key not in names or value.storage_offset() != 0:
            raise UnboundArgument(f"{node}: {fn_name} argument {p} ({tuple(value.shape)} {value.dtype}) is not a named "
                                  "tensor of the AOT decode graph" + (" (a view at an offset)" if key in names
                                                                       else ""))
        pointers.append(p)
        bindings.append(names[key])
    scalars = {p: (spec.step_scalars[p] if p in spec.step_scalars else spec.scalars[p])
               for p in spec.params if not spec.signature[p].startswith("*")}
    return Launch(node, spec.name, spec, pointers, bindings, scalars, sym)
