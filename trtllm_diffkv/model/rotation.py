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

``R = diag(s) H / sqrt(head_dim)``: ``H`` the Sylvester Hadamard matrix,
``s`` random signs from ``torch.Generator`` seeded with ``(seed, layer, KV
head)``: deterministic on every machine. ``head_dim`` must be a power of two
(:data:`~trtllm_diffkv.config.ROTATION_HEAD_DIMS`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ROTATION_HEAD_DIMS, DiffKVConfig


def hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix ``float32 [n, n]`` of +-1 entries (``H H^T = n I``).

    Raises:
        ValueError: ``n`` not a positive power of two.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"head_dim={n}: a Hadamard matrix exists here only for powers of two")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def key_rotation_matrices(num_layers: int, num_kv_heads: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """The randomized Hadamard rotations of a model.

    Args:
        num_layers, num_kv_heads, head_dim: the model's shape; ``head_dim`` in
            :data:`~trtllm_diffkv.config.ROTATION_HEAD_DIMS`.
        seed: ``DiffKVConfig.rotation_seed``.

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
            gen = torch.Generator().manual_seed(((seed * 65537 + layer) * 4099 + head) % (2**63 - 1))
            signs = torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1
            out[layer, head] = signs[:, None] * h
    return out


def rotate_model(model, seed: int = 0):
    """A copy of ``model`` that attends in rotated coordinates (see the module docstring).

    Every tensor but ``v_proj`` and ``o_proj`` is shared with ``model`` (no
    copy; the MLP's concatenated gate/up buffer too, while the rotated attention
    runs its q/k/v products separately); those two are folded in fp32 and stored
    in the model's dtype. Each
    layer's ``self_attn.key_rotation`` holds its ``float32 [num_kv_heads,
    head_dim, head_dim]`` matrices.

    Args:
        model: a :class:`~trtllm_diffkv.model.llama.LlamaForCausalLM` (not rotated already).
        seed: ``DiffKVConfig.rotation_seed``.

    Raises:
        ValueError: another model class, a model already rotated, or an unsupported head_dim.
    """
    from .llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"key_rotation needs a LlamaForCausalLM model; got {type(model).__name__}")
    if model.model.layers[0].self_attn.key_rotation is not None:
        raise ValueError("the model is rotated already")
    mc = model.config
    group = mc.num_heads // mc.num_kv_heads
    rot = key_rotation_matrices(mc.num_layers, mc.num_kv_heads, mc.head_dim, seed).to(model.device)
    weights = dict(model.state_dict())
    for i in range(mc.num_layers):
        r = rot[i]
        p = f"model.layers.{i}.self_attn"
        wv = weights[f"{p}.v_proj.weight"]  # [num_kv_heads * head_dim, hidden]
        wv_rot = torch.einsum("gde,gdk->gek", r, wv.float().view(mc.num_kv_heads, mc.head_dim, -1))
        weights[f"{p}.v_proj.weight"] = wv_rot.reshape(wv.shape).to(wv.dtype)
        if f"{p}.v_proj.bias" in weights:
            bv = weights[f"{p}.v_proj.bias"]
            weights[f"{p}.v_proj.bias"] = torch.einsum(
                "gd,gde->ge", bv.float().view(mc.num_kv_heads, mc.head_dim), r).reshape(bv.shape).to(bv.dtype)
        wo = weights[f"{p}.o_proj.weight"]  # [hidden, num_heads * head_dim]
        r_q = r.repeat_interleave(group, 0)  # [num_heads, head_dim, head_dim]
        wo_rot = torch.einsum("khd,hde->khe", wo.float().view(-1, mc.num_heads, mc.head_dim), r_q)
        weights[f"{p}.o_proj.weight"] = wo_rot.reshape(wo.shape).to(wo.dtype)
    rotated = LlamaForCausalLM.from_weights(mc, weights)
    for i, (src, dst) in enumerate(zip(model.model.layers, rotated.model.layers)):
        dst.self_attn.key_rotation = rot[i].contiguous()
        # from_weights concatenated q/k/v and gate/up into new buffers; share the source's tensors instead
        # (new Parameter objects over them, so a .to() of one model never converts the other's): the rotated
        # attention runs its separate products (its v rows differ), its MLP the source's concatenated buffer.
        attn, mlp = dst.self_attn, dst.mlp
        attn._qkv_weight = attn._qkv_bias = None
        for name in ("q_proj", "k_proj"):
            for attr in ("weight", "bias"):
                tensor = getattr(getattr(src.self_attn, name), attr)
                if tensor is not None:
                    setattr(getattr(attn, name), attr, nn.Parameter(tensor.detach(), requires_grad=False))
        for attr in ("weight", "bias"):
            if getattr(attn.v_proj, attr) is not None:
                setattr(attn.v_proj, attr, nn.Parameter(getattr(attn.v_proj, attr).detach().clone(), requires_grad=False))
        for name in ("gate_proj", "up_proj"):
            setattr(getattr(mlp, name), "weight", nn.Parameter(getattr(src.mlp, name).weight.detach(), requires_grad=False))
        mlp._gate_up_weight = src.mlp._gate_up_weight
    return rotated


def model_for_kv_config(model, kv_config: DiffKVConfig):
    """The model a cache of ``kv_config`` runs with: ``model`` itself, or its rotated copy.

    With ``kv_config.key_rotation == "hadamard"`` the rotated copy
    (:func:`rotate_model`) is made once per (model, seed) and kept on
    ``model`` (attribute ``_rotated_copies``), so several generators share it.

    Raises:
        ValueError: as :func:`rotate_model`.
    """
    if kv_config.key_rotation == "none":
        return model
    copies = model.__dict__.setdefault("_rotated_copies", {})
    key = (kv_config.key_rotation, kv_config.rotation_seed, model.device, model.dtype)
    if key not in copies:
        copies[key] = rotate_model(model, kv_config.rotation_seed)
    return copies[key]
