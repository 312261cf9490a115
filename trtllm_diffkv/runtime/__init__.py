"""In-flight batching runtime: the page-pool runtime wrapper, the executor, sampling, CUDA graphs.

- :mod:`.resource_manager`: :class:`DiffKVResourceManager`, the one object that owns the page
  pool and the page manager between executor steps (TensorRT-LLM's resource-manager contract).
- :mod:`.executor`: :class:`Executor`, the step loop over a packed batch of prefill and decode
  requests (abort, streaming, per-request failures); :mod:`.scheduler`: admission by free pages,
  preemption by recomputation; :mod:`.request`: :class:`Request`, :class:`RequestUpdate`.
- :mod:`.sampling`: :class:`SamplingParams`, the batched :class:`Sampler`; :mod:`.stop_checker`:
  :class:`StopChecker`.
- :mod:`.cuda_graphs`: decode steps replayed from CUDA graphs over bucketed batch sizes.

Names are imported on first use.
"""
from ..lazy import lazy_exports

_LAZY = {
    "DiffKVResourceManager": ".resource_manager", "ScheduledBatch": ".resource_manager",
    "Executor": ".executor", "Request": ".request", "RequestUpdate": ".request", "Scheduler": ".scheduler",
    "SamplingParams": ".sampling", "Sampler": ".sampling", "StopChecker": ".stop_checker",
    "DecodeGraphRunner": ".cuda_graphs",
}
__all__ = sorted(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY)
