"""TensorRT Python plugins (``tensorrt.plugin``, TensorRT 10.9+) for DiffKV. NOT RUN here: TensorRT cannot
be installed on this project's machines; written against the documented API (``@trtp.register``,
``@trtp.impl``, ``@trtp.aot_impl``, ``TensorDesc.like()/aliased()``, ``KernelLaunchParams``,
``SymIntExprs``), with its plain-Python parts (:mod:`.specs`) tested on the CPU.

Importing this module registers, for each plugin of :data:`.specs.PLUGINS` (the five per-operation
plugins - ``decode_decide``, ``page_update`` and ``decode_locate`` being the decode step's plan, whose outputs of
new shapes are described with ``trtp.from_shape_expr`` - and the two composite ones the exported ONNX graph is made of, ``DiffKVPageUpdate`` and
``DiffKVAttention``, whose implementations run a ``PagedDiffKVCache`` registered in this process, so they
need Python at run time and have no AOT form):

* the descriptor (the attention output shaped like q, the state outputs aliased to their inputs, as
  :func:`.specs.infer` states and tests);
* the Python implementation (``@trtp.impl``): wraps TensorRT's device tensors as torch tensors and calls
  the project's Triton kernels (``kernels/``, ``memory/triton_page_manager.py``) - the JIT path;
* for the AOT route, one plugin per compiled kernel, ``diffkv::aot_<kernel>`` (``@trtp.aot_impl`` returns
  one kernel per plugin, so a multi-kernel operation such as decode attention is three plugin nodes:
  partial, merge, score): it returns the manifest's PTX, kernel name, grid and block, shared memory and the
  runtime scalar arguments as symbolic expressions, so the engine runs without Python.

Node attributes (ONNX) / plugin fields: each plugin's ``fields`` (:mod:`.specs`: the model shape and the
DiffKV configuration, ``trtllm_diffkv.build.fields.kv_config_to_fields``).
"""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import tensorrt as trt
import tensorrt.plugin as trtp  # noqa: F401 - this module needs TensorRT (import it only where it exists)

from . import ops, specs

MANIFEST = os.environ.get("TRTLLM_DIFFKV_MANIFEST")
"""Path of the engine's kernels/manifest.json (set by ``trtllm-diffkv build`` before parsing the graph)."""


def _with_signature(fn, plugin: specs.PluginSpec, kind: str):
    """``fn(*tensors, **attrs)`` with the explicit signature ``tensorrt.plugin`` reads (tensor params, then attrs)."""
    tensor_type = {"register": trtp.TensorDesc, "impl": trtp.Tensor}[kind]
    params = [inspect.Parameter(t.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=tensor_type)
              for t in plugin.inputs]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=a) for n, a in plugin.fields.items()]
    if kind == "impl":
        params += [inspect.Parameter("outputs", inspect.Parameter.KEYWORD_ONLY, annotation=tuple),
                   inspect.Parameter("stream", inspect.Parameter.KEYWORD_ONLY, annotation=int)]
    fn.__signature__ = inspect.Signature(params)
    return fn


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
    return _with_signature(desc, plugin, "register")


def _impl(plugin: specs.PluginSpec):
    def impl(*inputs, outputs, stream, **attrs):
        import torch

        from trtllm_diffkv.build.fields import kv_config_from_fields

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
    return _with_signature(impl, plugin, "impl")


for _plugin in specs.PLUGINS.values():
    trtp.register(_plugin.full_name)(_descriptor(_plugin))
    trtp.impl(_plugin.full_name)(_impl(_plugin))


# --------------------------------------------------------------------------- AOT: one plugin per compiled kernel


def aot_launch(entry: dict, target: str, sizes: dict) -> tuple[str, str, dict, list]:
    """(kernel name, PTX, launch params dict, runtime scalar values) of a manifest entry for ``sizes``.

    Plain Python (no TensorRT types) so the GPU test and the AOT plugins share it: grid from the manifest's
    expressions, block ``num_warps * 32``, shared memory from the compiled metadata.
    """
    from trtllm_diffkv.build.aot import eval_grid

    c = entry["compiled"][target]
    grid = eval_grid(entry["grid"], sizes, entry["constexprs"]) + (1,) * (3 - len(entry["grid"]))
    ptx = (Path(MANIFEST).parent / c["ptx"]).read_text() if MANIFEST else ""
    params = dict(grid_x=grid[0], grid_y=grid[1], grid_z=grid[2], block_x=32 * c["num_warps"],
                  shared_mem=c["shared_bytes"])
    step = entry.get("step_scalars", {})  # per-call scalars (row counts...): evaluated for these sizes
    return c["kernel_name"], ptx, params, [eval_grid([step[n]], sizes, entry["constexprs"])[0] if n in step
                                          else entry["scalars"].get(n) for n in entry["params"]
                                          if not entry["signature"][n].startswith("*")]


def register_aot_plugins(manifest_path: str | Path, target: str = "sm_90") -> list[str]:
    """Register ``diffkv::aot_<kernel name>`` for every manifest entry (its pointer args as tensors, each output the
    input of the same index, aliased: the AOT decode graph's nodes, ``build/onnx_export.py::export_aot``); returns names.

    NOT RUN, and known not to fit TensorRT's AOT calling convention as it stands: ``tensorrt.plugin`` launches an AOT
    kernel with the input pointers, then the ``extra_args`` (integers only), then the output pointers, whereas our
    Triton kernels interleave pointers and scalars, take fp32 scalars (``qk_scale``) and fp64 data (the alphas), and
    Triton 3.6 appends two scratch pointers; a wrapper kernel per entry (or reordered kernel parameters) is missing.

    The runtime sizes (grid) come from the first input's shape at build time through ``trtp.KernelLaunchParams``
    symbolic expressions; scalars recorded as constants in the manifest are passed as ``SymIntExprs``.
    """
    global MANIFEST
    MANIFEST = str(manifest_path)
    manifest = json.loads(Path(manifest_path).read_text())
    names = []
    for entry in manifest["kernels"]:
        name = f"{specs.NAMESPACE}::aot_{entry['name']}"
        pointers = [n for n in entry["params"] if entry["signature"][n].startswith("*")]

        def desc(*tensors, _n=len(pointers)):  # every pointer argument, updated in place (the AOT graph's nodes)
            return tuple(t.aliased() for t in tensors)

        desc.__signature__ = inspect.Signature(
            [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=trtp.TensorDesc) for p in pointers])
        trtp.register(name)(desc)

        def aot(*tensors, outputs, tactic, _entry=entry):
            kernel_name, ptx, p, scalars = aot_launch(_entry, target, _entry["sizes"])
            launch = trtp.KernelLaunchParams()
            for key, value in p.items():
                setattr(launch, key, value)
            return kernel_name, ptx, launch, trtp.SymIntExprs.from_tuple([trtp.SymInt32(int(s)) for s in scalars
                                                                            if isinstance(s, int)])
        aot.__signature__ = inspect.Signature(
            [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=trtp.TensorDesc) for p in pointers]
            + [inspect.Parameter("outputs", inspect.Parameter.KEYWORD_ONLY, annotation=tuple),
               inspect.Parameter("tactic", inspect.Parameter.KEYWORD_ONLY, annotation=int)])
        trtp.aot_impl(name)(aot)
        names.append(name)
    return names
