"""plugins/trtllm_plugins.py (TensorRT-LLM legacy Python plugin classes) imported against a STAND-IN for
``tensorrt_llm.python_plugin``: TensorRT-LLM cannot be installed here, so nothing below runs the real module.

The stand-in (:func:`_standin`) copies, from ``tensorrt_llm/python_plugin.py`` as read from NVIDIA/TensorRT-LLM,
only what these classes touch: ``trtllm_plugin`` (keyword-only version / namespace / ``plugin_num_outputs``, the
output count from the ``shape_dtype_inference`` return annotation read with ``inspect.signature``, refusal of a
redefinition; registrations recorded here), ``PluginBase.__init__`` (refuses an unregistered class),
``DimensionExpr`` / ``ShapeExpr`` (``+ - * // /`` and ``max``/``min`` through an expression builder, ints made
``exprBuilder.constant``, which fails without a builder as in the real module) and ``SymTensor`` (a shape is a
``ShapeExpr`` or a list/tuple of ints). Not copied: dtype conversion to ``trt.DataType`` (the stand-in keeps dtype
names), ``enqueue``, ``__call__``, serialization. The expression builder is a recording stand-in for
``trt.IExprBuilder`` whose expressions are evaluated here with concrete dims.

Checked: every per-operation plugin of specs.PLUGINS has a registered class; ``shape_dtype_inference`` in the three
ways ``PluginBase`` calls it agrees with :func:`trtllm_diffkv.export.plugin_specs.infer`; ``forward`` of the decode-plan classes equals
``trtllm_diffkv.export.plugin_ops.run_decode_decide`` / ``run_decode_locate`` (Triton interpreter, ``TRITON_INTERPRET=1`` from
conftest on a machine without CUDA).
"""
import importlib
import inspect
import os
import sys
import types
import typing
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trtllm_diffkv.export import plugin_ops as ops, plugin_specs as specs
from test_aot_plugins import prompted_cache
from trtllm_diffkv.export.fields import kv_config_to_fields

COMPOSITE = (specs.STEP_PAGE_UPDATE, specs.LAYER_ATTENTION)
PER_OP = [p for p in specs.PLUGINS.values() if p not in COMPOSITE]


# --------------------------------------------------------------------------- the stand-in


class _Builder:
    """Stand-in for ``trt.IExprBuilder``: expressions are tuples (``("dim", input, axis)`` leaves are the inputs')."""

    def constant(self, value):
        return ("const", int(value))

    def operation(self, op, a, b):
        return (op, a, b)


_OPS = {"SUM": lambda a, b: a + b, "PROD": lambda a, b: a * b, "SUB": lambda a, b: a - b,
        "FLOOR_DIV": lambda a, b: a // b, "CEIL_DIV": lambda a, b: -(-a // b), "MAX": max, "MIN": min,
        "EQUAL": lambda a, b: int(a == b), "LESS": lambda a, b: int(a < b)}


def _eval(expr, shapes):
    """The value of a builder expression for concrete input ``shapes``."""
    if expr[0] == "const":
        return expr[1]
    if expr[0] == "dim":
        return shapes[expr[1]][expr[2]]
    return _OPS[expr[0]](_eval(expr[1], shapes), _eval(expr[2], shapes))


