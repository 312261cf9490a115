"""The contract between a model and the KV cache that serves its attention.

A model never owns KV storage. Every attention layer hands its projected,
position-encoded tensors to an :class:`AttentionBackend` and gets the attention
output back; the backend decides how keys and values are stored (dense FP16,
DiffKV tiers, pages) and which tokens each head still reads. This mirrors
TensorRT-LLM's PyTorch ``AttentionBackend.forward(q, k, v, metadata)``: the
executor describes the step to the backend first (which requests, how many new
tokens each), then runs the model.

Token layout ("packed"): the new tokens of one step, all requests concatenated,
``[num_tokens, num_heads, head_dim]``; the backend knows from its own step
metadata where each request starts.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionBackend(Protocol):
    """What a model layer calls for attention.

    ``forward`` is called once per layer per step, layers in order 0..L-1.
    """

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention for the step's new tokens.

        Args:
            layer_idx: decoder layer index, 0-based.
            q: ``[num_tokens, num_heads, head_dim]`` queries after RoPE, model dtype.
            k: ``[num_tokens, num_kv_heads, head_dim]`` keys after RoPE.
            v: ``[num_tokens, num_kv_heads, head_dim]`` values.

        Returns:
            ``[num_tokens, num_heads, head_dim]`` attention output, model dtype,
            causal over each request's tokens (cached ones and new ones).
        """
        ...


class DenseCausalAttention:
    """Stateless causal attention over one sequence; no cache (parity tests, scoring).

    Treats the ``num_tokens`` tokens as one request starting at position 0.
    GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    """

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        qh = q.transpose(0, 1)  # [num_heads, num_tokens, head_dim]
        kh = k.transpose(0, 1).repeat_interleave(group, dim=0)
        vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        return out.transpose(0, 1)
