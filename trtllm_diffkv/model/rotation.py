"""Orthogonal key/value rotation: a seeded randomized Hadamard transform per (layer, KV head).

Why (issue 18 section 3): a few key channels with large magnitude (outlier
channels) set every token's quantization step, so 4-bit keys lose the small
channels. An orthogonal ``R`` spreads each channel over all of them
(QuaRot, arXiv:2404.00456; SpinQuant, arXiv:2405.16406), and attention does
not change:

* keys after RoPE become ``k R`` and queries ``q R`` (``R`` of the query
  head's KV head), so ``(q R) . (k R) = q . k``: the logits, the softmax and
  therefore DiffKV's tier scores (attention probabilities) are unchanged;
* values become ``v R`` by folding ``R`` into ``v_proj`` (weight rows and
  bias of each KV head), and the attention output ``o R`` is turned back by
  folding ``R^T`` into ``o_proj`` (the columns of each query head), so the
  layer output is unchanged.

The caches and kernels store and read the rotated keys and values like any
others (they never see ``R``). Keys cannot be folded into ``k_proj``: RoPE
does not commute with ``R``, so the model multiplies them after RoPE
(:class:`~trtllm_diffkv.model.llama.Attention`, fp32 matmul on any device).

``R = diag(s) H / sqrt(head_dim)``: ``H`` a Hadamard matrix of order
``head_dim`` (:func:`hadamard_matrix`: Sylvester's for powers of two, Paley's
construction times Sylvester's for 80 and 96; integer entries, so ``R`` is
orthogonal to fp32 rounding), ``s`` random signs from a CPU
``torch.Generator`` seeded with ``(seed, layer, global KV head)``:
deterministic on every machine, and a tensor-parallel rank uses the rows of
its own KV heads (``first_kv_head``). Every head_dim of
:data:`~trtllm_diffkv.config.ROTATION_HEAD_DIMS` has one.

Two ways to apply it: :func:`rotate_model` makes a copy for a model the caller
keeps (the copy shares every tensor but ``v_proj`` / ``o_proj``);
:func:`rotate_model_` rotates a model the product loaded itself in place (no
second copy of any weight). :func:`model_for_kv_config` picks.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ROTATION_HEAD_DIMS, DiffKVConfig
from .fused import use_fused_kernels


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _paley_hadamard(q: int) -> torch.Tensor:
    """Paley's construction I: a Hadamard matrix of order ``q + 1`` for a prime ``q = 3 (mod 4)``.

    ``H = I + [[0, 1^T], [-1, Q]]`` with ``Q[i, j] = chi(j - i)``, ``chi`` the quadratic character mod ``q``.
    """
    chi = [-1] * q
    chi[0] = 0
    for x in range(1, q):
        chi[x * x % q] = 1
    idx = torch.arange(q)
    s = torch.zeros(q + 1, q + 1)
    s[0, 1:], s[1:, 0] = 1, -1
    s[1:, 1:] = torch.tensor(chi, dtype=torch.float32)[(idx[None, :] - idx[:, None]) % q]
    return torch.eye(q + 1) + s


def hadamard_matrix(n: int) -> torch.Tensor:
    """A Hadamard matrix ``float32 [n, n]`` of +-1 entries (``H H^T = n I``, exact).

    Powers of two: Sylvester's construction. Otherwise ``n = 2^a (q + 1)`` with ``q`` a prime
    ``= 3 (mod 4)`` (80 = 79 + 1; 96 = 2 (47 + 1)): Sylvester's ``2^a`` times Paley's ``q + 1``
    (Kronecker product), the smallest ``a`` that works.

    Raises:
        ValueError: ``n`` of neither form, naming it.
    """
    if n < 1:
        raise ValueError(f"head_dim={n}: no Hadamard matrix of that order")
    base, sylvester = torch.ones(1, 1), n
    if n & (n - 1):  # not a power of two: find 2^a (q + 1)
        sylvester = 1
        while n % sylvester == 0 and not (_is_prime(n // sylvester - 1) and (n // sylvester - 1) % 4 == 3):
            sylvester *= 2
        if n % sylvester:
            raise ValueError(f"head_dim={n}: no Hadamard construction here (a power of two, or 2^a (q + 1) with q "
                             "a prime = 3 mod 4)")
        base = _paley_hadamard(n // sylvester - 1)
    h = torch.ones(1, 1)
    while h.shape[0] < sylvester:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.kron(h, base)


def key_rotation_matrices(num_layers: int, num_kv_heads: int, head_dim: int, seed: int = 0,
                          first_kv_head: int = 0) -> torch.Tensor:
    """The randomized Hadamard rotations of a model (or of a tensor-parallel rank's KV heads).

    Args:
        num_layers, num_kv_heads, head_dim: the model's shape (a rank's: its KV heads);
            ``head_dim`` in :data:`~trtllm_diffkv.config.ROTATION_HEAD_DIMS`.
        seed: ``DiffKVConfig.rotation_seed``.
        first_kv_head: global index of the first KV head (rank ``r`` of ``tp``: ``r * num_kv_heads``):
            head ``h`` gets the signs of global head ``first_kv_head + h``, so the ranks together hold
            exactly the single-process matrices.

    Returns:
        ``float32 [num_layers, num_kv_heads, head_dim, head_dim]`` orthogonal
        matrices on the CPU; ``x @ R[layer, head]`` rotates a row vector.

    Raises:
        ValueError: ``head_dim`` not supported, naming it.
    """
    if head_dim not in ROTATION_HEAD_DIMS:
        raise ValueError(f"key_rotation='hadamard' needs head_dim in {list(ROTATION_HEAD_DIMS)}; got "
                         f"head_dim={head_dim}")
    h = hadamard_matrix(head_dim) / math.sqrt(head_dim)
    out = torch.empty(num_layers, num_kv_heads, head_dim, head_dim)
    for layer in range(num_layers):
        for head in range(num_kv_heads):
            g = first_kv_head + head
            gen = torch.Generator().manual_seed(((seed * 65537 + layer) * 4099 + g) % (2**63 - 1))
            signs = torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1
            out[layer, head] = signs[:, None] * h
    return out


def _folded(model, seed: int, first_kv_head: int | None):
    """Per layer: ``(R, v_proj weight, v_proj bias or None, o_proj weight)`` rotated, in the model's dtype."""
    from .gemma3 import Gemma3ForCausalLM
    from .llama import LlamaForCausalLM

    if not isinstance(model, (LlamaForCausalLM, Gemma3ForCausalLM)):
        raise ValueError(f"key_rotation needs a LlamaForCausalLM or Gemma3ForCausalLM model; got {type(model).__name__}")
    if rotation_of(model) is not None:
        raise ValueError("the model is rotated already")
    mc = model.config
    group = mc.num_heads // mc.num_kv_heads
    if first_kv_head is None:  # a tensor-parallel shard records its first KV head (parallel/sharding.py)
        first_kv_head = getattr(model, "_first_kv_head", 0)
    rot = key_rotation_matrices(mc.num_layers, mc.num_kv_heads, mc.head_dim, seed, first_kv_head).to(model.device)
    for layer, r in zip(model.model.layers, rot):
        attn = layer.self_attn
        wv, bv, wo = attn.v_proj.weight, attn.v_proj.bias, attn.o_proj.weight
        wv_rot = torch.einsum("gde,gdk->gek", r, wv.float().view(mc.num_kv_heads, mc.head_dim, -1))
        bv_rot = None if bv is None else torch.einsum(
            "gd,gde->ge", bv.float().view(mc.num_kv_heads, mc.head_dim), r).reshape(bv.shape).to(bv.dtype)
        r_q = r.repeat_interleave(group, 0)  # [num_heads, head_dim, head_dim]
        wo_rot = torch.einsum("khd,hde->khe", wo.float().view(-1, mc.num_heads, mc.head_dim), r_q)
        yield r.contiguous(), wv_rot.reshape(wv.shape).to(wv.dtype), bv_rot, wo_rot.reshape(wo.shape).to(wo.dtype)


