"""Per-row metadata that lives beside the pages: its format and its one buffer.

A page holds tokens; some state belongs to a whole row (one request slot,
layer and KV head) instead: the key channel offset of ``center_keys``
(``DiffKVConfig.center_keys``: the fp16 per-channel mean of the row's prompt
keys, subtracted before quantization). :class:`RowMetadataFormat` states its
bytes per row next to the :class:`~trtllm_diffkv.memory.PageFormat`, and
:class:`RowMetadata` allocates it once for every row of the page table, so
the paged cache's memory is the pool plus this region, both accounted in bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import DiffKVConfig


@dataclass(frozen=True)
class RowMetadataFormat:
    """Bytes of per-row metadata.

    Attributes:
        head_dim: the model's head dimension.
        key_offset: whether rows store the fp16 ``[head_dim]`` key offset
            (``config.compress and config.center_keys``).
    """

    head_dim: int
    key_offset: bool

    @classmethod
    def for_config(cls, config: DiffKVConfig, head_dim: int) -> "RowMetadataFormat":
        """The row metadata ``config`` needs at ``head_dim``."""
        return cls(head_dim, bool(config.compress and config.center_keys))

    @property
    def row_bytes(self) -> int:
        """Bytes one row takes: ``2 * head_dim`` for the fp16 key offset, else 0."""
        return 2 * self.head_dim if self.key_offset else 0


class RowMetadata:
    """The per-row metadata buffer of a paged cache, allocated once.

    Args:
        fmt: the :class:`RowMetadataFormat`.
        num_rows: page-table rows (``max_slots * num_layers * num_kv_heads``).
        device: where to allocate.

    Attributes:
        key_offsets: fp16 ``[num_rows, head_dim]`` (``[num_rows, 0]`` without
            ``center_keys``); row ``r`` as in the page table.
    """

    def __init__(self, fmt: RowMetadataFormat, num_rows: int, device: str | torch.device) -> None:
        self.format = fmt
        self.num_rows = num_rows
        width = fmt.head_dim if fmt.key_offset else 0
        self.key_offsets = torch.zeros(num_rows, width, dtype=torch.float16, device=device)

    @property
    def size_bytes(self) -> int:
        """Bytes allocated for all rows."""
        return self.num_rows * self.format.row_bytes
