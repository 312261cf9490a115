"""Engine export: ahead-of-time kernels (:mod:`.aot`, :mod:`.cuda_aot`; a recorded launch: :mod:`.launches`), the AOT
decode and prefill graphs (:mod:`.aot_graph`, :mod:`.aot_prefill`), TensorRT's AOT calling convention
(:mod:`.trt_abi`), the DiffKV plugins' node specs and op bodies (:mod:`.plugin_specs`, :mod:`.plugin_ops`), ONNX
export with DiffKV plugin nodes (:mod:`.onnx_export`), onnxruntime custom ops for those nodes (:mod:`.ort_ops`), the
engine's fields (:mod:`.fields`) and engine directories (:mod:`.engine_dir`). Nothing in the core imports this
package; the TensorRT plugins that register these specs are the package ``trtllm_diffkv_plugins`` (``plugins/``).

The graph forms are defined here, free of imports, so the command line lists them without loading the exporter.
"""

GRAPHS = ("composite", "per-op")
"""ONNX graph forms that need no kernel manifest (:mod:`.onnx_export`)."""
EXPORT_GRAPHS = (*GRAPHS, "aot")
"""Graph forms ``onnx_export.export_onnx`` and ``trtllm-diffkv build --graph`` write (``"aot"``: the prefill and decode
steps with their kernels as AOT nodes, ``export_aot_prefill`` / ``export_aot``, which need the engine's manifest)."""
