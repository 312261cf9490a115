"""Triton kernels of the paged DiffKV decode attention (see :mod:`.decode_attention`).

Three launches per call (the third only when scores are updated):

* ``_decode_partial_kernel``, grid ``(num_seqs, num_kv_heads, num_partitions)``:
  one program reads one partition of one (sequence, KV head) row -- a slice of
  the row's high-tier pages, then a slice of its low-tier pages, ``*_PPI``
  pages per loop step -- for all the query heads of the KV head at once (GQA
  packing: the group's queries are the M dimension of ``tl.dot``, padded to
  16). Each tier yields its own partial softmax state (running max ``m``, sum
  ``l``, unnormalized output ``acc``), written to the workspace. With score
  updates on, it also writes each token's probabilities relative to the
  running max (fp16) and that max per page (fp32).
* ``_decode_merge_kernel``, grid ``(num_seqs, num_kv_heads)``: merges the
  ``2 x num_partitions`` partial states of a row, writes the output and each
  query head's final base-2 log-sum-exp.
* ``_decode_score_kernel``, grid ``(num_seqs, num_kv_heads, page chunks)``:
  adds to each token's score segment the max over the group's query heads of
  its final probability.

Codes are dequantized in fp16 registers (``x = code * scale + zero``, the
code converted by the 0x6400 magic number: no int-to-float conversion
instruction) and enter one ``tl.dot`` per code position in a byte: a 4-bit
byte holds elements ``2b`` and ``2b + 1``, so the query is split into its
even and odd columns (2-bit: four phases) and the value product accumulates
one output per phase, interleaved when stored. No reshapes, no per-group
products. Softmax runs in base 2 (``qk_scale = sm_scale * log2(e)``).

Constexpr names: ``GROUP`` query heads per KV head, ``GROUP_PAD`` that padded
to >= 16, ``HEAD_DIM`` / ``BLOCK_D`` the head dim and its power-of-two pad,
``R`` the page-table width, ``PMAX`` the larger tokens-per-page of the two
tiers (the probability workspace's page stride), ``PAGE_BYTES``; per tier
(``H_`` high, ``L_`` low): ``TOKENS`` tokens per page, ``PPI`` pages per loop
step, ``BLOCK_T`` the padded token block of one step, ``KB`` / ``KG`` /
``VB`` / ``VG`` key and value bits and groups, ``KC`` / ``KM`` / ``VC`` /
``VM`` / ``SC`` byte offsets of the key codes, key meta, value codes, value
meta and score segments inside a page.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _codes_to(x, DT: tl.constexpr):
    """Unsigned codes (< 1024) to exact DT; fp16 by the magic number 0x6400 (= 1024.0), no int->float cvt."""
    if DT == tl.float16:
        return (x.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    else:
        return x.to(DT)


@triton.jit
def _meta(meta_ptr, valid, g):
    """(scale, zero) fp16 ``[BLOCK_T]`` of group ``g``; ``meta_ptr`` points at each token's first uint32 word."""
    w = tl.load(meta_ptr + g, mask=valid, other=0)
    scale = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    zero = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return scale, zero


