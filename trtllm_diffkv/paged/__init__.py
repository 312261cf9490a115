"""Paged DiffKV: tokens live quantized in unified pages, moved by the page manager (paper section 5).

* :class:`PagedDiffKVCache` (:mod:`.cache`): the model's attention backend for
  a batch of requests over one :class:`~trtllm_diffkv.memory.KVCachePool`;
* :mod:`.step_plan`: the typed plan of one step (:class:`~.step_plan.StepPlan`, its prefill and decode parts)
  that ``plan`` builds, the layers read and ``end_step`` ends;
* :mod:`.host_inputs`: a step's host integers in one (pinned, non-blocking) host-to-device copy;
* :mod:`.decisions`: the batched per-step DiffKV decisions of every row;
* :mod:`.gather`: a row's tier pages read back and dequantized (the tests' paged oracle,
  ``tests/support/paged_oracle.py``, builds on it);
* :mod:`.torch_ops`: plain-torch versions of the kernels (CPU path, fallback).

Greedy generation on this cache (static batches) is :class:`trtllm_diffkv.generation.PagedGenerator`.
"""
from .cache import OutOfPagesError, PagedCacheStats, PagedDiffKVCache
from .row_meta import RowMetadata, RowMetadataFormat

__all__ = ["PagedDiffKVCache", "PagedCacheStats", "OutOfPagesError", "RowMetadata", "RowMetadataFormat"]
