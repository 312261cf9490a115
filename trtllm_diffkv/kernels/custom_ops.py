"""Our kernels as PyTorch custom ops (namespace ``diffkv``), so a compiled or exported step can hold them (issue 19).

Each op wraps the direct function unchanged (same kernels, same numerics) behind a ``torch.library.custom_op``
schema with its mutated arguments declared and a fake implementation that only builds empty outputs of the right
shape and dtype (pure-mutation ops return ``None``), so ``torch.compile`` / ``torch.export`` trace through them
without looking inside (Triton launches, host reads of ``cu_seqlens``, the CUDA C++ decode backend).

========================================  ====================================================  ========================
op                                        direct function                                       mutates
========================================  ====================================================  ========================
``diffkv::rms_norm``                      :func:`~trtllm_diffkv.model.fused.rms_norm`, no       --
                                          residual (returns ``normed`` only)
``diffkv::add_rms_norm``                  ``fused.rms_norm`` with ``residual``                  --
                                          (returns ``(normed, x + residual)``)
``diffkv::silu_mul``                      :func:`~trtllm_diffkv.model.fused.silu_mul`           --
``diffkv::qkv_rope``                      :func:`~trtllm_diffkv.model.fused.qkv_rope`           --
``diffkv::rotate_heads``                  :func:`~trtllm_diffkv.model.fused.rotate_heads`       --
``diffkv::paged_decode_attention``        :func:`.decode_attention.paged_decode_attention`      ``out``, ``pool_pages``
                                                                                                (score segments), the
                                                                                                six workspace tensors
``diffkv::write_tokens``                  :func:`.quant_write.write_tokens`                     ``pages``,
                                                                                                ``error_flags``
``diffkv::write_tokens_unflagged``        ``quant_write.write_tokens`` without error flags      ``pages``
``diffkv::scored_prefill_attention``      :func:`.prefill_attention.scored_prefill_attention`   -- (returns fresh
                                                                                                ``(out, score_sums)``)
========================================  ====================================================  ========================

The rule (the one place it lives is :func:`_compiled_through`): **eager code calls the direct functions, and the
wrappers of this module call ``torch.ops.diffkv.*`` only while** ``torch.compiler.is_compiling()``; outside a
trace they call the direct function. The model and the paged cache keep calling the direct functions, so the
eager step pays nothing; code meant to be compiled calls the wrappers here (same signatures as the direct
functions) and pays one flag read in eager. Why: an op call costs Python dispatch on top of the direct call.
Measured on this CPU (torch 2.13, one thread, ``timeit`` best of 7 x 2000 calls, 2026-12-03), microseconds a call:

=====================================================  ======  ===========================  ==========================
call                                                   direct  op (grad mode)               both in ``inference_mode``
=====================================================  ======  ===========================  ==========================
``silu_mul`` ``[1, 8]`` fp32, torch path               5.0     12.7 (the wrapper: 5.3)      3.8 / 8.0
``rms_norm`` ``[1, 8]`` fp32, torch path               10.8    20.5                         9.8 / 15.0
``paged_decode_attention``, 0 sequences (checks only)  8.7     70 (57 under ``no_grad``)    8.6 / 22.6
=====================================================  ======  ===========================  ==========================

A mutating op pays most: torch's Python ``ADInplaceOrView`` kernel of a custom op walks the schema once per
argument (``inference_mode`` skips it), hence the workspace as one ``Tensor[]`` (17 arguments cost 100 us). An
eager prefill step makes about eight such calls per layer. ``tests/kernels/test_custom_ops.py`` prints the
``silu_mul`` row (visible with ``pytest -s``).

Arguments that cannot cross a schema:

* a :class:`~trtllm_diffkv.memory.PageFormat` travels as ``int[]`` (:func:`page_format_ints`, 39 ints: head_dim,
  page and alignment bytes, then per tier its bits, groups, tokens per page, token bytes and the six segments'
  offset and size); the op rebuilds the frozen format from them (:func:`page_format_from_ints`, cached). A list of
  ints, not a process-local registry handle, so a traced or exported graph names its format itself.
* a :class:`~.decode_attention.DecodeWorkspace` travels as its six tensors in one ``Tensor[]`` (declared
  mutated; ``part_m`` first, ``num_partitions`` read from its shape). A compiled step passes its workspace
  (allocated once, outside the graph); ``None`` is refused there (the eager fallback still allocates one).
* the decode launch-tuning knobs (``num_warps``, ``num_stages``, ``tokens_per_step``, ``max_registers``,
  ``cuda_min_blocks``) keep their defaults: the op takes ``backend`` only.

No autograd formula is registered (inference kernels): a backward through an op raises. ``pool_pages`` is declared
mutated even when ``update_scores=False`` (the schema is static; the call then leaves it untouched).
"""
import functools
from typing import Optional

