"""``python -m trtllm_diffkv.trtllm_backend.serve``: TensorRT-LLM's ``trtllm-serve`` with DiffKV registered.

``trtllm-serve`` (``tensorrt_llm.commands.serve:main``, a click command) reads
``--extra_llm_api_options FILE.yaml`` into its LLM arguments before anything of ours is imported, so a
``kv_cache_compression_config: {algorithm: diffkv, ...}`` block needs :func:`~.registration.register`
first. This launcher registers, then runs ``trtllm-serve`` with the same arguments::

    python -m trtllm_diffkv.trtllm_backend.serve /models/Llama-3.1-8B-Instruct \\
        --backend pytorch --extra_llm_api_options examples/trtllm_serve_diffkv.yaml

NOT RUN: TensorRT-LLM cannot be installed on this project's machines.
"""
from __future__ import annotations


def main() -> None:
    """Register DiffKV with TensorRT-LLM, then hand the command line to ``trtllm-serve``.

    Raises:
        ImportError: TensorRT-LLM is not installed (the message says how).
    """
    from .config import DiffKVCompressionConfig  # noqa: F401 - importing it registers the method
    from tensorrt_llm.commands.serve import main as trtllm_serve

    trtllm_serve()


if __name__ == "__main__":
    main()