def _standin():
    """A STAND-IN ``tensorrt_llm.python_plugin`` module (see the module docstring) and its registrations
    ``{(namespace, name, version): (class, num_outputs)}``."""
    pp = types.ModuleType("tensorrt_llm.python_plugin")
    pp.__doc__ = "STAND-IN for tensorrt_llm.python_plugin (tests/plugins/test_trtllm_plugins.py), not TensorRT-LLM."
    registered = {}

    def make_expr(builder, dim):
        if isinstance(dim, DimensionExpr):
            assert builder == dim.exprBuilder
            return dim.expr
        if isinstance(dim, int):
            return builder.constant(dim)  # as the real one: AttributeError when there is no builder
        if dim is None:
            return None
        if isinstance(dim, tuple):  # a builder expression (trt.IDimensionExpr)
            return dim
        raise Exception(f"not a dimension: {dim!r}")

    def expr_operation(a, b, op, builder):
        return DimensionExpr(None if builder is None or a is None or b is None else builder.operation(op, a, b),
                             builder)

    class DimensionExpr:
        def __init__(self, expr, exprBuilder):
            self.exprBuilder = exprBuilder
            self.expr = make_expr(exprBuilder, expr)

        def _op(self, other, op, reverse=False):
            other = make_expr(self.exprBuilder, other)
            a, b = (other, self.expr) if reverse else (self.expr, other)
            return expr_operation(a, b, op, self.exprBuilder)

        __add__ = __radd__ = lambda self, o: self._op(o, "SUM")
        __mul__ = __rmul__ = lambda self, o: self._op(o, "PROD")
        __sub__ = lambda self, o: self._op(o, "SUB")
        __rsub__ = lambda self, o: self._op(o, "SUB", True)
        __floordiv__ = lambda self, o: self._op(o, "FLOOR_DIV")
        __rfloordiv__ = lambda self, o: self._op(o, "FLOOR_DIV", True)
        __truediv__ = lambda self, o: self._op(o, "CEIL_DIV")
        __rtruediv__ = lambda self, o: self._op(o, "CEIL_DIV", True)
        __eq__ = lambda self, o: self._op(o, "EQUAL")
        __lt__ = lambda self, o: self._op(o, "LESS")
        max = lambda self, o: self._op(o, "MAX")  # noqa: E731
        min = lambda self, o: self._op(o, "MIN")  # noqa: E731

    class ShapeExpr:
        def __init__(self, dims, exprBuilder):
            self.exprBuilder = exprBuilder
            self.dims = None if dims is None else [DimensionExpr(make_expr(exprBuilder, d), exprBuilder) for d in dims]

        def __getitem__(self, index):
            return DimensionExpr(None, self.exprBuilder) if self.dims is None else self.dims[index]

        def __len__(self):
            return 0 if self.dims is None else len(self.dims)

        def to_trt(self):
            return [d.expr for d in self.dims]

    class SymTensor:
        def __init__(self, dtype, shape):
            assert isinstance(shape, (ShapeExpr, list, tuple))
            if isinstance(shape, (list, tuple)):
                assert all(isinstance(d, int) for d in shape), shape
            self.dtype = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
            self.shape = shape

    class PluginBase:
        _plugin_creator = None

        def __init__(self):
            cls = type(self)
            assert cls._plugin_creator is not None, "Please make sure the plugin is registered through `@trtllm_plugin`"
            assert cls != PluginBase
            self.num_outputs = cls._num_outputs
            self.plugin_namespace, self.plugin_name = cls._plugin_namespace, cls._plugin_name
            self.plugin_version = cls._plugin_version

        def forward(self, inputs, outputs):
            raise NotImplementedError

        def shape_dtype_inference(self, inputs):
            raise NotImplementedError

    def trtllm_plugin(plugin_name, *, plugin_version="1", plugin_namespace="tensorrt_llm", plugin_num_outputs=None,
                      deepcopy_clone=True, no_serialize_attr=()):
        def plugin_registration(plugin_cls):
            nonlocal plugin_num_outputs
            assert issubclass(plugin_cls, PluginBase)
            annotation = inspect.signature(plugin_cls.shape_dtype_inference).return_annotation
            if typing.get_origin(annotation) is tuple or annotation is SymTensor:
                if typing.get_origin(annotation) is tuple:
                    assert all(t == SymTensor for t in typing.get_args(annotation))
                    inferred = len(typing.get_args(annotation))
                else:
                    inferred = 1
                assert plugin_num_outputs is None or plugin_num_outputs == inferred
                plugin_num_outputs = inferred
            else:
                assert plugin_num_outputs is not None, f"no valid return annotation: {annotation!r}"
            key = (plugin_namespace, plugin_name, plugin_version)
            assert key not in registered, f"Redefine plugin {key}"
            registered[key] = (plugin_cls, plugin_num_outputs)
            plugin_cls._plugin_name, plugin_cls._plugin_version = plugin_name, plugin_version
            plugin_cls._plugin_namespace, plugin_cls._num_outputs = plugin_namespace, plugin_num_outputs
            plugin_cls._plugin_creator = ("stand-in creator", key)
            return plugin_cls
        return plugin_registration

    for obj in (DimensionExpr, ShapeExpr, SymTensor, PluginBase, trtllm_plugin):
        setattr(pp, obj.__name__, obj)
    return pp, registered