def rotation_of(model) -> int | None:
    """The ``rotation_seed`` of a model rotated by :func:`rotate_model` / :func:`rotate_model_`, else ``None``."""
    return getattr(model, "_key_rotation_seed", None)


def rotate_model_(model, seed: int = 0, first_kv_head: int | None = None):
    """Rotate ``model`` in place (see the module docstring) and return it: for a model the product loaded itself.

    ``v_proj`` (weight rows and bias; they are row views of the concatenated q/k/v buffer, which therefore stays
    valid) and ``o_proj`` are overwritten with their folded values, ``self_attn.key_rotation`` set. No weight
    exists twice; the transient extra memory is one layer's fp32 ``v_proj`` and ``o_proj``. A row-parallel
    ``o_proj`` (a tensor-parallel rank, ``parallel/sharding.py``) keeps its wrapper.

    Args:
        model: a :class:`~trtllm_diffkv.model.llama.LlamaForCausalLM` (not rotated already), a rank's shard
            included.
        seed: ``DiffKVConfig.rotation_seed``.
        first_kv_head: global index of the model's first KV head (:func:`key_rotation_matrices`); ``None``:
            the one a tensor-parallel shard records (``model._first_kv_head``), else 0.

    Raises:
        ValueError: another model class, a model already rotated, or an unsupported head_dim.
    """
    with torch.no_grad():
        for layer, (r, wv, bv, wo) in zip(model.model.layers, _folded(model, seed, first_kv_head)):
            attn = layer.self_attn
            attn.v_proj.weight.copy_(wv)
            if bv is not None:
                attn.v_proj.bias.copy_(bv)
            attn.o_proj.weight.copy_(wo)
            attn.key_rotation = r
    model._key_rotation_seed = seed
    return model


