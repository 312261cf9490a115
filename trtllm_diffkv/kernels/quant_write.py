"""Write path of the unified pages: quantize token rows into page slots, and read them back (Triton).

Paper section 5 (``DiffKV.md``, "Memory manager"): a page holds tokens of one
(request, layer, KV head) at one tier, in six segments. The in-page layout
(:meth:`~trtllm_diffkv.memory.KVCachePool.segment`) is token-major: token slot
``s`` of a page owns

* ``key_codes`` bytes ``[s * D * bits / 8, (s + 1) * D * bits / 8)``, packed
  exactly as :func:`trtllm_diffkv.quant.pack_codes` (element ``j`` in byte
  ``j * bits // 8`` at bit ``(j * bits) % 8``); a 16-bit side holds plain
  fp16 ``[D]``;
* ``key_meta`` fp16 ``[groups, 2]`` (scale, zero); empty for a 16-bit side;
* ``value_codes`` / ``value_meta`` likewise; ``score`` fp32; ``position`` int32.

Quantization is bit-identical to :func:`trtllm_diffkv.quant.quantize`: per
token and group ``scale = max((max - min) / (2^b - 1), 2^-14)`` rounded to
fp16, ``zero = min`` rounded to fp16, codes ``clamp(round_half_even((x - zero)
/ scale))`` against the fp16-rounded scale and zero. Divisions are IEEE
round-to-nearest (``div_rn``) and the kernels are launched without fp
contraction, so the GPU reproduces the CPU reference bit for bit.

On CPU tensors the kernels run only under ``TRITON_INTERPRET=1`` (set before
Triton is imported); :mod:`trtllm_diffkv.paged.torch_ops` has the same
operations in plain torch for the CPU path.

Entry points (one program per token row, no host synchronization; rows whose
destination page is negative are skipped, so callers pass fixed-size batches
with padding):

* :func:`write_tokens`: quantize ``[n, D]`` keys/values (keys optionally minus
  a per-row fp16 offset, ``DiffKVConfig.center_keys``) into ``(page, slot)`` of
  a tier, with score and position; flags non-finite rows.
* :func:`read_tokens`: dequantize ``(page, slot)`` of a tier into fp32 rows
  (the first half of a demotion, which then writes them at the low tier).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..memory.page_format import PageFormat
from ..quant import FP16_MAX, SCALE_EPSILON

# The kernels spell these constants out (65504.0, 0.00006103515625); keep them in step with quant.py.
assert FP16_MAX == 65504.0 and SCALE_EPSILON == 0.00006103515625

WRITE_NUM_WARPS = 1
"""Warps of a :func:`_write_tokens_kernel` program (one token row of ``head_dim`` elements: one warp reduces its groups
with shuffles alone). H100, 2026-12-06, 32 launches in a CUDA graph, us a launch (1 / 2 / 4 / 8 warps): Llama-3-8B
K8V4, 384 rows of head_dim 128 3.38 / 3.70 / 3.73 / 4.85; FP16 1.88 / 2.09 / 2.09 / 2.20; the default preset, 192 rows
of head_dim 64 3.00 / 3.38 / 3.63 / 4.03; pools bit-equal. In the executor step at 48 x 4096 the writes took 149 against
181 us a step (docs/PERFORMANCE.md)."""


@triton.jit
def _round_half_even(y):
    """``torch.round`` (ties to even) from floor and compares only (same on the interpreter and the GPU)."""
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return f + up.to(tl.float32)


@triton.jit
def _splat(flag, like):
    """Scalar bool ``flag`` as a bool tensor shaped like ``like`` (some interpreter versions mistype
    ``tensor & scalar`` masks; see ``memory/triton_page_manager.py``)."""
    return (tl.zeros_like(like).to(tl.int32) + flag.to(tl.int32)) != 0


@triton.jit
def _side_index(D: tl.constexpr, BITS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_GB: tl.constexpr):
    """Element index ``e = g * GD + b * PB + k`` as ``[GROUPS, BLOCK_GB, PB]`` (PB codes per byte) and its mask."""
    PB: tl.constexpr = 8 // BITS if BITS < 16 else 1
    GD: tl.constexpr = D // GROUPS
    g = tl.arange(0, GROUPS)[:, None, None]
    b = tl.arange(0, BLOCK_GB)[None, :, None]
    k = tl.arange(0, PB)[None, None, :]
    valid = (b < GD // PB) & (g >= 0) & (k >= 0)
    return g * GD + b * PB + k, valid, g, b, k


@triton.jit
def _quantize_side(src_ptr, off_ptr, ok, codes_u8, codes_f16, meta_f16, pool_u8, pool_f16,
                   D: tl.constexpr, BITS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_GB: tl.constexpr,
                   HAS_OFFSET: tl.constexpr):
    """Quantize one row ``src_ptr[0:D]`` (minus ``off_ptr[0:D]`` fp16 if HAS_OFFSET) and store it.

    ``codes_u8`` / ``codes_f16``: element offsets of the token's codes in the
    uint8 / fp16 views of the pool; ``meta_f16``: of its (scale, zero) pairs.
    Returns True where the row holds a NaN/Inf or a magnitude above fp16's range.
    """
    e, valid, g, b, k = _side_index(D, BITS, GROUPS, BLOCK_GB)
    m = valid & _splat(ok, e)
    x = tl.load(src_ptr + e, mask=m, other=0.0).to(tl.float32)
    bad = tl.max(tl.max(tl.max(((tl.abs(x) > 65504.0) | (x != x)).to(tl.int32), axis=2), axis=1), axis=0) > 0
    if HAS_OFFSET:
        x = x - tl.load(off_ptr + e, mask=m, other=0.0).to(tl.float32)
        # A key within fp16's range can land beyond it once centered: its fp16 zero point would be inf.
        bad = bad | (tl.max(tl.max(tl.max(((tl.abs(x) > 65504.0) | (x != x)).to(tl.int32),
                                           axis=2), axis=1), axis=0) > 0)
    if BITS == 16:
        tl.store(pool_f16 + codes_f16 + e, x.to(tl.float16), mask=m)
    else:
        QMAX: tl.constexpr = (1 << BITS) - 1
        lo = tl.min(tl.min(tl.where(valid, x, float("inf")), axis=2), axis=1)  # [GROUPS]
        hi = tl.max(tl.max(tl.where(valid, x, float("-inf")), axis=2), axis=1)
        scale = tl.maximum(tl.math.div_rn(hi - lo, tl.full(hi.shape, QMAX, tl.float32)), 0.00006103515625)
        scale16 = scale.to(tl.float16)
        zero16 = lo.to(tl.float16)
        s = scale16.to(tl.float32)[:, None, None]
        z = zero16.to(tl.float32)[:, None, None]
        y = tl.math.div_rn(x - z, s + tl.zeros_like(x))
        code = tl.minimum(tl.maximum(_round_half_even(y), 0.0), QMAX * 1.0).to(tl.int32)
        packed = tl.sum(code << (k * BITS), axis=2)  # [GROUPS, BLOCK_GB]
        g2 = tl.arange(0, GROUPS)[:, None]
        b2 = tl.arange(0, BLOCK_GB)[None, :]
        GB: tl.constexpr = (D // GROUPS) * BITS // 8
        tl.store(pool_u8 + codes_u8 + g2 * GB + b2, packed.to(tl.uint8), mask=(b2 < GB) & _splat(ok, packed))
        gm = tl.arange(0, GROUPS)
        okg = _splat(ok, gm)
        tl.store(pool_f16 + meta_f16 + gm * 2, scale16, mask=okg)
        tl.store(pool_f16 + meta_f16 + gm * 2 + 1, zero16, mask=okg)
    return bad


@triton.jit
def _dequantize_side(dst_ptr, ok, codes_u8, codes_f16, meta_f16, pool_u8, pool_f16,
                     D: tl.constexpr, BITS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_GB: tl.constexpr):
    """Dequantize one stored row into ``dst_ptr[0:D]`` fp32 (``code * scale + zero``, fp32, no fma)."""
    e, valid, g, b, k = _side_index(D, BITS, GROUPS, BLOCK_GB)
    m = valid & _splat(ok, e)
    if BITS == 16:
        x = tl.load(pool_f16 + codes_f16 + e, mask=m, other=0.0).to(tl.float32)
    else:
        QMAX: tl.constexpr = (1 << BITS) - 1
        GB: tl.constexpr = (D // GROUPS) * BITS // 8
        byte = tl.load(pool_u8 + codes_u8 + g * GB + b, mask=m, other=0).to(tl.int32)
        code = ((byte >> (k * BITS)) & QMAX).to(tl.float32)
        okg = _splat(ok, g)
        scale = tl.load(pool_f16 + meta_f16 + g * 2, mask=okg, other=0.0).to(tl.float32)
        zero = tl.load(pool_f16 + meta_f16 + g * 2 + 1, mask=okg, other=0.0).to(tl.float32)
        x = code * scale + zero
    tl.store(dst_ptr + e, x, mask=m)


@triton.jit
def _token_offsets(page, slot, PAGE_BYTES, KC, KM, VC, VM, SC, PO,
                   D: tl.constexpr, KB: tl.constexpr, KG: tl.constexpr, VB: tl.constexpr, VG: tl.constexpr):
    """Element offsets of token ``slot`` of ``page`` in the u8/f16/f32 views (int64)."""
    base = page.to(tl.int64) * PAGE_BYTES
    kc = base + KC + slot * (D * KB // 8)
    vc = base + VC + slot * (D * VB // 8)
    km = (base + KM) // 2 + slot * (2 * KG)
    vm = (base + VM) // 2 + slot * (2 * VG)
    sc = (base + SC) // 4 + slot
    po = (base + PO) // 4 + slot
    return kc, kc // 2, km, vc, vc // 2, vm, sc, po


@triton.jit
def _write_tokens_kernel(
    pool_u8, pool_f16, pool_f32, pool_i32,
    dest_page_ptr, dest_slot_ptr, k_ptr, v_ptr, k_stride, v_stride,
    off_ptr, off_row_ptr, score_ptr, pos_ptr, err_ptr, err_idx_ptr,
    PAGE_BYTES, KC, KM, VC, VM, SC, PO,
    D: tl.constexpr, KB: tl.constexpr, KG: tl.constexpr, VB: tl.constexpr, VG: tl.constexpr,
    BLOCK_KGB: tl.constexpr, BLOCK_VGB: tl.constexpr,
    HAS_OFFSET: tl.constexpr, HAS_META: tl.constexpr, HAS_ERR: tl.constexpr,
):
    """One program per token row; see :func:`write_tokens`."""
    i = tl.program_id(0).to(tl.int64)
    page = tl.load(dest_page_ptr + i)
    ok = page >= 0
    slot = tl.load(dest_slot_ptr + i).to(tl.int64)
    page = tl.where(ok, page, 0)
    slot = tl.where(ok, slot, 0)
    kc, kc16, km, vc, vc16, vm, sc, po = _token_offsets(page, slot, PAGE_BYTES, KC, KM, VC, VM, SC, PO, D, KB, KG, VB, VG)
    off = off_ptr
    if HAS_OFFSET:
        off = off_ptr + tl.load(off_row_ptr + i).to(tl.int64) * D
    bad_k = _quantize_side(k_ptr + i * k_stride, off, ok, kc, kc16, km, pool_u8, pool_f16, D, KB, KG, BLOCK_KGB, HAS_OFFSET)
    bad_v = _quantize_side(v_ptr + i * v_stride, off, ok, vc, vc16, vm, pool_u8, pool_f16, D, VB, VG, BLOCK_VGB, False)
    if HAS_META:
        tl.store(pool_f32 + sc, tl.load(score_ptr + i), mask=ok)
        tl.store(pool_i32 + po, tl.load(pos_ptr + i), mask=ok)
    if HAS_ERR:
        tl.store(err_ptr + tl.load(err_idx_ptr + i), 1, mask=ok & (bad_k | bad_v))


@triton.jit
def _read_tokens_kernel(
    pool_u8, pool_f16, pool_f32, pool_i32,
    src_page_ptr, src_slot_ptr, k_out, v_out, score_out, pos_out,
    PAGE_BYTES, KC, KM, VC, VM, SC, PO,
    D: tl.constexpr, KB: tl.constexpr, KG: tl.constexpr, VB: tl.constexpr, VG: tl.constexpr,
    BLOCK_KGB: tl.constexpr, BLOCK_VGB: tl.constexpr, HAS_META: tl.constexpr,
):
    """One program per token row; see :func:`read_tokens`."""
    i = tl.program_id(0).to(tl.int64)
    page = tl.load(src_page_ptr + i)
    ok = page >= 0
    slot = tl.where(ok, tl.load(src_slot_ptr + i).to(tl.int64), 0)
    page = tl.where(ok, page, 0)
    kc, kc16, km, vc, vc16, vm, sc, po = _token_offsets(page, slot, PAGE_BYTES, KC, KM, VC, VM, SC, PO, D, KB, KG, VB, VG)
    _dequantize_side(k_out + i * D, ok, kc, kc16, km, pool_u8, pool_f16, D, KB, KG, BLOCK_KGB)
    _dequantize_side(v_out + i * D, ok, vc, vc16, vm, pool_u8, pool_f16, D, VB, VG, BLOCK_VGB)
    if HAS_META:
        tl.store(score_out + i, tl.load(pool_f32 + sc, mask=ok, other=0.0), mask=ok)
        tl.store(pos_out + i, tl.load(pool_i32 + po, mask=ok, other=0), mask=ok)


def _pool_views(pages: torch.Tensor):
    if pages.dtype != torch.uint8 or pages.dim() != 2 or not pages.is_contiguous():
        raise ValueError(f"pool pages must be contiguous uint8 [num_pages, page_size_bytes], got "
                         f"{pages.dtype} {tuple(pages.shape)}")
    flat = pages.reshape(-1)
    return flat, flat.view(torch.float16), flat.view(torch.float32), flat.view(torch.int32)


def _layout_args(fmt: PageFormat, tier: str) -> tuple[tuple, dict]:
    lay = fmt.tier(tier)
    t = lay.tier
    offs = tuple(lay.segment(s).offset_bytes for s in ("key_codes", "key_meta", "value_codes", "value_meta",
                                                         "score", "position"))

    def block(bits, groups):
        per_byte = 8 // bits if bits < 16 else 1
        return triton.next_power_of_2(fmt.head_dim // groups // per_byte)

    kg = t.key_groups if t.key_bits < 16 else 1
    vg = t.value_groups if t.value_bits < 16 else 1
    const = dict(D=fmt.head_dim, KB=t.key_bits, KG=kg, VB=t.value_bits, VG=vg,
                 BLOCK_KGB=block(t.key_bits, kg), BLOCK_VGB=block(t.value_bits, vg))
    return (fmt.page_size_bytes,) + offs, const


def _launch_options(device: torch.device) -> dict:
    # No fp contraction on the GPU: code * scale + zero must round like the CPU reference.
    return {"enable_fp_fusion": False} if device.type == "cuda" else {}


def _check_rows(name: str, x: torch.Tensor, n: int, head_dim: int) -> None:
    if x.dim() != 2 or tuple(x.shape) != (n, head_dim) or (n and x.stride(1) != 1) or not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be a float [n={n}, head_dim={head_dim}] tensor with unit inner stride, "
                         f"got {x.dtype} {tuple(x.shape)}")


def write_tokens(
    pages: torch.Tensor,
    page_format: PageFormat,
    tier: str,
    dest_page: torch.Tensor,
    dest_slot: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    key_offsets: torch.Tensor | None = None,
    offset_rows: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    error_flags: torch.Tensor | None = None,
    error_index: torch.Tensor | None = None,
) -> None:
    """Quantize ``n`` token rows at ``tier`` and store them in their page slots (paper section 5).

    Args:
        pages: the pool, ``uint8 [num_pages, page_size_bytes]`` (``KVCachePool.pages()``).
        page_format: the pool's :class:`PageFormat`.
        tier: ``"high"`` or ``"low"``: the layout and bits used.
        dest_page: int32 ``[n]`` page id per row; a negative id skips the row.
        dest_slot: int32 ``[n]`` token slot inside the page, ``< tokens_per_page``.
        keys, values: float ``[n, head_dim]`` (any float dtype; unit inner stride).
        key_offsets: fp16 ``[rows, head_dim]`` per-row key offset, subtracted
            from the key before quantization (``center_keys``); with it,
            ``offset_rows`` int32/int64 ``[n]`` gives each row's offset row.
        scores: fp32 ``[n]``, positions: int32 ``[n]``: the token metadata
            (required when the format has score/position segments).
        error_flags: int32 ``[m]``; ``error_flags[error_index[i]] = 1`` when row
            ``i`` holds a NaN/Inf or a value beyond the fp16 range (edge case 1;
            checked on the device, no host sync). ``error_index`` int ``[n]``.

    Raises:
        ValueError: wrong shapes/dtypes, or metadata missing for a format
            that stores it. Values are not checked (no host sync).
    """
    n = dest_page.numel()
    D = page_format.head_dim
    _check_rows("keys", keys, n, D)
    _check_rows("values", values, n, D)
    if dest_slot.numel() != n:
        raise ValueError(f"dest_slot has {dest_slot.numel()} rows, dest_page {n}")
    has_meta = page_format.tier(tier).score.size_bytes > 0
    if has_meta and (scores is None or positions is None or scores.numel() != n or positions.numel() != n):
        raise ValueError("scores fp32 [n] and positions int32 [n] are required for a format with token metadata")
    if (key_offsets is None) != (offset_rows is None) or (error_flags is None) != (error_index is None):
        raise ValueError("give key_offsets with offset_rows, and error_flags with error_index")
    if n == 0:
        return
    u8, f16, f32, i32 = _pool_views(pages)
    ints, const = _layout_args(page_format, tier)
    dummy = dest_page
    _write_tokens_kernel[(n,)](
        u8, f16, f32, i32, dest_page, dest_slot, keys, values, keys.stride(0), values.stride(0),
        key_offsets if key_offsets is not None else keys, offset_rows if offset_rows is not None else dummy,
        scores if has_meta else dummy, positions if has_meta else dummy,
        error_flags if error_flags is not None else dummy, error_index if error_index is not None else dummy,
        *ints, HAS_OFFSET=key_offsets is not None, HAS_META=has_meta, HAS_ERR=error_flags is not None,
        **const, num_warps=WRITE_NUM_WARPS, **_launch_options(pages.device),
    )


def read_tokens(
    pages: torch.Tensor,
    page_format: PageFormat,
    tier: str,
    src_page: torch.Tensor,
    src_slot: torch.Tensor,
    keys_out: torch.Tensor,
    values_out: torch.Tensor,
    scores_out: torch.Tensor | None = None,
    positions_out: torch.Tensor | None = None,
) -> None:
    """Dequantize ``n`` stored tokens of ``tier`` into fp32 rows (``code * scale + zero``, as :func:`quant.dequantize`).

    Args:
        pages, page_format, tier: as in :func:`write_tokens`.
        src_page: int32 ``[n]`` page ids (negative: row skipped, outputs untouched).
        src_slot: int32 ``[n]`` slots.
        keys_out, values_out: fp32 contiguous ``[n, head_dim]``; keys come back
            in the stored (centered) domain, without any offset.
        scores_out: fp32 ``[n]``, positions_out: int32 ``[n]``: the token
            metadata (required when the format stores it).

    Raises:
        ValueError: wrong shapes or dtypes.
    """
    n = src_page.numel()
    D = page_format.head_dim
    for name, t in (("keys_out", keys_out), ("values_out", values_out)):
        if t.dtype != torch.float32 or tuple(t.shape) != (n, D) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous fp32 [{n}, {D}], got {t.dtype} {tuple(t.shape)}")
    has_meta = page_format.tier(tier).score.size_bytes > 0
    if has_meta and (scores_out is None or positions_out is None):
        raise ValueError("scores_out and positions_out are required for a format with token metadata")
    if n == 0:
        return
    u8, f16, f32, i32 = _pool_views(pages)
    ints, const = _layout_args(page_format, tier)
    _read_tokens_kernel[(n,)](
        u8, f16, f32, i32, src_page, src_slot, keys_out, values_out,
        scores_out if has_meta else keys_out, positions_out if has_meta else src_page,
        *ints, HAS_META=has_meta, **const, **_launch_options(pages.device),
    )
