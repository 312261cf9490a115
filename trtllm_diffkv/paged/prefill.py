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
right end of the row. The cache commits at the end of the step
(:meth:`~.cache.PagedDiffKVCache.end_step`), returning the surplus pages to the ring.

The tiers and writes of a layer need only that layer's K/V and scores, and no later layer reads the
pages (a prompt step attends over its own full-precision K/V), so a planned step
(:func:`plan_prefill`) runs them for a group of layers at once (:data:`WRITE_GROUP_BYTES`): an eager
step's cost is mostly its host work per layer (docs/PERFORMANCE.md, "Chunked prefill steps"). A
caller without a plan (the TensorRT plugin op, one layer a call) writes each layer in its call.

Sliding-window layers (``cache.sliding_windows``): the prompt's attention (every path: whole, grouped and
chunked) applies the layer's window ``W``; the tiers keep the last ``W`` tokens high and prune the older ones
whatever the preset (:func:`trtllm_diffkv.policy.sliding_window_prompt_tiers`), so the kept tokens sit at
high-tier indices ``0..W-1`` in position order, where the decode step's ring expects them (:mod:`.decisions`).

Chunked prefill (:mod:`.staging`): a prefill request of the step may bring the chunk
``[start, end)`` of a prompt of ``n`` tokens. Its first chunk reserves the whole prompt's pages;
every chunk attends causally over the kept full-precision K/V of the earlier chunks plus itself
and keeps its own K/V (and its scoring queries) in the prompt's :class:`~.staging.PromptStaging`;
only the final chunk (``end == n``) scores, tiers and writes, over all ``n`` tokens, as an
unchunked prefill of the same prompt does.
"""
from __future__ import annotations

import torch

from .. import policy
from ..model.attention_api import causal_attention
from .gather import token_location
from .staging import PromptStaging
from .step_plan import PrefillChunk, PrefillPlan, WholePrompts

WRITE_GROUP_BYTES = 256 << 20
"""Most bytes of the K/V (model dtype) and fp32 score sums that a prompt step keeps for layers whose tiers
and writes are still to run; a step runs them for ``max(1, WRITE_GROUP_BYTES // one layer's bytes)`` layers
at once (all 30 of the default model for prompts of up to ~40k tokens; 7 of Llama-3-8B's 32 at 8192
tokens)."""


def _prompt_sets(step) -> tuple[list[int], list[int]]:
    """(the prefill requests at their prompt's first chunk, those whose prompt ends in the step), as indices."""
    n_pre, starts, ends, totals = step.n_pre, step.positions, step.seq_lens, step.prompt_lens
    return [i for i in range(n_pre) if starts[i] == 0], [i for i in range(n_pre) if ends[i] == totals[i]]


def host_inputs(cache, step) -> list[list[int]]:
    """The host integers :func:`plan_prefill` needs on the device, as five lists (copied in the step's one copy,
    :class:`~.host_inputs.StepInputs`): the first chunks' slots and whole prompt tokens (``reserve_prompt``), the
    ending prompts' slots and tokens, and their reserved pages per row (``prompt_reserve_pages``)."""
    first, finishing = _prompt_sets(step)
    slots, totals = step.slots, step.prompt_lens
    return [[slots[i] for i in first], [totals[i] for i in first], [slots[i] for i in finishing],
            [totals[i] for i in finishing], [cache.page_format.prompt_reserve_pages(totals[i]) for i in finishing]]


def plan_prefill(cache, step, inputs: list[torch.Tensor]) -> None:
    """Reserve the prompt pages at each prompt's first chunk (all tokens counted high), start the staging of
    prompts that continue in later steps, and build the per-token tensors of the prompts that end in this step.

    ``step.positions[i]`` / ``step.seq_lens[i]`` / ``step.prompt_lens[i]`` of prefill request ``i``: its chunk
    ``[start, end)`` and its whole prompt's tokens ``n`` (``start == 0 and end == n``: an unchunked prompt).
    ``inputs``: :func:`host_inputs` as int64 tensors on the cache device (no host synchronization here: the
    per-token tensors are built on the device from them and from host sizes)."""
    cfg, dev = cache.config, cache.device
    n_pre = step.n_pre
    slots_host, starts, ends, totals = step.slots[:n_pre], step.positions[:n_pre], step.seq_lens[:n_pre], \
        step.prompt_lens[:n_pre]
    first, finishing = _prompt_sets(step)
    first_slots, first_totals, slots, lens_t, reserved_pages = inputs
    if first:
        cache.manager.reserve_prompt(first_slots, first_totals)
    scoring = cfg.prompt_score_window_tokens if cfg.tiered else 0
    for i in first:
        if ends[i] < totals[i]:
            cache.staging[slots_host[i]] = PromptStaging(cache.num_layers, cache.num_kv_heads, cache.num_heads,
                                                         cache.head_dim, totals[i], scoring, cache.dtype, dev)
    bounds = [0]
    for a, b in zip(starts, ends):
        bounds.append(bounds[-1] + b - a)
    lens = [totals[i] for i in finishing]
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64, device=dev)
    cu[1:] = torch.cumsum(lens_t, 0)
    req = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens_t, output_size=sum(lens))  # no sync
    t = torch.arange(int(sum(lens)), device=dev) - cu[req]
    n_tok = lens_t[req]
    S, W = cfg.prompt_score_window_tokens, cfg.recent_window_tokens
    length = t + 1 if cfg.prompt_threshold_base == "position" else n_tok
    thr_h, thr_l = policy.tier_thresholds(cfg.alpha_high, length), policy.tier_thresholds(cfg.alpha_low, length)
    cu_host = [0]
    for x in lens:
        cu_host.append(cu_host[-1] + x)
    step.prefill = PrefillPlan(
        slots=slots, cu=host_bounds(cu_host, dev), cu_host=cu_host, req=req,
        t=t.to(torch.int32), count=torch.minimum(n_tok - t, torch.full_like(t, S)).float(), thr_h=thr_h, thr_l=thr_l,
        window=t >= n_tok - W, start=cu[req], row_base=slots[req] * cache.rows_per_slot,
        reserved=reserved_pages[req],
        counts=torch.zeros(len(lens), cache.num_layers, cache.num_kv_heads, 2, dtype=torch.int32, device=dev),
        err_idx=slots[req].to(torch.int32).repeat_interleave(cache.num_kv_heads), finishing=finishing,
        prompt_tokens=n_tok,
        chunked=any(a or b < n for a, b, n in zip(starts, ends, totals)),
        chunks=[PrefillChunk(slots_host[i], starts[i], ends[i], totals[i], bounds[i], bounds[i + 1])
                for i in range(n_pre)],
        write_group_layers=write_group_layers(cache, sum(lens)),
    )
    if step.prefill.chunked:
        step.prefill.whole = _whole_prompts(step.prefill.chunks, dev)
    if finishing:
        cache.prompt_len_device[slots] = lens_t