import torch
from torch import Tensor

from ..config import TierConfig
from ..memory.page_format import SEGMENT_NAMES, PageFormat, Segment, TierLayout
from ..model import fused
from . import decode_attention as _decode
from . import prefill_attention as _prefill
from . import quant_write as _write


def _compiled_through(direct):
    """Decorate a wrapper built on ``torch.ops.diffkv``: it runs only while compiling, ``direct`` otherwise."""
    def decorate(traced):
        @functools.wraps(traced)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return traced(*args, **kwargs)
            return direct(*args, **kwargs)
        return call
    return decorate


def _owned(t: Tensor, *inputs: Optional[Tensor]) -> Tensor:
    """``t`` contiguous and sharing no storage with ``inputs`` (a custom op's outputs may not alias its inputs)."""
    t = t.contiguous()
    ptr = t.untyped_storage().data_ptr()
    if t.numel() and any(i is not None and i.untyped_storage().data_ptr() == ptr for i in inputs):
        t = t.clone()
    return t


# --------------------------------------------------------------------------- page formats as int[]
def page_format_ints(page_format: PageFormat) -> list[int]:
    """The 39 ints :func:`page_format_from_ints` rebuilds ``page_format`` from (attribute reads only: traceable)."""
    ints = [page_format.head_dim, page_format.page_size_bytes, page_format.alignment_bytes]
    for lay in (page_format.high, page_format.low):
        t = lay.tier
        ints += [t.key_bits, t.value_bits, t.key_groups, t.value_groups, lay.tokens_per_page, lay.token_bytes]
        for name in SEGMENT_NAMES:
            seg = getattr(lay, name)
            ints += [seg.offset_bytes, seg.size_bytes]
    return ints


_TIER_INTS = 6 + 2 * len(SEGMENT_NAMES)


@functools.lru_cache(maxsize=64)
def _format_of(ints: tuple[int, ...]) -> PageFormat:
    if len(ints) != 3 + 2 * _TIER_INTS:
        raise ValueError(f"a page format is {3 + 2 * _TIER_INTS} ints, got {len(ints)}")
    lays = []
    for base in (3, 3 + _TIER_INTS):
        kb, vb, kg, vg, tokens, token_bytes = ints[base:base + 6]
        segs = [Segment(ints[i], ints[i + 1]) for i in range(base + 6, base + _TIER_INTS, 2)]
        lays.append(TierLayout(TierConfig(kb, vb, kg, vg), tokens, token_bytes, *segs))
    return PageFormat(ints[0], ints[1], ints[2], *lays)


def page_format_from_ints(ints) -> PageFormat:
    """The :class:`PageFormat` that :func:`page_format_ints` encoded (equal to the original; cached).

    Raises:
        ValueError: not 39 ints, or a tier field outside its allowed set.
    """
    return _format_of(tuple(int(i) for i in ints))


