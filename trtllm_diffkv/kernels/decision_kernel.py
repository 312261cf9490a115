"""The decode step's bookkeeping in two Triton launches: the DiffKV decisions and the token locations.

:func:`decide_rows` computes what :func:`trtllm_diffkv.paged.decisions.decide`
computes (the reference and the torch fallback; its docstring states the
rules, paper section 4.2) for every (sequence, layer, KV head) row of a decode
step. One program takes ``ROWS`` consecutive rows of one sequence
(:data:`ROWS_PER_PROGRAM`; a layer's KV heads with ``ROWS = num_kv_heads``) as
one ``[ROWS, BLOCK]`` tile per loop iteration: it walks the rows' high tiers
(page table -> page -> position and score segments) to find each row's
candidate (the token at position ``pos - max(W, 1)``) and least important
high token at positions ``<= cand``, then their low tiers for the least
important low token, and writes the rows' :class:`StepActions`. Each tile
element keeps its own running state and the rows reduce once after the loop
(issue 19: reductions inside the loop held the kernel at ~10 % of the copy
bandwidth, 0.92 ms per step at Llama-3-8B 48 x 4096 on the H200).
Results are
bit-identical to the reference: importance ``score / count`` is an IEEE fp32
division (``div_rn``), thresholds ``alpha / N`` are divided in fp64 and rounded
to fp32 (the alphas come in an fp64 tensor: a Python float argument would be
rounded to fp32 first), ties go to the lowest position, and a NaN importance
among the eligible tokens gives what ``torch.amin`` gives (NaN, column 0).
For a preset that keeps every token (fp16) the same launch writes
``decisions.append_only``'s actions. Rows of sliding-window layers (``layer_windows``) are
not scanned: they get ``decisions.slide_windows``'s actions (the window's ring slot).

:func:`locate_rows` (after the page manager's ``append_decode``, which may
give a row the page its new token goes to) turns the actions into page ids and
slots: the new token's high slot, written layer-major into the step buffers
the layers read (padding sequences ``b >= n`` of a bucket get page -1 and row
id -1, which every decode kernel skips), and the source/destination of each
move to the low tier.

Layouts: ``G = num_layers * num_kv_heads`` rows per sequence slot; table row
``slot * G + layer * num_kv_heads + head``; item ``i = b * G + g`` of a step
is sequence ``b``'s ``g``-th row (the page manager's ``[n, num_layers,
num_kv_heads]`` order). Pool offsets: :class:`~trtllm_diffkv.memory.PageFormat`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..memory.page_format import PageFormat

BLOCK_TOKENS = 128
"""Tier tokens per row one loop iteration of :func:`_decide_kernel` reads."""
ROWS_PER_PROGRAM = 1
"""Rows one :func:`_decide_kernel` program takes by default. H200, Llama-3-8B 48 x 4096 (12288 rows of 4096
tokens; ``tools/sweep_kv_gpu.py``, 2026-12-02): 370 us at 1 row and 128-token blocks, 452 us at 4, 472 us at
8 rows of 64 tokens, 1008 us at 8 rows of 128 (the per-element state no longer fits the registers); the
earlier kernel with reductions inside the loop took 1062 us (one row) to 767 us (4 rows)."""
DECIDE_WARPS = 4
"""Warps of a :func:`_decide_kernel` program (8: 531 us against 472 at 8 rows of 64 tokens, same sweep)."""
LOCATE_BLOCK = 256
"""Items per program of :func:`_locate_kernel`."""
_BIG = 2 ** 31 - 1  # larger than every position and column


@triton.jit
def _scan_tier(f32_ptr, i32_ptr, table_ptr, row, count, live, cand, prompt_len, pos, R, PAGE_BYTES, SC, PO, S,
               TOKENS: tl.constexpr, LOW: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """One tier of ``ROWS`` rows of one sequence (``row``, ``count``, ``live``: ``[ROWS]``): per row the least
    important eligible token and the candidate.

    Eligible: every token of the low tier; high-tier tokens at positions ``<= cand``. The rows' tokens are read
    as one ``[ROWS, BLOCK]`` tile per loop iteration (up to the longest row's count); each tile element keeps
    its own running state (least (importance, position, column), NaN seen, first candidate column) and the
    rows are reduced once after the loop: the loop body is loads and elementwise arithmetic only (reductions
    inside it, several block-wide ones per iteration, bounded the kernel far below the memory bandwidth).
    Returns ``[ROWS]`` tensors ``(least importance, its column, candidate found, candidate column, candidate
    importance)``; least importance is NaN when an eligible importance is NaN and +inf when none is eligible;
    the column is then 0 (``decisions._argmin_importance``). The candidate is the first column holding
    position ``cand`` (``decisions.decide``'s ``argmax``).
    """
    BIG: tl.constexpr = 2147483647
    b_imp = tl.zeros((ROWS, BLOCK), tl.float32) + float("inf")
    b_pos = tl.zeros((ROWS, BLOCK), tl.int32) + BIG
    b_col = tl.zeros((ROWS, BLOCK), tl.int32) + BIG
    nan = tl.zeros((ROWS, BLOCK), tl.int32)
    h_col = tl.zeros((ROWS, BLOCK), tl.int32) + BIG
    h_imp = tl.zeros((ROWS, BLOCK), tl.float32)
    n_max = tl.max(tl.where(live, count, 0), 0)
    for start in range(0, n_max, BLOCK):
        j = start + tl.arange(0, BLOCK).to(tl.int64)[None, :]
        valid = live[:, None] & (j < count[:, None])
        blk = j // TOKENS
        if LOW:
            blk = R - 1 - blk
        page = tl.load(table_ptr + row[:, None] * R + blk, mask=valid, other=0).to(tl.int64)
        base = tl.where(valid, page, 0) * PAGE_BYTES
        slot = j % TOKENS
        p = tl.load(i32_ptr + (base + PO) // 4 + slot, mask=valid, other=0).to(tl.int64)
        score = tl.load(f32_ptr + (base + SC) // 4 + slot, mask=valid, other=0.0)
        from_prompt = tl.where(p < prompt_len, tl.minimum(prompt_len - p, S), 0)
        from_decode = tl.maximum(pos - tl.maximum(p, prompt_len), 0)
        counted = tl.maximum((from_prompt + from_decode).to(tl.float32), 1.0)
        imp = tl.math.div_rn(score, counted)
        j32 = j.to(tl.int32)
        p32 = p.to(tl.int32)
        if LOW:
            elig = valid
        else:
            elig = valid & (p <= cand)
            first_hit = valid & (p == cand) & (h_col == BIG)
            h_col = tl.where(first_hit, j32, h_col)
            h_imp = tl.where(first_hit, imp, h_imp)
        nan = nan | (elig & (imp != imp)).to(tl.int32)
        ok = elig & (imp == imp)
        take = ok & ((imp < b_imp) | ((imp == b_imp) & (p32 < b_pos)))  # later columns only replace on (imp, pos)
        b_imp = tl.where(take, imp, b_imp)
        b_pos = tl.where(take, p32, b_pos)
        b_col = tl.where(take, j32, b_col)
    best = tl.min(b_imp, 1)
    tie = (b_pos < BIG) & (b_imp == best[:, None])
    best_pos = tl.min(tl.where(tie, b_pos, BIG), 1)
    best_col = tl.min(tl.where(tie & (b_pos == best_pos[:, None]), b_col, BIG), 1).to(tl.int64)
    any_nan = tl.max(nan, 1)
    best_col = tl.where((any_nan > 0) | (best_pos == BIG), 0, best_col)
    best = tl.where(any_nan > 0, float("nan"), best)
    c_col = tl.min(h_col, 1)
    c_found = (c_col < BIG).to(tl.int32)
    c_imp = tl.sum(tl.where((h_col == c_col[:, None]) & (h_col < BIG), h_imp, 0.0), 1)
    return best, best_col, c_found, c_col.to(tl.int64) * c_found, c_imp


@triton.jit
def _classify(imp, thr_h, thr_l):
    """Tier code: 1 HIGH (``> thr_h``), 2 LOW (``>= thr_l``), 0 PRUNED (``policy.classify``)."""
    return tl.where(imp > thr_h, 1, tl.where(imp >= thr_l, 2, 0))


@triton.jit
def _decide_kernel(
    f32_ptr, i32_ptr, table_ptr, tokens_ptr, slots_ptr, pos_ptr, prompt_len_ptr, alpha_ptr, win_ptr,
    dh_ptr, dl_ptr, new_ptr, from_ptr, to_ptr,
    G, R, PAGE_BYTES, H_SC, H_PO, L_SC, L_PO, W, S,
    H_TOKENS: tl.constexpr, L_TOKENS: tl.constexpr, BLOCK: tl.constexpr, COMPRESS: tl.constexpr,
    ROWS: tl.constexpr, WINDOWS: tl.constexpr = False, NUM_KV_HEADS: tl.constexpr = 1,
):
    """Program ``(b, c)``: the decisions of items ``i = b * G + g``, ``g`` in ``[c * ROWS, (c + 1) * ROWS)`` (rows
    ``slots[b] * G + g``; see :func:`decide_rows`): one sequence's consecutive rows (with ``ROWS`` = num_kv_heads,
    the KV heads of one layer) in one program.

    ``COMPRESS=False`` (fp16 preset, ``decisions.append_only``): every new token appended to the high tier.
    ``WINDOWS``: ``win_ptr`` holds int32 ``[num_layers]`` windows (0: full attention); the rows of a layer with one
    take ``decisions.slide_windows``'s actions and are not scanned (row ``g``'s layer: ``g // NUM_KV_HEADS``).
    Both constexprs: a model without sliding-window layers compiles exactly the kernel it did.
    """
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    live = g < G
    i = b * G + g
    slot = tl.load(slots_ptr + b).to(tl.int64)
    row = tl.where(live, slot * G + g, 0)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    prompt_len = tl.load(prompt_len_ptr + slot).to(tl.int64)
    h_count = tl.load(tokens_ptr + row * 2, mask=live, other=0).to(tl.int64)
    l_count = tl.load(tokens_ptr + row * 2 + 1, mask=live, other=0).to(tl.int64)
    if WINDOWS:
        win = tl.load(win_ptr + g // NUM_KV_HEADS, mask=live, other=0).to(tl.int64)
    else:
        win = tl.zeros((ROWS,), tl.int64)
    sliding = win > 0
    w_safe = tl.maximum(win, 1)
    w_append = pos < w_safe
    w_new = tl.where(w_append, h_count, (pos - tl.maximum(prompt_len - w_safe, 0)) % w_safe)
    if not COMPRESS:
        tl.store(dh_ptr + i, tl.where(sliding, w_append.to(tl.int32), 1), mask=live)
        tl.store(dl_ptr + i, tl.zeros((ROWS,), tl.int32), mask=live)
        tl.store(new_ptr + i, tl.where(sliding, w_new, h_count), mask=live)
        tl.store(from_ptr + i, tl.zeros((ROWS,), tl.int64) - 1, mask=live)
        tl.store(to_ptr + i, tl.zeros((ROWS,), tl.int64) - 1, mask=live)
        return
    scan = live & ~sliding
    cand = pos - W
    n = tl.maximum(pos, 1).to(tl.float64)
    thr_h = (tl.load(alpha_ptr) / n).to(tl.float32)
    thr_l = (tl.load(alpha_ptr + 1) / n).to(tl.float32)
    imp_vh, iv_h, c_found, ic, imp_c = _scan_tier(f32_ptr, i32_ptr, table_ptr, row, h_count, scan, cand, prompt_len,
                                                  pos, R, PAGE_BYTES, H_SC, H_PO, S, H_TOKENS, False, BLOCK, ROWS)
    imp_vl, iv_l, _f, _c, _i = _scan_tier(f32_ptr, i32_ptr, table_ptr, row, l_count, scan, cand, prompt_len, pos,
                                          R, PAGE_BYTES, L_SC, L_PO, S, L_TOKENS, True, BLOCK, ROWS)
    found = (cand >= 0) & (c_found > 0)
    c_tier = _classify(imp_c, thr_h, thr_l)
    vh_tier = _classify(imp_vh, thr_h, thr_l)
    imp_v = tl.where(imp_c < imp_vl, imp_c, imp_vl)  # the candidate is the low victim when strictly less important
    vl_pruned = _classify(imp_v, thr_h, thr_l) == 0
    c_high = found & (c_tier == 1)
    c_low = found & (c_tier == 2)
    append = (~found) | (c_high & (vh_tier == 1))
    demote = c_high & (vh_tier == 2)
    to_low_end = demote | (c_low & ~vl_pruned)
    tl.store(dh_ptr + i, tl.where(sliding, w_append, append).to(tl.int32), mask=live)
    tl.store(dl_ptr + i, tl.where(sliding, 0, to_low_end.to(tl.int32)), mask=live)
    tl.store(new_ptr + i, tl.where(sliding, w_new, tl.where(append, h_count, tl.where(c_high, iv_h, ic))), mask=live)
    tl.store(from_ptr + i, tl.where(sliding, -1, tl.where(demote, iv_h, tl.where(c_low, ic, -1))), mask=live)
    tl.store(to_ptr + i, tl.where(sliding, -1, tl.where(to_low_end, l_count, tl.where(c_low, iv_l, -1))), mask=live)


@triton.jit
def _locate_kernel(
    table_ptr, slots_ptr, pos_ptr, new_ptr, from_ptr, to_ptr,
    rows_out, row_ids_out, page_out, slot_out, positions_out, err_idx_out,
    src_page_out, src_slot_out, dst_page_out, dst_slot_out,
    n, B, G, H, R,
    P_HIGH: tl.constexpr, P_LOW: tl.constexpr, MOVES: tl.constexpr, BLOCK: tl.constexpr,
):
    """Items ``i < B * G``: real rows (``b < n``) get their locations, padding rows page -1 / row id -1."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = i < B * G
    b = i // G
    g = i % G
    real = inside & (b < n)
    slot_id = tl.load(slots_ptr + b, mask=real, other=0).to(tl.int64)
    row = slot_id * G + g
    new = tl.load(new_ptr + i, mask=real, other=0)
    col = tl.minimum(tl.maximum(new // P_HIGH, 0), R - 1)
    page = tl.load(table_ptr + row * R + col, mask=real, other=-1)
    out = (g // H) * (B * H) + b * H + g % H  # layer-major [L, B, H]
    tl.store(rows_out + out, tl.where(real, row, 0), mask=inside)
    tl.store(row_ids_out + out, tl.where(real, row, -1).to(tl.int32), mask=inside)
    tl.store(page_out + out, tl.where(real, page, -1), mask=inside)
    tl.store(slot_out + out, tl.where(real, new % P_HIGH, 0).to(tl.int32), mask=inside)
    first_layer = inside & (g < H)
    pos = tl.load(pos_ptr + b, mask=real, other=0)
    tl.store(positions_out + b * H + g, tl.where(real, pos, 0).to(tl.int32), mask=first_layer)
    tl.store(err_idx_out + b * H + g, tl.where(real, slot_id, 0).to(tl.int32), mask=first_layer)
    if MOVES:
        mf = tl.load(from_ptr + i, mask=real, other=-1)
        mt = tl.maximum(tl.load(to_ptr + i, mask=real, other=0), 0)
        moving = real & (mf >= 0)
        mf = tl.maximum(mf, 0)
        src = tl.load(table_ptr + row * R + tl.minimum(mf // P_HIGH, R - 1), mask=moving, other=-1)
        dst = tl.load(table_ptr + row * R + tl.maximum(R - 1 - mt // P_LOW, 0), mask=moving, other=-1)
        tl.store(src_page_out + i, src, mask=real)
        tl.store(src_slot_out + i, (mf % P_HIGH).to(tl.int32), mask=real)
        tl.store(dst_page_out + i, dst, mask=real)
        tl.store(dst_slot_out + i, (mt % P_LOW).to(tl.int32), mask=real)


def _pool_views(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if pages.dtype != torch.uint8 or pages.dim() != 2 or not pages.is_contiguous():
        raise ValueError(f"pool pages must be contiguous uint8 [num_pages, page_size_bytes], got "
                         f"{pages.dtype} {tuple(pages.shape)}")
    flat = pages.reshape(-1)
    return flat.view(torch.float32), flat.view(torch.int32)


def alpha_tensor(alpha_high: float, alpha_low: float, device) -> torch.Tensor:
    """fp64 ``[2]`` = (alpha_high, alpha_low) for :func:`decide_rows` (allocate once per cache)."""
    return torch.tensor([alpha_high, alpha_low], dtype=torch.float64, device=device)


def decide_rows(pool_pages: torch.Tensor, page_format: PageFormat, page_table: torch.Tensor,
                tier_tokens: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, prompt_len: torch.Tensor,
                alphas: torch.Tensor, *, rows_per_slot: int, recent_window_tokens: int,
                prompt_score_window_tokens: int, out: tuple[torch.Tensor, ...] | None = None,
                block_tokens: int = BLOCK_TOKENS, compress: bool = True,
                rows_per_program: int = ROWS_PER_PROGRAM, num_warps: int = DECIDE_WARPS,
                layer_windows: torch.Tensor | None = None, num_kv_heads: int = 1):
    """The decode decisions of every row of ``n`` sequences, one launch (= ``decisions.decide``, bit for bit).

    Args:
        pool_pages: ``uint8 [num_pages, page_size_bytes]`` (``KVCachePool.pages()``); the
            format must store token metadata (scores and positions: a compressing preset).
        page_format: the pool's :class:`PageFormat`.
        page_table: int32 ``[num_rows, R]``, tier_tokens: int32 ``[num_rows, 2]``: the page
            manager's state before the step.
        slots: int64 ``[n]`` sequence slots; pos: int64 ``[n]`` the position each writes.
        prompt_len: int64 ``[max_slots]`` prompt length per slot.
        alphas: fp64 ``[2]`` from :func:`alpha_tensor`.
        rows_per_slot: ``G = num_layers * num_kv_heads``.
        recent_window_tokens, prompt_score_window_tokens: W and S of the policy.
        out: optional preallocated (high_delta int32, low_delta int32, new_index int64,
            move_from int64, move_to int64), each ``[>= n * G]``.
        block_tokens: tier tokens per loop iteration (a power of two; tests shrink it to
            cover ties across iterations).
        compress: ``False`` for a preset that keeps every token (fp16): the actions of
            ``decisions.append_only`` (new token appended high), no scan, no metadata needed.
        rows_per_program: consecutive rows of a sequence one program decides (a power of two;
            e.g. ``num_kv_heads``: a layer's KV heads); launch tuning (:data:`ROWS_PER_PROGRAM`),
            the results do not depend on it.
        num_warps: warps per program (launch tuning).
        layer_windows: int32 ``[num_layers]`` on the device, each layer's sliding window (0: full attention),
            or ``None`` (no sliding-window layer); the rows of a sliding layer get
            ``decisions.slide_windows``'s actions. num_kv_heads: H, to find a row's layer (``g // H``).

    Returns:
        ``(high_delta, low_delta, new_index, move_from, move_to)``, each ``[n * G]`` in item
        order ``b * G + g`` (see :class:`trtllm_diffkv.paged.decisions.StepActions`).

    Raises:
        ValueError: a format without token metadata, a too-small ``out``, or a ``rows_per_program``
            that is not a power of two.
    """
    high, low = page_format.high, page_format.low
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program={rows_per_program} must be a power of two")
    if compress and not (high.score.size_bytes and low.score.size_bytes):
        raise ValueError("decide_rows needs token metadata (scores, positions) in both tiers: a compressing preset")
    m = slots.numel() * rows_per_slot
    dev = slots.device
    if out is None:
        out = (torch.empty(m, dtype=torch.int32, device=dev), torch.empty(m, dtype=torch.int32, device=dev),
               *(torch.empty(m, dtype=torch.int64, device=dev) for _ in range(3)))
    if any(t.numel() < m for t in out):
        raise ValueError(f"decide_rows: out tensors must hold at least {m} items")
    out = tuple(t[:m] for t in out)
    if m == 0:
        return out
    f32, i32 = _pool_views(pool_pages)
    _decide_kernel[(slots.numel(), triton.cdiv(rows_per_slot, rows_per_program))](
        f32, i32, page_table, tier_tokens, slots, pos, prompt_len, alphas,
        layer_windows if layer_windows is not None else slots, *out,
        rows_per_slot, page_table.shape[1], page_format.page_size_bytes,
        high.score.offset_bytes, high.position.offset_bytes, low.score.offset_bytes, low.position.offset_bytes,
        max(recent_window_tokens, 1), prompt_score_window_tokens,
        H_TOKENS=high.tokens_per_page, L_TOKENS=low.tokens_per_page, BLOCK=block_tokens, COMPRESS=compress,
        ROWS=rows_per_program, WINDOWS=layer_windows is not None, NUM_KV_HEADS=num_kv_heads, num_warps=num_warps)
    return out


def locate_rows(page_table: torch.Tensor, page_format: PageFormat, slots: torch.Tensor, pos: torch.Tensor,
                actions: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, ...],
                moves: tuple[torch.Tensor, ...] | None, *, num_kv_heads: int, rows_per_slot: int) -> None:
    """Page ids and slots of the step's new tokens and moves, after ``append_decode``; one launch.

    Args:
        page_table: the page manager's table after ``append_decode``.
        page_format: the pool's format (tokens per page of each tier).
        slots, pos: int64 ``[n]`` the real sequences' slots and positions.
        actions: ``(high_delta, low_delta, new_index, move_from, move_to)`` of
            :func:`decide_rows`.
        out: the step's layer-major buffers for a bucket of ``B >= n`` sequences,
            filled in full: ``(rows, row_ids, page, slot, positions, err_idx)``,
            ``rows`` int64 / ``row_ids`` int32 / ``page`` int32 / ``slot`` int32
            ``[L, B, H]``, ``positions`` and ``err_idx`` int32 ``[B * H]``
            (``paged.step_plan.DecodeBuffers.located``); padding sequences get row 0 /
            row id -1 / page -1 / slot 0 / position 0 / error index 0.
        moves: (src_page, src_slot, dst_page, dst_slot) int32 ``[>= n * G]`` for
            the moves to the low tier (page -1 where the row moves nothing);
            ``None``: no moves (fp16 preset).
        num_kv_heads, rows_per_slot: H and G.
    """
    B = out[1].shape[1]
    n = slots.numel()
    total = B * rows_per_slot
    if total == 0:
        return
    new, mf, mt = actions[2:]
    mv = moves if moves is not None else (slots,) * 4
    _locate_kernel[(triton.cdiv(total, LOCATE_BLOCK),)](
        page_table, slots, pos, new, mf, mt, *out, *mv,
        n, B, rows_per_slot, num_kv_heads, page_table.shape[1],
        P_HIGH=page_format.high_tokens_per_page, P_LOW=page_format.low_tokens_per_page, MOVES=moves is not None,
        BLOCK=LOCATE_BLOCK)


__all__ = ["alpha_tensor", "decide_rows", "locate_rows", "BLOCK_TOKENS", "ROWS_PER_PROGRAM", "DECIDE_WARPS"]
