"""Serving adapters over the :class:`~trtllm_diffkv.llmapi.llm.LLM` API (heavy imports stay in the submodules).

- :mod:`.tritonserver_repo`: write a Triton Inference Server model repository (Python backend, decoupled).
- :mod:`.tritonserver_binary`: run the ``tritonserver`` binary bundled in ``nvidia-pytriton`` on it.
- :mod:`.tritonserver_requests`: the Triton model's tensors (TensorRT-LLM's names) and their translation.
- :mod:`.openai_server`: an OpenAI-compatible HTTP server (FastAPI + uvicorn).
- :mod:`.metrics`: the Prometheus metrics both servers export; :mod:`.process`: server processes.
"""

SERVER_FAULTS = ("the step failed", "the executor step failed", "the executor dropped the request", "abort failed",
                 "the LLM was shut down")
"""Markers of the LLM's error messages that are the server's fault, not the request's (llm.py, executor.py)."""


def is_server_fault(output) -> bool:
    """Whether the failed ``output`` (a :class:`~trtllm_diffkv.llmapi.outputs.RequestOutput` with ``error`` set)
    failed through the server's fault (a failed executor step, a shutdown, an LLM that cannot serve any more):
    an HTTP 500 or 503 (:func:`is_unavailable`) / Triton ``INTERNAL``. Every other error is the request's (bad
    prompt or sampling values, too long, cannot fit the KV pool): a 400 / ``INVALID_ARG``. Apart from
    :func:`is_unavailable`, a request the LLM refused before it reached the executor (no prompt token ids) is
    the request's fault (its message may quote the request: only the LLM's own prefix is trusted there)."""
    error = output.error or ""
    return is_unavailable(output) or (bool(output.prompt_token_ids) and any(marker in error for marker in SERVER_FAULTS))


def is_unavailable(output) -> bool:
    """Whether the failed ``output`` was refused because the LLM cannot serve any request (a broken
    tensor-parallel group, a stopped generation loop: :meth:`~trtllm_diffkv.llmapi.llm.LLM.health`): an HTTP 503,
    so that clients retry elsewhere and an orchestrator restarts the server."""
    from ..llmapi.llm import UNAVAILABLE

    return (output.error or "").startswith(UNAVAILABLE)

DRAINING_MESSAGE = "trtllm-diffkv: shutting down"
"""What the Triton model logs when its shutdown drain begins (``: N request(s) in flight get T s`` follows)."""

DRAINED_MESSAGE = "trtllm-diffkv: drained: every request ended"
"""What the Triton model logs once its shutdown drain is over (``; KV pool pages held: N`` follows); the launcher
(:meth:`~trtllm_diffkv.serve.tritonserver_binary.TritonServer.stop`) reads it in the server's log."""