# --------------------------------------------------------------------------- the model's fused steps
@torch.library.custom_op("diffkv::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float, use_triton: Optional[bool] = None) -> Tensor:
    return _owned(fused.rms_norm(x, weight, eps, None, use_triton=use_triton)[0], x, weight)


@_rms_norm_op.register_fake
def _(x, weight, eps, use_triton=None):
    return x.new_empty(x.shape)


@torch.library.custom_op("diffkv::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                     use_triton: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    normed, s = fused.rms_norm(x, weight, eps, residual, use_triton=use_triton)
    return _owned(normed, x, residual, weight), _owned(s, x, residual, weight)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, use_triton=None):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("diffkv::silu_mul", mutates_args=())
def _silu_mul_op(gate_up: Tensor, use_triton: Optional[bool] = None) -> Tensor:
    return _owned(fused.silu_mul(gate_up, use_triton=use_triton), gate_up)


@_silu_mul_op.register_fake
def _(gate_up, use_triton=None):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


@torch.library.custom_op("diffkv::qkv_rope", mutates_args=())
def _qkv_rope_op(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 use_triton: Optional[bool] = None) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = fused.qkv_rope(qkv, cos, sin, num_heads, num_kv_heads, head_dim, use_triton=use_triton)
    return tuple(_owned(t, qkv, cos, sin) for t in (q, k, v))  # one token: v is a view of qkv


@_qkv_rope_op.register_fake
def _(qkv, cos, sin, num_heads, num_kv_heads, head_dim, use_triton=None):
    n = qkv.shape[0]
    return (qkv.new_empty(n, num_heads, head_dim), qkv.new_empty(n, num_kv_heads, head_dim),
            qkv.new_empty(n, num_kv_heads, head_dim))


@torch.library.custom_op("diffkv::rotate_heads", mutates_args=())
def _rotate_heads_op(q: Tensor, k: Tensor, rotation: Tensor,
                     use_triton: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    q_rot, k_rot = fused.rotate_heads(q, k, rotation, use_triton=use_triton)
    return _owned(q_rot, q, k, rotation), _owned(k_rot, q, k, rotation)


@_rotate_heads_op.register_fake
def _(q, k, rotation, use_triton=None):
    return q.new_empty(q.shape), q.new_empty(k.shape)


# --------------------------------------------------------------------------- paged decode attention
_WORKSPACE_FIELDS = ("part_m", "part_l", "part_acc", "page_probs", "page_max", "lse", "row_done")
"""The :class:`~.decode_attention.DecodeWorkspace` tensors the op takes, in its field order (``row_done`` last and
only where the workspace has it: the CUDA backend's fused launch counts a row's CTAs there)."""


@torch.library.custom_op("diffkv::paged_decode_attention", mutates_args=("pool_pages", "out", "workspace"))
def _decode_op(q: Tensor, pool_pages: Tensor, page_format: list[int], page_table: Tensor, tier_tokens: Tensor,
               row_ids: Tensor, out: Tensor, workspace: list[Tensor], sm_scale: float, update_scores: bool,
               backend: Optional[str] = None) -> None:
    ws = _decode.DecodeWorkspace(workspace[0].shape[2], *workspace)  # part_m [.., num_partitions, ..] first
    _decode.paged_decode_attention(q, pool_pages, _format_of(tuple(page_format)), page_table, tier_tokens,
                                   row_ids, out, sm_scale=sm_scale, update_scores=update_scores, workspace=ws,
                                   backend=backend)


@_decode_op.register_fake
def _(q, pool_pages, page_format, page_table, tier_tokens, row_ids, out, workspace, sm_scale, update_scores,
      backend=None):
    return None


# --------------------------------------------------------------------------- the KV write
# Two ops, so that no mutated argument is ever None: torch 2.11's functionalization of a mutable Optional[Tensor]
# passed as None failed under Dynamo's fake tensors (IndexError, seen on the H200 with torch 2.11.0+cu130).
@torch.library.custom_op("diffkv::write_tokens", mutates_args=("pages", "error_flags"))
def _write_tokens_op(pages: Tensor, page_format: list[int], tier: str, dest_page: Tensor, dest_slot: Tensor,
                     keys: Tensor, values: Tensor, key_offsets: Optional[Tensor], offset_rows: Optional[Tensor],
                     scores: Optional[Tensor], positions: Optional[Tensor], error_flags: Tensor,
                     error_index: Tensor) -> None:
    _write.write_tokens(pages, _format_of(tuple(page_format)), tier, dest_page, dest_slot, keys, values,
                        key_offsets=key_offsets, offset_rows=offset_rows, scores=scores, positions=positions,
                        error_flags=error_flags, error_index=error_index)


@_write_tokens_op.register_fake
def _(pages, page_format, tier, dest_page, dest_slot, keys, values, key_offsets, offset_rows, scores, positions,
      error_flags, error_index):
    return None


@torch.library.custom_op("diffkv::write_tokens_unflagged", mutates_args=("pages",))
def _write_tokens_unflagged_op(pages: Tensor, page_format: list[int], tier: str, dest_page: Tensor,
                               dest_slot: Tensor, keys: Tensor, values: Tensor, key_offsets: Optional[Tensor],
                               offset_rows: Optional[Tensor], scores: Optional[Tensor],
                               positions: Optional[Tensor]) -> None:
    _write.write_tokens(pages, _format_of(tuple(page_format)), tier, dest_page, dest_slot, keys, values,
                        key_offsets=key_offsets, offset_rows=offset_rows, scores=scores, positions=positions)


@_write_tokens_unflagged_op.register_fake
def _(pages, page_format, tier, dest_page, dest_slot, keys, values, key_offsets, offset_rows, scores, positions):
    return None


# --------------------------------------------------------------------------- scored prefill attention
@torch.library.custom_op("diffkv::scored_prefill_attention", mutates_args=())
def _prefill_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, sm_scale: float,
                num_scoring_queries: int = 64) -> tuple[Tensor, Tensor]:
    out, sums = _prefill.scored_prefill_attention(q, k, v, cu_seqlens, sm_scale=sm_scale,
                                                  num_scoring_queries=num_scoring_queries)
    return _owned(out, q, k, v), _owned(sums, q, k, v)


@_prefill_op.register_fake
def _(q, k, v, cu_seqlens, sm_scale, num_scoring_queries=64):
    return q.new_empty(q.shape), q.new_empty(q.shape[0], k.shape[1], dtype=torch.float32)


# --------------------------------------------------------------------------- the wrappers compiled code calls
@_compiled_through(fused.rms_norm)
def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Optional[Tensor] = None, *,
             use_triton: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """:func:`~trtllm_diffkv.model.fused.rms_norm` (same arguments, shapes, result, errors); traced as
    ``diffkv::rms_norm`` (then ``s`` is ``x`` itself) or ``diffkv::add_rms_norm``."""
    if residual is None:
        return torch.ops.diffkv.rms_norm(x, weight, eps, use_triton), x
    normed, s = torch.ops.diffkv.add_rms_norm(x, residual, weight, eps, use_triton)
    return normed, s


@_compiled_through(fused.silu_mul)
def silu_mul(gate_up: Tensor, *, use_triton: Optional[bool] = None) -> Tensor:
    """:func:`~trtllm_diffkv.model.fused.silu_mul`; traced as ``diffkv::silu_mul``."""
    return torch.ops.diffkv.silu_mul(gate_up, use_triton)


@_compiled_through(fused.qkv_rope)
def qkv_rope(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, *,
             use_triton: Optional[bool] = None) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`~trtllm_diffkv.model.fused.qkv_rope`; traced as ``diffkv::qkv_rope``."""
    q, k, v = torch.ops.diffkv.qkv_rope(qkv, cos, sin, num_heads, num_kv_heads, head_dim, use_triton)
    return q, k, v


@_compiled_through(fused.rotate_heads)
def rotate_heads(q: Tensor, k: Tensor, rotation: Tensor, *,
                 use_triton: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """:func:`~trtllm_diffkv.model.fused.rotate_heads`; traced as ``diffkv::rotate_heads``."""
    q_rot, k_rot = torch.ops.diffkv.rotate_heads(q, k, rotation, use_triton)
    return q_rot, k_rot


@_compiled_through(_decode.paged_decode_attention)
def paged_decode_attention(q: Tensor, pool_pages: Tensor, page_format: PageFormat, page_table: Tensor,
                           tier_tokens: Tensor, row_ids: Tensor, out: Tensor, *, sm_scale: float,
                           update_scores: bool = True, workspace: Optional[_decode.DecodeWorkspace] = None,
                           backend: Optional[str] = None, **tuning) -> None:
    """:func:`~.decode_attention.paged_decode_attention`; traced as ``diffkv::paged_decode_attention`` (writes
    ``out``, the workspace and, with ``update_scores``, the pool's score segments).

    Raises:
        ValueError: while compiling, ``workspace=None`` or a launch-tuning keyword (``num_warps`` ...); the
            direct function's errors when the op runs.
    """
    if workspace is None or tuning:
        raise ValueError("a compiled decode step passes its DecodeWorkspace (allocated once, outside the graph) and "
                         f"no launch-tuning keywords (got {sorted(tuning)})")
    torch.ops.diffkv.paged_decode_attention(
        q, pool_pages, page_format_ints(page_format), page_table, tier_tokens, row_ids, out,
        [t for t in (getattr(workspace, name) for name in _WORKSPACE_FIELDS) if t is not None], sm_scale,
        update_scores, backend)


@_compiled_through(_write.write_tokens)
def write_tokens(pages: Tensor, page_format: PageFormat, tier: str, dest_page: Tensor, dest_slot: Tensor,
                 keys: Tensor, values: Tensor, *, key_offsets: Optional[Tensor] = None,
                 offset_rows: Optional[Tensor] = None, scores: Optional[Tensor] = None,
                 positions: Optional[Tensor] = None, error_flags: Optional[Tensor] = None,
                 error_index: Optional[Tensor] = None) -> None:
    """:func:`~.quant_write.write_tokens`; traced as ``diffkv::write_tokens`` (writes ``pages``, ``error_flags``)
    or, without ``error_flags``, ``diffkv::write_tokens_unflagged`` (writes ``pages``).

    Raises:
        ValueError: as :func:`~.quant_write.write_tokens`, and ``error_flags`` without ``error_index`` or the
            reverse.
    """
    if (error_flags is None) != (error_index is None):
        raise ValueError("write_tokens: error_flags and error_index go together")
    ints = page_format_ints(page_format)
    if error_flags is None:
        torch.ops.diffkv.write_tokens_unflagged(pages, ints, tier, dest_page, dest_slot, keys, values, key_offsets,
                                                offset_rows, scores, positions)
        return
    torch.ops.diffkv.write_tokens(pages, ints, tier, dest_page, dest_slot, keys, values, key_offsets, offset_rows,
                                  scores, positions, error_flags, error_index)


@_compiled_through(_prefill.scored_prefill_attention)
def scored_prefill_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *, sm_scale: float,
                             num_scoring_queries: int = 64, out: Optional[Tensor] = None,
                             score_sums: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """:func:`~.prefill_attention.scored_prefill_attention`; traced as ``diffkv::scored_prefill_attention``
    (functional: given ``out`` / ``score_sums`` are filled by a copy of its results)."""
    o, sums = torch.ops.diffkv.scored_prefill_attention(q, k, v, cu_seqlens, sm_scale, num_scoring_queries)
    if out is not None:
        o = out.copy_(o)
    if score_sums is not None:
        sums = score_sums.copy_(sums)
    return o, sums


__all__ = ["page_format_from_ints", "page_format_ints", "paged_decode_attention", "qkv_rope", "rms_norm",
           "rotate_heads", "scored_prefill_attention", "silu_mul", "write_tokens"]
