"""DiffKV inside TensorRT-LLM's PyTorch backend, through TensorRT-LLM's own ``LLM`` API.

NOT RUN: TensorRT-LLM cannot be installed on this project's machines (the adapter is tested through
``tests/trtllm_backend/trtllm_standin.py``). Needs TensorRT-LLM 1.4.0rc or later (docs/RUNTIME.md); PyPI's
tensorrt_llm stops at 1.2.1, a placeholder without the compression framework:

    pip install --pre --extra-index-url https://pypi.nvidia.com "tensorrt_llm>=1.4.0rc1"   # or NVIDIA's container
    pip install --no-deps -e /path/to/trtllm-diffkv   # this package's checkout (TensorRT-LLM already brings torch, triton)

Usage: ``python examples/trtllm_llm_api.py /path/to/hf_checkpoint``
"""
import sys

# first: without TensorRT-LLM it says what to install (importing it registers "diffkv" / "DIFFKV")
from trtllm_diffkv.trtllm_backend import DiffKVCompressionConfig

from tensorrt_llm import LLM, SamplingParams  # noqa: E402
from tensorrt_llm.llmapi import KvCacheConfig  # noqa: E402


def main(model_dir: str) -> None:
    print(f"loading {model_dir} into TensorRT-LLM with DiffKV attention ...", flush=True)
    llm = LLM(model_dir,
              attn_backend="DIFFKV",                  # DiffKVAttention: the layers read DiffKV's paged cache
              disable_overlap_scheduler=True,         # this TensorRT-LLM adapter plans each step after the previous one ended
              enable_chunked_prefill=False,           # the whole prompt is scored at once (last 64 queries)
              cuda_graph_config=None,                 # on by default; a replay would skip DiffKV's host-side planning
              kv_cache_config=KvCacheConfig(
                  use_kv_cache_manager_v2=True,       # the compression framework binds only V2 ("auto": V1 for Llama)
                  enable_block_reuse=False,           # on by default; compacted prompts are not reusable prefixes
                  free_gpu_memory_fraction=0.1),      # TensorRT-LLM's own KV cache: the layers' KV lives in DiffKV's pool
              kv_cache_compression_config=DiffKVCompressionConfig(preset="llama3-8b", kv_memory_fraction=0.8))
    for output in llm.generate(["Explain in two sentences why a KV cache grows with context length."],
                               SamplingParams(max_tokens=64, temperature=0.0)):
        print(output.outputs[0].text, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
