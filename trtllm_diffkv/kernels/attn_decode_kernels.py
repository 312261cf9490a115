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

Dequantization is folded out of the products. Keys: ``q.k = s (q.c) + z sum(q)``
per token and quantization group, so the raw codes enter ``tl.dot`` as exact
fp16 integers (four bytes at a time by two ``prmt`` + one ``sub.f16x2`` per
pair, :func:`_bytes_to_f16`; Triton's elementwise path on the CPU) against a
query tile stacked by key group (row ``g * GP2 + h``: head ``h``'s columns of
group ``g``), and the ``[NG, GP2, BLOCK_T]`` partial logits are scaled and
summed over groups in fp32. Values: ``sum_t p (s c + z) = (p s) C + sum_t p z``:
the probabilities are scaled per (value group, token), stacked the same way,
and ``sum_t p z`` is kept apart; row ``g * GP2 + h`` of a value accumulator
holds the output columns of group ``g``. 4/2-bit bytes hold elements
``b * PB + k``: one product per phase ``k`` (no reshapes), the query split into
the matching columns and the outputs stored strided. Query groups larger than
32 stacked rows allow are split into chunks of ``GP2`` heads (``NCHUNK``
programs per partition). Softmax runs in base 2 (``qk_scale = sm_scale * log2(e)``).

Constexpr names: ``GROUP`` query heads per KV head, ``GROUP_PAD`` that padded
to >= 16 (workspace rows), ``GP2`` query heads per program (power of two),
``NCHUNK`` programs per partition, ``HEAD_DIM`` / ``BLOCK_D`` the head dim and
its power-of-two pad, ``R`` the page-table width, ``PMAX`` the larger tokens-per-page of the two
tiers (the probability workspace's page stride), ``PAGE_BYTES``; per tier
(``H_`` high, ``L_`` low): ``TOKENS`` tokens per page, ``PPI`` pages per loop
step, ``BLOCK_T`` the padded token block of one step, ``KB`` / ``KG`` /
``VB`` / ``VG`` key and value bits and groups, ``KC`` / ``KM`` / ``VC`` /
``VM`` / ``SC`` byte offsets of the key codes, key meta, value codes, value
meta and score segments inside a page, ``NG`` stacked quantization groups.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def _cvt_asm(shift: int, mask_word: str | None) -> str:
    """PTX of :func:`_bytes_to_f16`: four packed bytes in ``$2`` to four fp16 codes in ``$0``, ``$1``."""
    pre = "mov.b32 t, $2;"
    if mask_word is not None:
        pre = (f"shr.b32 t, $2, {shift}; " if shift else "") + f"and.b32 t, {'t' if shift else '$2'}, {mask_word};"
    return ("{ .reg .b32 m, t; mov.b32 m, 0x64006400; " + pre + " "
            "prmt.b32 $0, t, 0x64646464, 0x4140; prmt.b32 $1, t, 0x64646464, 0x4342; "
            "sub.f16x2 $0, $0, m; sub.f16x2 $1, $1, m; }")


_ASM_8 = tl.constexpr(_cvt_asm(0, None))
_ASM_4_0 = tl.constexpr(_cvt_asm(0, "0x0F0F0F0F"))
_ASM_4_4 = tl.constexpr(_cvt_asm(4, "0x0F0F0F0F"))
_ASM_2_0 = tl.constexpr(_cvt_asm(0, "0x03030303"))
_ASM_2_2 = tl.constexpr(_cvt_asm(2, "0x03030303"))
_ASM_2_4 = tl.constexpr(_cvt_asm(4, "0x03030303"))
_ASM_2_6 = tl.constexpr(_cvt_asm(6, "0x03030303"))


@triton.jit
def _codes_to(x, DT: tl.constexpr):
    """Unsigned codes (< 1024) to exact DT; fp16 by the magic number 0x6400 (= 1024.0), no int->float cvt."""
    if DT == tl.float16:
        return (x.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    else:
        return x.to(DT)


@triton.jit
def _bytes_to_f16(x, SHIFT: tl.constexpr, MASK: tl.constexpr):
    """``((byte >> SHIFT) & MASK)`` of four bytes at a time to exact fp16, in PTX (GPU only).

    One 32-bit register holds four codes; two ``prmt`` place each byte under the 0x64 exponent
    byte (1024 + code as fp16), one ``sub.f16x2`` each removes the 1024: 1 to 1.5 instructions
    per element, against ~2.5 for the per-byte unpack and repack Triton emits for ``_codes_to``.
    """
    if MASK == 255:
        asm: tl.constexpr = _ASM_8
    elif MASK == 15:
        if SHIFT == 0:
            asm: tl.constexpr = _ASM_4_0
        else:
            asm: tl.constexpr = _ASM_4_4
    else:
        if SHIFT == 0:
            asm: tl.constexpr = _ASM_2_0
        elif SHIFT == 2:
            asm: tl.constexpr = _ASM_2_2
        elif SHIFT == 4:
            asm: tl.constexpr = _ASM_2_4
        else:
            asm: tl.constexpr = _ASM_2_6
    return tl.inline_asm_elementwise(asm, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _codes_phase(raw, k: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr = False):
    """Phase ``k`` of a packed byte tile as exact DT codes (16 bits: the stored fp16 values).

    ``FAST`` (GPU, fp16): the PTX conversion :func:`_bytes_to_f16`.
    """
    if BITS == 16:
        return raw.to(DT)
    elif FAST:
        if BITS == 8:
            return _bytes_to_f16(raw, 0, 255)
        else:
            return _bytes_to_f16(raw, k * BITS, (1 << BITS) - 1)
    elif BITS == 8:
        return _codes_to(raw, DT)
    else:
        MASK: tl.constexpr = (1 << BITS) - 1
        if k == 0:
            return _codes_to(raw & MASK, DT)
        else:
            return _codes_to((raw >> (k * BITS)) & MASK, DT)


@triton.jit
def _load_codes(page_base, slot, valid, BITS: tl.constexpr, CODES: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Raw code bytes ``[BLOCK_T, BLOCK_D // PB]`` of a block of tokens (fp16 values for 16 bits), zero-masked."""
    PB: tl.constexpr = 8 // BITS if BITS < 16 else 1
    NB: tl.constexpr = BLOCK_D // PB
    NB_REAL: tl.constexpr = HEAD_DIM // PB
    ROW_BYTES: tl.constexpr = HEAD_DIM * BITS // 8
    b = tl.arange(0, NB)
    if BITS == 16:
        ptr = (page_base + CODES).to(tl.pointer_type(tl.float16))[:, None] + (slot * HEAD_DIM)[:, None] + b[None, :]
        other = 0.0
    else:
        ptr = (page_base + CODES + slot * ROW_BYTES)[:, None] + b[None, :]
        other = 0
    if NB == NB_REAL:
        raw = tl.load(ptr, mask=valid[:, None], other=other)
    else:
        raw = tl.load(ptr, mask=valid[:, None] & (b[None, :] < NB_REAL), other=other)
    return raw


@triton.jit
def _meta_rows(page_base, slot, valid, BITS: tl.constexpr, GROUPS: tl.constexpr, META: tl.constexpr,
               NG: tl.constexpr):
    """fp32 (scale, zero) ``[NG, BLOCK_T]`` per quantization group (rows >= GROUPS: 0; 16 bits: scale 1, zero 0)."""
    grp = tl.arange(0, NG)
    if BITS == 16:
        one = tl.where(grp[:, None] == 0, 1.0, 0.0) + tl.zeros((NG, slot.shape[0]), tl.float32)
        return one, tl.zeros((NG, slot.shape[0]), tl.float32)
    else:
        ptr = (page_base + META).to(tl.pointer_type(tl.uint32))[None, :] + (slot * GROUPS)[None, :] + grp[:, None]
        w = tl.load(ptr, mask=valid[None, :] & (grp[:, None] < GROUPS), other=0)
        scale = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        zero = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return scale, zero


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _load_q_phase(q_row_ptr, k: tl.constexpr, PB: tl.constexpr, KG: tl.constexpr, NH,
                  GP2: tl.constexpr, NG: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  DT: tl.constexpr):
    """Stacked query tile ``[NG * GP2, BLOCK_D // PB]`` of phase ``k`` (columns ``b * PB + k``).

    Row ``g * GP2 + h`` holds query head ``h``'s columns of key quantization group ``g`` and zeros
    elsewhere (and for heads ``h >= NH``), so one product gives every (group, head) partial dot at once.
    """
    r = tl.arange(0, NG * GP2)
    grp = r // GP2
    h = r % GP2
    b = tl.arange(0, BLOCK_D // PB)
    col = b * PB + k
    in_grp = (col // (HEAD_DIM // KG))[None, :] == grp[:, None]
    q = tl.load(q_row_ptr + h[:, None] * HEAD_DIM + col[None, :],
                mask=(h[:, None] < NH) & (col[None, :] < HEAD_DIM) & in_grp, other=0.0)
    return q.to(DT)


@triton.jit
def _tier_partial(pool_ptr, table_row_ptr, n_tok, part, num_parts, q_row_ptr, NH, qk_scale, prob_ptr, page_max_ptr,
                  part_acc_ptr, part_slot,
                  R: tl.constexpr, FROM_RIGHT: tl.constexpr, PAGE_BYTES: tl.constexpr, PMAX: tl.constexpr,
                  TOKENS: tl.constexpr, PPI: tl.constexpr, BLOCK_T: tl.constexpr,
                  KB: tl.constexpr, KG: tl.constexpr, VB: tl.constexpr, VG: tl.constexpr,
                  KC: tl.constexpr, KM: tl.constexpr, VC: tl.constexpr, VM: tl.constexpr, NG: tl.constexpr,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GP2: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, STORE_PROBS: tl.constexpr,
                  FAST: tl.constexpr):
    """Online softmax over one partition of one tier; stores acc (natural column order), returns (m, l).

    Dequantization is folded out of the products: the keys' integer codes enter the dot as exact
    DT values against a query tile stacked by key group (rows ``g * GP2 + h``), and each token's
    group scale/zero are applied to the ``[NG, GP2, BLOCK_T]`` partial logits; the values' codes
    enter the dot against probabilities scaled per (value group, token), stacked the same way,
    and ``sum_t p z`` is accumulated apart. Row ``g * GP2 + h`` of the value accumulators is
    valid for the output columns of value group ``g``.
    """
    M: tl.constexpr = NG * GP2
    KPB: tl.constexpr = 8 // KB if KB < 16 else 1
    VPB: tl.constexpr = 8 // VB if VB < 16 else 1
    VNB: tl.constexpr = BLOCK_D // VPB
    q0 = _load_q_phase(q_row_ptr, 0, KPB, KG, NH, GP2, NG, HEAD_DIM, BLOCK_D, DT)
    qsum = tl.sum(q0.to(tl.float32), axis=1)
    q1 = q0
    q2 = q0
    q3 = q0
    if KPB >= 2:
        q1 = _load_q_phase(q_row_ptr, 1, KPB, KG, NH, GP2, NG, HEAD_DIM, BLOCK_D, DT)
        qsum += tl.sum(q1.to(tl.float32), axis=1)
    if KPB == 4:
        q2 = _load_q_phase(q_row_ptr, 2, KPB, KG, NH, GP2, NG, HEAD_DIM, BLOCK_D, DT)
        q3 = _load_q_phase(q_row_ptr, 3, KPB, KG, NH, GP2, NG, HEAD_DIM, BLOCK_D, DT)
        qsum += tl.sum(q2.to(tl.float32), axis=1) + tl.sum(q3.to(tl.float32), axis=1)
    qsum3 = tl.reshape(qsum, (NG, GP2))
    m = tl.full((GP2,), float("-inf"), tl.float32)
    l = tl.zeros((GP2,), tl.float32)
    zacc = tl.zeros((NG, GP2), tl.float32)
    acc0 = tl.zeros((M, VNB), tl.float32)
    acc1 = tl.zeros((M, VNB), tl.float32)
    acc2 = tl.zeros((M, VNB), tl.float32)
    acc3 = tl.zeros((M, VNB), tl.float32)
    t = tl.arange(0, BLOCK_T)
    sub = t // TOKENS  # page of the loop step each token row belongs to
    slot = t % TOKENS
    h = tl.arange(0, GP2)
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
        kraw = _load_codes(tok_base, slot, valid, KB, KC, HEAD_DIM, BLOCK_D)
        vraw = _load_codes(tok_base, slot, valid, VB, VC, HEAD_DIM, BLOCK_D)
        ks, kz = _meta_rows(tok_base, slot, valid, KB, KG, KM, NG)
        vs, vz = _meta_rows(tok_base, slot, valid, VB, VG, VM, NG)
        part_l = _dot(q0, tl.trans(_codes_phase(kraw, 0, KB, DT, FAST)), IEEE)
        if KPB >= 2:
            part_l += _dot(q1, tl.trans(_codes_phase(kraw, 1, KB, DT, FAST)), IEEE)
        if KPB == 4:
            part_l += _dot(q2, tl.trans(_codes_phase(kraw, 2, KB, DT, FAST)), IEEE)
            part_l += _dot(q3, tl.trans(_codes_phase(kraw, 3, KB, DT, FAST)), IEEE)
        l3 = tl.reshape(part_l, (NG, GP2, BLOCK_T))
        logits = tl.sum(l3 * ks[:, None, :] + kz[:, None, :] * qsum3[:, :, None], axis=0)  # [GP2, BLOCK_T]
        logits = tl.where(valid[None, :], logits * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(logits - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        zacc = zacc * alpha[None, :] + tl.sum(p[None, :, :] * vz[:, None, :], axis=2)
        ps = tl.reshape(p[None, :, :] * vs[:, None, :], (M, BLOCK_T)).to(DT)
        alpha_r = tl.reshape(tl.broadcast_to(alpha[None, :], (NG, GP2)), (M,))[:, None]
        acc0 = acc0 * alpha_r + _dot(ps, _codes_phase(vraw, 0, VB, DT, FAST), IEEE)
        if VPB >= 2:
            acc1 = acc1 * alpha_r + _dot(ps, _codes_phase(vraw, 1, VB, DT, FAST), IEEE)
        if VPB == 4:
            acc2 = acc2 * alpha_r + _dot(ps, _codes_phase(vraw, 2, VB, DT, FAST), IEEE)
            acc3 = acc3 * alpha_r + _dot(ps, _codes_phase(vraw, 3, VB, DT, FAST), IEEE)
        m = m_new
        if STORE_PROBS:
            pp = prob_ptr + (pos[None, :] * GROUP + h[:, None]) * PMAX + slot[None, :]
            tl.store(pp, p.to(tl.float16), mask=valid[None, :] & (h[:, None] < NH))
            i = tl.arange(0, PPI)
            if FROM_RIGHT:
                pos_i = R - 1 - (j0 + i)
            else:
                pos_i = j0 + i
            tl.store(page_max_ptr + pos_i[None, :] * GROUP + h[:, None],
                     tl.broadcast_to(m_new[:, None], (GP2, PPI)),
                     mask=(h[:, None] < NH) & ((j0 + i) < last)[None, :])
    # row g * GP2 + hh of acc_k holds output columns b * VPB + k of value group g: store those, in natural order
    r = tl.arange(0, M)
    rg = r // GP2
    rh = r % GP2
    zr = tl.reshape(zacc, (M,))[:, None]
    b = tl.arange(0, VNB)
    VGE: tl.constexpr = VG if VB < 16 else 1
    row = (part_slot * GROUP_PAD + rh[:, None]) * BLOCK_D
    ok_r = rh[:, None] < NH
    d = b[None, :] * VPB
    tl.store(part_acc_ptr + row + d, acc0 + zr, mask=ok_r & ((d // (HEAD_DIM // VGE)) == rg[:, None]) & (d < HEAD_DIM))
    if VPB >= 2:
        d = b[None, :] * VPB + 1
        tl.store(part_acc_ptr + row + d, acc1 + zr,
                 mask=ok_r & ((d // (HEAD_DIM // VGE)) == rg[:, None]) & (d < HEAD_DIM))
    if VPB == 4:
        d = b[None, :] * VPB + 2
        tl.store(part_acc_ptr + row + d, acc2 + zr,
                 mask=ok_r & ((d // (HEAD_DIM // VGE)) == rg[:, None]) & (d < HEAD_DIM))
        d = b[None, :] * VPB + 3
        tl.store(part_acc_ptr + row + d, acc3 + zr,
                 mask=ok_r & ((d // (HEAD_DIM // VGE)) == rg[:, None]) & (d < HEAD_DIM))
    return m, l


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
def _load_q_phase_deq(q_row_ptr, k: tl.constexpr, PB: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DT: tl.constexpr):
    """Query columns ``b * PB + k`` of the group's heads: ``[GROUP_PAD, BLOCK_D // PB]`` in DT (zero padded)."""
    h = tl.arange(0, GROUP_PAD)
    b = tl.arange(0, BLOCK_D // PB)
    col = b * PB + k
    q = tl.load(q_row_ptr + h[:, None] * HEAD_DIM + col[None, :],
                mask=(h[:, None] < GROUP) & (col[None, :] < HEAD_DIM), other=0.0)
    return q.to(DT)


@triton.jit
def _tier_partial_deq(pool_ptr, table_row_ptr, n_tok, part, num_parts, q_row_ptr, qk_scale, prob_ptr, page_max_ptr,
                  part_acc_ptr, part_slot,
                  R: tl.constexpr, FROM_RIGHT: tl.constexpr, PAGE_BYTES: tl.constexpr, PMAX: tl.constexpr,
                  TOKENS: tl.constexpr, PPI: tl.constexpr, BLOCK_T: tl.constexpr,
                  KB: tl.constexpr, KG: tl.constexpr, VB: tl.constexpr, VG: tl.constexpr,
                  KC: tl.constexpr, KM: tl.constexpr, VC: tl.constexpr, VM: tl.constexpr,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  DT: tl.constexpr, IEEE: tl.constexpr, STORE_PROBS: tl.constexpr):
    """:func:`_tier_partial` with the codes dequantized in registers (``GROUP_PAD`` rows, whole group).

    The previous design, kept for tiers whose folded products would stack 32 rows (query groups of
    5-8 heads with 4 value groups): there the folded loop spills registers (H200, 2026-11-30:
    Qwen2.5-7B all-low 2840 us folded against 976 us with this loop; docs/PERFORMANCE.md).
    """
    KPB: tl.constexpr = 8 // KB if KB < 16 else 1
    VPB: tl.constexpr = 8 // VB if VB < 16 else 1
    VNB: tl.constexpr = BLOCK_D // VPB
    q0 = _load_q_phase_deq(q_row_ptr, 0, KPB, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, DT)
    q1 = q0
    q2 = q0
    q3 = q0
    if KPB >= 2:
        q1 = _load_q_phase_deq(q_row_ptr, 1, KPB, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, DT)
    if KPB == 4:
        q2 = _load_q_phase_deq(q_row_ptr, 2, KPB, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, DT)
        q3 = _load_q_phase_deq(q_row_ptr, 3, KPB, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, DT)
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
            pp = prob_ptr + (pos[None, :] * GROUP + h[:, None]) * PMAX + slot[None, :]
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
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GP2: tl.constexpr, NCHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    H_TOKENS: tl.constexpr, H_PPI: tl.constexpr, H_BLOCK_T: tl.constexpr, H_KB: tl.constexpr, H_KG: tl.constexpr,
    H_VB: tl.constexpr, H_VG: tl.constexpr, H_KC: tl.constexpr, H_KM: tl.constexpr, H_VC: tl.constexpr,
    H_VM: tl.constexpr, H_NG: tl.constexpr, H_FOLD: tl.constexpr,
    L_TOKENS: tl.constexpr, L_PPI: tl.constexpr, L_BLOCK_T: tl.constexpr, L_KB: tl.constexpr, L_KG: tl.constexpr,
    L_VB: tl.constexpr, L_VG: tl.constexpr, L_KC: tl.constexpr, L_KM: tl.constexpr, L_VC: tl.constexpr,
    L_VM: tl.constexpr, L_NG: tl.constexpr, L_FOLD: tl.constexpr,
    DT: tl.constexpr, IEEE: tl.constexpr, STORE_PROBS: tl.constexpr, FAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2) // NCHUNK
    h0 = (tl.program_id(2) % NCHUNK) * GP2  # first query head of this program's chunk of the group
    nh = GROUP - h0  # heads of the chunk that exist (>= 1; the chunk has GP2 rows)
    row = tl.load(row_ids_ptr + seq * num_kv_heads + kvh)
    valid = row >= 0
    row_safe = tl.maximum(row, 0).to(tl.int64)
    n_high = tl.load(tokens_ptr + row_safe * 2, mask=valid, other=0)
    n_low = tl.load(tokens_ptr + row_safe * 2 + 1, mask=valid, other=0)
    h = tl.arange(0, GP2)
    q_row_ptr = q_ptr + (seq * num_kv_heads * GROUP + kvh * GROUP + h0).to(tl.int64) * HEAD_DIM
    rs = seq * num_kv_heads + kvh  # workspace row
    table_row_ptr = table_ptr + row_safe * R
    prob_row_ptr = prob_ptr + rs.to(tl.int64) * (R * PMAX * GROUP) + h0 * PMAX
    page_max_row_ptr = page_max_ptr + rs.to(tl.int64) * (R * GROUP) + h0
    acc_ptr = part_acc_ptr + h0 * BLOCK_D
    h_ok = h < nh
    slot = (rs * num_parts + part) * 2
    if H_FOLD:
        m, l = _tier_partial(pool_ptr, table_row_ptr, n_high, part, num_parts, q_row_ptr, nh, qk_scale,
                             prob_row_ptr, page_max_row_ptr, acc_ptr, slot, R, False, PAGE_BYTES, PMAX,
                             H_TOKENS, H_PPI, H_BLOCK_T, H_KB, H_KG, H_VB, H_VG, H_KC, H_KM, H_VC, H_VM, H_NG,
                             GROUP, GROUP_PAD, GP2, HEAD_DIM, BLOCK_D, DT, IEEE, STORE_PROBS, FAST)
        tl.store(part_m_ptr + slot * GROUP_PAD + h0 + h, m, mask=h_ok)
        tl.store(part_l_ptr + slot * GROUP_PAD + h0 + h, l, mask=h_ok)
    else:
        m, l = _tier_partial_deq(pool_ptr, table_row_ptr, n_high, part, num_parts, q_row_ptr, qk_scale,
                                 prob_row_ptr, page_max_row_ptr, part_acc_ptr, slot, R, False, PAGE_BYTES, PMAX,
                                 H_TOKENS, H_PPI, H_BLOCK_T, H_KB, H_KG, H_VB, H_VG, H_KC,
                                 H_KM, H_VC, H_VM, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, DT, IEEE, STORE_PROBS)
        hp = tl.arange(0, GROUP_PAD)  # one chunk (NCHUNK == 1, h0 == 0): the whole group
        tl.store(part_m_ptr + slot * GROUP_PAD + hp, m)
        tl.store(part_l_ptr + slot * GROUP_PAD + hp, l)
    if L_FOLD:
        m, l = _tier_partial(pool_ptr, table_row_ptr, n_low, part, num_parts, q_row_ptr, nh, qk_scale,
                             prob_row_ptr, page_max_row_ptr, acc_ptr, slot + 1, R, True, PAGE_BYTES, PMAX,
                             L_TOKENS, L_PPI, L_BLOCK_T, L_KB, L_KG, L_VB, L_VG, L_KC, L_KM, L_VC, L_VM, L_NG,
                             GROUP, GROUP_PAD, GP2, HEAD_DIM, BLOCK_D, DT, IEEE, STORE_PROBS, FAST)
        tl.store(part_m_ptr + (slot + 1) * GROUP_PAD + h0 + h, m, mask=h_ok)
        tl.store(part_l_ptr + (slot + 1) * GROUP_PAD + h0 + h, l, mask=h_ok)
    else:
        m, l = _tier_partial_deq(pool_ptr, table_row_ptr, n_low, part, num_parts, q_row_ptr, qk_scale,
                                 prob_row_ptr, page_max_row_ptr, part_acc_ptr, slot + 1, R, True, PAGE_BYTES, PMAX,
                                 L_TOKENS, L_PPI, L_BLOCK_T, L_KB, L_KG, L_VB, L_VG, L_KC,
                                 L_KM, L_VC, L_VM, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, DT, IEEE, STORE_PROBS)
        hp = tl.arange(0, GROUP_PAD)  # one chunk (NCHUNK == 1, h0 == 0): the whole group
        tl.store(part_m_ptr + (slot + 1) * GROUP_PAD + hp, m)
        tl.store(part_l_ptr + (slot + 1) * GROUP_PAD + hp, l)


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
    e = tl.load(prob_ptr + ((rs.to(tl.int64) * R + pos[:, None, None]) * GROUP + h[None, None, :]) * PMAX
                + t[None, :, None], mask=tok_ok[:, :, None] & (h[None, None, :] < GROUP), other=0.0)
    prob = tl.max(e.to(tl.float32) * factor[:, None, :], axis=2)  # [P, T]
    sc = tl.where(is_high, H_SC, L_SC)
    score_ptr = (pool_ptr + page * PAGE_BYTES + sc)[:, None].to(tl.pointer_type(tl.float32)) + t[None, :]
    old = tl.load(score_ptr, mask=tok_ok, other=0.0)
    tl.store(score_ptr, old + prob, mask=tok_ok)
