"""``trtllm_diffkv_plugins``: DiffKV's TensorRT plugin layer (namespace ``diffkv``), installed from the folder
``plugins/`` by the same ``pyproject.toml`` as ``trtllm_diffkv``.

- :mod:`.trt_plugins`: the TensorRT Python plugins (``tensorrt.plugin``, TensorRT 10.9+; needs ``tensorrt``);
- :mod:`.trtllm_plugins`: TensorRT-LLM's legacy Python plugin classes (``tensorrt_llm.python_plugin``; needs
  ``tensorrt_llm``; they register when imported into a TensorRT-LLM network build);
- :func:`register`: what an engine build calls to register the TensorRT plugins.

Arrows run one way: this package imports ``trtllm_diffkv`` (the plugins' descriptors,
``trtllm_diffkv.export.plugin_specs``, and their implementations, ``trtllm_diffkv.export.plugin_ops``), and
``trtllm_diffkv`` never imports it (``tests/layout``): ``trtllm-diffkv build`` finds :func:`register` through the
entry point ``diffkv`` of the group ``trtllm_diffkv.plugins`` (``pyproject.toml``). Importing this package needs
neither TensorRT nor TensorRT-LLM.
"""
from __future__ import annotations


def register(manifest_path=None, target: str = "sm_90") -> list[str]:
    """Register DiffKV's TensorRT plugins with ``tensorrt.plugin``; returns the plugin names registered.

    Imports :mod:`.trt_plugins`, which registers every plugin of ``trtllm_diffkv.export.plugin_specs.PLUGINS`` (the
    five per-operation plugins and the two composite ones the exported ONNX graph is made of) when first imported;
    with ``manifest_path`` (an engine's ``kernels/manifest.json``) also one ``diffkv::aot_<wrapper>`` plugin per
    TensorRT-convention wrapper compiled for ``target`` (:func:`.trt_plugins.register_aot_plugins`). Idempotent.
    NOT RUN against TensorRT (it cannot be installed on this project's machines).

    Raises:
        ImportError: TensorRT (``tensorrt.plugin``) is not importable.
        KeyError: a manifest without wrappers, or a wrapper not compiled for ``target``.
    """
    from trtllm_diffkv.export import plugin_specs

    from . import trt_plugins

    names = [plugin.full_name for plugin in plugin_specs.PLUGINS.values()]
    if manifest_path is not None:
        names += trt_plugins.register_aot_plugins(manifest_path, target)
    return names
