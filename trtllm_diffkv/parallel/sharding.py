"""Which part of each weight a tensor-parallel rank holds, and the refusals (Megatron-LM, arXiv:1909.08053, section 3).

With ``tp`` ranks, rank ``r`` holds (HF weight names, ``[out_features, in_features]`` layout):

==============================================  ===========================================================
weights                                          rank ``r``'s part
==============================================  ===========================================================
``q_proj`` weight/bias                           rows of query heads ``[r*H/tp, (r+1)*H/tp)`` (column-parallel)
``k_proj``, ``v_proj`` weight/bias               rows of KV heads ``[r*K/tp, (r+1)*K/tp)`` (column-parallel)
``gate_proj``, ``up_proj``                       rows ``[r*I/tp, (r+1)*I/tp)`` (column-parallel)
``o_proj``                                       columns of its query heads (row-parallel: one all-reduce)
``down_proj``                                    columns ``[r*I/tp, (r+1)*I/tp)`` (row-parallel: one all-reduce)
``embed_tokens``, ``lm_head``, norms             the whole tensor (replicated; every rank computes the same
                                                 logits, so no gather is needed)
==============================================  ===========================================================

(``H`` query heads, ``K`` KV heads, ``I`` MLP width.) Query heads ``[r*H/tp, ...)`` attend to KV heads
``[r*K/tp, ...)`` (GQA groups stay whole), so each rank's attention, and its DiffKV cache, is the
single-process attention of those heads: per-head tiers and budgets are decided per head (DiffKV
section 4) and do not change.

Refused by name (:func:`check_tensor_parallel`): ``num_heads``, ``num_kv_heads`` or
``intermediate_size`` not divisible by ``tp``. TensorRT-LLM replicates KV heads when
``num_kv_heads < tp``; here that would split a KV head's query group over ranks, and DiffKV scores a
token by the max over the group's query heads (DiffKV.md "Policy details"), so each replica would
keep different tokens: it is refused instead. ``key_rotation`` works: rank ``r``'s shard rotates its KV heads
with the matrices of their global indices (:func:`load_model_shard` records the first one; ``model/rotation.py``
``first_kv_head``), so the ranks together run exactly the single-process rotated model.
"""
from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from ..model.llama import LlamaForCausalLM, ModelConfig
from .groups import TensorParallelGroup
from ..validators import positive_int

_COLUMN = re.compile(r"\.(self_attn\.(q_proj|k_proj|v_proj)|mlp\.(gate_proj|up_proj))\.(weight|bias)$")
_ROW = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")


def check_tensor_parallel(config: ModelConfig, tensor_parallel_size: int, kv_config=None) -> None:
    """Refuse a model (and DiffKV configuration) that cannot be split over ``tensor_parallel_size`` ranks.

    Raises:
        ValueError: ``tensor_parallel_size`` not a positive int; a model other than the Llama family (Gemma 3:
            its sharding is not written) with more than one rank; ``num_heads``, ``num_kv_heads`` or
            ``intermediate_size`` not divisible by it (each naming the field; see the module docstring
            for why KV heads are not replicated); or ``kv_config`` refusing the whole model (:meth:`DiffKVConfig.validate_for_model`).
    """
    tp = tensor_parallel_size
    positive_int("tensor_parallel_size", tp)
    if tp > 1 and type(config) is not ModelConfig:
        raise ValueError(f"tensor parallelism covers the Llama-family decoders; {config.architecture} runs on one "
                         "device (tensor_parallel_size=1)")
    if config.num_kv_heads % tp:
        raise ValueError(
            f"num_kv_heads={config.num_kv_heads} is not divisible by tensor_parallel_size={tp}: each rank must own "
            "whole KV heads (replicating a KV head would split its query group, whose max scores DiffKV's tiers)")
    if config.num_heads % tp:
        raise ValueError(f"num_heads={config.num_heads} is not divisible by tensor_parallel_size={tp}")
    if config.intermediate_size % tp:
        raise ValueError(f"intermediate_size={config.intermediate_size} is not divisible by tensor_parallel_size={tp}")
    if kv_config is not None:
        kv_config.validate_for_model(config.head_dim, config.num_heads, config.num_kv_heads)


