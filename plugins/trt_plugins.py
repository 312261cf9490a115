"""TensorRT Python plugins (``tensorrt.plugin``, TensorRT 10.9+) for DiffKV. NOT RUN here: TensorRT cannot
be installed on this project's machines; written against the documented API (``@trtp.register``,
``@trtp.impl``, ``@trtp.aot_impl``, ``TensorDesc.like()/aliased()``, ``KernelLaunchParams``,
``SymIntExprs``), with its plain-Python parts (:mod:`trtllm_diffkv.export.plugin_specs`) tested on the CPU.

Importing this module registers, for each plugin of :data:`trtllm_diffkv.export.plugin_specs.PLUGINS` (the five per-operation
plugins - ``decode_decide``, ``page_update`` and ``decode_locate`` being the decode step's plan, whose outputs of
new shapes are described with ``trtp.from_shape_expr`` - and the two composite ones the exported ONNX graph is made of, ``DiffKVPageUpdate`` and
``DiffKVAttention``, whose implementations run a ``PagedDiffKVCache`` registered in this process, so they
need Python at run time and have no AOT form):

* the descriptor (the attention output shaped like q, the state outputs aliased to their inputs, as
  :func:`trtllm_diffkv.export.plugin_specs.infer` states and tests);
* the Python implementation (``@trtp.impl``): wraps TensorRT's device tensors as torch tensors and calls
  the project's Triton kernels (``kernels/``, ``memory/triton_page_manager.py``) - the JIT path;
* for the AOT route (:func:`register_aot_plugins`), one plugin per TensorRT-convention wrapper of the manifest,
  ``diffkv::aot_<wrapper>`` (``@trtp.aot_impl`` returns one kernel per plugin, so a multi-kernel operation such as
  decode attention is three plugin nodes: partial, merge, score): it returns the wrapper's PTX, kernel name, grid and
  block, shared memory and the runtime scalar arguments as symbolic expressions, so the engine runs without Python.

Node attributes (ONNX) / plugin fields: each plugin's ``fields`` (:mod:`trtllm_diffkv.export.plugin_specs`: the model shape and the
DiffKV configuration, ``trtllm_diffkv.export.fields.kv_config_to_fields``).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
from pathlib import Path

import tensorrt as trt
import tensorrt.plugin as trtp  # noqa: F401 - this module needs TensorRT (import it only where it exists)

from trtllm_diffkv.export import plugin_ops as ops, plugin_specs as specs

MANIFEST = os.environ.get("TRTLLM_DIFFKV_MANIFEST")
"""Path of the engine's kernels/manifest.json: the environment's ``TRTLLM_DIFFKV_MANIFEST``, or the one
:func:`register_aot_plugins` last registered (a deployment's loader calls that before deserializing an engine; the
build command never builds an engine from the AOT graphs)."""


def signature(tensors: list[str], tensor_type, attrs: dict, kind: str, num_outputs: int) -> inspect.Signature:
    """The signature ``tensorrt.plugin`` validates (``tensorrt/plugin/_validate.py``), for a function that takes
    TensorRT's calls (``_plugin_class.py``, ``_lib.py``):

    * ``"register"``: ``(tensors..., *, attrs...) -> Tuple[TensorDesc, ...]`` (the return annotation gives the output
      count); TensorRT calls ``desc(*input_descs, **attrs)``;
    * ``"impl"``: ``(tensors..., attrs..., outputs, stream)`` (``outputs`` unannotated: the validator wants a
      ``typing.Tuple``, and the annotation is optional); TensorRT calls ``impl(*tensors, *attr_values, outputs,
      stream=stream)``;
    * ``"aot_impl"``: ``(tensors..., attrs..., outputs, tactic) -> Tuple[str | bytes, str | bytes,
      KernelLaunchParams, SymIntExprs]``; TensorRT calls ``aot_impl(*input_descs, *attr_values, output_descs,
      tactic)``.
    """
    from typing import Tuple, Union

    P = inspect.Parameter
    params = [P(n, P.POSITIONAL_OR_KEYWORD, annotation=tensor_type) for n in tensors]
    if kind == "register":
        params += [P(n, P.KEYWORD_ONLY, annotation=a) for n, a in attrs.items()]
        return inspect.Signature(params, return_annotation=Tuple[(trtp.TensorDesc,) * num_outputs])
    params += [P(n, P.POSITIONAL_OR_KEYWORD, annotation=a) for n, a in attrs.items()]
    params.append(P("outputs", P.POSITIONAL_OR_KEYWORD))
    if kind == "impl":
        return inspect.Signature(params + [P("stream", P.KEYWORD_ONLY, annotation=int)])
    ret = Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]
    return inspect.Signature(params + [P("tactic", P.POSITIONAL_OR_KEYWORD, annotation=int)], return_annotation=ret)


def split_call(args: tuple, num_tensors: int, attr_names: list[str]) -> tuple[list, dict, object]:
    """``(tensors, attrs, outputs)`` of a positional ``impl`` / ``aot_impl`` call (tensors, attribute values in
    registration order, outputs[, tactic])."""
    n = len(attr_names)
    return list(args[:num_tensors]), dict(zip(attr_names, args[num_tensors:num_tensors + n])), \
        args[num_tensors + n]


def _descriptor(plugin: specs.PluginSpec):
    def desc(*inputs, **attrs):
        outs = []
        for j, _ in enumerate(plugin.outputs):
            if j in plugin.aliases:
                outs.append(inputs[plugin.aliases[j]].aliased())
            elif j in plugin.new_outputs:  # the decode plan's outputs: sized by input dims and the fields
                dtype, shape = plugin.new_outputs[j]
                dims = shape([list(t.shape_expr) for t in inputs], attrs)
                outs.append(trtp.from_shape_expr(trtp.ShapeExprs.from_tuple(tuple(dims)), dtype=getattr(trt, dtype)))
            else:
                outs.append(inputs[0].like())
        return tuple(outs)
    desc.__signature__ = signature([t.name for t in plugin.inputs], trtp.TensorDesc, plugin.fields, "register",
                                   len(plugin.outputs))
    return desc


def _impl(plugin: specs.PluginSpec):
    def impl(*args, stream, tactic=None):
        import torch

        from trtllm_diffkv.export.fields import kv_config_from_fields

        inputs, attrs, outputs = split_call(args, len(plugin.inputs), list(plugin.fields))

        tensors = [torch.as_tensor(t, device="cuda") for t in inputs]
        cfg = kv_config_from_fields(attrs)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            if plugin is specs.STEP_PAGE_UPDATE:  # composite: the registered cache's plan
                ops.run_step_page_update(tensors, torch.as_tensor(outputs[0], device="cuda"))
            elif plugin is specs.LAYER_ATTENTION:  # composite: the registered cache's layer forward
                ops.run_layer_attention(tensors, torch.as_tensor(outputs[0], device="cuda"), attrs)
            elif plugin is specs.PAGE_UPDATE:
                ops.run_page_update(tensors, cfg, attrs)  # every output aliases its input: updated in place
            elif plugin is specs.DECODE_DECIDE:
                ops.run_decode_decide(tensors, [torch.as_tensor(o, device="cuda") for o in outputs], cfg, attrs)
            elif plugin is specs.DECODE_LOCATE:
                ops.run_decode_locate(tensors, [tensors[7], *(torch.as_tensor(o, device="cuda") for o in outputs[1:])],
                                      cfg, attrs, use_triton=True)
            else:
                run = ops.run_prefill if plugin is specs.PREFILL else ops.run_decode
                run(tensors, torch.as_tensor(outputs[0], device="cuda"), cfg, attrs, use_triton=True)
    impl.__signature__ = signature([t.name for t in plugin.inputs], trtp.Tensor, plugin.fields, "impl",
                                   len(plugin.outputs))
    return impl


for _plugin in specs.PLUGINS.values():
    trtp.register(_plugin.full_name)(_descriptor(_plugin))
    trtp.impl(_plugin.full_name)(_impl(_plugin))


# --------------------------------------------------------------------------- AOT: one plugin per compiled kernel


def register_aot_plugins(manifest_path: str | Path, target: str = "sm_90") -> list[str]:
    """Register ``diffkv::aot_<wrapper>`` for every TensorRT-convention wrapper of the engine's manifest
    (``manifest["trt_abi"]``, ``trtllm_diffkv/export/trt_abi.py``): the AOT decode graph's nodes
    (``export/onnx_export.py::export_aot``). Returns the plugin names.

    Per plugin: inputs = the wrapper's inputs (the launch's distinct buffers), every output aliased to its input
    (updated in place); fields = the node's attributes (``onnx_export.AOT_ATTRS``: JSON strings and ints);
    ``aot_impl`` returns the wrapper's PTX for ``target`` (its entry declares exactly the inputs, the int32 extra
    args and the outputs: the convention TensorRT launches with), its name, the launch parameters - grid from the
    node's expressions of the inputs' dims, ``num_warps * 32`` threads, the compiled shared memory - and the extra
    args as ``SymInt32`` expressions (:func:`trtllm_diffkv.export.trt_abi.launch_plan`, the function onnxruntime's
    ops use with integer dims). NOT RUN against TensorRT (not installable here); the wrappers' PTX ran on an H200
    through the CUDA driver with this parameter list (``tests/export/test_aot_gpu.py``).

    Raises:
        KeyError: a manifest without wrappers (``trt_abi``) or a wrapper not compiled for ``target`` (naming it).
    """
    from trtllm_diffkv.export import trt_abi
    from trtllm_diffkv.export.onnx_export import AOT_ATTRS

    global MANIFEST
    MANIFEST = str(manifest_path)
    folder = Path(manifest_path).parent
    manifest = json.loads(Path(manifest_path).read_text())
    names = []
    if "trt_abi" not in manifest:
        raise KeyError(f"{manifest_path}: no TensorRT-convention wrappers (manifest 'trt_abi'): rebuild the kernels "
                       "with this version (aot.build_kernels)")
    for data in manifest["trt_abi"]:
        abi = trt_abi.AbiKernel.from_json(data)
        if target not in abi.compiled:
            raise KeyError(f"{abi.name}: not compiled for {target} (compiled: {sorted(abi.compiled)})")
        compiled = abi.compiled[target]
        name = f"{specs.NAMESPACE}::aot_{abi.name}"
        ptx_text = (folder / compiled["ptx"]).read_text()
        digest = hashlib.sha256(ptx_text.encode()).hexdigest()
        if name in _AOT_REGISTERED:  # TensorRT refuses a second definition of a name (tensorrt/plugin/_lib.py)
            if _AOT_REGISTERED[name] != digest:
                raise ValueError(f"{name} is already registered with another PTX (another build of the same wrapper "
                                 "name); register one engine's kernels per process")
            names.append(name)
            continue
        tensors = [f"in{j}" for j in range(len(abi.input_dtypes))]

        def desc(*inputs, **attrs):  # every output aliases its input: the kernels update in place
            return tuple(t.aliased() for t in inputs)

        desc.__signature__ = signature(tensors, trtp.TensorDesc, AOT_ATTRS, "register", len(tensors))
        trtp.register(name)(desc)

        trtp.aot_impl(name)(_aot_impl(compiled, tensors, ptx_text))
        _AOT_REGISTERED[name] = digest
        names.append(name)
    return names


def _aot_impl(compiled: dict, tensors: list[str], ptx: str):
    """The ``aot_impl`` of one wrapper: TensorRT calls it ``(*input_descs, *attr_values, output_descs, tactic)``;
    returns the kernel name, the PTX, the launch parameters (grid from the node's expressions of the inputs' dims,
    ``num_warps * 32`` threads, the compiled shared memory) and the extra args as ``SymInt32`` expressions."""
    from trtllm_diffkv.export import trt_abi
    from trtllm_diffkv.export.onnx_export import AOT_ATTRS

    def aot(*args):
        inputs, attrs, _ = split_call(args, len(tensors), list(AOT_ATTRS))
        grid, extras = trt_abi.launch_plan(attrs, lambda j, axis: inputs[j].shape_expr[axis], cdiv=trtp.cdiv)
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y, launch.grid_z = grid
        launch.block_x = 32 * compiled["num_warps"]
        launch.shared_mem = compiled["shared_bytes"]
        return compiled["kernel_name"], ptx, launch, trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in extras])

    aot.__signature__ = signature(tensors, trtp.TensorDesc, AOT_ATTRS, "aot_impl", len(tensors))
    return aot


_AOT_REGISTERED: dict[str, str] = {}
"""``diffkv::aot_<wrapper>`` names registered in this process -> their PTX's sha256 (a second engine with the same
wrapper is skipped; the same name with another PTX is refused)."""
