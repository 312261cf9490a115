"""DiffKV memory manager: unified pages, one pool, circular free list, bidirectional page table.

Paper section 5 (``DiffKV.md``, "Memory manager"):

* :class:`PageFormat` (``page_format``): the frozen page spec (page bytes,
  tokens per tier, segment offsets) every kernel and size calculation reads;
* :class:`KVCachePool` (``pool``): the one byte buffer of a model's KV cache;
* :class:`PageManager` (``page_manager``): the allocator API, integers only;
  :class:`CpuPageManager` is its CPU implementation (oracle and CPU path),
  ``TritonPageManager`` (``triton_page_manager``, needs Triton) the GPU one.
"""
from .page_format import PageFormat, Segment, TierLayout, tier_layout
from .page_manager import CpuPageManager, PageManager, PageStatus, PageTableSnapshot, SlotState, StepStatus
from .pool import KVCachePool

__all__ = [
    "PageFormat", "Segment", "TierLayout", "tier_layout", "KVCachePool", "PageManager", "CpuPageManager",
    "PageStatus", "SlotState", "StepStatus", "PageTableSnapshot", "TritonPageManager",
]


def __getattr__(name: str):
    if name == "TritonPageManager":  # imported on demand: Triton is optional for the CPU path
        from .triton_page_manager import TritonPageManager

        return TritonPageManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