def rotate_model(model, seed: int = 0, first_kv_head: int | None = None):
    """A copy of ``model`` that attends in rotated coordinates (see the module docstring): for a caller's model.

    Every tensor but ``v_proj`` and ``o_proj`` is shared with ``model`` (no copy: the gate/up buffers too). So
    while both models live, ``v_proj`` and ``o_proj`` exist twice: ``num_layers * (num_kv_heads + num_heads) *
    head_dim * hidden_size`` extra elements of the model's dtype (and the bias), plus the fp32 rotations
    (``num_layers * num_kv_heads * head_dim**2 * 4`` bytes). On CUDA (where the fused kernels run) a source with
    concatenated q/k/v weights gives the copy its own concatenated buffer of q, k and its rotated v rows, so
    its attention runs one q/k/v product as the source's does (three products and their concatenation cost
    SmolLM2's decode step ~0.3 ms on the H200): ``q_proj`` / ``k_proj`` exist twice too, another
    ``num_layers * (num_heads + num_kv_heads) * head_dim * hidden_size`` elements (1.3 GB at Llama-3-8B in
    bf16). The product's own models rotate in place instead (:func:`rotate_model_`, no copy at all). Each layer's ``self_attn.key_rotation`` holds its
    ``float32 [num_kv_heads, head_dim, head_dim]`` matrices.

    Args:
        model: a :class:`~trtllm_diffkv.model.llama.LlamaForCausalLM` (not rotated already).
        seed: ``DiffKVConfig.rotation_seed``.
        first_kv_head: as :func:`rotate_model_`.

    Raises:
        ValueError: another model class, a model already rotated, or an unsupported head_dim.
    """
    import copy

    folded = list(_folded(model, seed, first_kv_head))
    # New modules over the same tensors: new Parameter objects (a .to() of one model never converts the
    # other's), the same buffers and concatenated q/k/v, gate/up tensors; none of the source's rotated copies.
    memo = {id(model._rotated_copies): {}} if "_rotated_copies" in model.__dict__ else {}
    for module in model.modules():
        if hasattr(module, "tp_group"):  # a row-parallel projection of a shard: the same process group
            memo[id(module.tp_group)] = module.tp_group
        for p in module._parameters.values():
            if p is not None and id(p) not in memo:
                memo[id(p)] = nn.Parameter(p.detach(), requires_grad=False)
        for t in list(module._buffers.values()) + list(module.__dict__.values()):
            if isinstance(t, torch.Tensor):
                memo[id(t)] = t

    rotated = copy.deepcopy(model, memo)
    rotated.__dict__.pop("_rotated_copies", None)
    for source, layer, (r, wv, bv, wo) in zip(model.model.layers, rotated.model.layers, folded):
        attn = layer.self_attn
        attn._qkv_weight = attn._qkv_bias = None  # the shared buffer holds the unrotated v rows
        attn.v_proj.weight = nn.Parameter(wv, requires_grad=False)
        if bv is not None:
            attn.v_proj.bias = nn.Parameter(bv, requires_grad=False)
        attn.o_proj.weight = nn.Parameter(wo, requires_grad=False)
        attn.key_rotation = r
        if source.self_attn._qkv_weight is not None and use_fused_kernels(wv):
            attn.fuse_projections()  # one q/k/v product where the fused kernels run: q and k rows copied
    rotated._key_rotation_seed = seed
    return rotated


def model_for_kv_config(model, kv_config: DiffKVConfig, *, in_place: bool = False):
    """The model a cache of ``kv_config`` runs with: ``model`` itself, or ``model`` rotated.

    With ``kv_config.key_rotation == "hadamard"``: a model already rotated with ``rotation_seed`` is returned
    as it is; otherwise ``in_place=True`` (the product loaded the model and keeps no unrotated use of it)
    rotates it in place (:func:`rotate_model_`), and ``in_place=False`` (a caller's model) makes the rotated
    copy (:func:`rotate_model`) once per (model, seed, device, dtype), kept on ``model`` (attribute
    ``_rotated_copies``) so several generators share it.

    Raises:
        ValueError: as :func:`rotate_model`; a rotated model with ``key_rotation="none"`` or another seed.
    """
    done = rotation_of(model)
    if kv_config.key_rotation == "none":
        if done is not None:
            raise ValueError(f"this model was rotated for key_rotation='hadamard' (rotation_seed={done}); a "
                             "kv_config with key_rotation='none' needs the unrotated model")
        return model
    if done is not None:
        if done != kv_config.rotation_seed:
            raise ValueError(f"this model was rotated with rotation_seed={done}; the kv_config asks for "
                             f"rotation_seed={kv_config.rotation_seed}")
        return model
    if in_place:
        return rotate_model_(model, kv_config.rotation_seed)
    copies = model.__dict__.setdefault("_rotated_copies", {})
    key = (kv_config.key_rotation, kv_config.rotation_seed, model.device, model.dtype)
    if key not in copies:
        copies[key] = rotate_model(model, kv_config.rotation_seed)
    return copies[key]
