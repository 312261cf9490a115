"""Dense float64 attention, written head by head: the independent oracle of the cache's attention.

GQA/MQA mapping: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
"""
from __future__ import annotations

import math

import torch


def kv_head_of(h: int, num_heads: int, num_kv_heads: int) -> int:
    """The KV head query head ``h`` reads."""
    return h // (num_heads // num_kv_heads)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one sequence starting at position 0, in float64.

    Args:
        q: ``[seq_len, num_heads, head_dim]`` any float dtype.
        k, v: ``[seq_len, num_kv_heads, head_dim]``.

    Returns:
        float64 ``[seq_len, num_heads, head_dim]``.
    """
    seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    out = torch.zeros(seq_len, num_heads, head_dim, dtype=torch.float64)
    for h in range(num_heads):
        kv = kv_head_of(h, num_heads, num_kv_heads)
        for i in range(seq_len):
            keys = k[:i + 1, kv].double().cpu()  # keys 0..i: the causal mask
            logits = keys @ q[i, h].double().cpu() / math.sqrt(head_dim)
            out[i, h] = torch.softmax(logits, 0) @ v[:i + 1, kv].double().cpu()
    return out


def causal_probs_of_query(q: torch.Tensor, k: torch.Tensor, i: int, h: int) -> torch.Tensor:
    """float64 ``[i + 1]``: probabilities query ``i`` of head ``h`` gives keys ``0..i``.

    Shapes as in :func:`causal_attention`.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv = kv_head_of(h, num_heads, k.shape[1])
    logits = k[:i + 1, kv].double().cpu() @ q[i, h].double().cpu() / math.sqrt(head_dim)
    return torch.softmax(logits, 0)


def prompt_score_sums(q: torch.Tensor, k: torch.Tensor, prompt_score_window_tokens: int) -> torch.Tensor:
    """Stored prompt scores: per query head, the sum over the last S queries; then max over the group.

    Args:
        q: ``[prompt_len, num_heads, head_dim]``; k: ``[prompt_len, num_kv_heads, head_dim]``.
        prompt_score_window_tokens: S (clipped to ``prompt_len``).

    Returns:
        float64 ``[num_kv_heads, prompt_len]``.
    """
    prompt_len, num_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    first = prompt_len - min(prompt_score_window_tokens, prompt_len)
    per_query_head = torch.zeros(num_heads, prompt_len, dtype=torch.float64)
    for h in range(num_heads):
        for i in range(first, prompt_len):
            per_query_head[h, :i + 1] += causal_probs_of_query(q, k, i, h)
    sums = torch.full((num_kv_heads, prompt_len), -math.inf, dtype=torch.float64)
    for h in range(num_heads):
        kv = kv_head_of(h, num_heads, num_kv_heads)
        sums[kv] = torch.maximum(sums[kv], per_query_head[h])
    return sums


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per head over each KV head's kept tokens, in float64.

    Args:
        q: ``[num_heads, head_dim]``.
        keys, values: ``[num_kv_heads, seq_len, head_dim]`` (what the cache stores).
        kept: bool ``[num_kv_heads, seq_len]``; each head keeps at least one token.

    Returns:
        ``(out float64 [num_heads, head_dim], probs float64 [num_heads, seq_len])``,
        probabilities exactly 0 at tokens not kept.
    """
    num_heads, head_dim = q.shape
    num_kv_heads, seq_len, _ = keys.shape
    out = torch.zeros(num_heads, head_dim, dtype=torch.float64)
    probs = torch.zeros(num_heads, seq_len, dtype=torch.float64)
    for h in range(num_heads):
        kv = kv_head_of(h, num_heads, num_kv_heads)
        idx = [t for t in range(seq_len) if bool(kept[kv, t])]
        logits = keys[kv, idx].double().cpu() @ q[h].double().cpu() / math.sqrt(head_dim)
        p = torch.softmax(logits, 0)
        probs[h, idx] = p
        out[h] = p @ values[kv, idx].double().cpu()
    return out, probs


def group_max(probs: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """float64 ``[num_kv_heads, seq_len]``: per KV head, the max over its query heads of ``probs [num_heads, seq_len]``."""
    num_heads = probs.shape[0]
    merged = torch.full((num_kv_heads, probs.shape[1]), -math.inf, dtype=torch.float64)
    for h in range(num_heads):
        kv = kv_head_of(h, num_heads, num_kv_heads)
        merged[kv] = torch.maximum(merged[kv], probs[h].double())
    return merged


class DenseBackend:
    """Attention backend without a cache: :func:`causal_attention` over the step's whole sequence.

    Returns the output in q's dtype, on q's device (the oracle computes on the CPU in float64).
    """

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v).to(device=q.device, dtype=q.dtype)
