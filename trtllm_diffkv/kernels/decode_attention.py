"""Paged DiffKV decode attention over mixed-precision unified pages (paper sections 5-6).

One query token per sequence attends to every stored token of its (sequence,
layer, KV head) row, both tiers, reading the packed codes straight from the
pool's pages (``KVCachePool.pages()``): the high tier's pages from the left of
the page-table row, the low tier's from the right (``memory/page_manager.py``),
each page's tokens laid out as ``KVCachePool.segment`` documents. Optionally
the attention probabilities are added to each token's score segment (the
DiffKV importance accumulator, max over the query heads of a KV head).

Host side (:class:`DecodeWorkspace`) is separate from the launch: the
workspace is allocated once for a maximum batch and reused; the call does no
host synchronisation and no allocation when given one, so it can be captured
in a CUDA graph (tested). Kernels (three launches: partial, merge, score):
:mod:`.attn_decode_kernels`; in CUDA C++ (:mod:`.cuda_decode`, the default on CUDA where it covers the
configuration) two launches: the partial kernel, then the merge with the score update folded in. Measured speed: ``docs/PERFORMANCE.md``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..memory.page_format import PageFormat, TierLayout
from .attn_decode_kernels import LOG2E, _decode_merge_kernel, _decode_partial_kernel, _decode_score_kernel
from .cuda_decode import CudaDecodeKernels, choose_backend
from .sizes import next_pow2

SUPPORTED_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_GROUP = 64
FAST_CONVERT = True
MAX_STACK_ROWS = 32
"""Most (quantization group, query head) rows one program's products stack; larger groups are split."""
FOLD_WIDE_FALLBACK = True
"""Tiers whose folded products would stack 32 rows use the dequantize-in-registers loop (False: fold all)."""
DEFAULT_MAX_REGISTERS = 128
"""Register cap of the main kernel at 4 warps: 4 programs (16 warps) per multiprocessor instead of 3
(H200, 2026-11-30: 244 us against 284 us uncapped, Llama-3-8B 64 x 4096 all-high; docs/PERFORMANCE.md)."""
"""Most (quantization group, query head) rows one program's products stack; larger groups are split."""
"""Convert codes to fp16 with the PTX byte permutes (GPU, fp16 products); False: Triton's per-element path (A/B)."""
"""Largest query:KV head ratio the kernels accept (the M dimension of one program's matrix products)."""



