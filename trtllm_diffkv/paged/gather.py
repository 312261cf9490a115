"""Where a row's tier tokens live, and gathering them back out of the pages (plain torch).

Layout (``trtllm_diffkv.memory``, paper section 5): row ``r`` of the page table
holds one (request slot, layer, KV head); its ``j``-th high-tier token lies in
page ``page_table[r, j // P_high]`` at slot ``j % P_high``, its ``j``-th
low-tier token in page ``page_table[r, R - 1 - j // P_low]`` at slot
``j % P_low`` (R = ``max_pages_per_row``); ``tier_tokens[r] = (high, low)``
counts. Each tier is dense: tokens ``0 .. count-1`` are all live (no holes).

These helpers are vectorized over rows (no loop over requests, layers or
heads) and used by the decode decisions, the torch fallback attention and the
paged oracle.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory import KVCachePool
from ..quant import QuantizedKV, dequantize


def token_location(page_table: torch.Tensor, rows: torch.Tensor, tier: str, index: torch.Tensor,
                   tokens_per_page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Page id and slot of tier token ``index`` of each row.

    Args:
        page_table: int32 ``[num_rows, R]``.
        rows: int64 ``[m]`` (or broadcastable to ``index``'s leading dims) table rows.
        tier: "high" (pages from the left) or "low" (pages from the right).
        index: int64 ``[m, ...]`` token index inside the tier (>= 0).
        tokens_per_page: P of the tier.

    Returns:
        ``(page int32, slot int32)`` shaped like ``index``; page is whatever the
        table holds there (-1 for an unallocated position).
    """
    width = page_table.shape[1]
    col = index // tokens_per_page
    if tier == "low":
        col = width - 1 - col
    col = col.clamp(0, width - 1)
    r = rows.reshape(rows.shape + (1,) * (index.dim() - rows.dim()))
    page = page_table[r.expand_as(index), col]
    return page.to(torch.int32), (index % tokens_per_page).to(torch.int32)


@dataclass
class TierView:
    """One tier of ``m`` rows gathered out of the pages, ``width`` token columns per row.

    Attributes:
        valid: bool ``[m, width]``: column ``j < count`` of the row.
        page, slot: int32 ``[m, width]`` location of each column (page clamped to >= 0 where invalid).
        positions: int32 ``[m, width]`` (None without token metadata).
        scores: fp32 ``[m, width]`` (None without token metadata).
    """

    valid: torch.Tensor
    page: torch.Tensor
    slot: torch.Tensor
    positions: torch.Tensor | None
    scores: torch.Tensor | None


def gather_tier(pool: KVCachePool, page_table: torch.Tensor, tier_tokens: torch.Tensor, rows: torch.Tensor,
                tier: str, width: int) -> TierView:
    """Locations, positions and scores of the first ``width`` tokens of ``tier`` for ``rows`` (int64 ``[m]``)."""
    lay = pool.page_format.tier(tier)
    index = torch.arange(width, device=rows.device).expand(rows.numel(), width)
    page, slot = token_location(page_table, rows, tier, index, lay.tokens_per_page)
    count = tier_tokens[rows, 0 if tier == "high" else 1].to(torch.int64)
    valid = index < count[:, None]
    page = torch.where(valid, page, torch.zeros_like(page)).clamp(min=0)
    p, s = page.long(), slot.long()
    if lay.score.size_bytes:
        positions = pool.segment(tier, "position")[p, s]
        scores = pool.segment(tier, "score")[p, s]
    else:
        positions = scores = None
    return TierView(valid, page, slot, positions, scores)


def dequantize_tier(pool: KVCachePool, tier: str, page: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 keys and values ``[..., head_dim]`` of the tokens at ``(page, slot)`` (keys without offset)."""
    fmt = pool.page_format
    t = fmt.tier(tier).tier
    p, s = page.long(), slot.long()
    out = []
    for side, bits, groups in (("key", t.key_bits, t.key_groups), ("value", t.value_bits, t.value_groups)):
        codes = pool.segment(tier, f"{side}_codes")[p, s]
        if bits == 16:
            out.append(codes.contiguous().view(torch.float16).float())
            continue
        meta = pool.segment(tier, f"{side}_meta")[p, s]
        out.append(dequantize(QuantizedKV(codes, meta[..., 0], meta[..., 1], bits, fmt.head_dim)))
    return out[0], out[1]
