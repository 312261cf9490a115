"""TensorRT-LLM legacy Python plugin classes for DiffKV (``tensorrt_llm.python_plugin``). NOT RUN against
TensorRT-LLM: it cannot be installed on this project's machines. ``tests/plugins/test_trtllm_plugins.py`` imports this
module against a stand-in for ``tensorrt_llm.python_plugin`` (registration, annotation-derived output counts,
``SymTensor`` / ``ShapeExpr`` shape arithmetic as the real module defines them) and runs ``forward`` of the
decode-plan classes on CPU tensors; the real base class, TensorRT's calls and the engine path never ran.

Written against ``tensorrt_llm/python_plugin.py`` (read from NVIDIA/TensorRT-LLM): a class deriving
``PluginBase``, decorated ``@trtllm_plugin(name, plugin_version=..., plugin_namespace=..., plugin_num_outputs=...)``
(keyword-only after the name), with ``shape_dtype_inference(self, inputs: list[SymTensor])`` (its return
annotation, a ``typing.Tuple`` of ``SymTensor``, gives the output count; the decorator checks it against
``plugin_num_outputs``) and ``forward(self, inputs, outputs)`` (``tensorrt_llm._utils.TensorWrapper`` objects on
TensorRT's stream in an engine, torch tensors when called on torch tensors; the plugin's fields are its
``__dict__``, pickled by ``PluginBase``). In a ``tensorrt_llm`` network, ``plugin(*tensors)`` adds the layer; on
torch tensors it allocates the outputs from ``shape_dtype_inference`` and runs ``forward``. No
``from __future__ import annotations`` here: the decorator reads the return annotation with
``inspect.signature`` (no ``eval_str``), so it must be a real ``Tuple[SymTensor, ...]``, not a string.
The legacy path was removed from TensorRT-LLM in mid 2026 (deployments on older releases still use it).

``shape_dtype_inference`` is called three ways by ``PluginBase``: ``get_output_data_types`` passes
``SymTensor(dtype, ShapeExpr(None, None))`` (no shapes, no expression builder), ``get_output_shapes`` passes
``SymTensor(None, ShapeExpr(dims, exprBuilder))`` (``ShapeExpr[i]`` is a ``DimensionExpr`` supporting
``+ - * // /`` (``/``: ceil division), ``max``/``min``, with ints made ``exprBuilder.constant``), and
``plugin(*torch_tensors)`` passes ``SymTensor(torch dtype, [int dims])``. :func:`_infer` serves all three: aliased
outputs take their input's dtype and shape, the decode plan's ``new_outputs`` the spec's dtype and its shape
function applied to the input shapes (ints, or ``DimensionExpr`` wrapped into a ``ShapeExpr`` of the same
builder; in the dtype-only call the shape is ``ShapeExpr(None, None)``, since ``DimensionExpr`` arithmetic with an
int needs a builder).

The classes register under the per-operation plugins' names of :mod:`trtllm_diffkv.export.plugin_specs` (``diffkv::prefill_attention``,
``diffkv::decode_attention``, ``diffkv::page_update``, ``diffkv::decode_decide``, ``diffkv::decode_locate``,
version 1), the names ``trt_plugins`` registers; the composite ``DiffKVPageUpdate`` / ``DiffKVAttention`` have no
class here. ``forward`` calls :mod:`trtllm_diffkv.export.plugin_ops` as ``trt_plugins._impl`` does.

Known gaps, from reading the TensorRT-LLM source (not from running it):

* no input/output aliasing: ``PluginBase`` is an ``IPluginV3OneBuild`` without ``get_aliased_input``, so the
  "aliased" state outputs (kv_pool, page table, ...) are separate buffers TensorRT allocates; ``forward`` updates
  the *input* state in place (as :mod:`trtllm_diffkv.export.plugin_ops` does) and leaves those outputs unwritten, and ``plugin(*torch_tensors)``
  returns fresh ``torch.empty`` tensors for them. Writing an input is outside TensorRT's contract for a plugin
  without aliasing; a correct legacy node would copy the state into its outputs (a whole-pool copy per node) and
  update those instead.
* uint8: the ``tensorrt_llm/_utils.py`` read maps no uint8 in ``trt_dtype_to_torch`` / ``torch_dtype_to_trt`` /
  ``str_dtype_to_trt``, so ``TensorWrapper.from_trt_desc`` (in ``enqueue``) and ``plugin(*torch_tensors)`` would
  refuse the uint8 ``kv_pool`` of every plugin except ``page_update``.
"""
import numbers
from typing import Tuple

from tensorrt_llm.python_plugin import PluginBase, ShapeExpr, SymTensor, trtllm_plugin

from trtllm_diffkv.export import plugin_ops as ops
from trtllm_diffkv.export import plugin_specs as specs


def _infer(plugin: specs.PluginSpec, inputs, fields: dict) -> tuple:
    """SymTensors of ``plugin``'s outputs (:func:`trtllm_diffkv.export.plugin_specs.infer`'s rules): an aliased output like its input, a
    ``new_outputs`` one with the spec's dtype and shape (``f(input shapes, fields)``), else like the first input.

    Raises:
        ValueError: ``plugin`` has ``new_outputs`` and ``fields`` lacks ``num_layers`` / ``num_kv_heads``.
    """
    shapes = [t.shape for t in inputs]
    if plugin.new_outputs:
        missing = {"num_layers", "num_kv_heads"} - set(fields)
        if missing:
            raise ValueError(f"{plugin.full_name}: output shapes need the plugin fields {sorted(missing)}")
    f = {k: int(v) if isinstance(v, numbers.Integral) else v for k, v in fields.items()}  # numpy ints: no constant()
    concrete = all(isinstance(s, (list, tuple)) for s in shapes)
    builder = None if concrete else next((s.exprBuilder for s in shapes if isinstance(s, ShapeExpr)), None)
    out = []
    for j in range(len(plugin.outputs)):
        if j in plugin.new_outputs:
            dtype, shape_fn = plugin.new_outputs[j]
            if concrete:  # plugin(*torch_tensors): int dims
                shape = tuple(int(d) for d in shape_fn(shapes, f))
            elif builder is None:  # get_output_data_types: only the dtype is read
                shape = ShapeExpr(None, None)
            else:  # get_output_shapes: DimensionExpr dims, ints become the builder's constants
                shape = ShapeExpr(list(shape_fn(shapes, f)), builder)
            out.append(SymTensor(dtype, shape))
        else:
            src = inputs[plugin.aliases.get(j, 0)]
            out.append(SymTensor(src.dtype, src.shape))
    return tuple(out)


