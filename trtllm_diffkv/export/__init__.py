"""Engine build: ahead-of-time kernels (:mod:`.aot`), ONNX export with DiffKV plugin nodes
(:mod:`.onnx_export`), onnxruntime custom ops for those nodes (:mod:`.ort_ops`) and engine
directories (:mod:`.engine_dir`). Nothing in the core imports this package.

The graph forms are defined here, free of imports, so the command line lists them without loading the exporter.
"""

GRAPHS = ("composite", "per-op")
"""ONNX graph forms that need no kernel manifest (:mod:`.onnx_export`)."""
EXPORT_GRAPHS = (*GRAPHS, "aot")
"""Graph forms ``onnx_export.export_onnx`` and ``trtllm-diffkv build --graph`` write (``"aot"``: the prefill and decode
steps with their kernels as AOT nodes, ``export_aot_prefill`` / ``export_aot``, which need the engine's manifest)."""
