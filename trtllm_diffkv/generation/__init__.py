"""Generation loops and what every generation path shares.

- :mod:`.reference`: :class:`ReferenceGenerator`, the exact oracle loop (one request at a time, reference cache);
- :mod:`.static_batch`: :class:`PagedGenerator`, greedy static batches on the paged cache;
- :mod:`.results`: :class:`GenerationResult`, :class:`PagedGenerationResult` and :func:`result_fields`, the result
  of every path (the executor's included);
- :mod:`.prompts`: :func:`check_prompt_ids` and :func:`position_limit`, the one home of the request checks.

Names are imported on first use (the loops pull in the caches and kernels).
"""
from ..lazy import lazy_exports

_LAZY = {
    "ReferenceGenerator": ".reference", "PagedGenerator": ".static_batch",
    "GenerationResult": ".results", "PagedGenerationResult": ".results", "result_fields": ".results",
    "check_prompt_ids": ".prompts", "position_limit": ".prompts",
}
__all__ = sorted(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY)