def _as_torch(t):
    """A torch tensor over ``t``'s memory: ``t`` itself, or a ``TensorWrapper`` (``__cuda_array_interface__``,
    bfloat16 described as ``<f2``, hence the view to its torch dtype)."""
    import torch

    if isinstance(t, torch.Tensor):
        return t
    return torch.as_tensor(t, device="cuda").view(t.dtype)


class _DiffKVPlugin(PluginBase):
    """Common part: the plugin fields (model shape + DiffKV configuration) as attributes."""

    spec: specs.PluginSpec

    def __init__(self, **fields):
        super().__init__()
        self.fields = dict(fields)

    def forward(self, inputs, outputs):
        """Run :mod:`trtllm_diffkv.export.plugin_ops` on the tensors, as ``trt_plugins._impl`` does (state inputs updated in place)."""
        from trtllm_diffkv.export.fields import kv_config_from_fields

        tensors = [_as_torch(t) for t in inputs]
        cfg = kv_config_from_fields(self.fields)
        attrs = self.fields
        if self.spec is specs.PAGE_UPDATE:
            ops.run_page_update(tensors, cfg, attrs)  # every output aliases its input: updated in place
        elif self.spec is specs.DECODE_DECIDE:
            ops.run_decode_decide(tensors, [_as_torch(o) for o in outputs], cfg, attrs)
        elif self.spec is specs.DECODE_LOCATE:  # kv_pool (output 0) is input 7, moved in place
            ops.run_decode_locate(tensors, [tensors[7], *(_as_torch(o) for o in outputs[1:])], cfg, attrs,
                                  use_triton=True)
        else:
            run = ops.run_prefill if self.spec is specs.PREFILL else ops.run_decode
            run(tensors, _as_torch(outputs[0]), cfg, attrs, use_triton=True)


def _register(spec: specs.PluginSpec):
    return trtllm_plugin(spec.name, plugin_version=specs.VERSION, plugin_namespace=specs.NAMESPACE,
                         plugin_num_outputs=len(spec.outputs))


@_register(specs.PREFILL)
class DiffKVPrefillAttentionPlugin(_DiffKVPlugin):
    """``diffkv::prefill_attention`` (see :data:`trtllm_diffkv.export.plugin_specs.PREFILL`)."""

    spec = specs.PREFILL

    def shape_dtype_inference(self, inputs) -> Tuple[SymTensor, SymTensor, SymTensor, SymTensor, SymTensor]:
        return _infer(self.spec, inputs, self.fields)


@_register(specs.DECODE)
class DiffKVDecodeAttentionPlugin(_DiffKVPlugin):
    """``diffkv::decode_attention`` (see :data:`trtllm_diffkv.export.plugin_specs.DECODE`)."""

    spec = specs.DECODE

    def shape_dtype_inference(self, inputs) -> Tuple[SymTensor, SymTensor, SymTensor]:
        return _infer(self.spec, inputs, self.fields)


@_register(specs.PAGE_UPDATE)
class DiffKVPageUpdatePlugin(_DiffKVPlugin):
    """``diffkv::page_update`` (see :data:`trtllm_diffkv.export.plugin_specs.PAGE_UPDATE`)."""

    spec = specs.PAGE_UPDATE

    def shape_dtype_inference(self, inputs) -> Tuple[SymTensor, SymTensor, SymTensor, SymTensor, SymTensor, SymTensor]:
        return _infer(self.spec, inputs, self.fields)


@_register(specs.DECODE_DECIDE)
class DiffKVDecodeDecidePlugin(_DiffKVPlugin):
    """``diffkv::decode_decide`` (see :data:`trtllm_diffkv.export.plugin_specs.DECODE_DECIDE`): the decode step's tier decisions; every output
    new (high/low deltas int32 ``[n, L, Hkv]``, new_index / move_from / move_to int64 ``[n * L * Hkv]``), sized by
    the fields ``num_layers`` / ``num_kv_heads``."""

    spec = specs.DECODE_DECIDE

    def shape_dtype_inference(self, inputs) -> Tuple[SymTensor, SymTensor, SymTensor, SymTensor, SymTensor]:
        return _infer(self.spec, inputs, self.fields)


@_register(specs.DECODE_LOCATE)
class DiffKVDecodeLocatePlugin(_DiffKVPlugin):
    """``diffkv::decode_locate`` (see :data:`trtllm_diffkv.export.plugin_specs.DECODE_LOCATE`): kv_pool (aliases input 7; the moves are
    written into the input), then the decode_attention nodes' plan tensors (new, int32, sized by
    ``token_positions``' length and the fields)."""

    spec = specs.DECODE_LOCATE

    def shape_dtype_inference(self, inputs) -> Tuple[SymTensor, SymTensor, SymTensor, SymTensor, SymTensor, SymTensor]:
        return _infer(self.spec, inputs, self.fields)
