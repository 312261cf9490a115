"""GPU page manager: parallel allocation and reclamation with prefix sums (Triton).

Same API and bit-identical results as :class:`~.page_manager.CpuPageManager`
(see that module for the state, the workflows and the canonical order); the
state lives in device tensors and every call is two or three Triton launches,
with no host synchronization and no Python loop over requests, layers or heads:

1. ``_count_kernel`` (grid: one program per block of items): each item (one
   row of one listed slot) states how many pages it takes (reserve, decode) or
   gives back (commit, release) and flags invalid input or row overflow; the
   program writes its block's sum and flags. A slot listed twice is invalid:
   each slot's first row claims it with an atomic increment of ``claim[slot]``
   and a row that finds the counter already raised flags the call.
2. ``_scan_kernel`` (one program): exclusive prefix sum over the block sums,
   the total checked against the free count (allocation) and the flags; then
   either commits by moving the ring's start (allocate) or end (reclaim)
   pointer by the total, or changes nothing and raises status bits. It writes
   a ``go`` flag and the old pointer for step 3. When the block sums fit in one
   chunk (``scan_chunk`` blocks: every decode step up to 512 requests x 1024
   rows), step 3's programs each do this scan themselves and the launch is
   skipped (see ``_slice``).
3. ``_*_apply_kernel`` (grid as in 1): if ``go``, each item recomputes its count,
   adds the in-block exclusive prefix sum to its block's offset, and so owns
   the disjoint ring slice ``[base + offset, base + offset + count)`` (mod
   ``num_pages``): it copies page ids between that slice and its table row
   and updates its counters. Whether or not ``go``, it zeroes the ``claim``
   counters step 1 raised, so they are all zero between calls.

The one device-to-host read of a step is :meth:`TritonPageManager.read_status`
(24 bytes: ring start, ring end, status bits), called by the executor once per
step after the step's bookkeeping: it tells whether any call ran out of pages
and the exact free count the scheduler admits against in the next step (the
paper's scheduler corrects its conservative admission "from the true free
count measured after each step"). With admission within that count (prompt:
:meth:`reserve_pages_needed`, decode: :meth:`worst_case_decode_pages`), no call
can run out of pages, so the read need not block the step that issued it.

Argument values, distinct slot ids included, are checked on the device
(status bit ``INVALID``, nothing changes); with ``validate=True`` every check
of the CPU implementation runs on host copies first and raises ``ValueError``
(costs synchronizations; for tests/debugging).

Runs under ``TRITON_INTERPRET=1`` on CPU tensors (``device="cpu"``) for CI.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .page_format import PageFormat
from .page_manager import PageManager, PageStatus, PageTableSnapshot, StepStatus

OP_RESERVE, OP_COMMIT, OP_DECODE, OP_RELEASE = 0, 1, 2, 3
ROW_BLOCK = 16  # items per program for the ops that copy whole rows (reserve, commit, release)
DECODE_BLOCK = 512  # items per program for decode (at most two pages per item)
ROW_CHUNK = 128  # table positions per inner-loop iteration
SCAN_CHUNK = 1024  # block sums per iteration of the scan (calls with at most this many blocks: no scan launch)


@triton.jit
def _items(pid, slots_ptr, n_items, G, S, BLOCK: tl.constexpr):
    """Item ids of program ``pid`` and their slot index, slot id, table row and masks."""
    items = pid * BLOCK + tl.arange(0, BLOCK)
    mask = items < n_items
    slot_idx = items // G
    slot = tl.load(slots_ptr + slot_idx, mask=mask, other=0).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < S)
    row = tl.where(slot_ok, slot, 0) * G + (items % G)
    return items, mask, slot_idx, slot, slot_ok, row


@triton.jit
def _splat(flag, like):
    """Scalar bool ``flag`` as a bool tensor shaped like ``like`` (Triton 3.9's interpreter
    mistypes ``tensor & scalar`` masks, 'mask has unsupported dtype')."""
    return (tl.zeros_like(like).to(tl.int32) + flag.to(tl.int32)) != 0


@triton.jit
def _claims(items, mask, slot_ok, G):
    """Items whose slot they claim (or unclaim): the first row of each listed in-range slot."""
    return mask & slot_ok & (items % G == 0)


@triton.jit
def _slot_state(state_ptr, slot, ok, CHECK: tl.constexpr):
    """Slot states for the checks of step 1; step 3 skips the read (it may race with step 3's own writes)."""
    if CHECK:
        return tl.load(state_ptr + slot, mask=ok, other=-1)
    else:
        return tl.zeros_like(slot)


@triton.jit
def _reserve_counts(items, mask, slot_idx, slot, slot_ok, prompt_ptr, state_ptr, R, P_MIN, CHECK: tl.constexpr):
    """Pages reserved per row, ceil(prompt / P_MIN) + 1, and per-item invalid / row-full flags."""
    n_tok = tl.load(prompt_ptr + slot_idx, mask=mask, other=1).to(tl.int64)
    state = _slot_state(state_ptr, slot, mask & slot_ok, CHECK)
    count = tl.where(mask, (n_tok + P_MIN - 1) // P_MIN + 1, 0)
    invalid = mask & ((~slot_ok) | (state != 0) | (n_tok < 1))
    full = mask & (count > R)
    return count, invalid, full


@triton.jit
def _commit_counts(items, mask, slot, slot_ok, row, high_ptr, low_ptr, state_ptr, pages_ptr, P_HIGH, P_LOW,
                   CHECK: tl.constexpr):
    """Per row: tokens, kept high and low pages, reserved pages, surplus pages returned; invalid flags."""
    ok = mask & slot_ok
    h = tl.load(high_ptr + items, mask=mask, other=0).to(tl.int64)
    l = tl.load(low_ptr + items, mask=mask, other=0).to(tl.int64)
    state = _slot_state(state_ptr, slot, ok, CHECK)
    reserved = tl.load(pages_ptr + row * 2, mask=ok, other=0).to(tl.int64)
    kh = (h + P_HIGH - 1) // P_HIGH
    kl = (l + P_LOW - 1) // P_LOW
    surplus = tl.where(mask, reserved - kh - kl, 0)
    invalid = mask & ((~slot_ok) | (state != 1) | (h < 0) | (l < 0) | (surplus < 0))
    return h, l, kh, kl, reserved, surplus, invalid


@triton.jit
def _decode_counts(items, mask, slot, slot_ok, row, dh_ptr, dl_ptr, state_ptr, pages_ptr, tokens_ptr, R, P_HIGH, P_LOW,
                   CHECK: tl.constexpr):
    """Per row: new token counts, pages held, whether each tier takes a page; invalid / row-full flags."""
    ok = mask & slot_ok
    dh = tl.load(dh_ptr + items, mask=mask, other=0).to(tl.int64)
    dl = tl.load(dl_ptr + items, mask=mask, other=0).to(tl.int64)
    state = _slot_state(state_ptr, slot, ok, CHECK)
    nh = tl.load(pages_ptr + row * 2, mask=ok, other=0).to(tl.int64)
    nl = tl.load(pages_ptr + row * 2 + 1, mask=ok, other=0).to(tl.int64)
    h = tl.load(tokens_ptr + row * 2, mask=ok, other=0).to(tl.int64) + dh
    l = tl.load(tokens_ptr + row * 2 + 1, mask=ok, other=0).to(tl.int64) + dl
    need_h = tl.where(mask, (h > nh * P_HIGH).to(tl.int64), 0)
    need_l = tl.where(mask, (l > nl * P_LOW).to(tl.int64), 0)
    bad_delta = (dh < -1) | (dh > 1) | (dl < -1) | (dl > 1)
    invalid = mask & ((~slot_ok) | (state != 2) | bad_delta | (h < 0) | (l < 0))
    full = mask & (nh + need_h + nl + need_l > R)
    return h, l, nh, nl, need_h, need_l, invalid, full


@triton.jit
def _count_kernel(
    slots_ptr, a_ptr, b_ptr, state_ptr, pages_ptr, tokens_ptr, block_sum_ptr, block_flag_ptr, ring_state_ptr, ctrl_ptr,
    claim_ptr, n_items, G, S, R, P_HIGH, P_LOW, P_MIN,
    OP: tl.constexpr, BLOCK: tl.constexpr,
):
    """Step 1: per-block page counts (taken or given back) and status flags; program 0 copies the ring state."""
    pid = tl.program_id(0)
    r = tl.arange(0, 4)
    tl.store(ctrl_ptr + 2 + r, tl.load(ring_state_ptr + r, mask=r < 3, other=0), mask=(r < 3) & _splat(pid == 0, r))
    items, mask, slot_idx, slot, slot_ok, row = _items(pid, slots_ptr, n_items, G, S, BLOCK)
    claims = _claims(items, mask, slot_ok, G)
    duplicate = claims & (tl.atomic_add(claim_ptr + slot, 1, mask=claims) != 0)  # slot listed before
    full = mask & False
    if OP == 0:
        count, invalid, full = _reserve_counts(items, mask, slot_idx, slot, slot_ok, a_ptr, state_ptr, R, P_MIN, True)
    elif OP == 1:
        _h, _l, _kh, _kl, _res, count, invalid = _commit_counts(
            items, mask, slot, slot_ok, row, a_ptr, b_ptr, state_ptr, pages_ptr, P_HIGH, P_LOW, True)
    elif OP == 2:
        _h, _l, _nh, _nl, need_h, need_l, invalid, full = _decode_counts(
            items, mask, slot, slot_ok, row, a_ptr, b_ptr, state_ptr, pages_ptr, tokens_ptr, R, P_HIGH, P_LOW, True)
        count = need_h + need_l
    else:
        ok = mask & slot_ok
        count = (tl.load(pages_ptr + row * 2, mask=ok, other=0) + tl.load(pages_ptr + row * 2 + 1, mask=ok, other=0)).to(tl.int64)
        invalid = mask & ~slot_ok
    invalid = invalid | duplicate
    count = tl.where(invalid, 0, count)  # an invalid call commits nothing; keep its total meaningful
    flags = tl.max(invalid.to(tl.int32), 0) * 4 + tl.max(full.to(tl.int32), 0) * 2
    tl.store(block_sum_ptr + pid, tl.sum(count, 0))
    tl.store(block_flag_ptr + pid, flags)


@triton.jit
def _decide(total, flags, start, end, status, ALLOC: tl.constexpr):
    """Commit or refuse a call: (go, base pointer of its ring slice, new start, new end, new status)."""
    err = flags.to(tl.int64)
    if ALLOC:
        err = err | (total > end - start).to(tl.int64)
    go = err == 0
    if ALLOC:
        return go, start, tl.where(go, start + total, start), end, status | err
    else:
        return go, end, start, tl.where(go, end + total, end), status | err


@triton.jit
def _scan_kernel(
    block_sum_ptr, block_flag_ptr, block_off_ptr, ring_state_ptr, ctrl_ptr, num_blocks,
    ALLOC: tl.constexpr, CHUNK: tl.constexpr,
):
    """Step 2 (one program, used when there are more blocks than one chunk): exclusive scan of
    the block sums, free-count check, pointer update."""
    carry = tl.zeros((), tl.int64)
    flags = tl.zeros((), tl.int32)
    for c in range(0, num_blocks, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        m = offs < num_blocks
        s = tl.load(block_sum_ptr + offs, mask=m, other=0)
        tl.store(block_off_ptr + offs, carry + tl.cumsum(s, 0) - s, mask=m)
        carry += tl.sum(s, 0)
        f = tl.load(block_flag_ptr + offs, mask=m, other=0)
        flags = flags | tl.max(f & 4, 0) | tl.max(f & 2, 0)
    go, base, start, end, status = _decide(
        carry, flags, tl.load(ring_state_ptr), tl.load(ring_state_ptr + 1), tl.load(ring_state_ptr + 2), ALLOC)
    tl.store(ctrl_ptr, go.to(tl.int64))
    tl.store(ctrl_ptr + 1, base)
    tl.store(ring_state_ptr, start)
    tl.store(ring_state_ptr + 1, end)
    tl.store(ring_state_ptr + 2, status)


@triton.jit
def _slice(count, mask, pid, block_sum_ptr, block_flag_ptr, block_off_ptr, ctrl_ptr, ring_state_ptr, num_blocks,
           FUSED: tl.constexpr, ALLOC: tl.constexpr, CHUNK: tl.constexpr):
    """Each item's offset into the call's ring slice (exclusive prefix), the slice base, and go.

    FUSED (all block sums fit in one chunk): every program scans the block sums
    itself and program 0 updates the ring state, saving the scan launch; the
    ring state was copied to ``ctrl[2:5]`` by step 1, so no program reads what
    program 0 writes. Otherwise ``_scan_kernel`` left offsets and go/base.
    """
    if FUSED:
        offs = tl.arange(0, CHUNK)
        m = offs < num_blocks
        sums = tl.load(block_sum_ptr + offs, mask=m, other=0)
        f = tl.load(block_flag_ptr + offs, mask=m, other=0)
        go, base, start, end, status = _decide(
            tl.sum(sums, 0), tl.max(f & 4, 0) | tl.max(f & 2, 0),
            tl.load(ctrl_ptr + 2), tl.load(ctrl_ptr + 3), tl.load(ctrl_ptr + 4), ALLOC)
        first = pid == 0
        tl.store(ring_state_ptr, start, mask=first)
        tl.store(ring_state_ptr + 1, end, mask=first)
        tl.store(ring_state_ptr + 2, status, mask=first)
        prefix = tl.sum(tl.where(offs < pid, sums, 0), 0)
    else:
        go = tl.load(ctrl_ptr) != 0
        base = tl.load(ctrl_ptr + 1)
        prefix = tl.load(block_off_ptr + pid)
    mask = mask & _splat(go, mask)
    count = tl.where(mask, count, 0)
    offset = prefix + tl.cumsum(count, 0) - count
    return offset, base, mask, count


@triton.jit
def _unclaim(claim_ptr, items, mask, slot, slot_ok, G):
    """Step 3, go or not: zero the claim counters step 1 raised (no program of step 3 reads them)."""
    claims = _claims(items, mask, slot_ok, G)
    tl.store(claim_ptr + slot, tl.zeros_like(slot).to(tl.int32), mask=claims)


@triton.jit
def _finish_rows(mask, row, slot, items, pages_ptr, tokens_ptr, state_ptr, nh, nl, h, l, G, NEW_STATE: tl.constexpr):
    tl.store(pages_ptr + row * 2, nh.to(tl.int32), mask=mask)
    tl.store(pages_ptr + row * 2 + 1, nl.to(tl.int32), mask=mask)
    tl.store(tokens_ptr + row * 2, h.to(tl.int32), mask=mask)
    tl.store(tokens_ptr + row * 2 + 1, l.to(tl.int32), mask=mask)
    tl.store(state_ptr + slot, tl.full(items.shape, NEW_STATE, tl.int32), mask=mask & (items % G == 0))


@triton.jit
def _reserve_apply_kernel(
    slots_ptr, prompt_ptr, state_ptr, pages_ptr, tokens_ptr, table_ptr, ring_ptr,
    block_sum_ptr, block_flag_ptr, block_off_ptr, ctrl_ptr, ring_state_ptr, claim_ptr,
    n_items, num_blocks, G, S, R, P_MIN, num_pages,
    BLOCK: tl.constexpr, RCHUNK: tl.constexpr, FUSED: tl.constexpr, CHUNK: tl.constexpr,
):
    """Step 3, prompt reservation: table positions [0, count) take ring slice ids."""
    pid = tl.program_id(0)
    items, mask, slot_idx, slot, slot_ok, row = _items(pid, slots_ptr, n_items, G, S, BLOCK)
    _unclaim(claim_ptr, items, mask, slot, slot_ok, G)
    count, _inv, _full = _reserve_counts(items, mask, slot_idx, slot, slot_ok, prompt_ptr, state_ptr, R, P_MIN, False)
    offset, base, mask, count = _slice(count, mask, pid, block_sum_ptr, block_flag_ptr, block_off_ptr, ctrl_ptr,
                                       ring_state_ptr, num_blocks, FUSED, True, CHUNK)
    row_ptr = table_ptr + row * R
    for p0 in range(0, tl.max(count, 0), RCHUNK):
        p = p0 + tl.arange(0, RCHUNK)
        m2 = mask[:, None] & (p[None, :] < count[:, None])
        ids = tl.load(ring_ptr + (base + offset[:, None] + p[None, :]) % num_pages, mask=m2)
        tl.store(row_ptr[:, None] + p[None, :], ids, mask=m2)
    zero = tl.zeros_like(count)
    _finish_rows(mask, row, slot, items, pages_ptr, tokens_ptr, state_ptr, count, zero, zero, zero, G, 1)


@triton.jit
def _commit_apply_kernel(
    slots_ptr, high_ptr, low_ptr, state_ptr, pages_ptr, tokens_ptr, table_ptr, ring_ptr,
    block_sum_ptr, block_flag_ptr, block_off_ptr, ctrl_ptr, ring_state_ptr, claim_ptr,
    n_items, num_blocks, G, S, R, P_HIGH, P_LOW, num_pages,
    BLOCK: tl.constexpr, RCHUNK: tl.constexpr, FUSED: tl.constexpr, CHUNK: tl.constexpr,
):
    """Step 3, prompt commit: surplus [kh, C-kl) to the ring, [C-kl, C) shifted to [R-kl, R), rest -1."""
    pid = tl.program_id(0)
    items, mask, slot_idx, slot, slot_ok, row = _items(pid, slots_ptr, n_items, G, S, BLOCK)
    _unclaim(claim_ptr, items, mask, slot, slot_ok, G)
    h, l, kh, kl, reserved, surplus, _inv = _commit_counts(
        items, mask, slot, slot_ok, row, high_ptr, low_ptr, state_ptr, pages_ptr, P_HIGH, P_LOW, False)
    offset, base, mask, surplus = _slice(surplus, mask, pid, block_sum_ptr, block_flag_ptr, block_off_ptr, ctrl_ptr,
                                         ring_state_ptr, num_blocks, FUSED, False, CHUNK)
    row_ptr = table_ptr + row * R
    for j0 in range(0, tl.max(surplus, 0), RCHUNK):  # surplus pages, in position order
        j = j0 + tl.arange(0, RCHUNK)
        m2 = mask[:, None] & (j[None, :] < surplus[:, None])
        ids = tl.load(row_ptr[:, None] + kh[:, None] + j[None, :], mask=m2)
        tl.store(ring_ptr + (base + offset[:, None] + j[None, :]) % num_pages, ids, mask=m2)
    shift = R - reserved  # memmove right by shift >= 0: go from the right end, loads before stores
    kl_move = tl.where(mask & (shift > 0), kl, 0)
    for j0 in range(0, tl.max(kl_move, 0), RCHUNK):
        j = j0 + tl.arange(0, RCHUNK)
        m2 = j[None, :] < kl_move[:, None]
        ids = tl.load(row_ptr[:, None] + (reserved[:, None] - 1 - j[None, :]), mask=m2)
        tl.debug_barrier()
        tl.store(row_ptr[:, None] + (R - 1 - j[None, :]), ids, mask=m2)
        tl.debug_barrier()
    tl.debug_barrier()
    clear_end = tl.minimum(reserved, R - kl)
    clear = tl.where(mask, clear_end - kh, 0)
    for j0 in range(0, tl.max(clear, 0), RCHUNK):
        j = j0 + tl.arange(0, RCHUNK)
        m2 = j[None, :] < clear[:, None]
        tl.store(row_ptr[:, None] + kh[:, None] + j[None, :], tl.full(m2.shape, -1, tl.int32), mask=m2)
    _finish_rows(mask, row, slot, items, pages_ptr, tokens_ptr, state_ptr, kh, kl, h, l, G, 2)


@triton.jit
def _decode_apply_kernel(
    slots_ptr, dh_ptr, dl_ptr, state_ptr, pages_ptr, tokens_ptr, table_ptr, ring_ptr,
    block_sum_ptr, block_flag_ptr, block_off_ptr, ctrl_ptr, ring_state_ptr, claim_ptr,
    n_items, num_blocks, G, S, R, P_HIGH, P_LOW, num_pages,
    BLOCK: tl.constexpr, FUSED: tl.constexpr, CHUNK: tl.constexpr,
):
    """Step 3, decode: a high page at position nh, a low page at R-1-nl, counters updated."""
    pid = tl.program_id(0)
    items, mask, slot_idx, slot, slot_ok, row = _items(pid, slots_ptr, n_items, G, S, BLOCK)
    _unclaim(claim_ptr, items, mask, slot, slot_ok, G)
    h, l, nh, nl, need_h, need_l, _inv, _full = _decode_counts(
        items, mask, slot, slot_ok, row, dh_ptr, dl_ptr, state_ptr, pages_ptr, tokens_ptr, R, P_HIGH, P_LOW, False)
    offset, base, mask, _count = _slice(need_h + need_l, mask, pid, block_sum_ptr, block_flag_ptr, block_off_ptr,
                                        ctrl_ptr, ring_state_ptr, num_blocks, FUSED, True, CHUNK)
    m_h = mask & (need_h > 0)
    m_l = mask & (need_l > 0)
    id_h = tl.load(ring_ptr + (base + offset) % num_pages, mask=m_h)
    id_l = tl.load(ring_ptr + (base + offset + need_h) % num_pages, mask=m_l)
    tl.store(table_ptr + row * R + nh, id_h, mask=m_h)
    tl.store(table_ptr + row * R + (R - 1 - nl), id_l, mask=m_l)
    _finish_rows(mask, row, slot, items, pages_ptr, tokens_ptr, state_ptr, nh + need_h, nl + need_l, h, l, G, 2)


@triton.jit
def _release_apply_kernel(
    slots_ptr, state_ptr, pages_ptr, tokens_ptr, table_ptr, ring_ptr,
    block_sum_ptr, block_flag_ptr, block_off_ptr, ctrl_ptr, ring_state_ptr, claim_ptr,
    n_items, num_blocks, G, S, R, num_pages,
    BLOCK: tl.constexpr, RCHUNK: tl.constexpr, FUSED: tl.constexpr, CHUNK: tl.constexpr,
):
    """Step 3, release: high pages then low pages (token order) to the ring; row cleared."""
    pid = tl.program_id(0)
    items, mask, slot_idx, slot, slot_ok, row = _items(pid, slots_ptr, n_items, G, S, BLOCK)
    _unclaim(claim_ptr, items, mask, slot, slot_ok, G)
    ok = mask & slot_ok
    nh = tl.load(pages_ptr + row * 2, mask=ok, other=0).to(tl.int64)
    nl = tl.load(pages_ptr + row * 2 + 1, mask=ok, other=0).to(tl.int64)
    offset, base, mask, _count = _slice(nh + nl, mask, pid, block_sum_ptr, block_flag_ptr, block_off_ptr, ctrl_ptr,
                                        ring_state_ptr, num_blocks, FUSED, False, CHUNK)
    nh = tl.where(mask, nh, 0)
    nl = tl.where(mask, nl, 0)
    row_ptr = table_ptr + row * R
    for j0 in range(0, tl.max(nh, 0), RCHUNK):
        j = j0 + tl.arange(0, RCHUNK)
        m2 = j[None, :] < nh[:, None]
        ids = tl.load(row_ptr[:, None] + j[None, :], mask=m2)
        tl.store(ring_ptr + (base + offset[:, None] + j[None, :]) % num_pages, ids, mask=m2)
        tl.store(row_ptr[:, None] + j[None, :], tl.full(m2.shape, -1, tl.int32), mask=m2)
    for j0 in range(0, tl.max(nl, 0), RCHUNK):
        j = j0 + tl.arange(0, RCHUNK)
        m2 = j[None, :] < nl[:, None]
        ids = tl.load(row_ptr[:, None] + (R - 1 - j[None, :]), mask=m2)
        tl.store(ring_ptr + (base + offset[:, None] + nh[:, None] + j[None, :]) % num_pages, ids, mask=m2)
        tl.store(row_ptr[:, None] + (R - 1 - j[None, :]), tl.full(m2.shape, -1, tl.int32), mask=m2)
    zero = tl.zeros_like(nh)
    _finish_rows(mask, row, slot, items, pages_ptr, tokens_ptr, state_ptr, zero, zero, zero, zero, G, 0)


class TritonPageManager(PageManager):
    """The page manager on the GPU: state in device tensors, each call two or three Triton launches.

    Args:
        page_format, num_pages, max_slots, num_layers, num_kv_heads,
        max_seq_len_tokens: as :class:`~.page_manager.PageManager`.
        device: where the state lives (``"cuda"``; ``"cpu"`` only under
            ``TRITON_INTERPRET=1``).
        validate: run the CPU implementation's value checks on host copies
            before each call and raise ``ValueError`` (synchronizes; tests).
        row_block, decode_block, row_chunk, scan_chunk: launch shape (powers
            of two): items per program of the row-copying calls and of
            decode, table positions per inner iteration, block sums per scan
            iteration (calls with at most this many blocks skip the scan
            launch). Defaults suit the GPU; tests shrink them to cover the
            multi-block and multi-chunk paths on small problems.

    Device state (all allocated once here): ``ring`` int32 ``[num_pages]``;
    ``ring_state`` int64 ``[3]`` = (start, end, status bits); ``page_table`` int32
    ``[max_slots * rows_per_slot, max_pages_per_row]``; ``pages`` and ``tokens``
    int32 ``[rows, 2]``; ``slot_state`` int32 ``[max_slots]``; plus scan scratch and
    ``claim`` int32 ``[max_slots]`` (duplicate-slot detection, all zero between calls).
    No call allocates device memory, so calls can be captured in a CUDA graph
    when their inputs are fixed device tensors.
    """

    def __init__(
        self,
        page_format: PageFormat,
        num_pages: int,
        max_slots: int,
        num_layers: int,
        num_kv_heads: int,
        max_seq_len_tokens: int,
        device: str | torch.device = "cuda",
        validate: bool = False,
        row_block: int = ROW_BLOCK,
        decode_block: int = DECODE_BLOCK,
        row_chunk: int = ROW_CHUNK,
        scan_chunk: int = SCAN_CHUNK,
    ) -> None:
        super().__init__(page_format, num_pages, max_slots, num_layers, num_kv_heads, max_seq_len_tokens)
        for name, value in (("row_block", row_block), ("decode_block", decode_block),
                            ("row_chunk", row_chunk), ("scan_chunk", scan_chunk)):
            if value < 2 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 2")
        self.row_block, self.decode_block = row_block, decode_block
        self.row_chunk, self.scan_chunk = row_chunk, scan_chunk
        self.device = torch.device(device)
        self._validate_values = validate
        rows = max_slots * self.rows_per_slot
        dev = dict(device=self.device)
        self.ring = torch.arange(num_pages, dtype=torch.int32, **dev)
        self.ring_state = torch.tensor([0, num_pages, 0], dtype=torch.int64, **dev)
        self.page_table = torch.full((rows, self.max_pages_per_row), -1, dtype=torch.int32, **dev)
        self.pages = torch.zeros(rows, 2, dtype=torch.int32, **dev)
        self.tokens = torch.zeros(rows, 2, dtype=torch.int32, **dev)
        self.slot_state = torch.zeros(max_slots, dtype=torch.int32, **dev)
        max_blocks = triton.cdiv(rows, min(row_block, decode_block))
        self._block_sum = torch.zeros(max_blocks, dtype=torch.int64, **dev)
        self._block_flag = torch.zeros(max_blocks, dtype=torch.int32, **dev)
        self._block_off = torch.zeros(max_blocks, dtype=torch.int64, **dev)
        self._ctrl = torch.zeros(8, dtype=torch.int64, **dev)  # go, base, copy of (start, end, status)
        self._claim = torch.zeros(max_slots, dtype=torch.int32, **dev)  # times listed in this call; 0 between calls

    # ----------------------------------------------------------- launches
    def _launch(self, op: int, apply_kernel, slots, inputs: tuple, op_ints: tuple, block: int, alloc: bool,
                **constexprs) -> None:
        """Steps 1-3 for one call: count, scan (only when the block sums exceed one chunk), apply."""
        n_items = slots.numel() * self.rows_per_slot
        num_blocks = triton.cdiv(n_items, block)
        a, b = (inputs + (slots, slots))[:2]
        _count_kernel[(num_blocks,)](
            slots, a, b, self.slot_state, self.pages, self.tokens, self._block_sum, self._block_flag,
            self.ring_state, self._ctrl, self._claim, n_items, self.rows_per_slot, self.max_slots, self.max_pages_per_row,
            self.high_tokens_per_page, self.low_tokens_per_page, self.page_format.min_tokens_per_page,
            OP=op, BLOCK=block,
        )
        fused = num_blocks <= self.scan_chunk
        if not fused:
            _scan_kernel[(1,)](
                self._block_sum, self._block_flag, self._block_off, self.ring_state, self._ctrl, num_blocks,
                ALLOC=alloc, CHUNK=self.scan_chunk,
            )
        apply_kernel[(num_blocks,)](
            slots, *inputs, self.slot_state, self.pages, self.tokens, self.page_table, self.ring,
            self._block_sum, self._block_flag, self._block_off, self._ctrl, self.ring_state, self._claim,
            n_items, num_blocks, self.rows_per_slot, self.max_slots, self.max_pages_per_row, *op_ints, self.num_pages,
            BLOCK=block, FUSED=fused, CHUNK=self.scan_chunk, **constexprs,
        )

    def _reserve(self, slots, prompt) -> None:
        self._launch(OP_RESERVE, _reserve_apply_kernel, slots, (prompt,), (self.page_format.min_tokens_per_page,),
                     self.row_block, True, RCHUNK=self.row_chunk)

    def _commit(self, slots, high, low) -> None:
        self._launch(OP_COMMIT, _commit_apply_kernel, slots, (high, low),
                     (self.high_tokens_per_page, self.low_tokens_per_page), self.row_block, False, RCHUNK=self.row_chunk)

    def _decode(self, slots, dh, dl) -> None:
        self._launch(OP_DECODE, _decode_apply_kernel, slots, (dh, dl),
                     (self.high_tokens_per_page, self.low_tokens_per_page), self.decode_block, True)

    def _release(self, slots) -> None:
        self._launch(OP_RELEASE, _release_apply_kernel, slots, (), (), self.row_block, False, RCHUNK=self.row_chunk)

    # ----------------------------------------------------------- state access
    def _host_state(self, slots):
        host = slots.cpu().to(torch.int64)
        rows = self._rows(host).to(self.device)
        return self.slot_state[host.to(self.device)].cpu(), self.pages[rows].cpu(), self.tokens[rows].cpu()

    def read_status(self) -> StepStatus:
        start, end, status = self.ring_state.tolist()  # the one device-to-host read of a step
        self.ring_state[2] = 0
        return StepStatus(PageStatus(status), end - start)

    def snapshot_counters(self) -> tuple[int, int, int]:
        start, end, status = self.ring_state.tolist()
        return start, end, status

    def snapshot(self) -> PageTableSnapshot:
        shape = (self.max_slots, self.num_layers, self.num_kv_heads)
        start, end, status = self.ring_state.tolist()
        return PageTableSnapshot(
            ring=self.ring.cpu(),
            ring_start=start,
            ring_end=end,
            page_table=self.page_table.reshape(*shape, -1).cpu(),
            pages=self.pages.reshape(*shape, 2).cpu(),
            tokens=self.tokens.reshape(*shape, 2).cpu(),
            slot_state=self.slot_state.cpu(),
            status=status,
        )

    def load_snapshot(self, snapshot: PageTableSnapshot) -> None:
        self.ring.copy_(snapshot.ring)
        self.ring_state.copy_(torch.tensor([snapshot.ring_start, snapshot.ring_end, snapshot.status], dtype=torch.int64))
        self.page_table.copy_(snapshot.page_table.reshape(self.page_table.shape))
        self.pages.copy_(snapshot.pages.reshape(-1, 2))
        self.tokens.copy_(snapshot.tokens.reshape(-1, 2))
        self.slot_state.copy_(snapshot.slot_state)
        self._claim.zero_()
