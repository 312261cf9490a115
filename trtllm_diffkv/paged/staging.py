"""Full-precision staging of a prompt prefilled in chunks (chunked prefill with DiffKV's prompt compaction).

DiffKV tiers and quantizes a prompt from the scores its last ``S = prompt_score_window_tokens``
queries give every token (paper section 4.2; ``DiffKV.md`` "Policy details"), so nothing of a
prompt may be quantized before its last chunk has run. A prompt split over several steps
(TensorRT-LLM's chunked context, ``enable_chunked_prefill``) therefore keeps, until its final chunk:

* every layer's keys and values of the chunks so far, in the model dtype (``[L, n, H_kv, D]`` each),
  which the next chunks attend over;
* the queries of its last ``min(S, n)`` positions (``[L, min(S, n), H_q, D]``), which score the
  whole prompt at the final chunk exactly as an unchunked prefill does, also when they fall in
  earlier chunks (a final chunk shorter than ``S``).

The final chunk's layers then tier and quantize all ``n`` tokens into the pages reserved at the
first chunk (``reserve_prompt``: all tokens counted high), and the staging is dropped: the
compaction point is TensorRT-LLM's ``on_context_step_end``. The staging tensors live outside the
page pool; :class:`PagedDiffKVCache` counts their bytes against ``staging_limit_bytes`` and the
executor admits a chunked prompt only when its staging fits (docs/RUNTIME.md, "Chunked prefill").
Whether it fits is :func:`staging_fits`, the one rule the cache's plan, the scheduler's admission and the
executor's request check all call: a prompt whose staging exactly fills the limit fits (admitted by one and
refused by another, it was retried every step, stalling every other request's decodes).
"""
from __future__ import annotations

import torch


def staging_bytes(num_layers: int, num_kv_heads: int, num_heads: int, head_dim: int, prompt_tokens: int,
                  scoring_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of one prompt's staging: K and V of ``prompt_tokens`` tokens + ``min(scoring_tokens, n)`` queries.

    Args:
        num_layers, num_kv_heads, num_heads, head_dim: the model shape.
        prompt_tokens: the whole prompt's tokens ``n``.
        scoring_tokens: ``prompt_score_window_tokens`` (0 when nothing is scored: the ``fp16`` preset).
        dtype: the model dtype the staging keeps.
    """
    kv = 2 * num_layers * prompt_tokens * num_kv_heads * head_dim
    q = num_layers * min(scoring_tokens, prompt_tokens) * num_heads * head_dim
    return (kv + q) * dtype.itemsize


def staging_fits(new_bytes: int, held_bytes: int, limit_bytes: int) -> bool:
    """Whether new chunked prompts may start their staging: ``held_bytes + new_bytes <= limit_bytes``.

    The one home of the staging limit (module docstring): an exact fill fits, one byte more does not.

    Args:
        new_bytes: the staging the new prompts would hold (:func:`staging_bytes` of each, summed).
        held_bytes: what the half-prefilled prompts hold now (0: the prompts alone in an empty staging).
        limit_bytes: ``staging_limit_bytes`` (the executor's ``chunk_staging_bytes``).
    """
    return held_bytes + new_bytes <= limit_bytes


class PromptStaging:
    """One half-prefilled prompt's full-precision K/V and scoring queries (module docstring).

    Args:
        num_layers, num_kv_heads, num_heads, head_dim: the model shape.
        prompt_tokens: the whole prompt's tokens ``n``.
        scoring_tokens: ``prompt_score_window_tokens`` (0: no queries kept).
        dtype, device: the model dtype and the cache device.

    Attributes:
        keys, values: ``[num_layers, n, num_kv_heads, head_dim]``; positions ``[0, filled_tokens)`` hold the
            chunks that ran, the rest is unwritten (never read).
        queries: ``[num_layers, min(S, n), num_heads, head_dim]``; row ``j`` is the query of prompt position
            ``n - min(S, n) + j``, written when its chunk runs.
        filled_tokens: prompt tokens whose chunk ran in every layer.
        size_bytes: what :func:`staging_bytes` counts.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, num_heads: int, head_dim: int, prompt_tokens: int,
                 scoring_tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        self.prompt_tokens, self.filled_tokens = prompt_tokens, 0
        self.num_scoring = min(scoring_tokens, prompt_tokens)
        self.keys = torch.empty(num_layers, prompt_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.queries = torch.empty(num_layers, self.num_scoring, num_heads, head_dim, dtype=dtype, device=device)
        self.size_bytes = staging_bytes(num_layers, num_kv_heads, num_heads, head_dim, prompt_tokens, scoring_tokens,
                                        dtype)

    def put(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep one chunk's keys, values and scoring queries of ``layer``.

        Args:
            layer: 0-based layer.
            start: the chunk's first prompt position.
            q: ``[c, num_heads, head_dim]``; k, v: ``[c, num_kv_heads, head_dim]`` of positions ``[start, start + c)``.
        """
        end = start + k.shape[0]
        self.keys[layer, start:end] = k
        self.values[layer, start:end] = v
        first = self.prompt_tokens - self.num_scoring  # the first scoring position
        lo = max(start, first)
        if lo < end:
            self.queries[layer, lo - first:end - first] = q[lo - start:]

    def scoring_queries(self, layer: int) -> torch.Tensor:
        """``[n, num_heads, head_dim]`` for :func:`~trtllm_diffkv.kernels.prefill_attention.prompt_scores`: the kept
        queries in the last ``min(S, n)`` rows, zeros elsewhere (rows the scores never read)."""
        q = self.queries.new_zeros(self.prompt_tokens, *self.queries.shape[2:])
        q[self.prompt_tokens - self.num_scoring:] = self.queries[layer]
        return q
