"""Engine build: ahead-of-time kernels (:mod:`.aot`), ONNX export with DiffKV plugin nodes
(:mod:`.onnx_export`), onnxruntime custom ops for those nodes (:mod:`.ort_ops`) and engine
directories (:mod:`.engine_dir`). Nothing in the core imports this package.
"""
