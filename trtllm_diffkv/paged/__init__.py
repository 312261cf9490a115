"""Paged DiffKV: tokens live quantized in unified pages, moved by the page manager (paper section 5).

* :class:`PagedDiffKVCache` (:mod:`.cache`): the model's attention backend for
  a batch of requests over one :class:`~trtllm_diffkv.memory.KVCachePool`;
* :mod:`.decisions`: the batched per-step DiffKV decisions of every row;
* :func:`gather_request` (:mod:`.oracle`): a request's pages back as dense K/V (tests);
* :class:`PagedGenerator` (:mod:`.generator`): greedy generation on the paged cache;
* :mod:`.torch_ops`: plain-torch versions of the kernels (CPU path, fallback).
"""
from .cache import OutOfPagesError, PagedCacheStats, PagedDiffKVCache
from .oracle import RowTokens, gather_request
from .row_meta import RowMetadata, RowMetadataFormat

__all__ = ["PagedDiffKVCache", "PagedCacheStats", "OutOfPagesError", "RowMetadata", "RowMetadataFormat",
           "RowTokens", "gather_request", "PagedGenerator"]


def __getattr__(name: str):
    if name == "PagedGenerator":
        from .generator import PagedGenerator

        return PagedGenerator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
