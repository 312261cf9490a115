"""Decode step of the paged cache: batched decisions, one page-manager call, moves, new tokens (paper sections 4.2, 5).

Used by :class:`~.cache.PagedDiffKVCache`. :func:`plan_decode` (once per step,
before the layers) decides for every (request, layer, KV head) row from the
scores through the previous step (:func:`.decisions.decide`), makes ONE
``append_decode`` with all rows' (high, low) deltas in {0, +1}, then performs
every move to the low tier (demoted victim or departing candidate: dequantize
the high token, requantize it at the low tier into its low slot, keys in the
centered domain) and locates the high slot each new token goes to.
:func:`decode_layer` (per layer, no host synchronization) quantizes the new
token into that slot and runs paged decode attention, which adds each token's
probability to its score.
"""
from __future__ import annotations

import torch

from . import decisions, torch_ops
from .gather import token_location


def plan_decode(cache, step) -> None:
    """Decisions of every layer, ONE ``append_decode``, the moves to the low tier, the new tokens' slots."""
    cfg, dev, fmt = cache.config, cache.device, cache.page_format
    L, H = cache.num_layers, cache.num_kv_heads
    dec_slots = step.slots[step.n_pre:]
    slots = torch.tensor(dec_slots, dtype=torch.int64, device=dev)
    pos_host = step.positions[step.n_pre:]
    rows = (slots[:, None] * cache.rows_per_slot + torch.arange(cache.rows_per_slot, device=dev)).reshape(-1)
    pos = torch.tensor(pos_host, dtype=torch.int64, device=dev).repeat_interleave(cache.rows_per_slot)
    table, tokens = cache.manager.page_table, cache.manager.tokens
    if cfg.compress:
        act = decisions.decide(cache.pool, table, tokens, rows, pos, cache._prompt_len_dev[slots].repeat_interleave(
            cache.rows_per_slot), alpha_high=cfg.alpha_high, alpha_low=cfg.alpha_low,
            recent_window_tokens=cfg.recent_window_tokens, prompt_score_window_tokens=cfg.prompt_score_window_tokens,
            max_pos=max(pos_host))
    else:
        act = decisions.append_only(rows, tokens)
    shape = (len(dec_slots), L, H)
    cache.manager.append_decode(slots, act.high_delta.reshape(shape), act.low_delta.reshape(shape))
    if cfg.compress:
        move_to_low(cache, rows, act)
    page, slot = token_location(table, rows, "high", act.new_index, fmt.high_tokens_per_page)
    layer_major = lambda t: t.reshape(shape).transpose(0, 1).contiguous()  # noqa: E731 - [L, n, H]
    step.decode = dict(
        rows=layer_major(rows), row_ids=layer_major(rows.to(torch.int32)),
        page=layer_major(page), slot=layer_major(slot),
        positions=torch.tensor(pos_host, dtype=torch.int32, device=dev).repeat_interleave(H),
        scores=torch.zeros(len(dec_slots) * H, dtype=torch.float32, device=dev),
        err_idx=slots.to(torch.int32).repeat_interleave(H),
    )


def move_to_low(cache, rows: torch.Tensor, act: "decisions.StepActions") -> None:
    """Demotions and candidate moves: dequantize the high token, requantize it into its low slot (centered keys)."""
    fmt, table = cache.page_format, cache.manager.page_table
    moving = act.move_from >= 0
    src_page, src_slot = token_location(table, rows, "high", act.move_from.clamp(min=0), fmt.high_tokens_per_page)
    dst_page, dst_slot = token_location(table, rows, "low", act.move_to.clamp(min=0), fmt.low_tokens_per_page)
    src_page = torch.where(moving, src_page, -1)
    dst_page = torch.where(moving, dst_page, -1)
    m, D = rows.numel(), cache.head_dim
    k = torch.empty(m, D, dtype=torch.float32, device=cache.device)
    v = torch.empty_like(k)
    score = torch.empty(m, dtype=torch.float32, device=cache.device)
    pos = torch.empty(m, dtype=torch.int32, device=cache.device)
    pages = cache.pool.pages()
    cache._ops.read_tokens(pages, fmt, "high", src_page, src_slot, k, v, score, pos)
    cache._ops.write_tokens(pages, fmt, "low", dst_page, dst_slot, k, v, scores=score, positions=pos)


def decode_layer(cache, step, layer, q, k, v, out) -> None:
    """Write the new token at high precision into its planned slot, then paged decode attention."""
    cfg, d = cache.config, step.decode
    D = cache.head_dim
    centered = cfg.compress and cfg.center_keys
    cache._ops.write_tokens(
        cache.pool.pages(), cache.page_format, "high", d["page"][layer].reshape(-1), d["slot"][layer].reshape(-1),
        k.reshape(-1, D), v.reshape(-1, D), key_offsets=cache.row_meta.key_offsets if centered else None,
        offset_rows=d["rows"][layer].reshape(-1) if centered else None, scores=d["scores"],
        positions=d["positions"], error_flags=cache.error_flags, error_index=d["err_idx"])
    kwargs = {}
    if cache._decode_attention is not torch_ops.paged_decode_attention:
        kwargs["workspace"] = decode_workspace(cache)
    cache._decode_attention(q, cache.pool.pages(), cache.page_format, cache.manager.page_table, cache.manager.tokens,
                            d["row_ids"][layer], out, sm_scale=cache.sm_scale, update_scores=cfg.compress, **kwargs)


def decode_workspace(cache):
    """The read-path kernel's scratch, allocated once for ``max_slots`` sequences (graph-safe reuse)."""
    if cache._workspace is None:
        from ..kernels.decode_attention import DecodeWorkspace

        cache._workspace = DecodeWorkspace.allocate(
            cache.max_slots, cache.num_heads, cache.num_kv_heads, cache.page_format, cache.manager.max_pages_per_row,
            cache.device, update_scores=cache.config.compress)
    return cache._workspace
