"""Scored prefill attention: causal attention plus DiffKV's prompt scores (paper section 4.2).

For each packed prompt, the output is ordinary causal attention (torch's
flash SDPA per sequence). The prompt scores follow the authors' rule
(``DiffKV.md`` "Policy details"): the last ``S = min(num_scoring_queries, n)``
queries of a prompt of ``n`` tokens score every token; per query head the
causal probabilities a token receives from those queries are summed, then each
KV head takes the max over its query heads.

The ``n x n`` matrix is never materialized (:mod:`.attn_prefill_kernels`):
a split-K Triton pass computes the log-sum-exp of each scoring query over
its causal keys (chunks of :data:`LSE_CHUNK_TOKENS` keys, then a merge), and
a second pass walks key blocks, recomputes the ``S x block`` logits of each
query head of the group and turns them into probabilities with those
log-sum-exps. Work: ``2 x 2 x S x n x num_heads x head_dim`` FLOPs, about 6 %
of the causal attention's at ``n = 4096``, ``S = 64``.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton

from ..model.attention_api import causal_attention
from .attn_prefill_kernels import _prompt_lse_kernel, _prompt_lse_merge_kernel, _prompt_score_kernel
from .sizes import next_pow2
from ..validators import optional_positive_int, positive_int

LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
LSE_CHUNK_TOKENS = 256
"""Keys per program of the log-sum-exp pass (split-K over the prompt)."""



def _check(q, k, v, cu_seqlens, num_scoring_queries, out, score_sums):
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q [total, num_heads, head_dim], k/v [total, num_kv_heads, head_dim] expected, "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    total, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape[0] != total or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q/k/v must share one dtype of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported; allowed: {list(SUPPORTED_HEAD_DIMS)}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be int32 [num_seqs + 1], got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    positive_int("num_scoring_queries", num_scoring_queries)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    if score_sums is not None and (score_sums.shape != (total, num_kv_heads) or score_sums.dtype != torch.float32
                                   or not score_sums.is_contiguous()):
        raise ValueError(f"score_sums must be contiguous fp32 [{total}, {num_kv_heads}], "
                         f"got {tuple(score_sums.shape)} {score_sums.dtype}")


def _check_window(sliding_window_tokens) -> None:
    optional_positive_int("sliding_window_tokens", sliding_window_tokens, allowed="a positive integer or None")


def scored_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                             sm_scale: float, num_scoring_queries: int = 64, out: torch.Tensor | None = None,
                             score_sums: torch.Tensor | None = None,
                             sliding_window_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal (or sliding-window) attention of packed prompts and their DiffKV prompt scores.

    Args:
        q: ``[total_tokens, num_heads, head_dim]`` fp16/bf16 (fp32 for tests).
        k, v: ``[total_tokens, num_kv_heads, head_dim]``, same dtype.
        cu_seqlens: int32 ``[num_seqs + 1]`` prompt boundaries (``cu_seqlens[0] = 0``,
            non-decreasing, last = total_tokens), on the host or on q's device; read on the
            host (prefill is not captured), so a device tensor costs one synchronisation.
        sm_scale: softmax scale.
        num_scoring_queries: how many of each prompt's last queries score it (authors: 64).
        out: optional preallocated ``[total_tokens, num_heads, head_dim]`` of q's dtype.
        score_sums: optional preallocated fp32 ``[total_tokens, num_kv_heads]``.
        sliding_window_tokens: ``W`` of a sliding-window layer: query ``i`` attends keys
            ``i - W < t <= i`` only, in the output (torch SDPA over the reachable key blocks,
            :func:`~trtllm_diffkv.model.attention_api.causal_attention`) and the scores; ``None``: causal.

    Returns:
        ``(out, score_sums)``: ``score_sums[t, g]`` for token ``t`` of a prompt of
        ``n`` tokens is ``max_{h in group g} sum_{i = n - S}^{n - 1} P_h(i, t)``
        (``P_h(i, t) = 0`` for ``t > i``, and for ``t <= i - W`` with a window),
        ``S = min(num_scoring_queries, n)``.
        Query head ``h`` belongs to KV head ``h // (num_heads // num_kv_heads)``.

    Raises:
        ValueError: shapes, dtypes, head_dim or ``cu_seqlens`` invalid.
    """
    _check(q, k, v, cu_seqlens, num_scoring_queries, out, score_sums)
    _check_window(sliding_window_tokens)
    total, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    bounds = cu_seqlens.tolist()  # a host tensor avoids waiting here for the device queue
    if cu_seqlens.device != q.device:
        host = cu_seqlens.pin_memory() if q.device.type == "cuda" else cu_seqlens
        cu_seqlens = host.to(q.device, non_blocking=True)
    if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at total_tokens={total}")
    if score_sums is None:
        score_sums = torch.empty(total, num_kv_heads, dtype=torch.float32, device=q.device)
    num_seqs = len(bounds) - 1
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    max_len = max(lens)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            if sliding_window_tokens is None:
                # 4-D [1, heads, n, head_dim] views: torch's flash backend takes only 4-D inputs (3-D falls
                # back to the math backend, which materializes the n x n matrix)
                qh, kh, vh = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=sm_scale,
                                                   enable_gqa=num_heads != num_kv_heads)[0].transpose(0, 1)
            else:  # the reachable key blocks only (model/attention_api.py)
                o = causal_attention(q[a:b], k[a:b], v[a:b], scale=sm_scale, sliding_window_tokens=sliding_window_tokens)
            if out is None and b - a == total and o.is_contiguous():
                out = o  # one prompt: flash already wrote [n, num_heads, head_dim]; no copy
            else:
                if out is None:
                    out = torch.empty_like(q)
                out[a:b] = o
    if out is None:
        out = torch.zeros_like(q)
    prompt_scores(q, k, cu_seqlens, sm_scale=sm_scale, num_scoring_queries=num_scoring_queries, score_sums=score_sums,
                  sliding_window_tokens=sliding_window_tokens, _bounds=bounds)
    return out, score_sums


