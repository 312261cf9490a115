"""Serving adapters over the :class:`~trtllm_diffkv.llm.LLM` API (heavy imports stay in the submodules).

- :mod:`.triton_repo`: write a Triton Inference Server model repository (Python backend, decoupled).
- :mod:`.triton_server`: run the ``tritonserver`` binary bundled in ``nvidia-pytriton`` on it.
- :mod:`.triton_requests`: the Triton model's tensors (TensorRT-LLM's names) and their translation.
- :mod:`.openai_server`: an OpenAI-compatible HTTP server (FastAPI + uvicorn).
- :mod:`.metrics`: the Prometheus metrics both servers export; :mod:`.process`: server processes.
"""
