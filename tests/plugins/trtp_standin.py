"""A stand-in for ``tensorrt.plugin`` (TensorRT cannot be installed here) that enforces what TensorRT's own
``tensorrt/plugin`` validates and how it calls the registered functions (read from NVIDIA/TensorRT
``python/packaging/bindings_wheel/tensorrt/plugin/_validate.py``, ``_plugin_class.py``, ``_top_level.py``):

* ``register``: every parameter annotated, tensor parameters first, attributes of a serializable type, a return
  annotation ``TensorDesc`` or ``Tuple[TensorDesc, ...]`` (its length = the output count);
* ``impl``: parameter names ``(tensors, attrs..., outputs, stream[, tactic])``; an ``outputs`` annotation, if any, a
  ``typing.Tuple`` of ``Tensor``; called ``impl(*tensors, *attr_values, outputs, stream=stream)``;
* ``aot_impl``: names ``(tensors, attrs..., outputs, tactic)``, the return annotation
  ``Tuple[str | bytes, str | bytes, KernelLaunchParams, SymIntExprs]``; called
  ``aot_impl(*input_descs, *attr_values, output_descs, tactic)``;
* ``cdiv(a, b)`` refuses two ints;
* a name registered twice is refused.

What it does not reproduce: TensorRT's symbolic expressions (dims here are ints or the test's own symbols), the C++
launcher, serialization.
"""
from __future__ import annotations

import inspect
import types
import typing

SERIALIZABLE = (int, float, bytes, bool, str)


class TensorDesc:
    def __init__(self, shape_expr, tag=None):
        self.shape_expr, self.tag = shape_expr, tag

    def like(self):
        return ("like", self.tag)

    def aliased(self):
        return ("aliased", self.tag)


class Tensor:
    pass


class KernelLaunchParams:
    pass


class SymIntExprs(tuple):
    @classmethod
    def from_tuple(cls, values):
        return cls(values)


class Plugin:
    """What registration recorded: the functions, the tensor and attribute names, the output count."""

    def __init__(self, desc, tensors, attrs, num_outputs):
        self.desc, self.tensors, self.attrs, self.num_outputs = desc, tensors, attrs, num_outputs
        self.impl = self.aot_impl = None

    def call_impl(self, tensors, attrs: dict, outputs, stream=0):
        return self.impl(*tensors, *(attrs[n] for n in self.attrs), outputs, stream=stream)

    def call_aot_impl(self, descs, attrs: dict, outputs, tactic=0):
        return self.aot_impl(*descs, *(attrs[n] for n in self.attrs), outputs, tactic)


def module(**extra) -> tuple[types.ModuleType, dict]:
    """``(tensorrt.plugin stand-in, {name: Plugin})``."""
    plugins: dict[str, Plugin] = {}
    trtp = types.ModuleType("tensorrt.plugin")

    def register(name):
        def deco(fn):
            if name in plugins:  # tensorrt/plugin/_lib.py: a second definition of a name is refused
                raise ValueError(f"'{name}' already has a definition")
            sig = inspect.signature(fn)
            tensors, attrs, seen_attr = [], {}, False
            for pname, p in sig.parameters.items():
                if p.annotation is inspect.Parameter.empty:
                    raise ValueError(f"{name}: argument {pname} has no type annotation")
                if isinstance(p.annotation, type) and issubclass(p.annotation, TensorDesc):
                    if seen_attr:
                        raise ValueError(f"{name}: tensors and attributes interspersed")
                    tensors.append(pname)
                else:
                    if p.annotation not in SERIALIZABLE:
                        raise ValueError(f"{name}: attribute {pname} of type {p.annotation} is not serializable")
                    seen_attr = True
                    attrs[pname] = p.annotation
            ret = sig.return_annotation
            if ret is inspect.Parameter.empty:
                raise ValueError(f"{name}: no return annotation found for register function")
            if typing.get_origin(ret) is tuple:
                args = typing.get_args(ret)
                if not all(isinstance(a, type) and issubclass(a, TensorDesc) for a in args):
                    raise ValueError(f"{name}: return types can only be TensorDesc or Tuple[TensorDesc]")
                n_out = len(args)
            elif isinstance(ret, type) and issubclass(ret, TensorDesc):
                n_out = 1
            else:
                raise ValueError(f"{name}: return type {ret}")
            plugins[name] = Plugin(fn, tensors, list(attrs), n_out)
            return fn
        return deco

    def _check_names(name, fn, tail):
        sig = inspect.signature(fn)
        p = plugins[name]
        want = [*p.tensors, *p.attrs, *tail]
        if list(sig.parameters) != want:
            raise ValueError(f"{name}: signature {list(sig.parameters)} does not match {want}")
        out = sig.parameters["outputs"].annotation
        if out is not inspect.Parameter.empty and typing.get_origin(out) is not tuple:
            raise ValueError(f"{name}: 'outputs' should be of type Tuple[...]; received {out}")
        return sig

    def impl(name):
        def deco(fn):
            sig = _check_names(name, fn, [n for n in ("outputs", "stream", "tactic")
                                          if n in inspect.signature(fn).parameters])
            if sig.return_annotation not in (inspect.Parameter.empty, None):
                raise ValueError(f"{name}: impl's return annotation should be None")
            plugins[name].impl = fn
            return fn
        return deco

    def aot_impl(name):
        def deco(fn):
            sig = _check_names(name, fn, ["outputs", "tactic"])
            ret = sig.return_annotation
            args = typing.get_args(ret) if typing.get_origin(ret) is tuple else ()
            if len(args) != 4 or not issubclass(args[2], KernelLaunchParams) or not issubclass(args[3], SymIntExprs):
                raise ValueError(f"{name}: aot_impl's return annotation is {ret}")
            for a in args[:2]:
                members = typing.get_args(a) or (a,)
                if not all(m in (str, bytes) for m in members):
                    raise ValueError(f"{name}: aot_impl's return annotation is {ret}")
            plugins[name].aot_impl = fn
            return fn
        return deco

    def cdiv(a, b):
        if isinstance(a, int) and isinstance(b, int):
            raise ValueError("Both arguments cannot be 'int's")
        return (a + (b - 1)) // b

    trtp.TensorDesc, trtp.Tensor, trtp.KernelLaunchParams, trtp.SymIntExprs = (TensorDesc, Tensor,
                                                                               KernelLaunchParams, SymIntExprs)
    trtp.register, trtp.impl, trtp.aot_impl, trtp.cdiv = register, impl, aot_impl, cdiv
    trtp.SymInt32 = lambda e: ("i32", e)
    trtp.ShapeExprs = types.SimpleNamespace(from_tuple=tuple)
    trtp.from_shape_expr = lambda shape, dtype: ("new", tuple(shape), dtype)
    for k, v in extra.items():
        setattr(trtp, k, v)
    return trtp, plugins