@triton.jit
def _dequant_phases(page_base, slot, valid, BITS: tl.constexpr, GROUPS: tl.constexpr, CODES: tl.constexpr,
                    META: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr):
    """Dequantized fp16 rows of one side (key or value) of a block of tokens, by phase.

    ``page_base``: ``[BLOCK_T]`` byte pointers to each token's page; ``slot``
    its slot in the page. Returns four ``[BLOCK_T, BLOCK_D // PB]`` tensors,
    phase ``k`` holding head-dim elements ``b * PB + k`` (``PB = 8 // BITS``
    codes per byte; 1 for 8 and 16 bits; unused phases repeat phase 0), in
    DT (fp16 on the GPU; fp32 when DT is fp32, for exact interpreter tests).
    """
    PB: tl.constexpr = 8 // BITS if BITS < 16 else 1
    NB: tl.constexpr = BLOCK_D // PB
    NB_REAL: tl.constexpr = HEAD_DIM // PB
    ROW_BYTES: tl.constexpr = HEAD_DIM * BITS // 8
    b = tl.arange(0, NB)
    if BITS == 16:
        ptr = (page_base + CODES).to(tl.pointer_type(tl.float16))[:, None] + (slot * HEAD_DIM)[:, None] + b[None, :]
        if NB == NB_REAL:
            x = tl.load(ptr, mask=valid[:, None], other=0.0)
        else:
            x = tl.load(ptr, mask=valid[:, None] & (b[None, :] < NB_REAL), other=0.0)
        x0 = x.to(DT)
        x1 = x0
        x2 = x0
        x3 = x0
    else:
        ptr = (page_base + CODES + slot * ROW_BYTES)[:, None] + b[None, :]
        if NB == NB_REAL:
            raw = tl.load(ptr, mask=valid[:, None], other=0)
        else:
            raw = tl.load(ptr, mask=valid[:, None] & (b[None, :] < NB_REAL), other=0)
        meta_ptr = (page_base + META).to(tl.pointer_type(tl.uint32)) + slot * GROUPS
        scale, zero = _meta(meta_ptr, valid, 0)
        scale, zero = scale.to(DT), zero.to(DT)
        s = tl.broadcast_to(scale[:, None], (raw.shape[0], NB))
        z = tl.broadcast_to(zero[:, None], (raw.shape[0], NB))
        for g in tl.static_range(1, GROUPS):
            scale_g, zero_g = _meta(meta_ptr, valid, g)
            scale_g, zero_g = scale_g.to(DT), zero_g.to(DT)
            in_g = (b >= g * (NB_REAL // GROUPS))[None, :]
            s = tl.where(in_g, scale_g[:, None], s)
            z = tl.where(in_g, zero_g[:, None], z)
        MASK: tl.constexpr = (1 << BITS) - 1 if BITS < 16 else 255
        x0 = _codes_to((raw & MASK), DT) * s + z
        x1 = x0
        x2 = x0
        x3 = x0
        if PB >= 2:
            x1 = _codes_to((raw >> (BITS % 8)) & MASK, DT) * s + z
        if PB == 4:
            x2 = _codes_to((raw >> ((2 * BITS) % 8)) & MASK, DT) * s + z
            x3 = _codes_to((raw >> ((3 * BITS) % 8)) & MASK, DT) * s + z
    return x0, x1, x2, x3


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _load_q_phase(q_row_ptr, k: tl.constexpr, PB: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr):
    """Query columns ``b * PB + k`` of the group's heads: ``[GROUP_PAD, BLOCK_D // PB]`` in DT (zero padded)."""
    h = tl.arange(0, GROUP_PAD)
    b = tl.arange(0, BLOCK_D // PB)
    col = b * PB + k
    q = tl.load(q_row_ptr + h[:, None] * HEAD_DIM + col[None, :],
                mask=(h[:, None] < GROUP) & (col[None, :] < HEAD_DIM), other=0.0)
    return q.to(DT)


@triton.jit
def _tier_partial(pool_ptr, table_row_ptr, n_tok, part, num_parts, q_row_ptr, qk_scale, prob_ptr, page_max_ptr,
                  part_acc_ptr, part_slot,
                  R: tl.constexpr, FROM_RIGHT: tl.constexpr, PAGE_BYTES: tl.constexpr, PMAX: tl.constexpr,
                  TOKENS: tl.constexpr, PPI: tl.constexpr, BLOCK_T: tl.constexpr,
                  KB: tl.constexpr, KG: tl.constexpr, VB: tl.constexpr, VG: tl.constexpr,
                  KC: tl.constexpr, KM: tl.constexpr, VC: tl.constexpr, VM: tl.constexpr,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  DT: tl.constexpr, IEEE: tl.constexpr, STORE_PROBS: tl.constexpr):
    """Online softmax over one partition of one tier; stores acc (natural column order), returns (m, l)."""
    KPB: tl.constexpr = 8 // KB if KB < 16 else 1
    VPB: tl.constexpr = 8 // VB if VB < 16 else 1
    VNB: tl.constexpr = BLOCK_D // VPB
    q0 = _load_q_phase(q_row_ptr, 0, KPB, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, DT)
    q1 = q0
    q2 = q0
    q3 = q0
    if KPB >= 2:
        q1 = _load_q_phase(q_row_ptr, 1, KPB, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, DT)
    if KPB == 4:
        q2 = _load_q_phase(q_row_ptr, 2, KPB, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, DT)
        q3 = _load_q_phase(q_row_ptr, 3, KPB, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, DT)
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l = tl.zeros((GROUP_PAD,), tl.float32)
    acc0 = tl.zeros((GROUP_PAD, VNB), tl.float32)
    acc1 = tl.zeros((GROUP_PAD, VNB), tl.float32)
    acc2 = tl.zeros((GROUP_PAD, VNB), tl.float32)
    acc3 = tl.zeros((GROUP_PAD, VNB), tl.float32)
    t = tl.arange(0, BLOCK_T)
    sub = t // TOKENS  # page of the loop step each token row belongs to
    slot = t % TOKENS
    h = tl.arange(0, GROUP_PAD)
    n_pages = (n_tok + TOKENS - 1) // TOKENS
    per_part = (n_pages + num_parts - 1) // num_parts
    first = part * per_part
    last = tl.minimum(first + per_part, n_pages)
    for j0 in range(first, last, PPI):
        j = j0 + sub
        valid = (sub < PPI) & (j < last) & (j * TOKENS + slot < n_tok)
        if FROM_RIGHT:
            pos = R - 1 - j
        else:
            pos = j
        page = tl.load(table_row_ptr + pos, mask=valid, other=0).to(tl.int64)
        tok_base = pool_ptr + page * PAGE_BYTES
        k0, k1, k2, k3 = _dequant_phases(tok_base, slot, valid, KB, KG, KC, KM, HEAD_DIM, BLOCK_D, DT)
        logits = _dot(q0, tl.trans(k0), IEEE)
        if KPB >= 2:
            logits += _dot(q1, tl.trans(k1), IEEE)
        if KPB == 4:
            logits += _dot(q2, tl.trans(k2), IEEE)
            logits += _dot(q3, tl.trans(k3), IEEE)
        logits = tl.where(valid[None, :], logits * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(logits - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v0, v1, v2, v3 = _dequant_phases(tok_base, slot, valid, VB, VG, VC, VM, HEAD_DIM, BLOCK_D, DT)
        pd = p.to(DT)
        acc0 = acc0 * alpha[:, None] + _dot(pd, v0, IEEE)
        if VPB >= 2:
            acc1 = acc1 * alpha[:, None] + _dot(pd, v1, IEEE)
        if VPB == 4:
            acc2 = acc2 * alpha[:, None] + _dot(pd, v2, IEEE)
            acc3 = acc3 * alpha[:, None] + _dot(pd, v3, IEEE)
        m = m_new
        if STORE_PROBS:
            pp = prob_ptr + (pos[None, :] * PMAX + slot[None, :]) * GROUP + h[:, None]
            tl.store(pp, p.to(tl.float16), mask=valid[None, :] & (h[:, None] < GROUP))
            i = tl.arange(0, PPI)
            if FROM_RIGHT:
                pos_i = R - 1 - (j0 + i)
            else:
                pos_i = j0 + i
            tl.store(page_max_ptr + pos_i[None, :] * GROUP + h[:, None],
                     tl.broadcast_to(m_new[:, None], (GROUP_PAD, PPI)),
                     mask=(h[:, None] < GROUP) & ((j0 + i) < last)[None, :])
    # acc_k holds output columns b * VPB + k: scatter them to natural order in the workspace
    b = tl.arange(0, VNB)
    row = (part_slot * GROUP_PAD + h[:, None]) * BLOCK_D
    tl.store(part_acc_ptr + row + b[None, :] * VPB, acc0)
    if VPB >= 2:
        tl.store(part_acc_ptr + row + b[None, :] * VPB + 1, acc1)
    if VPB == 4:
        tl.store(part_acc_ptr + row + b[None, :] * VPB + 2, acc2)
        tl.store(part_acc_ptr + row + b[None, :] * VPB + 3, acc3)
    return m, l


@triton.jit
def _decode_partial_kernel(
    q_ptr, pool_ptr, table_ptr, tokens_ptr, row_ids_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr, prob_ptr, page_max_ptr,
    qk_scale, num_kv_heads, num_parts,
    R: tl.constexpr, PAGE_BYTES: tl.constexpr, PMAX: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    H_TOKENS: tl.constexpr, H_PPI: tl.constexpr, H_BLOCK_T: tl.constexpr, H_KB: tl.constexpr, H_KG: tl.constexpr,
    H_VB: tl.constexpr, H_VG: tl.constexpr, H_KC: tl.constexpr, H_KM: tl.constexpr, H_VC: tl.constexpr,
    H_VM: tl.constexpr,
    L_TOKENS: tl.constexpr, L_PPI: tl.constexpr, L_BLOCK_T: tl.constexpr, L_KB: tl.constexpr, L_KG: tl.constexpr,
    L_VB: tl.constexpr, L_VG: tl.constexpr, L_KC: tl.constexpr, L_KM: tl.constexpr, L_VC: tl.constexpr,
    L_VM: tl.constexpr,
    DT: tl.constexpr, IEEE: tl.constexpr, STORE_PROBS: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    row = tl.load(row_ids_ptr + seq * num_kv_heads + kvh)
    valid = row >= 0
    row_safe = tl.maximum(row, 0).to(tl.int64)
    n_high = tl.load(tokens_ptr + row_safe * 2, mask=valid, other=0)
    n_low = tl.load(tokens_ptr + row_safe * 2 + 1, mask=valid, other=0)
    h = tl.arange(0, GROUP_PAD)
    q_row_ptr = q_ptr + (seq * num_kv_heads * GROUP + kvh * GROUP).to(tl.int64) * HEAD_DIM
    rs = seq * num_kv_heads + kvh  # workspace row
    table_row_ptr = table_ptr + row_safe * R
    prob_row_ptr = prob_ptr + rs.to(tl.int64) * (R * PMAX * GROUP)
    page_max_row_ptr = page_max_ptr + rs.to(tl.int64) * (R * GROUP)
    slot = (rs * num_parts + part) * 2
    m, l = _tier_partial(pool_ptr, table_row_ptr, n_high, part, num_parts, q_row_ptr, qk_scale,
                         prob_row_ptr, page_max_row_ptr, part_acc_ptr, slot, R, False, PAGE_BYTES, PMAX,
                         H_TOKENS, H_PPI, H_BLOCK_T, H_KB, H_KG, H_VB, H_VG, H_KC, H_KM, H_VC, H_VM,
                         GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, DT, IEEE, STORE_PROBS)
    tl.store(part_m_ptr + slot * GROUP_PAD + h, m)
    tl.store(part_l_ptr + slot * GROUP_PAD + h, l)
    m, l = _tier_partial(pool_ptr, table_row_ptr, n_low, part, num_parts, q_row_ptr, qk_scale,
                         prob_row_ptr, page_max_row_ptr, part_acc_ptr, slot + 1, R, True, PAGE_BYTES, PMAX,
                         L_TOKENS, L_PPI, L_BLOCK_T, L_KB, L_KG, L_VB, L_VG, L_KC, L_KM, L_VC, L_VM,
                         GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, DT, IEEE, STORE_PROBS)
    tl.store(part_m_ptr + (slot + 1) * GROUP_PAD + h, m)
    tl.store(part_l_ptr + (slot + 1) * GROUP_PAD + h, l)


@triton.jit
def _decode_merge_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, lse_ptr, num_kv_heads, num_parts,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_PARTS: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    rs = seq * num_kv_heads + kvh
    h = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    i = tl.arange(0, BLOCK_PARTS)
    n_slots = 2 * num_parts
    base = rs * n_slots
    ms = tl.load(part_m_ptr + (base + i[:, None]) * GROUP_PAD + h[None, :], mask=i[:, None] < n_slots,
                 other=float("-inf"))
    ls = tl.load(part_l_ptr + (base + i[:, None]) * GROUP_PAD + h[None, :], mask=i[:, None] < n_slots, other=0.0)
    m_all = tl.max(ms, axis=0)  # [GROUP_PAD]; -inf where the row has no token
    m_safe = tl.where(m_all > float("-inf"), m_all, 0.0)
    w = tl.where(ms > float("-inf"), tl.exp2(ms - m_safe[None, :]), 0.0)
    l_all = tl.sum(ls * w, axis=0)
    acc = tl.zeros((GROUP_PAD, BLOCK_D), tl.float32)
    for s in range(0, n_slots):
        m_s = tl.load(part_m_ptr + (base + s) * GROUP_PAD + h)
        w_s = tl.where(m_s > float("-inf"), tl.exp2(m_s - m_safe), 0.0)
        a = tl.load(part_acc_ptr + ((base + s) * GROUP_PAD + h[:, None]) * BLOCK_D + d[None, :])
        acc += a * w_s[:, None]
    inv = tl.where(l_all > 0.0, 1.0 / tl.where(l_all > 0.0, l_all, 1.0), 0.0)
    o_rows = seq * num_kv_heads * GROUP + kvh * GROUP + h
    tl.store(out_ptr + o_rows[:, None] * HEAD_DIM + d[None, :], (acc * inv[:, None]).to(out_ptr.dtype.element_ty),
             mask=(h[:, None] < GROUP) & (d[None, :] < HEAD_DIM))
    lse = tl.where(l_all > 0.0, m_safe + tl.log2(tl.where(l_all > 0.0, l_all, 1.0)), float("inf"))
    tl.store(lse_ptr + rs * GROUP_PAD + h, lse)


@triton.jit
def _decode_score_kernel(
    pool_ptr, table_ptr, tokens_ptr, row_ids_ptr, prob_ptr, page_max_ptr, lse_ptr, num_kv_heads,
    R: tl.constexpr, PAGE_BYTES: tl.constexpr, PMAX: tl.constexpr, BLOCK_P: tl.constexpr,
    GROUP: tl.constexpr, HEADS_PAD: tl.constexpr, LSE_STRIDE: tl.constexpr, POS_PER_PROG: tl.constexpr,
    H_TOKENS: tl.constexpr, H_SC: tl.constexpr, L_TOKENS: tl.constexpr, L_SC: tl.constexpr,
):
    """Scores of the tokens on ``POS_PER_PROG`` page-table positions of one row (``HEADS_PAD``: group, pow2)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    chunk = tl.program_id(2)
    rs = seq * num_kv_heads + kvh
    row = tl.load(row_ids_ptr + rs)
    valid_row = row >= 0
    row_safe = tl.maximum(row, 0).to(tl.int64)
    n_high = tl.load(tokens_ptr + row_safe * 2, mask=valid_row, other=0)
    n_low = tl.load(tokens_ptr + row_safe * 2 + 1, mask=valid_row, other=0)
    hp = (n_high + H_TOKENS - 1) // H_TOKENS
    lp = (n_low + L_TOKENS - 1) // L_TOKENS
    pos = chunk * POS_PER_PROG + tl.arange(0, POS_PER_PROG)  # [P]
    is_high = pos < hp
    is_low = pos >= R - lp
    j = tl.where(is_high, pos, R - 1 - pos)  # page index within its tier
    count = tl.where(is_high, tl.minimum(n_high - j * H_TOKENS, H_TOKENS),
                     tl.where(is_low, tl.minimum(n_low - j * L_TOKENS, L_TOKENS), 0))
    count = tl.where(pos < R, count, 0)
    t = tl.arange(0, BLOCK_P)
    h = tl.arange(0, HEADS_PAD)
    tok_ok = t[None, :] < count[:, None]  # [P, T]
    page = tl.load(table_ptr + row_safe * R + pos, mask=count > 0, other=0).to(tl.int64)
    lse = tl.load(lse_ptr + rs * LSE_STRIDE + h, mask=h < GROUP, other=float("inf"))
    page_max = tl.load(page_max_ptr + (rs.to(tl.int64) * R + pos[:, None]) * GROUP + h[None, :],
                       mask=(count > 0)[:, None] & (h[None, :] < GROUP), other=float("-inf"))  # [P, H]
    factor = tl.exp2(page_max - lse[None, :])  # 0 for padded heads and empty pages
    e = tl.load(prob_ptr + ((rs.to(tl.int64) * R + pos[:, None, None]) * PMAX + t[None, :, None]) * GROUP
                + h[None, None, :], mask=tok_ok[:, :, None] & (h[None, None, :] < GROUP), other=0.0)
    prob = tl.max(e.to(tl.float32) * factor[:, None, :], axis=2)  # [P, T]
    sc = tl.where(is_high, H_SC, L_SC)
    score_ptr = (pool_ptr + page * PAGE_BYTES + sc)[:, None].to(tl.pointer_type(tl.float32)) + t[None, :]
    old = tl.load(score_ptr, mask=tok_ok, other=0.0)
    tl.store(score_ptr, old + prob, mask=tok_ok)
