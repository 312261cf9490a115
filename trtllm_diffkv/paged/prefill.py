"""Prefill of the paged cache: scored attention, prompt tiers, tokens quantized into their pages (paper sections 4.2, 5).

Used by :class:`~.cache.PagedDiffKVCache`. :func:`plan_prefill` (host side,
once per step) reserves every prompt's pages, all tokens counted high
(``reserve_prompt``), and builds per-token tensors. :func:`prefill_layer` (per
layer, no host synchronization) runs the scored prefill attention, tiers every
token (importance = score sum / ``min(n - t, S)`` against ``alpha / L``, the
last W tokens high; ``DiffKV.md`` "Policy details"), and quantizes the high and
low tokens straight into the places ``commit_prompt`` keeps: the j-th high
token in reserved page ``j // P_high``, the j-th low token in reserved page
``C - 1 - j // P_low`` (``C`` reserved pages), which the commit moves to the
right end of the row. The cache commits after the last layer, returning the
surplus pages to the ring.
"""
from __future__ import annotations

import torch

from .. import policy
from .gather import token_location


def plan_prefill(cache, step) -> None:
    """Reserve the prompt pages (all tokens counted high) and build the per-token tensors the layers use."""
    cfg, dev = cache.config, cache.device
    lens = step.seq_lens[:step.n_pre]
    slots = torch.tensor(step.slots[:step.n_pre], dtype=torch.int64, device=dev)
    cache.manager.reserve_prompt(slots, torch.tensor(lens, dtype=torch.int64, device=dev))
    lens_t = torch.tensor(lens, dtype=torch.int64, device=dev)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64, device=dev)
    cu[1:] = torch.cumsum(lens_t, 0)
    req = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens_t)
    t = torch.arange(int(sum(lens)), device=dev) - cu[req]
    n_tok = lens_t[req]
    S, W = cfg.prompt_score_window_tokens, cfg.recent_window_tokens
    length = t + 1 if cfg.prompt_threshold_base == "position" else n_tok
    thr_h, thr_l = policy.tier_thresholds(cfg.alpha_high, length), policy.tier_thresholds(cfg.alpha_low, length)
    step.prefill = dict(
        slots=slots, cu=cu.to(torch.int32), cu_host=[0] + list(torch.tensor(lens).cumsum(0).tolist()), req=req,
        t=t.to(torch.int32), count=torch.minimum(n_tok - t, torch.full_like(t, S)).float(), thr_h=thr_h, thr_l=thr_l,
        window=t >= n_tok - W, start=cu[req], row_base=slots[req] * cache.rows_per_slot,
        reserved=torch.tensor([cache.page_format.prompt_reserve_pages(x) for x in lens], device=dev)[req],
        counts=torch.zeros(len(lens), cache.num_layers, cache.num_kv_heads, 2, dtype=torch.int32, device=dev),
        err_idx=slots[req].to(torch.int32).repeat_interleave(cache.num_kv_heads),
    )
    for slot, n in zip(step.slots, lens):
        cache.prompt_len_device[slot] = n


def prefill_layer(cache, step, layer, q, k, v, out) -> None:
    """Scored prefill attention, prompt tiers, and the tokens quantized into the reserved pages (section 5)."""
    cfg, fmt, p = cache.config, cache.page_format, step.prefill
    H, D = cache.num_kv_heads, cache.head_dim
    _, sums = cache.prefill_attention(q, k, v, p["cu"], sm_scale=cache.sm_scale,
                                       num_scoring_queries=cfg.prompt_score_window_tokens, out=out,
                                       score_sums=cache.score_sums[:q.shape[0]])
    rows = p["row_base"][:, None] + layer * H + torch.arange(H, device=cache.device)  # [Tp, H]
    if cfg.compress:
        if cfg.center_keys:
            for s, e in zip(p["cu_host"], p["cu_host"][1:]):  # host bounds: no sync
                cache.row_meta.key_offsets[rows[s]] = k[s:e].transpose(0, 1).float().mean(1).to(torch.float16)
        importance = sums / p["count"][:, None]  # [Tp, H]
        if cfg.score_pool_tokens > 1:  # per request (host bounds: no sync), policy.pool_importance
            importance = torch.cat([policy.pool_importance(importance[s:e].T, cfg.score_pool_tokens).T
                                    for s, e in zip(p["cu_host"], p["cu_host"][1:])])
        high = (importance > p["thr_h"][:, None]) | p["window"][:, None]
        low = ~high & (importance >= p["thr_l"][:, None])
    else:
        high = torch.ones(rows.shape, dtype=torch.bool, device=cache.device)
        low = torch.zeros_like(high)
    for ti, (tier, sel) in enumerate((("high", high), ("low", low))):
        p["counts"][:, layer, :, ti].index_add_(0, p["req"], sel.to(torch.int32))
        excl = torch.cumsum(sel.to(torch.int64), 0) - sel.to(torch.int64)
        index = excl - excl[p["start"]]
        per_page = fmt.tier(tier).tokens_per_page
        page, slot = token_location(cache.manager.page_table, rows, tier, index, per_page)
        if tier == "low":  # before commit the low pages are the last reserved ones
            col = (p["reserved"][:, None] - 1 - index // per_page).clamp(min=0)
            page = cache.manager.page_table[rows, col]
        page = torch.where(sel, page, -1).to(torch.int32)
        cache.ops.write_tokens(
            cache.pool.pages(), fmt, tier, page.reshape(-1), slot.reshape(-1), k.reshape(-1, D), v.reshape(-1, D),
            key_offsets=cache.row_meta.key_offsets if cfg.compress and cfg.center_keys else None,
            offset_rows=rows.reshape(-1) if cfg.compress and cfg.center_keys else None,
            scores=sums.reshape(-1), positions=p["t"].repeat_interleave(H),
            error_flags=cache.error_flags, error_index=p["err_idx"])
