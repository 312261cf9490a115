"""The KV pool: one byte buffer per model and device, allocated once, viewed per layout.

DiffKV's unified pages (paper section 5; ``DiffKV.md``, "Memory manager") all
have one byte size, so the whole KV cache of a model is a single
``uint8 [num_pages * page_size_bytes]`` buffer. Page ``p`` occupies bytes
``[p * page_size_bytes, (p + 1) * page_size_bytes)``; which tier it holds is
decided by the page table (``page_manager``), so each tier's segment views
alias the same bytes. This is the only place that allocates KV memory.
"""
from __future__ import annotations

import torch

from .page_format import PageFormat
from ..validators import positive_int

SEGMENT_DTYPES = {
    "key_codes": torch.uint8,
    "key_meta": torch.float16,
    "value_codes": torch.uint8,
    "value_meta": torch.float16,
    "score": torch.float32,
    "position": torch.int32,
}
"""Element type of each segment view."""


class KVCachePool:
    """One byte buffer holding every page of a model's KV cache.

    Args:
        page_format: the page spec every view follows.
        num_pages: pages in the pool, >= 1.
        device: where to allocate (``"cuda"`` in the product).

    Attributes:
        buffer: ``uint8 [num_pages * page_size_bytes]``, the whole pool.

    Raises:
        ValueError: ``num_pages`` < 1.
    """

    def __init__(self, page_format: PageFormat, num_pages: int, device: str | torch.device = "cuda") -> None:
        positive_int("num_pages", num_pages)
        self.page_format = page_format
        self.num_pages = num_pages
        self.buffer = torch.empty(num_pages * page_format.page_size_bytes, dtype=torch.uint8, device=device)

    @classmethod
    def from_budget(
        cls,
        page_format: PageFormat,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_fraction: float | None = None,
        device: str | torch.device = "cuda",
    ) -> "KVCachePool":
        """A pool of as many pages as fit in a memory budget.

        Give exactly one of:
            kv_cache_memory_bytes: bytes for the pool.
            gpu_memory_fraction: fraction in (0, 1] of the device's *free*
                memory now (``torch.cuda.mem_get_info``); call after the model
                weights and a warm-up step have taken theirs.

        Raises:
            ValueError: neither or both given, a fraction outside (0, 1], a
                fraction for a non-CUDA device, or a budget below one page.
        """
        if (kv_cache_memory_bytes is None) == (gpu_memory_fraction is None):
            raise ValueError("give exactly one of kv_cache_memory_bytes and gpu_memory_fraction")
        if gpu_memory_fraction is not None:
            if not 0.0 < gpu_memory_fraction <= 1.0:
                raise ValueError(f"gpu_memory_fraction={gpu_memory_fraction} must be in (0, 1]")
            device = torch.device(device)
            if device.type != "cuda":
                raise ValueError(f"gpu_memory_fraction needs a CUDA device, got {device}")
            free_bytes, _total = torch.cuda.mem_get_info(device)
            kv_cache_memory_bytes = int(free_bytes * gpu_memory_fraction)
        num_pages = page_format.pages_in_budget(kv_cache_memory_bytes)
        if num_pages < 1:
            raise ValueError(
                f"kv-cache budget of {kv_cache_memory_bytes} bytes holds no {page_format.page_size_bytes}-byte page"
            )
        return cls(page_format, num_pages, device)

    @property
    def size_bytes(self) -> int:
        return self.buffer.numel()

    def pages(self) -> torch.Tensor:
        """``uint8 [num_pages, page_size_bytes]`` view: one row per page."""
        return self.buffer.view(self.num_pages, self.page_format.page_size_bytes)

    def segment(self, tier: str, name: str) -> torch.Tensor:
        """Typed view of one segment of every page, read as tier ``tier``.

        Shapes (T = tokens per page of the tier, D = head_dim):

        * ``key_codes`` / ``value_codes``: uint8 ``[num_pages, T, D * bits / 8]``
        * ``key_meta`` / ``value_meta``: float16 ``[num_pages, T, groups, 2]``
          (scale, zero); ``[num_pages, T, 0, 2]`` for a 16-bit side
        * ``score``: float32 ``[num_pages, T]``; ``position``: int32 ``[num_pages, T]``

        Raises:
            ValueError: unknown tier or segment.
        """
        layout = self.page_format.tier(tier)
        segment = layout.segment(name)
        dtype = SEGMENT_DTYPES[name]
        item = dtype.itemsize
        tokens, page = layout.tokens_per_page, self.page_format.page_size_bytes
        if name in ("key_codes", "value_codes"):
            bits = layout.tier.key_bits if name == "key_codes" else layout.tier.value_bits
            shape = (self.num_pages, tokens, self.page_format.head_dim * bits // 8)
        elif name in ("key_meta", "value_meta"):
            bits, groups = (
                (layout.tier.key_bits, layout.tier.key_groups) if name == "key_meta"
                else (layout.tier.value_bits, layout.tier.value_groups)
            )
            shape = (self.num_pages, tokens, groups if bits < 16 else 0, 2)
        else:
            shape = (self.num_pages, tokens if segment.size_bytes else 0)
        strides = (page // item,) + _contiguous_strides(shape[1:])
        return self.buffer.view(dtype).as_strided(shape, strides, segment.offset_bytes // item)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
