"""Independent quantization oracle: scalar min/max quantizer, golden packing, error bounds, level counts.

Rule (``DiffKV.md`` "Quantization"): per token, per KV head, per group of
``head_dim / groups`` consecutive elements,

    scale = fp16(max(fp32(max - min) / (2**bits - 1), 2**-14)),  zero = fp16(min)
    code  = clamp(round_half_even((x - zero) / scale), 0, 2**bits - 1)   (fp32 arithmetic)
    x_hat = code * scale + zero                                          (fp32)

Packing: element ``j`` of a row lives in byte ``j * bits // 8`` at bit offset
``(j * bits) % 8`` (little end first).
"""
from __future__ import annotations

import numpy as np
import torch

SCALE_EPSILON = 2.0**-14
FP32_EPS = 2.0**-23


def pack_golden(codes: list[int], bits: int) -> bytes:
    """Pack one row of integer codes bit by bit (the specification, no shortcuts)."""
    assert (len(codes) * bits) % 8 == 0
    out = bytearray(len(codes) * bits // 8)
    for j, code in enumerate(codes):
        assert 0 <= code < 2**bits
        for b in range(bits):
            bit_index = j * bits + b
            if (code >> b) & 1:
                out[bit_index // 8] |= 1 << (bit_index % 8)
    return bytes(out)


def quantize_row(row, bits: int, groups: int) -> tuple[list[int], list[float], list[float], np.ndarray]:
    """Quantize one row the scalar way.

    Args:
        row: ``head_dim`` values (anything numpy converts; taken as fp32).
        bits: 2, 4 or 8; groups: 1, 2 or 4.

    Returns:
        ``(codes, scales, zeros, x_hat)``: ``head_dim`` ints, ``groups`` fp16
        values as floats (twice), and the fp32 ``[head_dim]`` reconstruction.
    """
    x = np.asarray(row, dtype=np.float32)
    group_dim = x.size // groups
    qmax = 2**bits - 1
    codes, scales, zeros = [], [], []
    x_hat = np.zeros_like(x)
    for g in range(groups):
        part = x[g * group_dim:(g + 1) * group_dim]
        lo, hi = np.float32(part.min()), np.float32(part.max())
        step = np.float32(np.float32(hi - lo) / np.float32(qmax))
        scale = np.float16(max(step, np.float32(SCALE_EPSILON)))
        zero = np.float16(lo)
        for j, value in enumerate(part):
            code = np.rint(np.float32(np.float32(value) - np.float32(zero)) / np.float32(scale))
            code = int(min(max(code, 0), qmax))
            codes.append(code)
            x_hat[g * group_dim + j] = np.float32(np.float32(code) * np.float32(scale)) + np.float32(zero)
        scales.append(float(scale))
        zeros.append(float(zero))
    return codes, scales, zeros, x_hat


def check_quantized(source: torch.Tensor, stored: torch.Tensor, bits: int, groups: int, what: str = "",
                    offset: torch.Tensor | None = None) -> None:
    """Assert that ``stored`` rows are ``source`` rows quantized at ``bits``/``groups``.

    Per group of each row: the error is at most half a step (the fp16 scale)
    plus the fp16 rounding of zero and scale and fp32 slack; the stored values
    take at most ``2**bits`` distinct levels; every stored value sits on the
    grid ``zero + code * scale`` with an integer code in ``[0, 2**bits - 1]``.

    Args:
        source: ``[rows, head_dim]`` what was quantized (fp32 values; keys after
            subtracting their channel offset).
        stored: ``[rows, head_dim]`` what the cache reads back (same frame).
        bits, groups: the format; 16 bits means "stored exactly" (fp32 or the model dtype).
        what: names the rows in the message.
        offset: ``[rows, head_dim]`` the channel offset the cache added back
            (keys), only to size the fp32 slack of that addition.

    Raises:
        AssertionError: naming the first offending row and group.
    """
    src, got = source.double().cpu(), stored.double().cpu()
    if src.numel() == 0:
        return
    if bits == 16:
        err = (got - src).abs()
        assert bool((err <= 1e-3 * src.abs() + 1e-6).all()), f"{what}: unquantized values changed (max err {float(err.max())})"
        return
    rows, head_dim = src.shape
    qmax = 2**bits - 1
    xs = src.reshape(rows, groups, head_dim // groups)
    qs = got.reshape(rows, groups, head_dim // groups)
    lo, hi = xs.amin(-1), xs.amax(-1)
    exact_step = (hi - lo) / qmax
    step32 = ((hi - lo).float() / qmax).double()
    scale = step32.clamp_min(SCALE_EPSILON).half().double()
    zero = lo.half().double()
    magnitude = torch.maximum(xs.abs().amax(-1), qs.abs().amax(-1)) + scale * qmax
    if offset is not None:
        magnitude = magnitude + offset.double().cpu().abs().reshape(rows, groups, -1).amax(-1)
    slack = 16 * FP32_EPS * magnitude
    bound = 0.5 * scale + (zero - lo).abs() + qmax * (scale - exact_step).abs() + slack
    err = (qs - xs).abs().amax(-1)
    bad = (err > bound).nonzero()
    if bad.numel():
        r, g = (int(i) for i in bad[0])
        raise AssertionError(f"{what}: row {r} group {g}: error {float(err[r, g]):.6g} > half-step bound "
                             f"{float(bound[r, g]):.6g} (scale {float(scale[r, g]):.6g}, {bits} bits, {groups} groups)")
    code = (qs - zero[..., None]) / scale[..., None]
    nearest = code.round()
    off_grid = ((code - nearest).abs() * scale[..., None] > 0.02 * scale[..., None] + slack[..., None]) | (
        nearest < 0) | (nearest > qmax)
    bad = off_grid.any(-1).nonzero()
    if bad.numel():
        r, g = (int(i) for i in bad[0])
        raise AssertionError(f"{what}: row {r} group {g}: stored values off the {bits}-bit grid "
                             f"(codes {code[r, g][:8].tolist()}...)")
    ordered = qs.sort(-1).values
    levels = 1 + ((ordered[..., 1:] - ordered[..., :-1]) > 0.5 * scale[..., None]).sum(-1)
    bad = (levels > 2**bits).nonzero()
    if bad.numel():
        r, g = (int(i) for i in bad[0])
        raise AssertionError(f"{what}: row {r} group {g}: {int(levels[r, g])} levels > 2**{bits}")