def write_group_layers(cache, num_tokens: int) -> int:
    """How many layers' tiers and writes a prompt step of ``num_tokens`` finishing tokens runs at once
    (:data:`WRITE_GROUP_BYTES`), between 1 and the model's layers."""
    layer_bytes = num_tokens * cache.num_kv_heads * (2 * cache.head_dim * cache.dtype.itemsize + 4)
    return max(1, min(cache.num_layers, WRITE_GROUP_BYTES // max(1, layer_bytes)))


def host_bounds(bounds: list[int], device: torch.device) -> torch.Tensor:
    """int32 prompt boundaries on the host (pinned when ``device`` is CUDA): the prefill attention reads them
    without waiting for the device queue and copies them to the device asynchronously, once per layer."""
    t = torch.tensor(bounds, dtype=torch.int32)
    return t.pin_memory() if device.type == "cuda" else t


def _whole_prompts(chunks: list[PrefillChunk], device: torch.device) -> WholePrompts | None:
    """A step with chunks: the whole prompts in it run as one prefill attention call over their packed rows
    (:class:`~.step_plan.WholePrompts`), not one call each; ``None`` with fewer than two."""
    whole = [(c.first_row, c.end_row) for c in chunks if c.whole]
    if len(whole) < 2:
        return None
    bounds = [0]
    for cs, ce in whole:
        bounds.append(bounds[-1] + ce - cs)
    rows = torch.cat([torch.arange(cs, ce) for cs, ce in whole]).to(device, non_blocking=device.type == "cuda")
    return WholePrompts(rows=rows, cu=host_bounds(bounds, device),
                        at={cs: (a, b) for (cs, _), a, b in zip(whole, bounds[:-1], bounds[1:])})


def prefill_layer(cache, step, layer, q, k, v, out) -> None:
    """Scored prefill attention, prompt tiers, and the tokens quantized into the reserved pages (section 5).

    With chunks in the step (:func:`plan_prefill`), the attention runs per prompt (:func:`_chunk_attention`)
    and the tiers and writes cover the whole prompts that end in this step."""
    cfg, p = cache.config, step.prefill
    if p.chunked:
        k, v, sums = _chunk_attention(cache, p, layer, q, k, v, out)
    else:
        _, sums = cache.prefill_attention(q, k, v, p.cu, sm_scale=cache.sm_scale,
                                           num_scoring_queries=cfg.prompt_score_window_tokens, out=out,
                                           score_sums=cache.score_sums[:q.shape[0]],
                                           **_window_kwarg(cache, layer))
    if p.finishing:
        _write_layer(cache, p, layer, k, v, sums)


def _window_kwarg(cache, layer: int) -> dict:
    """``{"sliding_window_tokens": W}`` for a sliding-window layer, ``{}`` otherwise (the attention functions of a
    model without such layers, a caller's stand-ins included, are called as before)."""
    window = getattr(cache, "sliding_windows", None)
    return {"sliding_window_tokens": window[layer]} if window is not None and window[layer] is not None else {}


def _write_layer(cache, p: PrefillPlan, layer, k, v, sums) -> None:
    """The tiers and writes of ``layer``: at once with ``p.write_group_layers == 1`` (the plugin ops: one layer a
    call), else kept in the step's group buffers and run when the group's last layer (or the model's) has come."""
    group = p.write_group_layers
    if group <= 1:
        _tier_and_write(cache, p, layer, k[None], v[None], sums[None])
        return
    first = layer - layer % group
    if layer == first:
        n = min(group, cache.num_layers - first)
        p.pending = (k.new_empty((n,) + tuple(k.shape)), v.new_empty((n,) + tuple(v.shape)),
                     sums.new_empty((n,) + tuple(sums.shape)))
    kb, vb, sb = p.pending
    j = layer - first
    kb[j].copy_(k), vb[j].copy_(v), sb[j].copy_(sums)
    if j == kb.shape[0] - 1:
        p.pending = None
        _tier_and_write(cache, p, first, kb, vb, sb)


def _chunk_attention(cache, p: PrefillPlan, layer, q, k, v, out):
    """Per prefill request of a step with chunks: its chunk's attention output into ``out``, its K/V and scoring
    queries kept in its staging; returns the packed (keys, values, fp32 score sums) of the whole prompts that end
    in this step, in order (``None`` each when none does)."""
    cfg, dev = cache.config, cache.device
    S = cfg.prompt_score_window_tokens
    window = _window_kwarg(cache, layer)
    keys, values, sums = [], [], []
    whole = p.whole
    if whole is not None:  # every whole prompt of the step in one call, as an unchunked step runs them
        rows = whole.rows
        wq, wk, wv = q[rows], k[rows], v[rows]
        wo, ws = cache.prefill_attention(wq, wk, wv, whole.cu, sm_scale=cache.sm_scale, num_scoring_queries=S,
                                         **window)
        out[rows] = wo
    for c in p.chunks:
        slot, start, end, n, cs, ce = c.slot, c.start, c.end, c.prompt_tokens, c.first_row, c.end_row
        if c.whole and whole is not None:
            a, b = whole.at[cs]
            keys.append(wk[a:b]), values.append(wv[a:b]), sums.append(ws[a:b])
            continue
        qi, ki, vi = q[cs:ce], k[cs:ce], v[cs:ce]
        if c.whole:  # a whole prompt: the unchunked computation, bit for bit
            _, s = cache.prefill_attention(qi, ki, vi, torch.tensor([0, n], dtype=torch.int32), sm_scale=cache.sm_scale,
                                           num_scoring_queries=S, out=out[cs:ce], **window)
            keys.append(ki), values.append(vi), sums.append(s)
            continue
        st = cache.staging[slot]
        st.put(layer, start, qi, ki, vi)
        kf, vf = st.keys[layer, :end], st.values[layer, :end]  # never the unwritten rows past the chunk
        out[cs:ce] = chunk_causal_attention(qi, kf, vf, start, cache.sm_scale, window.get("sliding_window_tokens"))
        if end == n:  # the final chunk: the last S queries of the WHOLE prompt score every token
            if cfg.tiered:
                s = cache.prompt_scores(st.scoring_queries(layer), kf, torch.tensor([0, n], dtype=torch.int32),
                                        sm_scale=cache.sm_scale, num_scoring_queries=S, **window)
            else:
                s = torch.zeros(n, cache.num_kv_heads, dtype=torch.float32, device=dev)
            keys.append(kf), values.append(vf), sums.append(s)
    if not keys:
        return None, None, None
    return torch.cat(keys), torch.cat(values), torch.cat(sums)


def chunk_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, sm_scale: float,
                           sliding_window_tokens: int | None = None) -> torch.Tensor:
    """Causal attention of one chunk's queries over its prompt's keys so far
    (:func:`~trtllm_diffkv.model.attention_api.causal_attention`).

    Args:
        q: ``[c, num_heads, head_dim]``, the queries of positions ``[start, start + c)``.
        k, v: ``[start + c, num_kv_heads, head_dim]``, the keys and values of positions ``[0, start + c)``.
        start: the chunk's first position; sm_scale: the softmax scale.
        sliding_window_tokens: ``W`` of a sliding-window layer (query ``i`` attends keys ``i - W < j <= i``), or
            ``None``.

    Returns:
        ``[c, num_heads, head_dim]`` in q's dtype: query ``i`` attends keys ``0 .. start + i`` (GQA: query head ``h``
        reads KV head ``h // (num_heads // num_kv_heads)``), within the window when one is given.
    """
    return causal_attention(q, k, v, scale=sm_scale, first_query_pos=start, sliding_window_tokens=sliding_window_tokens)


def _slide_prompt_tiers(cache, p: PrefillPlan, first_layer: int, G: int, high: torch.Tensor, low: torch.Tensor):
    """``(high, low)`` bool ``[G, T, H]`` with the rows of sliding-window layers replaced by their rule
    (:func:`trtllm_diffkv.policy.sliding_window_prompt_tiers`: a prompt's last ``W`` tokens high, the rest pruned);
    unchanged for a model without such layers."""
    windows = getattr(cache, "sliding_windows", None)
    if windows is None or all(w is None for w in windows[first_layer:first_layer + G]):
        return high, low
    w = cache.layer_windows[first_layer:first_layer + G].long()[:, None]  # [G, 1]
    in_window = (p.t.long()[None, :] >= p.prompt_tokens[None, :] - w)[..., None]  # [G, T, 1]
    sliding = (w > 0)[..., None]
    return torch.where(sliding, in_window, high), low & ~sliding


def _tier_and_write(cache, p: PrefillPlan, first_layer, k, v, sums) -> None:
    """Tier every token of the prompts that end in this step and quantize it into its reserved page (section 5),
    for ``G`` consecutive layers from ``first_layer``.

    ``k``, ``v``: ``[G, T, num_kv_heads, head_dim]`` of those prompts, packed as ``p.cu_host``; ``sums``: fp32
    ``[G, T, num_kv_heads]`` prompt score sums."""
    cfg, fmt = cache.config, cache.page_format
    G, H, D = k.shape[0], cache.num_kv_heads, cache.head_dim
    dev = cache.device
    layers = torch.arange(first_layer, first_layer + G, device=dev)
    rows = p.row_base[None, :, None] + (layers * H)[:, None, None] + torch.arange(H, device=dev)  # [G, Tp, H]
    if cfg.compress and cfg.center_keys:
        for s, e in zip(p.cu_host, p.cu_host[1:]):  # host bounds: no sync
            cache.row_meta.key_offsets[rows[:, s]] = k[:, s:e].transpose(1, 2).float().mean(2).to(torch.float16)
    if cfg.tiered:
        importance = sums / p.count[:, None]  # [G, Tp, H]
        if cfg.score_pool_tokens > 1:  # per request (host bounds: no sync), policy.pool_importance
            importance = torch.cat([policy.pool_importance(importance[:, s:e].transpose(1, 2).reshape(G * H, e - s),
                                                           cfg.score_pool_tokens).reshape(G, H, e - s).transpose(1, 2)
                                    for s, e in zip(p.cu_host, p.cu_host[1:])], 1)
        high = (importance > p.thr_h[:, None]) | p.window[:, None]
        low = ~high & (importance >= p.thr_l[:, None])
    else:
        high = torch.ones(rows.shape, dtype=torch.bool, device=dev)
        low = torch.zeros_like(high)
    high, low = _slide_prompt_tiers(cache, p, first_layer, G, high, low)
    for ti, (tier, sel) in enumerate((("high", high), ("low", low))):
        p.counts[:, first_layer:first_layer + G, :, ti].index_add_(0, p.req, sel.transpose(0, 1).to(torch.int32))
        sel64 = sel.to(torch.int64)
        # Exclusive prefix count over the prompt tokens, scanned along the last dimension of a contiguous
        # [G, H, Tp] copy: torch's CUDA scan over an outer dimension runs about one thread per column (about
        # 260 us a call at Tp = 2146, H = 3 on the H200: 62 % of a prefill step's kernel time).
        excl = torch.cumsum(sel64.transpose(1, 2).contiguous(), 2).transpose(1, 2) - sel64
        index = excl - excl[:, p.start]
        per_page = fmt.tier(tier).tokens_per_page
        page, slot = token_location(cache.manager.page_table, rows, tier, index, per_page)
        if tier == "low":  # before commit the low pages are the last reserved ones
            col = (p.reserved[:, None] - 1 - index // per_page).clamp(min=0)
            page = cache.manager.page_table[rows, col]
        page = torch.where(sel, page, -1).to(torch.int32)
        cache.ops.write_tokens(
            cache.pool.pages(), fmt, tier, page.reshape(-1), slot.reshape(-1), k.reshape(-1, D), v.reshape(-1, D),
            key_offsets=cache.row_meta.key_offsets if cfg.compress and cfg.center_keys else None,
            offset_rows=rows.reshape(-1) if cfg.compress and cfg.center_keys else None,
            scores=sums.reshape(-1), positions=p.t.repeat_interleave(H).repeat(G),
            error_flags=cache.error_flags, error_index=p.err_idx.repeat(G))
