"""Plain-torch versions of the paged kernels: the CPU path and the fallback while a kernel is missing.

Same signatures and results as the Triton kernels:

* :func:`write_tokens` / :func:`read_tokens`: as
  :mod:`trtllm_diffkv.kernels.quant_write` (bit-identical: both follow
  :func:`trtllm_diffkv.quant.quantize`);
* :func:`paged_decode_attention` / :func:`scored_prefill_attention`: as the
  read-path kernels (``kernels/decode_attention.py``,
  ``kernels/prefill_attention.py``): gather then dense fp32 attention.

They synchronize with the host (gathers sized on the host, boolean masks) and
are meant for the CPU and for tests, not for the GPU hot path.
"""
from __future__ import annotations

import math

import torch

from ..memory import KVCachePool, PageFormat
from ..model.attention_api import causal_attention
from ..policy import window_attention_mask
from ..quant import FP16_MAX, quantize
from .gather import dequantize_tier, gather_tier


def _pool(pages: torch.Tensor, page_format: PageFormat) -> KVCachePool:
    pool = KVCachePool.__new__(KVCachePool)
    pool.page_format, pool.num_pages, pool.buffer = page_format, pages.shape[0], pages.reshape(-1)
    return pool


def write_tokens(pages, page_format, tier, dest_page, dest_slot, keys, values, *, key_offsets=None,
                 offset_rows=None, scores=None, positions=None, error_flags=None, error_index=None) -> None:
    """Torch version of :func:`trtllm_diffkv.kernels.quant_write.write_tokens` (same arguments and result)."""
    pool = _pool(pages, page_format)
    lay = page_format.tier(tier)
    sel = dest_page >= 0
    if not bool(sel.any()):
        return
    p, s = dest_page[sel].long(), dest_slot[sel].long()
    k, v = keys[sel].float(), values[sel].float()
    if key_offsets is not None:
        k = k - key_offsets[offset_rows[sel].long()].float()
    # Raw K/V beyond fp16, or keys whose distance from their offset is (the zero point is fp16).
    raw_bad = (keys[sel].float().abs().amax(1) > FP16_MAX) | (v.abs().amax(1) > FP16_MAX) | (k.abs().amax(1) > FP16_MAX)
    bad = ~(torch.isfinite(k).all(1) & torch.isfinite(v).all(1)) | raw_bad
    if error_flags is not None and bool(bad.any()):
        error_flags[error_index[sel][bad].long()] = 1
    k, v = torch.where(bad[:, None], 0.0, k), torch.where(bad[:, None], 0.0, v)  # the request fails; never raise here
    t = lay.tier
    for side, x, bits, groups in (("key", k, t.key_bits, t.key_groups), ("value", v, t.value_bits, t.value_groups)):
        codes = pool.segment(tier, f"{side}_codes")
        if bits == 16:
            codes[p, s] = x.to(torch.float16).view(torch.uint8).reshape(x.shape[0], -1)
            continue
        q = quantize(x[None], bits, groups)
        codes[p, s] = q.codes[0]
        pool.segment(tier, f"{side}_meta")[p, s] = torch.stack([q.scale[0], q.zero[0]], -1)
    if lay.score.size_bytes:
        pool.segment(tier, "score")[p, s] = scores[sel].float()
        pool.segment(tier, "position")[p, s] = positions[sel].to(torch.int32)


def read_tokens(pages, page_format, tier, src_page, src_slot, keys_out, values_out, scores_out=None,
                positions_out=None) -> None:
    """Torch version of :func:`trtllm_diffkv.kernels.quant_write.read_tokens` (same arguments and result)."""
    pool = _pool(pages, page_format)
    sel = src_page >= 0
    if not bool(sel.any()):
        return
    p, s = src_page[sel].long(), src_slot[sel].long()
    k, v = dequantize_tier(pool, tier, p, s)
    keys_out[sel], values_out[sel] = k, v
    if page_format.tier(tier).score.size_bytes:
        scores_out[sel] = pool.segment(tier, "score")[p, s]
        positions_out[sel] = pool.segment(tier, "position")[p, s]


