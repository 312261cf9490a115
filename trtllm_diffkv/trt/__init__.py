"""Adapters for NVIDIA's TensorRT stack (optional; the core never imports this package).

- :mod:`.tensorrt_llm`: DiffKV as a KV-cache compression method of TensorRT-LLM's PyTorch backend
  (configuration, compression manager, attention backend).
"""