def default_num_partitions(num_seqs: int, num_kv_heads: int, max_pages_per_row: int,
                           device: torch.device | str | None = None) -> int:
    """Partitions per row so that the grid fills about two waves of four programs per multiprocessor.

    Four programs fit per multiprocessor (128 registers); at least ~1.9 waves
    keeps the last, partial wave small (H200, 2026-11-30: the default model's
    768 rows, 1.45 waves in one partition, ran 15 % faster in two; Llama's 512
    rows in two partitions, 1.9 waves, beat four). Each partition reads at
    least ~8 pages of each tier; long rows in small batches get more
    partitions (split-K).
    """
    sms = 132
    if device is not None and torch.device(device).type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = max(1, num_seqs * num_kv_heads)
    want = -(-76 * sms // (10 * rows))
    return int(max(1, min(want, -(-max_pages_per_row // 8), 64)))


@dataclass
class DecodeWorkspace:
    """Preallocated scratch of :func:`paged_decode_attention` (reuse it across steps; graph-safe).

    Attributes:
        num_partitions: split of every row into this many partitions (split-K).
        part_m, part_l: fp32 ``[num_seqs, num_kv_heads, num_partitions, 2, group_pad]``
            per partition and tier, base-2 running max and sum of each query head.
        part_acc: fp32 ``[num_seqs, num_kv_heads, num_partitions, 2, group_pad, block_d]``
            unnormalized outputs.
        page_probs: fp16 ``[num_seqs, num_kv_heads, max_pages_per_row, group, max_tokens_per_page]``
            probabilities relative to ``page_max`` (score updates only).
        page_max: fp32 ``[num_seqs, num_kv_heads, max_pages_per_row, group]`` the
            base-2 running max each page's probabilities are relative to.
        lse: fp32 ``[num_seqs, num_kv_heads, group_pad]`` final base-2 log-sum-exp per query head.
        row_done: int32 ``[num_seqs, num_kv_heads]``, zero between launches: the CTAs of a row that have written
            their partial state, counted by the CUDA backend's fused launch (its last CTA merges the row and sets it
            back to zero); ``None`` (views built from bare buffers): that backend runs the merge as a second launch.
    """

    num_partitions: int
    part_m: torch.Tensor
    part_l: torch.Tensor
    part_acc: torch.Tensor
    page_probs: torch.Tensor
    page_max: torch.Tensor
    lse: torch.Tensor
    row_done: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_seqs: int, num_heads: int, num_kv_heads: int, page_format: PageFormat,
                 max_pages_per_row: int, device: torch.device | str, num_partitions: int | None = None,
                 update_scores: bool = True) -> "DecodeWorkspace":
        """Scratch for up to ``num_seqs`` sequences of this shape (``num_partitions``: default heuristic).

        Raises:
            ValueError: non-positive sizes, or ``num_heads`` not a multiple of ``num_kv_heads``.
        """
        _check_heads(num_heads, num_kv_heads)
        if num_seqs < 1 or max_pages_per_row < 1:
            raise ValueError(f"num_seqs={num_seqs} and max_pages_per_row={max_pages_per_row} must be >= 1")
        if num_partitions is None:
            num_partitions = default_num_partitions(num_seqs, num_kv_heads, max_pages_per_row, device)
        if num_partitions < 1:
            raise ValueError(f"num_partitions={num_partitions} must be >= 1")
        group = num_heads // num_kv_heads
        gp, bd = max(16, next_pow2(group)), next_pow2(page_format.head_dim)
        pmax = max(page_format.high_tokens_per_page, page_format.low_tokens_per_page)
        rows = (num_seqs, num_kv_heads)
        f32 = dict(dtype=torch.float32, device=device)
        probs_shape = rows + (max_pages_per_row, group, pmax) if update_scores else (1,)
        max_shape = rows + (max_pages_per_row, group) if update_scores else (1,)
        return cls(num_partitions,
                   torch.empty(rows + (num_partitions, 2, gp), **f32),
                   torch.empty(rows + (num_partitions, 2, gp), **f32),
                   torch.empty(rows + (num_partitions, 2, gp, bd), **f32),
                   torch.empty(probs_shape, dtype=torch.float16, device=device),
                   torch.empty(max_shape, **f32),
                   torch.empty(rows + (gp,), **f32),
                   torch.zeros(rows, dtype=torch.int32, device=device))


def _check_heads(num_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
    if num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"query:KV head ratio {num_heads // num_kv_heads} exceeds the supported {MAX_GROUP}")


def _tier_args(lay: TierLayout, head_dim: int, tokens_per_step: int = 64) -> dict:
    tier = lay.tier
    for side, bits, groups in (("key", tier.key_bits, tier.key_groups), ("value", tier.value_bits, tier.value_groups)):
        if bits not in (2, 4, 8, 16):
            raise ValueError(f"tier {tier.name}: {side}_bits={bits} has no decode kernel")
        if bits < 16 and groups not in (1, 2, 4):
            raise ValueError(f"tier {tier.name}: {side}_groups={groups} has no decode kernel")
        if bits < 16 and (head_dim % groups or (head_dim // groups * bits) % 8):
            raise ValueError(f"tier {tier.name}: {side} groups={groups} at {bits} bits do not pack head_dim={head_dim}")
    ppi = max(1, tokens_per_step // next_pow2(lay.tokens_per_page))  # pages per loop step
    return dict(TOKENS=lay.tokens_per_page, PPI=ppi, BLOCK_T=max(16, next_pow2(ppi * lay.tokens_per_page)),
                KB=tier.key_bits, KG=tier.key_groups, VB=tier.value_bits, VG=tier.value_groups,
                KC=lay.key_codes.offset_bytes, KM=lay.key_meta.offset_bytes, VC=lay.value_codes.offset_bytes,
                VM=lay.value_meta.offset_bytes, SC=lay.score.offset_bytes, HAS_SCORE=lay.score.size_bytes > 0)


def _check_inputs(q, pool_pages, page_format, page_table, tier_tokens, row_ids, out, update_scores):
    if not isinstance(page_format, PageFormat):
        raise ValueError(f"page_format must be a PageFormat, got {type(page_format).__name__}")
    if q.dim() != 3 or q.dtype not in SUPPORTED_Q_DTYPES:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim] fp16/bf16/fp32, got {tuple(q.shape)} {q.dtype}")
    num_seqs, num_heads, head_dim = q.shape
    if head_dim != page_format.head_dim:
        raise ValueError(f"q head_dim={head_dim} differs from the page format's {page_format.head_dim}")
    if row_ids.dim() != 2 or row_ids.shape[0] != num_seqs or row_ids.dtype != torch.int32:
        raise ValueError(f"row_ids must be int32 [num_seqs={num_seqs}, num_kv_heads], "
                         f"got {tuple(row_ids.shape)} {row_ids.dtype}")
    _check_heads(num_heads, row_ids.shape[1])
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    if pool_pages.dtype != torch.uint8 or pool_pages.dim() != 2 or pool_pages.shape[1] != page_format.page_size_bytes \
            or not pool_pages.is_contiguous():
        raise ValueError(f"pool_pages must be contiguous uint8 [num_pages, {page_format.page_size_bytes}], "
                         f"got {tuple(pool_pages.shape)} {pool_pages.dtype}")
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or not page_table.is_contiguous():
        raise ValueError(f"page_table must be contiguous int32 [num_rows, max_pages_per_row], got {page_table.dtype}")
    if tier_tokens.dtype != torch.int32 or tier_tokens.shape != (page_table.shape[0], 2) \
            or not tier_tokens.is_contiguous():
        raise ValueError(f"tier_tokens must be contiguous int32 [{page_table.shape[0]}, 2], "
                         f"got {tuple(tier_tokens.shape)} {tier_tokens.dtype}")
    devices = {t.device for t in (q, pool_pages, page_table, tier_tokens, row_ids, out)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if update_scores and page_format.high.score.size_bytes == 0:
        raise ValueError("update_scores=True but the page format has no score segment (uncompressed preset)")


def paged_decode_attention(q: torch.Tensor, pool_pages: torch.Tensor, page_format: PageFormat,
                           page_table: torch.Tensor, tier_tokens: torch.Tensor, row_ids: torch.Tensor,
                           out: torch.Tensor, *, sm_scale: float, update_scores: bool = True,
                           workspace: DecodeWorkspace | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, tokens_per_step: int = 64,
                           max_registers: int | None = None, backend: str | None = None,
                           cuda_min_blocks: int | None = None) -> None:
    """Decode attention of one query per sequence over its paged mixed-precision KV rows.

    Args:
        q: ``[num_seqs, num_heads, head_dim]`` fp16 or bf16 (fp32 for tests), contiguous.
        pool_pages: ``uint8 [num_pages, page_size_bytes]`` (``KVCachePool.pages()``).
        page_format: the pool's :class:`PageFormat` (tiers may be 16-bit: the fp16 preset).
        page_table: int32 ``[num_rows, max_pages_per_row]``: high-tier page ``j``
            of row ``r`` at ``[r, j]``, low-tier page ``j`` at ``[r, max_pages_per_row - 1 - j]``.
        tier_tokens: int32 ``[num_rows, 2]`` tokens stored per tier (high, low); tiers are dense.
        row_ids: int32 ``[num_seqs, num_kv_heads]`` page-table row of each
            (sequence, KV head) at this layer; < 0 marks a padding sequence
            (its output is zeros; nothing else is touched). No row may appear twice.
        out: ``[num_seqs, num_heads, head_dim]`` of q's dtype, written in full.
        sm_scale: softmax scale (usually ``head_dim ** -0.5``).
        update_scores: add to every attended token's fp32 score (in its page) the
            max over the KV head's query heads of its softmax probability
            (DiffKV's importance accumulator, ``DiffKV.md`` "Policy details").
        workspace: from :meth:`DecodeWorkspace.allocate` for at least this
            batch and ``max_pages_per_row``; ``None`` allocates one (not graph-safe).
        num_warps, num_stages, tokens_per_step, max_registers: launch tuning
            (benchmarks): warps and pipeline depth of the main kernel, tokens read
            per loop step (whole pages: ``tokens_per_step // next_pow2(tokens_per_page)``
            of them, at least one), and a register cap per thread (Triton's
            ``maxnreg``; ``None``: :data:`DEFAULT_MAX_REGISTERS` with 4 warps and
            16 stacked product rows, else the compiler's choice; 0: the
            compiler's choice; ignored on the CPU). Triton backend only.
        backend: which kernels run: ``"cuda"`` the CUDA C++ partial kernel and merge-with-scores
            (:mod:`.cuda_decode`; head_dim 64/128, ratios 1-8,
            fp16/bf16, 8/4-bit keys, 8/4/2-bit values), ``"triton"``, or ``None``/``"auto"``: the
            environment variable ``TRTLLM_DIFFKV_DECODE_BACKEND``, default CUDA where it can run.
        cuda_min_blocks: the CUDA kernel's ``__launch_bounds__`` blocks per multiprocessor (register
            cap; default :func:`~.cuda_decode.compile_defines`'s for the device).

    Precision: codes enter the products as exact fp16 integers (dequantization
    is folded out: per token and group, ``q.k = s (q.c) + z sum(q)`` in fp32,
    and the values' scale multiplies the probabilities, ``p s`` rounded to
    fp16, with ``sum(p z)`` kept in fp32); fp32 accumulation; a bf16 query is
    converted to fp16 for the products (exact within fp16's range, |q| < 65504).
    Probabilities for the score update pass through fp16 (relative error 2**-11). The CUDA kernel
    folds the keys the same way (exact fp16 codes in the products, fp32 accumulation) and
    dequantizes the values in fp16 registers (``s c + z`` rounded to fp16) before the second product.

    Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``. A row
    with no tokens gives zeros; logits of any finite magnitude are exact (no
    sentinel stands in for -inf). Keys may be stored centered (any per-row
    shift of the keys leaves the softmax unchanged).

    Raises:
        ValueError: wrong shapes/dtypes/devices, a tier format without a kernel,
            a ratio above :data:`MAX_GROUP`, a too-small workspace, or ``backend="cuda"`` where
            the CUDA kernel cannot run (the message says why), before any launch.
    """
    _check_inputs(q, pool_pages, page_format, page_table, tier_tokens, row_ids, out, update_scores)
    num_seqs, num_heads, _ = q.shape
    num_kv_heads = row_ids.shape[1]
    max_pages = page_table.shape[1]
    if workspace is None:
        _tier_args(page_format.high, page_format.head_dim, tokens_per_step)  # a tier without a kernel: before allocating
        _tier_args(page_format.low, page_format.head_dim, tokens_per_step)
        workspace = DecodeWorkspace.allocate(num_seqs, num_heads, num_kv_heads, page_format, max_pages,
                                             q.device, update_scores=update_scores)
    _check_workspace(workspace, num_seqs, num_kv_heads, num_heads // num_kv_heads, max_pages, page_format,
                     update_scores)
    attention = DecodeAttention(page_format, num_heads, num_kv_heads, workspace, max_pages, q.dtype, q.device,
                                sm_scale=sm_scale, update_scores=update_scores, num_warps=num_warps,
                                num_stages=num_stages, tokens_per_step=tokens_per_step, max_registers=max_registers,
                                backend=backend, cuda_min_blocks=cuda_min_blocks)
    attention(q, pool_pages, page_table, tier_tokens, row_ids, out)


class DecodeAttention:
    """Paged decode attention resolved once for a fixed shape: backend, tier arguments, grids, register caps and
    (CUDA) the compiled kernels, so a call only launches (FlashInfer's plan/run split; the paged cache builds one
    per cache, :func:`~trtllm_diffkv.paged.decode.decode_runner`). :func:`paged_decode_attention` builds one per
    call and documents the arguments, precision and kernels.

    Args:
        page_format, num_heads, num_kv_heads: the pool's format and the model's heads.
        workspace: :meth:`DecodeWorkspace.allocate` scratch for up to its batch of sequences (kept; graph-safe).
        max_pages_per_row: the page table's width (``page_table.shape[1]`` of every call).
        q_dtype, device: the queries' dtype and device of every call.
        sm_scale, update_scores, num_warps, num_stages, tokens_per_step, max_registers, backend, cuda_min_blocks:
            as :func:`paged_decode_attention`.

    Raises:
        ValueError: as :func:`paged_decode_attention`, at construction: heads, a tier format without a kernel, a
            workspace of another shape, or ``backend="cuda"`` where the CUDA kernel cannot run.
    """

    def __init__(self, page_format: PageFormat, num_heads: int, num_kv_heads: int, workspace: DecodeWorkspace,
                 max_pages_per_row: int, q_dtype: torch.dtype, device: torch.device | str, *, sm_scale: float,
                 update_scores: bool = True, num_warps: int | None = None, num_stages: int | None = None,
                 tokens_per_step: int = 64, max_registers: int | None = None, backend: str | None = None,
                 cuda_min_blocks: int | None = None) -> None:
        _check_heads(num_heads, num_kv_heads)
        head_dim = page_format.head_dim
        device = torch.device(device)
        group = num_heads // num_kv_heads
        high = _tier_args(page_format.high, head_dim, tokens_per_step)
        low = _tier_args(page_format.low, head_dim, tokens_per_step)
        _check_workspace(workspace, 0, num_kv_heads, group, max_pages_per_row, page_format, update_scores)
        self.page_format, self.workspace, self.update_scores = page_format, workspace, update_scores
        self.num_kv_heads, self.max_seqs = num_kv_heads, workspace.part_acc.shape[0]
        self.qk_scale = float(sm_scale) * LOG2E
        self.use_cuda = choose_backend(backend, page_format, num_heads, num_kv_heads, q_dtype,
                                       device.type == "cuda") == "cuda"
        nparts = workspace.num_partitions
        gp, bd = max(16, next_pow2(group)), next_pow2(head_dim)
        pmax = max(page_format.high_tokens_per_page, page_format.low_tokens_per_page)
        if self.use_cuda:
            self.cuda = CudaDecodeKernels.resolve(page_format, group, gp, bd, 2 * nparts, q_dtype, update_scores,
                                                  device, cuda_min_blocks,
                                                  fused=None if workspace.row_done is not None else False)
            self.max_pages_per_row, self.cuda_slots = max_pages_per_row, {}
            return
        # The products stack (quantization group, query head) rows: NG groups x GP2 heads, 16 <= rows <= 32
        # (32 keeps every product on the mma.sync path, registers in check); larger query groups are split
        # into chunks of GP2 heads, one program each.
        groups = [max(a["KG"] if a["KB"] < 16 else 1, a["VG"] if a["VB"] < 16 else 1) for a in (high, low)]
        gp2 = min(next_pow2(group), max(1, MAX_STACK_ROWS // max(groups)))
        nchunk = -(-group // gp2)
        for args, g in zip((high, low), groups):
            args["NG"] = max(g, max(1, 16 // gp2))
            # 32 stacked rows spill registers in the folded loop: such a tier dequantizes in registers
            # instead (whole group in one program, so only without head chunks)
            args["FOLD"] = args["NG"] * gp2 <= 16 or nchunk > 1 or not FOLD_WIDE_FALLBACK
        dt = _tl_dtype("fp32" if q_dtype == torch.float32 else "fp16")  # dot operands (a bf16 q is cast to fp16)
        per_tier = ("TOKENS", "PPI", "BLOCK_T", "KB", "KG", "VB", "VG", "KC", "KM", "VC", "VM", "NG", "FOLD")
        if max_registers is None and (num_warps or 4) == 4 and max(high["NG"], low["NG"]) * gp2 <= 16 \
                and head_dim <= 128:
            # 32 stacked rows need more registers than the cap (spills); so does head_dim 256 (gemma-3-270m, 4
            # query heads on 1 KV head: ptxas sm_90a, 508 / 672 spill bytes at 128 registers for default / k8v4,
            # none at 249 / 255 uncapped; not timed on a GPU)
            max_registers = DEFAULT_MAX_REGISTERS
        self.partial_parts = nparts * nchunk
        self.partial_constexprs = dict(
            R=max_pages_per_row, PAGE_BYTES=page_format.page_size_bytes, PMAX=pmax, GROUP=group, GROUP_PAD=gp,
            GP2=gp2, NCHUNK=nchunk, HEAD_DIM=head_dim, BLOCK_D=bd,
            **{f"H_{k}": high[k] for k in per_tier}, **{f"L_{k}": low[k] for k in per_tier},
            DT=dt, IEEE=q_dtype == torch.float32, STORE_PROBS=update_scores,
            FAST=FAST_CONVERT and device.type == "cuda" and dt == _tl_dtype("fp16"),
            num_warps=num_warps or 4, num_stages=num_stages or 2,
            **({"maxnreg": max_registers} if max_registers and device.type == "cuda" else {}))
        self.merge_constexprs = dict(GROUP=group, GROUP_PAD=gp, HEAD_DIM=head_dim, BLOCK_D=bd,
                                     BLOCK_PARTS=next_pow2(2 * nparts), num_warps=4)
        block_p, gps = next_pow2(pmax), next_pow2(group)
        pos_per_prog = max(1, min(16, 4096 // (block_p * gps)))
        self.score_programs = triton.cdiv(max_pages_per_row, pos_per_prog)
        self.score_constexprs = dict(
            R=max_pages_per_row, PAGE_BYTES=page_format.page_size_bytes, PMAX=pmax, BLOCK_P=block_p, GROUP=group,
            HEADS_PAD=gps, LSE_STRIDE=gp, POS_PER_PROG=pos_per_prog, H_TOKENS=high["TOKENS"], H_SC=high["SC"],
            L_TOKENS=low["TOKENS"], L_SC=low["SC"], num_warps=4)

    def __call__(self, q: torch.Tensor, pool_pages: torch.Tensor, page_table: torch.Tensor,
                 tier_tokens: torch.Tensor, row_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Launch the decode attention for ``q`` ``[num_seqs <= workspace batch, num_heads, head_dim]`` (the
        construction's dtype and device) into ``out``; the other tensors as :func:`paged_decode_attention`.
        No checks beyond the batch bound (the caller's tensors: the cache's own, or checked by
        :func:`paged_decode_attention`), no host synchronization, no allocation (a bf16 query is read as it is).
        On the CUDA backend the rows are split over :func:`~.cuda_decode.cuda_num_slots` CTAs a row for this
        ``num_seqs``: a row's output and score update can differ in the last bits between batch sizes (the
        split-K merge's rounding), as between the CUDA and Triton backends.

        Raises:
            ValueError: more sequences than the workspace holds.
        """
        num_seqs = q.shape[0]
        if num_seqs > self.max_seqs:
            raise ValueError(f"{num_seqs} sequences, the workspace holds {self.max_seqs}")
        if num_seqs == 0:
            return
        q = q.contiguous()
        ws, nkv = self.workspace, self.num_kv_heads
        if self.use_cuda:
            slots = self.cuda_slots.get(num_seqs)
            if slots is None:
                slots = self.cuda_slots[num_seqs] = self.cuda.slots_for(num_seqs * nkv, self.max_pages_per_row)
            self.cuda.launch(q, pool_pages, page_table, tier_tokens, row_ids, ws, self.qk_scale, out, num_slots=slots)
            return
        _decode_partial_kernel[(num_seqs, nkv, self.partial_parts)](
            q, pool_pages, page_table, tier_tokens, row_ids, ws.part_m, ws.part_l, ws.part_acc, ws.page_probs,
            ws.page_max, self.qk_scale, nkv, ws.num_partitions, **self.partial_constexprs)
        _decode_merge_kernel[(num_seqs, nkv)](out, ws.part_m, ws.part_l, ws.part_acc, ws.lse, nkv,
                                              ws.num_partitions, **self.merge_constexprs)
        if self.update_scores:
            _decode_score_kernel[(num_seqs, nkv, self.score_programs)](
                pool_pages, page_table, tier_tokens, row_ids, ws.page_probs, ws.page_max, ws.lse, nkv,
                **self.score_constexprs)


def _tl_dtype(name: str):
    import triton.language as tl

    return {"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32}[name]


def _check_workspace(ws: DecodeWorkspace, num_seqs: int, num_kv_heads: int, group: int, max_pages: int,
                     page_format: PageFormat, update_scores: bool) -> None:
    gp, bd = max(16, next_pow2(group)), next_pow2(page_format.head_dim)
    need = (num_kv_heads, ws.num_partitions, 2, gp, bd)
    if tuple(ws.part_acc.shape[1:]) != need or ws.part_acc.shape[0] < num_seqs:
        raise ValueError(f"workspace part_acc is {tuple(ws.part_acc.shape)}, this call needs [>= {num_seqs}, *{need}]: "
                         "allocate the workspace for this batch, head count and page format")
    if update_scores:
        pmax = max(page_format.high_tokens_per_page, page_format.low_tokens_per_page)
        need = (num_kv_heads, max_pages, group, pmax)
        if tuple(ws.page_probs.shape[1:]) != need or ws.page_probs.shape[0] < num_seqs:
            raise ValueError(f"workspace page_probs is {tuple(ws.page_probs.shape)}, "
                             f"this call needs [>= {num_seqs}, *{need}] "
                             "(allocate with update_scores=True and this max_pages_per_row)")


def decode_bytes(page_format: PageFormat, high_tokens: int, low_tokens: int, update_scores: bool = True) -> int:
    """Fewest bytes one decode call must move for these token counts (summed over rows).

    Key and value codes and their scale/zero once, plus the fp32 score read
    and written back per token when scores are updated (queries and outputs
    are negligible and left out). Used for bandwidth reporting.
    """
    total = 0
    for lay, n in ((page_format.high, high_tokens), (page_format.low, low_tokens)):
        per = lay.tier.token_bytes(page_format.head_dim)
        if update_scores and lay.score.size_bytes:
            per += 8
        total += n * per
    return total


__all__ = ["DecodeWorkspace", "DecodeAttention", "paged_decode_attention", "default_num_partitions", "decode_bytes", "MAX_GROUP"]