def paged_decode_attention(q, pool_pages, page_format, page_table, tier_tokens, row_ids, out, *, sm_scale,
                           update_scores=True, workspace=None) -> None:
    """Decode attention over every stored token of both tiers (gather, dense fp32 softmax).

    Args:
        q: ``[num_seqs, num_heads, head_dim]``; row_ids: int32 ``[num_seqs,
        num_kv_heads]`` (row < 0: padding, output zeros); out: written in place.
        update_scores: add each token's max-over-group probability to its score.
    """
    pool = _pool(pool_pages, page_format)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = row_ids.shape[1]
    group = num_heads // num_kv_heads
    rows = row_ids.reshape(-1).long()
    live = rows >= 0
    rows = rows.clamp(min=0)
    counts = tier_tokens[rows].long()
    parts = []
    for i, tier in enumerate(("high", "low")):
        width = int(counts[:, i].max()) if rows.numel() else 0
        view = gather_tier(pool, page_table, tier_tokens, rows, tier, width)
        k, v = dequantize_tier(pool, tier, view.page, view.slot)
        keep = view.valid[..., None]  # columns past the count hold stale bytes (possibly NaN): zero them
        parts.append((tier, view, torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)))
    keys = torch.cat([p[2] for p in parts], 1)  # [m, n, D]
    values = torch.cat([p[3] for p in parts], 1)
    valid = torch.cat([p[1].valid for p in parts], 1)
    qg = q.float().reshape(num_seqs * num_kv_heads, group, head_dim)
    logits = torch.einsum("mgd,mnd->mgn", qg, keys) * sm_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(logits, -1).nan_to_num(0.0)
    res = torch.einsum("mgn,mnd->mgd", probs, values)
    res = torch.where(live[:, None, None], res, 0.0)
    out.copy_(res.reshape(num_seqs, num_heads, head_dim).to(out.dtype))
    if not update_scores:
        return
    add = probs.amax(1) * live[:, None]
    start = 0
    for tier, view, _, _ in parts:
        width = view.valid.shape[1]
        sel = view.valid & live[:, None]
        score = pool.segment(tier, "score")
        score.index_put_((view.page[sel].long(), view.slot[sel].long()), add[:, start:start + width][sel], accumulate=True)
        start += width


def scored_prefill_attention(q, k, v, cu_seqlens, *, sm_scale, num_scoring_queries=64, out=None, score_sums=None,
                             sliding_window_tokens=None):
    """Causal prefill attention per request plus the prompt scores (DiffKV.md "Policy details").

    score_sums[t, h] (fp32 ``[total, num_kv_heads]``): per query head, the sum
    of the causal probabilities token t receives from the last
    ``min(num_scoring_queries, n)`` queries of its request; max over the KV
    head's query heads. ``sliding_window_tokens`` ``W``: query ``i`` attends keys
    ``i - W < j <= i`` only, in the output and the scores.
    """
    total, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    out = torch.empty_like(q) if out is None else out
    score_sums = torch.zeros(total, num_kv_heads, dtype=torch.float32, device=q.device) if score_sums is None else score_sums
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            out[start:end] = causal_attention(q[start:end], k[start:end], v[start:end], scale=sm_scale,
                                              sliding_window_tokens=sliding_window_tokens).to(out.dtype)
    prompt_scores(q, k, cu_seqlens, sm_scale=sm_scale, num_scoring_queries=num_scoring_queries, score_sums=score_sums,
                  sliding_window_tokens=sliding_window_tokens)
    return out, score_sums


def prompt_scores(q, k, cu_seqlens, *, sm_scale, num_scoring_queries=64, score_sums=None, sliding_window_tokens=None):
    """Torch version of :func:`trtllm_diffkv.kernels.prefill_attention.prompt_scores`: the scores of
    :func:`scored_prefill_attention` alone, reading only the last ``min(num_scoring_queries, n)`` query rows
    of each request (fp32 ``[total, num_kv_heads]``)."""
    total, num_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    if score_sums is None:
        score_sums = torch.zeros(total, num_kv_heads, dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        n = end - start
        if n == 0:
            continue
        m = min(num_scoring_queries, n)
        qh, kh = q[end - m:end].transpose(0, 1), k[start:end].transpose(0, 1)
        logits = qh.float() @ kh.float().repeat_interleave(group, 0).transpose(1, 2) * sm_scale
        attend = window_attention_mask(torch.arange(n - m, n, device=q.device), torch.arange(n, device=q.device),
                                       sliding_window_tokens)
        probs = torch.softmax(logits.masked_fill(~attend, float("-inf")), -1)
        sums = probs.sum(1).reshape(num_kv_heads, group, n).amax(1)  # [num_kv_heads, n]
        score_sums[start:end] = sums.transpose(0, 1)
    return score_sums


def default_sm_scale(head_dim: int) -> float:
    """``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim)
