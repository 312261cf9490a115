"""TensorRT-LLM's API shapes over the in-flight executor (TensorRT-LLM keeps them in ``tensorrt_llm.llmapi``).

- :mod:`.llm`: :class:`LLM` (``generate``, ``generate_async``, streaming) over one
  :class:`~trtllm_diffkv.runtime.executor.Executor`;
- :mod:`.outputs`: :class:`RequestOutput`, :class:`CompletionOutput` and the request handles;
- :mod:`.model_runner`: :class:`ModelRunner`, the ``ModelRunner.from_dir(...).generate(...)`` shape;
- :class:`SamplingParams` is the runtime's (:mod:`trtllm_diffkv.runtime.sampling`), re-exported here.

Names are imported on first use.
"""
from ..lazy import lazy_exports

_LAZY = {
    "LLM": ".llm", "RequestOutput": ".outputs", "CompletionOutput": ".outputs", "ModelRunner": ".model_runner",
    "SamplingParams": "..runtime.sampling",
}
__all__ = sorted(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY)