@pytest.fixture(scope="module")
def trtllm():
    """``trtllm_diffkv_plugins.trtllm_plugins`` imported fresh against the stand-in (removed from ``sys.modules`` afterwards, with
    the stand-in): ``SimpleNamespace(module, pp, registered)``."""
    import trtllm_diffkv_plugins as plugins

    pp, registered = _standin()
    pkg = types.ModuleType("tensorrt_llm")
    pkg.__path__, pkg.python_plugin = [], pp
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "tensorrt_llm", pkg)
        mp.setitem(sys.modules, "tensorrt_llm.python_plugin", pp)
        mp.delitem(sys.modules, "trtllm_diffkv_plugins.trtllm_plugins", raising=False)
        try:
            module = importlib.import_module("trtllm_diffkv_plugins.trtllm_plugins")
        finally:
            sys.modules.pop("trtllm_diffkv_plugins.trtllm_plugins", None)
            plugins.__dict__.pop("trtllm_plugins", None)
    return SimpleNamespace(module=module, pp=pp, registered=registered)


# --------------------------------------------------------------------------- registration and inference


def test_every_per_operation_plugin_has_a_registered_class(trtllm):
    assert [p.name for p in PER_OP] == ["prefill_attention", "decode_attention", "page_update", "decode_decide",
                                        "decode_locate"]
    assert set(trtllm.registered) == {(specs.NAMESPACE, p.name, specs.VERSION) for p in PER_OP}
    for p in PER_OP:
        cls, num_outputs = trtllm.registered[(specs.NAMESPACE, p.name, specs.VERSION)]
        assert cls.spec is p and issubclass(cls, trtllm.pp.PluginBase)
        annotation = inspect.signature(cls.shape_dtype_inference).return_annotation
        assert typing.get_origin(annotation) is tuple, p.name
        assert typing.get_args(annotation) == (trtllm.pp.SymTensor,) * len(p.outputs), p.name
        assert num_outputs == len(p.outputs)
        plugin = cls(num_layers=2, num_kv_heads=2)
        assert plugin.num_outputs == len(p.outputs) and plugin.fields == {"num_layers": 2, "num_kv_heads": 2}
    assert trtllm.module.DiffKVDecodeDecidePlugin.spec is specs.DECODE_DECIDE
    assert trtllm.module.DiffKVDecodeLocatePlugin.spec is specs.DECODE_LOCATE


def _example(plugin, scale=1):
    """Concrete input shapes (q/k/v consistent for the attention plugins) and dtypes of ``plugin``."""
    shapes = [tuple(d * scale for d in (7 + i, 3, 5, 2)[:t.rank]) for i, t in enumerate(plugin.inputs)]
    if plugin.inputs[0].name == "q":
        shapes[:3] = [(6 * scale, 4 * scale, 64), (6 * scale, 2 * scale, 64), (6 * scale, 2 * scale, 64)]
    return shapes, [t.dtypes[0] for t in plugin.inputs]


FIELDS = {"num_layers": np.int64(3), "num_kv_heads": 2, "head_dim": 64}  # a numpy int, as a field may arrive


@pytest.mark.parametrize("plugin", PER_OP, ids=lambda p: p.name)
def test_shape_dtype_inference_agrees_with_specs_infer(trtllm, plugin):
    """The three ways PluginBase calls shape_dtype_inference: ``plugin(*torch_tensors)`` (torch dtypes, int dims),
    ``get_output_data_types`` (dtypes, ``ShapeExpr(None, None)``), ``get_output_shapes`` (no dtypes, symbolic dims,
    evaluated here for two sets of input shapes)."""
    pp = trtllm.pp
    cls, _ = trtllm.registered[(specs.NAMESPACE, plugin.name, specs.VERSION)]
    p = cls(**FIELDS)
    shapes, dtypes = _example(plugin)
    want = specs.infer(plugin, shapes, dtypes, FIELDS)

    outs = p.shape_dtype_inference([pp.SymTensor(getattr(torch, d), list(s)) for s, d in zip(shapes, dtypes)])
    assert isinstance(outs, tuple) and len(outs) == len(plugin.outputs)
    assert [(tuple(o.shape), o.dtype) for o in outs] == want
    assert all(type(d) is int for o in outs for d in o.shape)

    outs = p.shape_dtype_inference([pp.SymTensor(d, pp.ShapeExpr(None, None)) for d in dtypes])
    assert [o.dtype for o in outs] == [d for _, d in want]

    builder = _Builder()
    sym = [pp.SymTensor(None, pp.ShapeExpr([("dim", i, a) for a in range(len(s))], builder))
           for i, s in enumerate(shapes)]
    outs = p.shape_dtype_inference(sym)
    assert len(outs) == len(plugin.outputs)
    for scale in (1, 2):
        shapes_s, _ = _example(plugin, scale)
        want_s = specs.infer(plugin, shapes_s, dtypes, FIELDS)
        got = [tuple(_eval(e, shapes_s) for e in o.shape.to_trt()) for o in outs]
        assert got == [s for s, _ in want_s], scale
    for j, o in enumerate(outs):
        assert o.dtype == (plugin.new_outputs[j][0] if j in plugin.new_outputs else None)


