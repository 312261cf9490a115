"""Reference KV quantization: asymmetric min/max, per token, per KV head, per group.

Rule (``DiffKV.md`` "Quantization"; paper section 4.1): for every token of
every KV head, and for each of ``groups`` equal slices of the head dimension,

    scale = max((max - min) / (2**bits - 1), SCALE_EPSILON)   stored as fp16
    zero  = min                                               stored as fp16
    code  = clamp(round((x - zero) / scale), 0, 2**bits - 1)  stored packed
    x_hat = code * scale + zero

Codes are computed against the fp16-rounded scale and zero, so dequantization
from the stored bytes reproduces exactly what the quantizer intended.
Codes are packed densely, little end first: element ``j`` of a row lives in
byte ``j * bits // 8`` at bit offset ``(j * bits) % 8``.

Every function here is the slow, obvious reference that GPU kernels are
tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

QUANT_BITS = (2, 4, 8)
"""Bit widths with a packed format."""

SCALE_EPSILON = 2.0**-14
"""Smallest scale stored (the smallest normal fp16): a constant row gets this
finite positive scale instead of 0, so dequantization never divides by or
multiplies into a degenerate value (edge case 1)."""

FP16_MAX = 65504.0


@dataclass(frozen=True)
class QuantizedKV:
    """Packed quantized rows.

    Attributes:
        codes: ``uint8 [..., head_dim * bits // 8]`` densely packed codes.
        scale: ``float16 [..., groups]`` step size per group.
        zero: ``float16 [..., groups]`` value of code 0 per group (the group minimum).
        bits: 2, 4 or 8.
        head_dim: number of elements per row before packing.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    head_dim: int

    @property
    def groups(self) -> int:
        """Quantization groups per row."""
        return self.scale.shape[-1]

    def nbytes(self) -> int:
        """Bytes these rows occupy in packed form (codes + fp16 scale + fp16 zero)."""
        return self.codes.numel() + 2 * self.scale.numel() + 2 * self.zero.numel()


def _check_bits(bits: int) -> None:
    if bits not in QUANT_BITS:
        raise ValueError(f"bits={bits!r} has no packed format; allowed: {list(QUANT_BITS)}")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes densely into bytes.

    Args:
        codes: ``uint8 [..., n]`` with every value below ``2**bits``;
            ``n * bits`` must be a multiple of 8.
        bits: 2, 4 or 8.

    Returns:
        ``uint8 [..., n * bits // 8]``.

    Raises:
        ValueError: unsupported bits, a code out of range, or a row that does
            not fill whole bytes.
    """
    _check_bits(bits)
    n = codes.shape[-1]
    if (n * bits) % 8:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole bytes")
    if codes.numel() and int(codes.max()) >= 2**bits:
        raise ValueError(f"code {int(codes.max())} does not fit in {bits} bits")
    per_byte = 8 // bits
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], n // per_byte, per_byte)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``uint8 [..., m]`` -> ``uint8 [..., m * 8 // bits]``."""
    _check_bits(bits)
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & (2**bits - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte).to(torch.uint8)


def check_finite(x: torch.Tensor, what: str, layer_idx: int | None = None, first_token: int = 0) -> None:
    """Refuse non-finite or fp16-overflowing KV rows, naming layer, head and token.

    Args:
        x: ``[num_kv_heads, num_tokens, head_dim]`` keys or values.
        what: "key" or "value", for the message.
        layer_idx: decoder layer, for the message.
        first_token: position of ``x``'s first token, for the message (a decode step's
            single token is at its sequence position, not 0).

    Values are compared in float32 whatever ``x``'s dtype (edge case 14): in
    bfloat16 the bound 65504 itself rounds to 65536, so a native comparison
    would miss ``±65536``.

    Raises:
        ValueError: a NaN/Inf, or a magnitude above the fp16 range that the
            16-bit scale and zero can represent (edge cases 1 and 14).
    """
    if x.numel() == 0:
        return
    xf = x.float()
    if float(xf.abs().amax()) <= FP16_MAX:  # NaN fails the comparison too
        return
    if xf.dim() != 3:
        raise ValueError(f"expected [num_kv_heads, num_tokens, head_dim], got shape {tuple(x.shape)}")
    bad = ~torch.isfinite(xf) | (xf.abs() > FP16_MAX)
    head, token, _ = (int(i) for i in bad.nonzero()[0])
    value = float(xf[head, token][bad[head, token]][0])
    raise ValueError(
        f"cannot quantize {what}: value {value} at layer {layer_idx}, KV head {head}, token {first_token + token} "
        f"is not finite or exceeds the fp16 range"
    )


def quantize(x: torch.Tensor, bits: int, groups: int = 1, *, what: str = "kv", layer_idx: int | None = None) -> QuantizedKV:
    """Asymmetric min/max quantization per token, per KV head, per group.

    Args:
        x: ``[num_kv_heads, num_tokens, head_dim]`` float tensor (any float dtype).
        bits: 2, 4 or 8.
        groups: equal slices of ``head_dim`` with their own scale/zero (1, 2 or 4).
        what, layer_idx: used only to name the offending row in errors.

    Returns:
        :class:`QuantizedKV` with leading dims ``[num_kv_heads, num_tokens]``.

    Raises:
        ValueError: wrong rank, head_dim not divisible into byte-filling groups,
            unsupported bits, or a non-finite input (naming layer and head).
    """
    head_dim = _check_rows(x, bits, groups)
    check_finite(x, what, layer_idx)
    codes, scale, zero = _codes_scale_zero(x, bits, groups)
    codes = codes.to(torch.uint8).reshape(x.shape)
    return QuantizedKV(pack_codes(codes, bits), scale, zero, bits, head_dim)


def _check_rows(x: torch.Tensor, bits: int, groups: int) -> int:
    """Refuse what :func:`quantize` cannot pack (its ``Raises``, but non-finite values); returns head_dim."""
    _check_bits(bits)
    if x.dim() != 3:
        raise ValueError(f"expected [num_kv_heads, num_tokens, head_dim], got shape {tuple(x.shape)}")
    head_dim = x.shape[-1]
    if head_dim % groups or (head_dim // groups * bits) % 8:
        raise ValueError(f"head_dim={head_dim} in {groups} groups of {bits}-bit codes does not fill whole bytes")
    return head_dim


def _codes_scale_zero(x: torch.Tensor, bits: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule of the module docstring: ``(codes float32 [..., groups, head_dim // groups] (whole numbers),
    scale float16 [..., groups], zero float16 [..., groups])`` of finite rows ``x [..., head_dim]``."""
    head_dim = x.shape[-1]
    xg = x.float().reshape(*x.shape[:-1], groups, head_dim // groups)
    lo, hi = xg.amin(-1), xg.amax(-1)
    qmax = 2**bits - 1
    # A tensor divisor, not the Python int: torch on CUDA turns ``tensor / scalar`` into a multiplication
    # by the reciprocal (one bit lost), whose fp16 rounding differs from the IEEE quotient at ties; the CPU
    # and the Triton write kernels divide exactly, so this keeps every path's scales bit-equal.
    scale = ((hi - lo) / torch.full_like(hi, float(qmax))).clamp_min(SCALE_EPSILON).to(torch.float16)
    zero = lo.to(torch.float16)
    codes = torch.round((xg - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp_(0, qmax)
    return codes, scale, zero


def dequantize(q: QuantizedKV, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reconstruct ``[..., head_dim]`` values from packed codes, scale and zero (fp32 math)."""
    codes = unpack_codes(q.codes, q.bits).float()
    groups = q.groups
    codes = codes.reshape(*codes.shape[:-1], groups, q.head_dim // groups)
    x = codes * q.scale.float().unsqueeze(-1) + q.zero.float().unsqueeze(-1)
    return x.reshape(*x.shape[:-2], q.head_dim).to(dtype)


def fake_quantize(x: torch.Tensor, bits: int, groups: int = 1, *, what: str = "kv", layer_idx: int | None = None,
                  check: bool = True) -> torch.Tensor:
    """``dequantize(quantize(x))``, bit for bit; 16 bits returns ``x`` in fp32 unchanged.

    The codes are dequantized as computed, without the pack / unpack round trip (lossless: every code
    fits its bits), so this costs about half the operations of ``dequantize(quantize(x))``; the
    equality is pinned by ``tests/core/test_quant.py``.

    Args:
        check: refuse non-finite rows (:func:`check_finite`, one host sync); ``False`` only for rows
            the caller has checked already (e.g. re-quantizing stored values).

    Shapes and errors as in :func:`quantize`; returns fp32.
    """
    if bits == 16:
        if check:
            check_finite(x, what, layer_idx)
        return x.float()
    _check_rows(x, bits, groups)
    if check:
        check_finite(x, what, layer_idx)
    codes, scale, zero = _codes_scale_zero(x, bits, groups)
    return (codes * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).reshape(x.shape)