def local_kv_config(kv_config, tensor_parallel_size: int):
    """The DiffKV configuration one rank's cache runs: ``kv_config`` with ``calibrated_for`` (if any) naming
    the rank's head counts (the thresholds are per head, so nothing else changes). Check the whole model
    with :func:`check_tensor_parallel` first."""
    if kv_config.calibrated_for is None or tensor_parallel_size == 1:
        return kv_config
    heads, kv_heads, head_dim = kv_config.calibrated_for
    return dataclasses.replace(kv_config, calibrated_for=(heads // tensor_parallel_size,
                                                          kv_heads // tensor_parallel_size, head_dim))


class WeightShard:
    """Rank ``rank``'s part of every weight (module docstring), for ``load_model(..., shard=...)``.

    Args:
        rank, tensor_parallel_size: the rank and the group's size.

    ``read`` takes a safetensors ``get_slice`` handle (or a tensor: anything indexable with slices and
    ``get_shape()``/``.shape``), so the loader reads only the rank's rows or columns from disk.
    """

    def __init__(self, rank: int, tensor_parallel_size: int) -> None:
        if not 0 <= rank < tensor_parallel_size:
            raise ValueError(f"rank={rank} must be in [0, tensor_parallel_size={tensor_parallel_size})")
        self.rank, self.tp = rank, tensor_parallel_size

    def config(self, config: ModelConfig) -> ModelConfig:
        """The rank's :class:`ModelConfig`: ``num_heads``, ``num_kv_heads`` and ``intermediate_size`` divided by
        ``tp``; everything else (``hidden_size``, ``vocab_size``, ``head_dim``, RoPE) unchanged.

        Raises:
            ValueError: as :func:`check_tensor_parallel`.
        """
        check_tensor_parallel(config, self.tp)
        return dataclasses.replace(config, num_heads=config.num_heads // self.tp,
                                   num_kv_heads=config.num_kv_heads // self.tp,
                                   intermediate_size=config.intermediate_size // self.tp)

    def part(self, name: str, shape: tuple[int, ...]) -> tuple[int, slice] | None:
        """``(dim, slice)`` of the rank's part of tensor ``name`` of full ``shape``; ``None``: the whole tensor."""
        if _COLUMN.search(name):
            dim = 0
        elif _ROW.search(name):
            dim = 1
        else:
            return None
        size = shape[dim]
        if size % self.tp:
            raise ValueError(f"tensor {name!r} dim {dim} ({size}) is not divisible by tensor_parallel_size={self.tp}")
        step = size // self.tp
        return dim, slice(self.rank * step, (self.rank + 1) * step)

    def read(self, name: str, tensor_slice) -> torch.Tensor:
        """The rank's part of ``name`` as a contiguous tensor (only that part is read from a safetensors slice)."""
        shape = tuple(tensor_slice.get_shape() if hasattr(tensor_slice, "get_shape") else tensor_slice.shape)
        part = self.part(name, shape)
        if part is None:
            return tensor_slice[:]
        dim, rows = part
        out = tensor_slice[rows] if dim == 0 else tensor_slice[:, rows]
        return out.contiguous()


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` over the rank's input columns whose output is summed over the ranks (one all-reduce).

    ``x`` ``[num_tokens, in_features / tp]`` (the rank's heads or MLP columns) -> ``[num_tokens,
    out_features]``, the same on every rank. No bias (Llama-family ``o_proj``/``down_proj`` have none;
    a bias would be added ``tp`` times). Megatron-LM section 3.
    """

    def __init__(self, in_features: int, out_features: int, group: TensorParallelGroup) -> None:
        super().__init__(in_features, out_features, bias=False, device="meta")
        self.tp_group = group

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: TensorParallelGroup) -> "RowParallelLinear":
        """The same weight (shared, not copied) in a row-parallel module.

        Raises:
            ValueError: ``linear`` has a bias.
        """
        if linear.bias is not None:
            raise ValueError("a row-parallel linear cannot carry a bias (it would be summed over the ranks)")
        out = cls(linear.in_features, linear.out_features, group)
        out.weight = linear.weight
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp_group.all_reduce_sum_(F.linear(x, self.weight))


def make_row_parallel(model: LlamaForCausalLM, group: TensorParallelGroup) -> LlamaForCausalLM:
    """Turn every layer's ``o_proj`` and ``down_proj`` of a rank's model into :class:`RowParallelLinear`
    (in place; HF parameter names unchanged) and return the model."""
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallelLinear.from_linear(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallelLinear.from_linear(layer.mlp.down_proj, group)
    return model


def load_model_shard(path, group: TensorParallelGroup, dtype: torch.dtype | None = None):
    """Load rank ``group.rank``'s part of a checkpoint onto ``group.device``.

    HF folders: only the rank's rows/columns of each split tensor are read (safetensors slices); the
    embedding, ``lm_head`` and norms are read whole on every rank (replicated). A ``.gguf`` is read from
    its converted safetensors folder (:func:`~trtllm_diffkv.model.loader.checkpoint_folder`: the
    conversion dequantizes the whole file once, on disk; convert before spawning the ranks).

    Returns:
        ``(model, tokenizer, local_config)``: the rank's :class:`LlamaForCausalLM` (its row-parallel
        projections all-reduce over ``group``; ``model._first_kv_head`` the global index of its first KV head,
        which a key rotation of it uses), the tokenizer (or ``None``), the rank's :class:`ModelConfig`.

    Raises:
        FileNotFoundError, ValueError: as :func:`~trtllm_diffkv.model.loader.load_model`, and
            :func:`check_tensor_parallel`'s refusals.
    """
    from ..model.loader import load_model

    model, tokenizer, local_config = load_model(path, device=group.device, dtype=dtype,
                                                shard=WeightShard(group.rank, group.world_size))
    model._first_kv_head = group.rank * local_config.num_kv_heads
    return make_row_parallel(model, group), tokenizer, local_config
