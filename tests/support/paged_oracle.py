"""Paged oracle: a request's pages gathered back into dense, dequantized K/V (slow, obvious; for tests).

For each (layer, KV head) of a request, every stored token of both tiers is
read out of its page (:mod:`.gather` layout), dequantized with
:func:`trtllm_diffkv.quant.dequantize` (keys get the row's fp16 offset added
back, ``center_keys``), and returned sorted by position, with its tier and
score, so that tests can compare the paged cache with
:class:`~trtllm_diffkv.cache.DiffKVReferenceCache` step by step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trtllm_diffkv.policy import TIER_HIGH, TIER_LOW
from trtllm_diffkv.paged.gather import dequantize_tier, gather_tier


@dataclass
class RowTokens:
    """The stored tokens of one (request, layer, KV head), sorted by position.

    Attributes:
        positions: int64 ``[n]``; tiers: int8 ``[n]`` (TIER_HIGH / TIER_LOW);
        keys, values: fp32 ``[n, head_dim]`` (keys with the offset added back);
        scores: fp32 ``[n]`` accumulated scores (zeros without token metadata).
    """

    positions: torch.Tensor
    tiers: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor


def gather_request(cache, slot: int) -> list[list[RowTokens]]:
    """``[num_layers][num_kv_heads]`` :class:`RowTokens` of the request in ``slot`` of a ``PagedDiffKVCache``.

    Without token metadata (fp16 preset) the high tier is in write order, so a
    token's position is its index.

    Raises:
        ValueError: ``slot`` holds no request.
    """
    if not 0 <= slot < cache.max_slots or not cache.prompt_len[slot]:
        raise ValueError(f"slot {slot} holds no request")
    pool, manager = cache.pool, cache.manager
    table, tokens = manager.page_table.cpu(), manager.tokens.cpu()
    pool_cpu = pool if pool.buffer.device.type == "cpu" else _cpu_pool(pool)
    offsets = cache.row_meta.key_offsets.cpu().float()
    out = []
    for layer in range(cache.num_layers):
        heads = []
        for head in range(cache.num_kv_heads):
            row = (slot * cache.num_layers + layer) * cache.num_kv_heads + head
            heads.append(_row_tokens(pool_cpu, table, tokens, row, offsets[row] if offsets.shape[1] else None))
        out.append(heads)
    return out


def _cpu_pool(pool):
    copy = pool.__class__.__new__(pool.__class__)
    copy.page_format, copy.num_pages, copy.buffer = pool.page_format, pool.num_pages, pool.buffer.cpu()
    return copy


def _row_tokens(pool, table, tokens, row: int, offset) -> RowTokens:
    rows = torch.tensor([row])
    parts = []
    for tier, code in (("high", TIER_HIGH), ("low", TIER_LOW)):
        count = int(tokens[row, 0 if tier == "high" else 1])
        view = gather_tier(pool, table, tokens, rows, tier, count)
        k, v = dequantize_tier(pool, tier, view.page[0], view.slot[0])
        if offset is not None:
            k = k + offset
        if view.positions is not None:
            pos, score = view.positions[0].long(), view.scores[0].float()
        else:
            pos, score = torch.arange(count), torch.zeros(count)
        parts.append((pos, torch.full((count,), code, dtype=torch.int8), k, v, score))
    pos, tiers, k, v, score = (torch.cat([p[i] for p in parts]) for i in range(5))
    order = torch.argsort(pos)
    return RowTokens(pos[order], tiers[order], k[order], v[order], score[order])
