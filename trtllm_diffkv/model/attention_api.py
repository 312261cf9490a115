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

Sliding-window layers (Gemma 3's local layers): a backend that serves a model
with such layers exposes ``sliding_windows``, one ``int | None`` per layer
(``None``: full attention), and applies each layer's window to its attention;
the model checks the backend's windows against its own before it runs
(:func:`check_backend_windows`), so a backend built without them fails
loudly instead of attending beyond the window.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from ..policy import window_attention_mask


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


WINDOW_QUERY_BLOCK_TOKENS = 512
"""Queries per SDPA call of :func:`causal_attention` with a sliding window: each block attends only the keys its
window can reach (``block + W - 1`` of them), so a long prompt costs ``O(n (block + W))``, not ``O(n^2)``."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                     first_query_pos: int = 0, sliding_window_tokens: int | None = None) -> torch.Tensor:
    """Causal (optionally sliding-window) attention of one sequence's queries over its keys, torch SDPA.

    The one torch home of prompt attention: the dense backend, the reference cache's prefill, the paged cache's
    torch and chunked prefill and the output half of the Triton scored prefill all call it.

    Args:
        q: ``[m, num_heads, head_dim]``, the queries of positions ``first_query_pos .. first_query_pos + m - 1``.
        k, v: ``[n, num_kv_heads, head_dim]``, the keys and values of positions ``0 .. n - 1``
            (``n >= first_query_pos + m``); GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
        scale: softmax scale (default ``head_dim ** -0.5``).
        first_query_pos: the first query's position.
        sliding_window_tokens: ``W``: query ``i`` attends keys ``i - W < j <= i``
            (:func:`~trtllm_diffkv.policy.window_attention_mask`); ``None``: every key ``j <= i``.

    Returns:
        ``[m, num_heads, head_dim]`` in q's dtype. A whole prompt without a reachable window (``first_query_pos ==
        0``, ``m == n``, ``W`` absent or ``>= n``) runs one ``is_causal`` call over the KV heads repeated per query
        head (the form the reference paths and the evaluation baselines share, so their prefills stay
        bit-identical); otherwise blocks of :data:`WINDOW_QUERY_BLOCK_TOKENS` queries with an explicit mask over
        the keys they can reach.
    """

    m, num_heads, _ = q.shape
    n, num_kv_heads = k.shape[0], k.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    window = sliding_window_tokens
    if first_query_pos == 0 and m == n and (window is None or window >= n):
        group = num_heads // num_kv_heads
        kh, vh = (x.transpose(0, 1).repeat_interleave(group, 0) for x in (k, v))
        return sdpa(q.transpose(0, 1), kh, vh, is_causal=True, scale=scale).transpose(0, 1)
    gqa = dict(enable_gqa=num_heads != num_kv_heads)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    block = m if window is None else WINDOW_QUERY_BLOCK_TOKENS
    out = torch.empty_like(q)
    for a in range(0, m, block):
        b = min(a + block, m)
        hi = first_query_pos + b
        lo = 0 if window is None else max(0, first_query_pos + a - window + 1)
        qpos = torch.arange(first_query_pos + a, hi, device=q.device)
        mask = window_attention_mask(qpos, torch.arange(lo, hi, device=q.device), window)
        o = sdpa(qh[:, :, a:b], kh[:, :, lo:hi], vh[:, :, lo:hi], attn_mask=mask, scale=scale, **gqa)
        out[a:b] = o[0].transpose(0, 1)
    return out


def check_backend_windows(backend, sliding_windows: tuple[int | None, ...]) -> None:
    """Refuse a backend that would not apply a model's sliding windows (module docstring).

    Args:
        backend: the step's :class:`AttentionBackend`.
        sliding_windows: the model's window per layer (``None``: full attention).

    Raises:
        ValueError: the model has a sliding-window layer and ``backend.sliding_windows`` is absent or differs,
            naming what to do.
    """
    if all(w is None for w in sliding_windows):
        return
    have = getattr(backend, "sliding_windows", None)
    if have is None or tuple(have) != tuple(sliding_windows):
        raise ValueError(
            f"the model has sliding-window layers {list(sliding_windows)} but its attention backend "
            f"{type(backend).__name__} applies {None if have is None else list(have)}; build the backend's "
            "kv config with kv_config.for_model(model_config) (DenseCausalAttention(sliding_windows=...))")


class DenseCausalAttention:
    """Stateless causal attention over one sequence; no cache (parity tests, scoring).

    Treats the ``num_tokens`` tokens as one request starting at position 0.
    GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

    Args:
        sliding_windows: one ``int | None`` per layer (a model's ``config.sliding_windows``); ``None``: every
            layer full causal attention.
    """

    def __init__(self, sliding_windows: tuple[int | None, ...] | None = None) -> None:
        self.sliding_windows = None if sliding_windows is None else tuple(sliding_windows)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        window = self.sliding_windows[layer_idx] if self.sliding_windows is not None else None
        return causal_attention(q, k, v, sliding_window_tokens=window)
