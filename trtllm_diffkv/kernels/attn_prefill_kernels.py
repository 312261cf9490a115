"""Triton kernel of the prompt scores (see :mod:`.prefill_attention`).

``_prompt_score_kernel``, grid ``(num_seqs, num_kv_heads, key blocks)``: one
program loads a block of ``BLOCK_N`` keys of one KV head once, then for each
query head of the group recomputes the logits of the prompt's last ``S``
queries against it (``BLOCK_Q`` at a time), turns them into causal
probabilities with each query's base-2 log-sum-exp, sums over the queries and
keeps the max over the group's heads. Constexprs: ``GROUP`` query heads per
KV head, ``HEAD_DIM`` / ``BLOCK_D`` head dim and its power-of-two pad,
``LSE_STRIDE`` the per-head stride of the lse buffer, ``IEEE`` exact fp32 dots.
``WINDOW``: 0 for causal attention, ``W > 0`` for a sliding-window layer
(query ``i`` sees keys ``i - W < t <= i``, ``policy.window_attention_mask``); a
constexpr, so a model without such layers compiles exactly the kernels it did.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _prompt_score_kernel(q_ptr, k_ptr, lse_ptr, cu_ptr, score_ptr, qk_scale, num_scoring, num_heads, num_kv_heads,
                         LSE_STRIDE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, IEEE: tl.constexpr,
                         WINDOW: tl.constexpr = 0):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    blk = tl.program_id(2)
    start = tl.load(cu_ptr + seq)
    n = tl.load(cu_ptr + seq + 1) - start
    s = tl.minimum(num_scoring, n)
    t = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    t_mask = t < n
    d_mask = d < HEAD_DIM
    k = tl.load(k_ptr + ((start + t[:, None]).to(tl.int64) * num_kv_heads + kvh) * HEAD_DIM + d[None, :],
                mask=t_mask[:, None] & d_mask[None, :], other=0.0)
    best = tl.zeros((BLOCK_N,), tl.float32)
    first_q = n - s
    # queries before the block's first key see none of it: skip them
    q_begin = tl.maximum(first_q, blk * BLOCK_N) - first_q
    q_begin = (q_begin // BLOCK_Q) * BLOCK_Q
    for g in range(0, GROUP):
        h = kvh * GROUP + g
        col = tl.zeros((BLOCK_N,), tl.float32)
        for qb in range(q_begin, s, BLOCK_Q):
            i = qb + tl.arange(0, BLOCK_Q)  # index among the scoring queries
            i_mask = i < s
            pos = first_q + i
            qv = tl.load(q_ptr + ((start + pos[:, None]).to(tl.int64) * num_heads + h) * HEAD_DIM + d[None, :],
                         mask=i_mask[:, None] & d_mask[None, :], other=0.0)
            if IEEE:
                logits = tl.dot(qv, tl.trans(k), input_precision="ieee")
            else:
                logits = tl.dot(qv, tl.trans(k))
            lse = tl.load(lse_ptr + (seq * num_heads + h) * LSE_STRIDE + i, mask=i_mask, other=0.0)
            keep = i_mask[:, None] & (t[None, :] <= pos[:, None]) & t_mask[None, :]
            if WINDOW > 0:
                keep = keep & (t[None, :] > pos[:, None] - WINDOW)
            p = tl.where(keep, tl.exp2(logits * qk_scale - lse[:, None]), 0.0)
            col += tl.sum(p, axis=0)
        best = tl.maximum(best, col)
    tl.store(score_ptr + (start + t).to(tl.int64) * num_kv_heads + kvh, best, mask=t_mask)


@triton.jit
def _prompt_lse_kernel(q_ptr, k_ptr, cu_ptr, part_m_ptr, part_l_ptr, qk_scale, num_scoring, num_heads, num_kv_heads,
                       num_chunks, LSE_STRIDE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, CHUNK: tl.constexpr,
                       IEEE: tl.constexpr, WINDOW: tl.constexpr = 0):
    """Partial base-2 (max, sum) of each scoring query of head ``h`` over the keys of chunk ``c`` (causal).

    Grid ``(num_seqs, num_heads, num_chunks)``; writes ``part_m / part_l [seq, h, c, LSE_STRIDE]``.
    """
    seq = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    kvh = h // GROUP
    start = tl.load(cu_ptr + seq)
    n = tl.load(cu_ptr + seq + 1) - start
    s = tl.minimum(num_scoring, n)
    first_q = n - s
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    k_begin = c * CHUNK
    k_end = tl.minimum(k_begin + CHUNK, n)
    out_base = ((seq * num_heads + h) * num_chunks + c) * LSE_STRIDE
    for qb in range(0, LSE_STRIDE, BLOCK_Q):
        i = qb + tl.arange(0, BLOCK_Q)
        i_mask = i < s
        pos = first_q + i
        qv = tl.load(q_ptr + ((start + pos[:, None]).to(tl.int64) * num_heads + h) * HEAD_DIM + d[None, :],
                     mask=i_mask[:, None] & d_mask[None, :], other=0.0)
        m = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_Q,), tl.float32)
        for kb in range(k_begin, k_end, BLOCK_N):
            t = kb + tl.arange(0, BLOCK_N)
            k = tl.load(k_ptr + ((start + t[:, None]).to(tl.int64) * num_kv_heads + kvh) * HEAD_DIM + d[None, :],
                        mask=(t < k_end)[:, None] & d_mask[None, :], other=0.0)
            if IEEE:
                logits = tl.dot(qv, tl.trans(k), input_precision="ieee")
            else:
                logits = tl.dot(qv, tl.trans(k))
            keep = i_mask[:, None] & (t[None, :] <= pos[:, None]) & (t < k_end)[None, :]
            if WINDOW > 0:
                keep = keep & (t[None, :] > pos[:, None] - WINDOW)
            logits = tl.where(keep, logits * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(logits, axis=1))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            l = l * tl.exp2(m - m_safe) + tl.sum(tl.exp2(logits - m_safe[:, None]), axis=1)
            m = m_new
        tl.store(part_m_ptr + out_base + i, m)
        tl.store(part_l_ptr + out_base + i, l)


@triton.jit
def _prompt_lse_merge_kernel(part_m_ptr, part_l_ptr, lse_ptr, num_heads, num_chunks,
                             LSE_STRIDE: tl.constexpr, BLOCK_C: tl.constexpr):
    """lse ``[seq, h, LSE_STRIDE]`` (base 2) from the chunk partials; grid ``(num_seqs, num_heads)``."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.arange(0, BLOCK_C)
    i = tl.arange(0, LSE_STRIDE)
    base = (seq * num_heads + h) * num_chunks
    ptr = (base + c[:, None]) * LSE_STRIDE + i[None, :]
    ms = tl.load(part_m_ptr + ptr, mask=(c < num_chunks)[:, None], other=float("-inf"))
    ls = tl.load(part_l_ptr + ptr, mask=(c < num_chunks)[:, None], other=0.0)
    m = tl.max(ms, axis=0)
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    l_all = tl.sum(tl.where(ms > float("-inf"), ls * tl.exp2(ms - m_safe[None, :]), 0.0), axis=0)
    lse = tl.where(l_all > 0.0, m_safe + tl.log2(tl.where(l_all > 0.0, l_all, 1.0)), 0.0)
    tl.store(lse_ptr + (seq * num_heads + h) * LSE_STRIDE + i, lse)
