"""TensorRT-LLM legacy Python plugin classes for DiffKV (``tensorrt_llm.python_plugin``). NOT RUN here:
TensorRT-LLM cannot be installed on this project's machines.

Written against ``tensorrt_llm/python_plugin.py`` (read from NVIDIA/TensorRT-LLM): a class deriving
``PluginBase``, decorated ``@trtllm_plugin(name, plugin_namespace=...)``, with
``shape_dtype_inference(self, inputs: list[SymTensor])`` (its return annotation, a tuple of
``SymTensor``, gives the output count) and ``forward(self, inputs, outputs)`` (torch tensors on
TensorRT's stream; the plugin's fields are its ``__dict__``, pickled by ``PluginBase``). In a
``tensorrt_llm`` network, ``plugin(*tensors)`` adds the layer; on torch tensors it runs ``forward``.
The legacy path was removed from TensorRT-LLM in mid 2026 (deployments on older releases still use it).

The classes register under the per-operation plugins' names of :mod:`.specs` (``diffkv::prefill_attention``,
``diffkv::decode_attention``, ``diffkv::page_update``, version 1), the names ``trt_plugins`` registers.
"""
from __future__ import annotations

from typing import Tuple

from tensorrt_llm.python_plugin import PluginBase, SymTensor, trtllm_plugin

from . import specs
from . import ops


def _infer(plugin: specs.PluginSpec, inputs):
    """SymTensors of the outputs: the attention output like q, state outputs like their inputs."""
    return tuple(SymTensor(inputs[plugin.aliases.get(j, 0)].dtype, inputs[plugin.aliases.get(j, 0)].shape)
                 for j in range(len(plugin.outputs)))


class _DiffKVPlugin(PluginBase):
    """Common part: the plugin fields (model shape + DiffKV configuration) as attributes."""

    spec: specs.PluginSpec

    def __init__(self, **fields):
        super().__init__()
        self.fields = dict(fields)

    def forward(self, inputs, outputs):
        from trtllm_diffkv.build.fields import kv_config_from_fields

        cfg = kv_config_from_fields(self.fields)
        if self.spec is specs.PAGE_UPDATE:
            ops.run_page_update(list(inputs), cfg, self.fields)
        elif self.spec is specs.PREFILL:
            ops.run_prefill(list(inputs), outputs[0], cfg, self.fields, use_triton=True)
        else:
            ops.run_decode(list(inputs), outputs[0], cfg, self.fields, use_triton=True)


@trtllm_plugin(specs.PREFILL.name, plugin_version=specs.VERSION, plugin_namespace=specs.NAMESPACE)
class DiffKVPrefillAttentionPlugin(_DiffKVPlugin):
    """``diffkv::prefill_attention`` (see :data:`.specs.PREFILL`)."""

    spec = specs.PREFILL

    def shape_dtype_inference(self, inputs) -> Tuple[SymTensor, SymTensor, SymTensor, SymTensor, SymTensor]:
        return _infer(self.spec, inputs)


@trtllm_plugin(specs.DECODE.name, plugin_version=specs.VERSION, plugin_namespace=specs.NAMESPACE)
class DiffKVDecodeAttentionPlugin(_DiffKVPlugin):
    """``diffkv::decode_attention`` (see :data:`.specs.DECODE`)."""

    spec = specs.DECODE

    def shape_dtype_inference(self, inputs) -> Tuple[SymTensor, SymTensor, SymTensor]:
        return _infer(self.spec, inputs)


@trtllm_plugin(specs.PAGE_UPDATE.name, plugin_version=specs.VERSION, plugin_namespace=specs.NAMESPACE)
class DiffKVPageUpdatePlugin(_DiffKVPlugin):
    """``diffkv::page_update`` (see :data:`.specs.PAGE_UPDATE`)."""

    spec = specs.PAGE_UPDATE

    def shape_dtype_inference(self, inputs) -> Tuple[SymTensor, SymTensor, SymTensor, SymTensor, SymTensor, SymTensor]:
        return _infer(self.spec, inputs)