def prompt_scores(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, *, sm_scale: float,
                  num_scoring_queries: int = 64, score_sums: torch.Tensor | None = None,
                  sliding_window_tokens: int | None = None, _bounds: list[int] | None = None) -> torch.Tensor:
    """DiffKV prompt scores alone (the scoring half of :func:`scored_prefill_attention`).

    Only the last ``S = min(num_scoring_queries, n)`` query rows of each prompt are read, so a caller
    that kept just those queries (chunked prefill, ``paged/prefill.py``) may pass any values in the
    other rows. Same arguments, layout and result (``score_sums``) as :func:`scored_prefill_attention`.

    Raises:
        ValueError: shapes, dtypes, head_dim or ``cu_seqlens`` invalid.
    """
    total, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if _bounds is None:
        _check(q, k, k, cu_seqlens, num_scoring_queries, None, score_sums)
        _check_window(sliding_window_tokens)
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at total_tokens={total}")
    else:
        bounds = _bounds
    if cu_seqlens.device != q.device:
        host = cu_seqlens.pin_memory() if q.device.type == "cuda" else cu_seqlens
        cu_seqlens = host.to(q.device, non_blocking=True)
    if score_sums is None:
        score_sums = torch.empty(total, num_kv_heads, dtype=torch.float32, device=q.device)
    num_seqs = len(bounds) - 1
    max_len = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    if max_len == 0:
        return score_sums
    s_pad = max(16, next_pow2(min(num_scoring_queries, max_len)))
    block_q = min(s_pad, 64)
    group = num_heads // num_kv_heads
    num_chunks = triton.cdiv(max_len, LSE_CHUNK_TOKENS)
    qc, kc = q.contiguous(), k.contiguous()
    if q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        qc, kc = qc.float(), kc.float()  # Triton 3.6's interpreter multiplies bf16 dots wrongly
    f32 = dict(dtype=torch.float32, device=q.device)
    part_m = torch.empty(num_seqs, num_heads, num_chunks, s_pad, **f32)
    part_l = torch.empty(num_seqs, num_heads, num_chunks, s_pad, **f32)
    lse = torch.empty(num_seqs, num_heads, s_pad, **f32)
    qk_scale = float(sm_scale) * LOG2E
    window = sliding_window_tokens or 0
    shape = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), BLOCK_Q=block_q,
                 IEEE=qc.dtype == torch.float32)
    warps = 4 if head_dim <= 128 else 8
    _prompt_lse_kernel[(num_seqs, num_heads, num_chunks)](
        qc, kc, cu_seqlens, part_m, part_l, qk_scale, num_scoring_queries, num_heads, num_kv_heads, num_chunks,
        WINDOW=window, LSE_STRIDE=s_pad, BLOCK_N=64, CHUNK=LSE_CHUNK_TOKENS, **shape, num_warps=warps, num_stages=2)
    _prompt_lse_merge_kernel[(num_seqs, num_heads)](part_m, part_l, lse, num_heads, num_chunks, LSE_STRIDE=s_pad,
                                                    BLOCK_C=next_pow2(num_chunks), num_warps=4)
    _prompt_score_kernel[(num_seqs, num_kv_heads, triton.cdiv(max_len, 64))](
        qc, kc, lse, cu_seqlens, score_sums, qk_scale, num_scoring_queries, num_heads, num_kv_heads,
        WINDOW=window, LSE_STRIDE=s_pad, BLOCK_N=64, **shape, num_warps=warps, num_stages=2)
    return score_sums


def prefill_flops(seq_len: int, num_heads: int, head_dim: int, num_scoring_queries: int = 64) -> tuple[float, float]:
    """(causal attention FLOPs, scoring FLOPs) of one prompt: ``2 * 2 * n^2/2 * H * D`` and ``2 * S * n * H * D``."""
    s = min(num_scoring_queries, seq_len)
    return 2.0 * seq_len * seq_len * num_heads * head_dim, 2.0 * s * seq_len * num_heads * head_dim


__all__ = ["scored_prefill_attention", "prompt_scores", "prefill_flops"]