def test_new_outputs_need_the_fields(trtllm):
    p = trtllm.module.DiffKVDecodeDecidePlugin(head_dim=64)
    shapes, dtypes = _example(specs.DECODE_DECIDE)
    with pytest.raises(ValueError, match="num_kv_heads"):
        p.shape_dtype_inference([trtllm.pp.SymTensor(d, list(s)) for s, d in zip(shapes, dtypes)])


# --------------------------------------------------------------------------- forward == ops


def _alloc(pp, plugin, inputs, fill):
    """Outputs of ``plugin`` for torch ``inputs``, shaped as ``plugin(*inputs)`` would allocate them (filled)."""
    outs = plugin.shape_dtype_inference([pp.SymTensor(t.dtype, list(t.shape)) for t in inputs])
    return [torch.full(tuple(o.shape), fill, dtype=getattr(torch, o.dtype)) for o in outs]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors through the Triton kernels need TRITON_INTERPRET=1 (conftest sets it without CUDA)")
@pytest.mark.parametrize("preset", ["demote", "fp16"])
def test_decode_plan_forward_is_the_ops(trtllm, preset):
    """DiffKVDecodeDecidePlugin / DiffKVDecodeLocatePlugin.forward on CPU tensors == ops.run_decode_decide /
    run_decode_locate called directly (the moves through the Triton kernels, as trt_plugins._impl runs them), on
    copies of a cache's state after a prompt: decisions, plan tensors and the pool moved in place. ``demote``
    (recent window 2, alpha_high 1.5) moves tokens to the low tier in this step."""
    from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4

    patch_interpreter_for_numpy_2_4()
    kv, cache, lens = prompted_cache(preset)
    L, Hkv, D = 2, 2, 64
    man = cache.manager
    slots, positions, tokens_pos = torch.tensor([0, 2]), torch.tensor(lens), torch.tensor(lens + [0])  # + 1 padding
    pool, table, tokens = cache.pool.pages().clone(), man.page_table.clone(), man.tokens.clone()
    fields = {"num_layers": L, "num_kv_heads": Hkv, "head_dim": D, **kv_config_to_fields(kv)}

    decide = trtllm.module.DiffKVDecodeDecidePlugin(**fields)
    inputs = [slots, positions, pool, table, tokens, cache.prompt_len_device]
    before = [t.clone() for t in inputs]
    got, ref = _alloc(trtllm.pp, decide, inputs, -7), _alloc(trtllm.pp, decide, inputs, -7)
    decide.forward(inputs, got)
    ops.run_decode_decide([t.clone() for t in inputs], ref, kv, fields)
    for j, (a, b) in enumerate(zip(got, ref)):
        assert torch.equal(a, b), specs.DECODE_DECIDE.outputs[j]
    assert all(torch.equal(a, b) for a, b in zip(inputs, before))  # nothing in place
    if preset == "demote":
        assert int((got[3] >= 0).sum()) > 0  # moves to the low tier in this step

    ops.run_page_update([slots, got[0], got[1], table, tokens, man.pages.clone(), man.slot_state.clone(),
                         man.ring.clone(), torch.tensor(man.snapshot_counters(), dtype=torch.int64)], kv, fields)
    locate = trtllm.module.DiffKVDecodeLocatePlugin(**fields)
    inputs = [slots, positions, tokens_pos, *got[2:], table, pool.clone()]
    ref_inputs = [t.clone() for t in inputs]
    outs, ref = _alloc(trtllm.pp, locate, inputs, -7), _alloc(trtllm.pp, locate, inputs, -7)
    assert [tuple(o.shape) for o in outs[1:]] == [(L, 3, Hkv), (L, 3 * Hkv), (L, 3 * Hkv), (3 * Hkv,), (3 * Hkv,)]
    locate.forward(inputs, outs)
    ops.run_decode_locate(ref_inputs, [ref_inputs[7], *ref[1:]], kv, fields, use_triton=True)
    for j in range(1, len(outs)):
        assert torch.equal(outs[j], ref[j]), specs.DECODE_LOCATE.outputs[j]
    assert torch.equal(inputs[7], ref_inputs[7])  # the pool: the moves written into the input (kv_pool aliases it)
    assert torch.equal(inputs[7], pool) == (preset != "demote")  # demote moved tokens, fp16 moves nothing
