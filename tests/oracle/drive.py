"""Random-data drivers: run a checked reference cache through a prefill and decode steps."""
from __future__ import annotations

import torch

from tests.oracle.checked_cache import CheckedCache


def random_qkv(seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int, spiky: bool = True):
    """``(q [seq_len, num_heads, head_dim], k, v [seq_len, num_kv_heads, head_dim])`` float32.

    ``spiky``: a tenth of the tokens get 3x keys and queries are doubled, so
    attention is sparse as in real models and every tier outcome occurs.
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_len, num_heads, head_dim, generator=g)
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
    if spiky:
        hitters = torch.randint(0, seq_len, (max(seq_len // 10, 1),), generator=g)
        k[hitters] *= 3
        q *= 2
    return q, k, v


def run_checked(config, num_heads: int, num_kv_heads: int, head_dim: int, prompt_len: int, steps: int,
                seed: int = 0, num_layers: int = 1, spiky: bool = True) -> CheckedCache:
    """Prefill ``prompt_len`` random tokens then ``steps`` decode steps, every step checked.

    Returns:
        The :class:`CheckedCache` (its ``outcomes`` say which rules fired).
    """
    from trtllm_diffkv.cache import DiffKVReferenceCache

    total = prompt_len + steps
    cache = DiffKVReferenceCache(config, num_layers, num_heads, num_kv_heads, head_dim, total)
    checked = CheckedCache(cache)
    data = [random_qkv(total, num_heads, num_kv_heads, head_dim, seed + 1000 * layer, spiky)
            for layer in range(num_layers)]
    for layer, (q, k, v) in enumerate(data):
        checked.forward(layer, q[:prompt_len], k[:prompt_len], v[:prompt_len])
    for t in range(prompt_len, total):
        for layer, (q, k, v) in enumerate(data):
            checked.forward(layer, q[t:t + 1], k[t:t + 1], v[t:t + 1])
    return checked


def spiky_tiny_llama(scale: float = 6.0):
    """The shared tiny random Llama (``conftest.tiny_llama``) with q/k projections scaled by ``scale``.

    Attention is then far from uniform, so no importance sits within rounding
    of ``alpha / N`` (the oracle refuses to judge such ties) and the tiers differ.
    """
    from conftest import tiny_llama

    model = tiny_llama()
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.data *= scale
        layer.self_attn.k_proj.weight.data *= scale
    return model


def teacher_forced(model, backend, prompt: list[int], steps: list[int]) -> torch.Tensor:
    """float32 logits ``[len(prompt) + len(steps), vocab]``: every prompt position, then one per decode step.

    The prompt is one prefill call; each token of ``steps`` is fed as one decode step.
    """
    device = next(model.parameters()).device
    n = len(prompt)
    logits = [model(torch.tensor(prompt, device=device), torch.arange(n, device=device), backend)]
    for i, tok in enumerate(steps):
        logits.append(model(torch.tensor([tok], device=device), torch.tensor([n + i], device=device), backend))
    return torch.cat(logits)
