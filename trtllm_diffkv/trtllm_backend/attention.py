"""``DiffKVAttention``: a TensorRT-LLM ``AttentionBackend`` that serves the layers from DiffKV's paged cache.

TensorRT-LLM's attention module (``tensorrt_llm/_torch/modules/attention.py``) projects q/k/v, applies
RoPE itself when the backend does not fuse it (``support_fused_rope() == False`` here), and calls
``backend.forward(q, k, v, metadata, forward_args=AttentionForwardArgs(...))`` once per layer per step. This
backend hands those tensors to :meth:`PagedDiffKVCache.forward` (our kernels: the scored prefill that writes the
prompt tiered, and the mixed-precision paged decode attention), for the step that
:class:`~.manager.DiffKVCompressionManager` planned in ``prepare_resources``. The last layer's call also
ends that step (:meth:`PagedDiffKVCache.end_step`): TensorRT-LLM's next hook after the forward,
``on_context_step_end``, already checks that the prompts are committed.

Forwards DiffKV did not plan (TensorRT-LLM's memory estimation and the model engine's warm-up, whose dummy
requests bypass the compression hooks) are served by dense causal attention over each request's new tokens,
outside DiffKV's pool: their outputs are discarded, the pool is untouched. CUDA graph capture is refused by name
(:meth:`DiffKVAttentionMetadata.create_cuda_graph_metadata`): a replay would skip the host-side step planning.

Selected by ``attn_backend="DIFFKV"`` (any case): :func:`~.registration.register` (run when ``config.py`` is
imported) adds the name to TensorRT-LLM's ``get_attention_backend``, which has no registration point.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..model.attention_api import DenseCausalAttention
from .bases import AttentionBackend, AttentionMetadata, PredefinedAttentionMask, merge_attention_forward_args
from .manager import MANAGER_ATTRIBUTE


@dataclass(kw_only=True)
class DiffKVAttentionMetadata(AttentionMetadata):
    """TensorRT-LLM's ``AttentionMetadata`` plus the DiffKV compression manager of its KV cache manager.

    ``prepare()`` (called by the model engine before each forward) finds the manager that
    ``bind_kv_cache_managers`` attached to ``kv_cache_manager`` and asks it whether ``request_ids``,
    ``seq_lens`` and ``num_contexts`` are the step DiffKV planned (``diffkv_step``), or a forward it serves outside
    its pool (estimation, warm-up).

    Raises:
        RuntimeError: (in ``prepare``) no DiffKV compression manager (the LLM was built without
            ``kv_cache_compression_config=DiffKVCompressionConfig(...)``), or a step that disagrees
            with the plan; (in ``create_cuda_graph_metadata``) always: CUDA graphs are refused by name.
    """

    diffkv_manager: Optional[Any] = field(default=None, init=False, repr=False)
    diffkv_step: bool = field(default=False, init=False, repr=False)

    def prepare(self) -> None:
        super().prepare()
        manager = getattr(self.kv_cache_manager, MANAGER_ATTRIBUTE, None)
        if manager is None:
            raise RuntimeError("attn_backend='DIFFKV' needs kv_cache_compression_config=DiffKVCompressionConfig(...): "
                               "no DiffKV compression manager is bound to the KV cache manager")
        self.diffkv_step = manager.check_step(self.request_ids, self.seq_lens.tolist(), self.num_contexts)
        self.diffkv_manager = manager

    def create_cuda_graph_metadata(self, *args, **kwargs):
        """Refused: a CUDA graph replays the captured kernels without the host-side plan of each DiffKV step.

        Raises:
            RuntimeError: always, naming ``cuda_graph_config=None``.
        """
        raise RuntimeError("DiffKV plans every step on the host, which a CUDA graph replay skips: set "
                           "cuda_graph_config=None (TensorRT-LLM captures decode graphs by default)")


class DiffKVAttention(AttentionBackend[DiffKVAttentionMetadata]):
    """Attention from DiffKV's paged cache (``PagedDiffKVCache.forward``) for one layer.

    Args:
        layer_idx, num_heads, head_dim, num_kv_heads, quant_config: TensorRT-LLM's ``AttentionBackend.__init__``
            (its positional parameters); other keywords (``pos_embd_params``, ``q_scaling``, ``mla_params``,
            ``attention_chunk_size``, ``sparse_params``, ``kv_cache_dtype``, ...) as ``create_attention`` passes them.

    Raises:
        ValueError: MLA (``mla_params``), a ``q_scaling`` other than 1 (the cache's softmax scale is
            ``1/sqrt(head_dim)``), chunked attention, sparse attention, or a KV-cache quantization
            (``quant_config.kv_cache_quant_algo``, ``kv_cache_dtype``; DiffKV quantizes the cache itself).
    """

    Metadata = DiffKVAttentionMetadata

    def __init__(self, layer_idx: int, num_heads: int, head_dim: int, num_kv_heads: Optional[int] = None,
                 quant_config=None, **kwargs) -> None:
        super().__init__(layer_idx, num_heads, head_dim, num_kv_heads, quant_config, **kwargs)
        if kwargs.get("mla_params") is not None:
            raise ValueError("DiffKVAttention does not serve MLA (multi-head latent attention) layers")
        if kwargs.get("q_scaling") not in (None, 1.0):
            raise ValueError(f"DiffKVAttention uses the softmax scale 1/sqrt(head_dim); "
                             f"q_scaling={kwargs['q_scaling']}")
        if kwargs.get("attention_chunk_size") is not None:
            raise ValueError("DiffKVAttention does not serve chunked (local) attention")
        if kwargs.get("sparse_params") is not None:
            raise ValueError("DiffKVAttention does not combine with sparse attention (sparse_params)")
        if getattr(quant_config, "kv_cache_quant_algo", None) is not None or \
                kwargs.get("kv_cache_dtype") not in (None, "auto"):
            raise ValueError("DiffKVAttention quantizes the KV cache itself; leave kv_cache_quant_algo unset and "
                             f"kv_cache_config.dtype='auto' (kv_cache_dtype={kwargs.get('kv_cache_dtype')!r})")

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                metadata: DiffKVAttentionMetadata, forward_args=None, **kwargs) -> torch.Tensor:
        """Store the step's new keys and values in DiffKV's pages and attend (one layer).

        Args:
            q: ``[num_tokens, num_heads * head_dim]`` queries after RoPE, the step's packed tokens
                (context requests' prompts first, then one token per generation request).
            k, v: ``[num_tokens, num_kv_heads * head_dim]`` keys after RoPE and values.
            metadata: the step's :class:`DiffKVAttentionMetadata` (``prepare()`` done).
            forward_args: TensorRT-LLM's ``AttentionForwardArgs`` (or its fields as legacy keywords, merged by
                TensorRT-LLM's ``merge_attention_forward_args``): ``attention_mask`` must be causal,
                ``is_fused_qkv`` false.

        With ``key_rotation`` q, k and v are rotated per KV head before the cache sees them and the output
        is rotated back (:meth:`~.manager.DiffKVCompressionManager.key_rotation`).

        The last layer's call ends the step (``PagedDiffKVCache.end_step``). A forward DiffKV did not plan
        (``metadata.diffkv_step`` false: estimation, warm-up) gets dense causal attention over each request's new
        tokens; the pool is untouched.

        Returns:
            ``[num_tokens, num_heads * head_dim]`` in the cache dtype: a view of the cache's output
            buffer, valid until the next layer's call (a new tensor with ``key_rotation``, or outside a plan).

        Raises:
            ValueError: fused QKV (``k`` or ``v`` is ``None``, or ``is_fused_qkv``), a mask other than causal,
                unknown forward arguments (TensorRT-LLM's merge), or shapes the plan refuses
                (``PagedDiffKVCache.forward``: also layers out of order).
            RuntimeError: metadata not prepared.
        """
        args = merge_attention_forward_args(forward_args, kwargs)
        if k is None or v is None or args.is_fused_qkv:
            raise ValueError("DiffKVAttention takes separate q, k, v (support_fused_qkv() is False)")
        if args.attention_mask != PredefinedAttentionMask.CAUSAL:
            raise ValueError(f"DiffKVAttention serves causal attention only, got attention_mask="
                             f"{args.attention_mask!r}")
        manager = metadata.diffkv_manager
        if manager is None:
            raise RuntimeError("DiffKVAttentionMetadata.prepare() must run before the forward")
        n, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        q, k, v = q.reshape(n, self.num_heads, d), k.reshape(n, hkv, d), v.reshape(n, hkv, d)
        if not metadata.diffkv_step:
            return _outside_the_pool(self.layer_idx, q, k, v, metadata.seq_lens.tolist()).reshape(n, -1)
        r = manager.key_rotation(self.layer_idx, q.device)
        if r is not None:  # as model/llama.py (q, k) and the folded v_proj (v), in fp32
            k = torch.einsum("nhd,hde->nhe", k.float(), r).to(k.dtype)
            v = torch.einsum("nhd,hde->nhe", v.float(), r).to(v.dtype)
            q = torch.einsum("nhgd,hde->nhge", q.float().view(n, hkv, -1, d), r).reshape(q.shape).to(q.dtype)
        cache = manager.rm.cache
        out = cache.forward(self.layer_idx, q, k, v)
        if self.layer_idx == cache.num_layers - 1:
            cache.end_step()  # the output buffer is untouched: end_step is host bookkeeping and the prompts' commit
        if r is not None:  # back to the model's coordinates (the folded o_proj's R^T)
            out = torch.einsum("nhge,hde->nhgd", out.float().view(n, hkv, -1, d), r).reshape(out.shape).to(out.dtype)
        return out.reshape(n, self.num_heads * self.head_dim)


def _outside_the_pool(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      seq_lens: list[int]) -> torch.Tensor:
    """Dense causal attention over each request's new tokens alone (``[n, heads, head_dim]`` in, the same out):
    TensorRT-LLM's estimation and warm-up forwards, whose outputs are discarded and whose requests DiffKV's pool
    never holds."""
    dense, out, start = DenseCausalAttention(), torch.empty_like(q), 0
    for length in seq_lens:
        end = start + int(length)
        out[start:end] = dense.forward(layer_idx, q[start:end], k[start:end], v[start:end])
        start = end
    return out
