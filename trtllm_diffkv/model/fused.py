"""Fused elementwise steps of the Llama decoder (issue 19): RMSNorm with the residual add, SiLU * up,
RoPE on the concatenated q/k/v projection and the key rotation of q and k, one Triton kernel each on CUDA.

Each function has two paths that compute the same rounding sequence as the unfused PyTorch code of
:mod:`.llama` (the transformers numerics):

* the torch path (CPU tensors, or ``use_triton=False``): exactly the former module code, so the CPU
  model stays bit-identical to what the transformers parity tests compare;
* the Triton path (CUDA tensors, or ``use_triton=True`` under ``TRITON_INTERPRET=1`` in tests): one
  program per row. RMSNorm and SiLU * up round to the model dtype where PyTorch does (the residual sum,
  the normed value, the SiLU), statistics in fp32: they agree with the torch path but for rare one- or
  two-ulp flips (the fp32 mean's summation order, ``exp``'s last bit; measured on the H200 by
  ``tests/model/test_model_fused_gpu.py``). RoPE computes ``x * cos + rotate_half(x) * sin`` in fp32 and
  rounds once (PyTorch rounds each product and the sum): at least as accurate, within an ulp or two of
  the terms' magnitude of PyTorch's result.

No host synchronization and fixed launch grids per shape: the kernels are CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from .rope import apply_rope

try:  # the CPU path needs no Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is a dependency; kept for minimal installs
    triton = None


def use_fused_kernels(x: torch.Tensor) -> bool:
    """Whether the model's forward runs the fused path on ``x``'s device: CUDA with Triton installed
    (the CPU keeps the unfused, transformers-exact code)."""
    return x.is_cuda and triton is not None


def _triton_for(x: torch.Tensor, use_triton: bool | None) -> bool:
    if use_triton is None:
        return use_fused_kernels(x)
    if use_triton and triton is None:
        raise RuntimeError("use_triton=True needs Triton installed")
    return use_triton


# --------------------------------------------------------------------------- RMSNorm (+ residual)
if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, hidden_size, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden_size
        x = tl.load(x_ptr + row * hidden_size + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * hidden_size + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(res_out_ptr + row * hidden_size + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden_size + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
        tl.store(out_ptr + row * hidden_size + cols, y.to(x.dtype), mask=mask)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm``: statistics in fp32, normalized value cast to ``x.dtype``, then
    times ``weight``. ``x`` ``[num_tokens, hidden_size]``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (or ``x``), then RMSNorm of ``s``.

    Args:
        x: ``[num_tokens, hidden_size]`` model dtype (fp16/bf16/fp32), contiguous.
        weight: ``[hidden_size]`` norm weight, same dtype.
        eps: the norm's epsilon.
        residual: ``None`` or a tensor like ``x`` (the residual stream).
        use_triton: ``None``: Triton where :func:`use_fused_kernels` (CUDA), torch otherwise.

    Returns:
        ``(normed, s)``: ``normed`` like ``x``; ``s`` the new residual stream (``x`` itself when
        ``residual`` is ``None``).

    Raises:
        ValueError: ``x`` not 2-D or ``weight``/``residual`` of another shape.
    """
    if x.dim() != 2 or weight.shape != x.shape[-1:] or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} must be [num_tokens, hidden_size] with weight "
                         f"{tuple(weight.shape)} [hidden_size] and residual like x")
    if not _triton_for(x, use_triton):
        s = x if residual is None else x + residual
        return rms_norm_reference(s, weight, eps), s
    x = x.contiguous()
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if x.shape[0]:
        hidden = x.shape[1]
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x.shape[0],)](x, residual.contiguous() if residual is not None else x, weight, out,
                                        res_out, hidden, float(eps), HAS_RESIDUAL=residual is not None,
                                        BLOCK=block, num_warps=max(1, min(16, block // 256)))
    return out, res_out


# --------------------------------------------------------------------------- SiLU * up
if triton is not None:

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, intermediate_size, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < intermediate_size
        g = tl.load(gate_up_ptr + row * 2 * intermediate_size + cols, mask=mask, other=0.0)
        u = tl.load(gate_up_ptr + row * 2 * intermediate_size + intermediate_size + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(out_ptr + row * intermediate_size + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype),
                 mask=mask)


def silu_mul(gate_up: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` from the concatenated projection.

    Args:
        gate_up: ``[num_tokens, 2 * intermediate_size]``: ``gate`` in the first half, ``up`` in the second.
        use_triton: ``None``: Triton where :func:`use_fused_kernels` (CUDA), torch otherwise.

    Returns:
        ``[num_tokens, intermediate_size]`` in ``gate_up``'s dtype.

    Raises:
        ValueError: ``gate_up`` not 2-D with an even last dim.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up {tuple(gate_up.shape)} must be [num_tokens, 2 * intermediate_size]")
    inter = gate_up.shape[1] // 2
    if not _triton_for(gate_up, use_triton):
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    gate_up = gate_up.contiguous()
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0]:
        block = 1024
        _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block,
                                                                          num_warps=4)
    return out


# --------------------------------------------------------------------------- RoPE on q/k/v
if triton is not None:

    @triton.jit
    def _qkv_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, num_heads, num_kv_heads,
                         HEAD_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        half: tl.constexpr = HEAD_DIM // 2
        offs = tl.arange(0, HALF_BLOCK)
        mask = offs < half
        row = (num_heads + 2 * num_kv_heads) * HEAD_DIM
        src = qkv_ptr + t * row + h * HEAD_DIM
        x1 = tl.load(src + offs, mask=mask, other=0.0)
        x2 = tl.load(src + half + offs, mask=mask, other=0.0)
        if h < num_heads + num_kv_heads:
            c1 = tl.load(cos_ptr + t * HEAD_DIM + offs, mask=mask, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + t * HEAD_DIM + half + offs, mask=mask, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + t * HEAD_DIM + offs, mask=mask, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + t * HEAD_DIM + half + offs, mask=mask, other=0.0).to(tl.float32)
            a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
            # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): fp32, one rounding at the end
            o1 = (a1 * c1 - a2 * s1).to(x1.dtype)
            o2 = (a2 * c2 + a1 * s2).to(x1.dtype)
            if h < num_heads:
                dst = q_ptr + (t * num_heads + h) * HEAD_DIM
            else:
                dst = k_ptr + (t * num_kv_heads + h - num_heads) * HEAD_DIM
            tl.store(dst + offs, o1, mask=mask)
            tl.store(dst + half + offs, o2, mask=mask)
        else:
            dst = v_ptr + (t * num_kv_heads + h - num_heads - num_kv_heads) * HEAD_DIM
            tl.store(dst + offs, x1, mask=mask)
            tl.store(dst + half + offs, x2, mask=mask)


def qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int, *, use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the concatenated projection into q/k/v and rotate q and k (rotate-half RoPE, HF layout).

    Args:
        qkv: ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]``: q, then k, then v.
        cos, sin: ``[num_tokens, head_dim]`` in ``qkv``'s dtype
            (:class:`~trtllm_diffkv.model.rope.RotaryEmbedding`).
        num_heads, num_kv_heads, head_dim: the attention shape.
        use_triton: ``None``: Triton where :func:`use_fused_kernels` (CUDA), torch otherwise.

    Returns:
        contiguous ``q`` ``[num_tokens, num_heads, head_dim]``, ``k`` and ``v``
        ``[num_tokens, num_kv_heads, head_dim]``; q and k rotated.

    Raises:
        ValueError: shapes that disagree.
    """

    n = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or \
            cos.shape != (n, head_dim) or sin.shape != (n, head_dim):
        raise ValueError(f"qkv_rope: qkv {tuple(qkv.shape)} must be [num_tokens, (num_heads + 2 * num_kv_heads) * "
                         f"head_dim] with cos/sin [num_tokens, head_dim={head_dim}] (got {tuple(cos.shape)})")
    if not _triton_for(qkv, use_triton):
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
        return (apply_rope(q.reshape(n, num_heads, head_dim), cos, sin),
                apply_rope(k.reshape(n, num_kv_heads, head_dim), cos, sin),
                v.reshape(n, num_kv_heads, head_dim).contiguous())
    qkv = qkv.contiguous()
    q = torch.empty(n, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(n, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    if n:
        _qkv_rope_kernel[(n, num_heads + 2 * num_kv_heads)](
            qkv, cos.contiguous(), sin.contiguous(), q, k, v, num_heads, num_kv_heads, HEAD_DIM=head_dim,
            HALF_BLOCK=triton.next_power_of_2(head_dim // 2), num_warps=1)
    return q, k, v


# --------------------------------------------------------------------------- key rotation of q/k
if triton is not None:

    @triton.jit
    def _rotate_heads_kernel(q_ptr, k_ptr, r_ptr, q_out_ptr, k_out_ptr, num_heads, num_kv_heads,
                             GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
        # one program per (token, KV head): rows 0 .. GROUP - 1 are the group's query heads, row GROUP the key
        t = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        rows = tl.arange(0, ROWS)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        is_q = rows < GROUP
        is_k = rows == GROUP
        q_row = (t * num_heads + kvh * GROUP + rows)[:, None] * HEAD_DIM
        k_row = (t * num_kv_heads + kvh) * HEAD_DIM + rows[:, None] * 0
        x = tl.load(q_ptr + q_row + d[None, :], mask=is_q[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        x += tl.load(k_ptr + k_row + d[None, :], mask=is_k[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        r_base = r_ptr + kvh.to(tl.int64) * HEAD_DIM * HEAD_DIM
        for j in tl.static_range(0, BLOCK_D, BLOCK_N):
            n = j + tl.arange(0, BLOCK_N)
            n_ok = n < HEAD_DIM
            r = tl.load(r_base + d[:, None] * HEAD_DIM + n[None, :], mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            y = tl.dot(x, r, input_precision="ieee")  # fp32 products and sums, as the einsum
            tl.store(q_out_ptr + q_row + n[None, :], y.to(q_out_ptr.dtype.element_ty), mask=is_q[:, None] & n_ok[None, :])
            tl.store(k_out_ptr + k_row + n[None, :], y.to(k_out_ptr.dtype.element_ty), mask=is_k[:, None] & n_ok[None, :])


def rotate_heads(q: torch.Tensor, k: torch.Tensor, rotation: torch.Tensor, *,
                 use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and queries in rotated coordinates: ``k @ R`` and ``q @ R`` of their KV head (``model/rotation.py``).

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
        k: ``[num_tokens, num_kv_heads, head_dim]``, q's dtype.
        rotation: float32 ``[num_kv_heads, head_dim, head_dim]`` (``Attention.key_rotation``).
        use_triton: ``None``: Triton where :func:`use_fused_kernels` (CUDA), torch otherwise.

    Returns:
        contiguous ``(q @ R, k @ R)`` in q's dtype, computed in fp32 and rounded once. The torch path is the
        einsum the model ran before this kernel (bit-identical on the CPU); the Triton path (one program per
        token and KV head, the group's queries and the key as the rows of one fp32 product; one launch
        instead of the einsums' casts and products) sums in another order: equal but for last-bit flips.

    Raises:
        ValueError: shapes that disagree.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != (n, num_kv_heads, head_dim) or rotation.shape != (num_kv_heads, head_dim, head_dim) or \
            num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"rotate_heads: q {tuple(q.shape)}, k {tuple(k.shape)} and rotation {tuple(rotation.shape)} "
                         "must be [n, num_heads, d], [n, num_kv_heads, d] and [num_kv_heads, d, d]")
    group = num_heads // num_kv_heads
    if not _triton_for(q, use_triton):
        k_rot = torch.einsum("nhd,hde->nhe", k.float(), rotation).to(k.dtype)
        qg = q.float().view(n, num_kv_heads, group, head_dim)
        return torch.einsum("nhgd,hde->nhge", qg, rotation).reshape(q.shape).to(q.dtype), k_rot
    q, k, rotation = q.contiguous(), k.contiguous(), rotation.float().contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if n:
        block_d = max(16, triton.next_power_of_2(head_dim))
        _rotate_heads_kernel[(n, num_kv_heads)](
            q, k, rotation, q_out, k_out, num_heads, num_kv_heads, GROUP=group,
            ROWS=max(16, triton.next_power_of_2(group + 1)), HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_N=min(64, block_d), num_warps=4)
    return q_out, k_out


__all__ = ["qkv_rope", "rms_norm", "rms_norm_reference", "rotate_heads", "silu_mul", "use_fused_kernels"]
