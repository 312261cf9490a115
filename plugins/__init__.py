"""TensorRT plugins of DiffKV (namespace ``diffkv``): descriptors in plain Python (:mod:`.specs`), the
TensorRT Python plugins (:mod:`.trt_plugins`, needs ``tensorrt``) and TensorRT-LLM's legacy Python
plugin classes (:mod:`.trtllm_plugins`, needs ``tensorrt_llm``).

Nothing in ``trtllm_diffkv`` imports this folder; it imports the kernels. Importing this package needs
neither TensorRT nor TensorRT-LLM.
"""
