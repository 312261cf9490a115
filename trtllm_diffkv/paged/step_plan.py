"""The typed plan of one step of the paged cache (FlashInfer's plan/run split; vLLM's step metadata dataclass).

:meth:`~.cache.PagedDiffKVCache.plan` builds one :class:`StepPlan` per step (host side, once, before the
layers); each layer's ``forward`` only reads it (launches, no host work beyond indexing), and
:meth:`~.cache.PagedDiffKVCache.end_step` ends it. Its two device parts:

* :class:`PrefillPlan` (:func:`.prefill.plan_prefill`): the per-token tensors of the prompts that end in
  the step (their tiers and writes) and the chunks of every prefill request (:mod:`.staging`);
* :class:`DecodeBuffers` (:func:`.decode.plan_decode`): where each decode row's new token goes and which
  rows the decode attention reads, layer-major; with ``pad_to`` the cache's persistent buffers of that
  bucket (fixed addresses: CUDA-graph inputs).

The TensorRT layer's plugin ops build the same classes over their input tensors (``export/plugin_ops.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class WholePrompts:
    """The whole prompts (``start == 0 and end == n``) of a step that also carries chunks, run as ONE prefill
    attention call over their packed rows instead of one call each (:func:`.prefill._chunk_attention`).

    Attributes:
        rows: int64 ``[W]`` on the cache device: the step's packed token rows of those prompts, in order.
        cu: int32 ``[k + 1]`` on the host (pinned on CUDA): their bounds within ``rows``.
        at: ``{first packed row of a prompt in the step: (start, end) of it within rows}``.
    """

    rows: torch.Tensor
    cu: torch.Tensor
    at: dict[int, tuple[int, int]]


@dataclass(slots=True)
class PrefillChunk:
    """One prefill request of the step: the chunk ``[start, end)`` of its prompt of ``prompt_tokens`` tokens,
    packed at rows ``[first_row, end_row)`` of the step's tokens (``start == 0 and end == prompt_tokens``: a
    whole prompt)."""

    slot: int
    start: int
    end: int
    prompt_tokens: int
    first_row: int
    end_row: int

    @property
    def whole(self) -> bool:
        """Whether the chunk is its whole prompt (unchunked)."""
        return self.start == 0 and self.end == self.prompt_tokens


@dataclass(slots=True)
class PrefillPlan:
    """The prefill part of a step (:func:`.prefill.plan_prefill`): tensors over the ``T`` tokens of the ``p``
    prompts that end in the step (packed in order; ``T`` = the sum of their whole prompts' tokens), on the cache
    device unless said otherwise.

    Attributes:
        slots: int64 ``[p]`` the ending prompts' slots.
        cu: int32 ``[p + 1]`` on the host (pinned on CUDA): prompt bounds within the ``T`` tokens
            (:func:`.prefill.host_bounds`); ``cu_host``: the same as a list of ints.
        req: int64 ``[T]`` each token's prompt index in ``[0, p)``.
        t: int32 ``[T]`` each token's position in its prompt.
        count: fp32 ``[T]`` the scoring queries that see the token: ``min(n - t, prompt_score_window_tokens)``.
        thr_h, thr_l: fp32 ``[T]`` the token's high / low thresholds ``alpha / N``
            (:func:`~trtllm_diffkv.policy.tier_thresholds`).
        window: bool ``[T]`` the token is one of its prompt's last ``recent_window_tokens`` (kept high).
        start: int64 ``[T]`` the first packed token of the token's prompt.
        row_base: int64 ``[T]`` the first page-manager row of the token's slot (``slot * rows_per_slot``).
        reserved: int64 ``[T]`` the pages reserved per row for the token's prompt (``prompt_reserve_pages``).
        counts: int32 ``[p, num_layers, num_kv_heads, 2]`` (high, low) tokens per row, filled by the layers and
            committed to the page manager at the end of the step (``commit_prompt``).
        err_idx: int32 ``[T * num_kv_heads]`` the slot whose error flag a token's non-finite K/V sets.
        finishing: the indices (in the step's prefill requests) of the prompts that end in the step.
        chunked: the step carries a chunk that is not a whole prompt (the attention then runs per prompt).
        chunks: one :class:`PrefillChunk` per prefill request of the step (empty for the plugin ops).
        write_group_layers: how many layers' tiers and writes run at once (:func:`.prefill.write_group_layers`).
        pending: the K/V and score sums of the current write group's layers so far
            (``[G, T, num_kv_heads, head_dim]`` twice and fp32 ``[G, T, num_kv_heads]``), ``None`` between groups.
        whole: the whole prompts of a chunked step run as one call (:class:`WholePrompts`), else ``None``.
        prompt_tokens: int64 ``[T]`` the whole prompt's tokens ``n`` of each token's prompt (the sliding-window
            layers' tiers: :func:`.prefill._slide_prompt_tiers`); ``None`` where the builder has no such layers.
    """

    slots: torch.Tensor
    cu: torch.Tensor
    cu_host: list[int]
    req: torch.Tensor
    t: torch.Tensor
    count: torch.Tensor
    thr_h: torch.Tensor
    thr_l: torch.Tensor
    window: torch.Tensor
    start: torch.Tensor
    row_base: torch.Tensor
    reserved: torch.Tensor
    counts: torch.Tensor
    err_idx: torch.Tensor
    finishing: list[int]
    chunked: bool = False
    chunks: list[PrefillChunk] = field(default_factory=list)
    write_group_layers: int = 1
    pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    whole: WholePrompts | None = None
    prompt_tokens: torch.Tensor | None = None


@dataclass(slots=True)
class DecodeBuffers:
    """The decode part of a step (:func:`.decode.plan_decode`) for a bucket of ``B`` sequences, layer-major, on the
    cache device; sequences ``b >= n`` (the real ones) are padding: row 0, row id -1, page -1, slot 0, position 0,
    error index 0 (the write and attention kernels skip them).

    Attributes:
        rows: int64 ``[L, B, H]`` page-manager row of each (layer, sequence, KV head) (the key-offset rows).
        row_ids: int32 ``[L, B, H]`` the same, -1 for padding: the rows the decode attention reads.
        page: int32 ``[L, B, H]`` the page the new token is written to (-1: none).
        slot: int32 ``[L, B, H]`` its slot in that page.
        positions: int32 ``[B * H]`` the new token's position, per (sequence, KV head).
        scores: fp32 ``[B * H]`` zeros: the new tokens' initial scores.
        err_idx: int32 ``[B * H]`` the slot whose error flag a non-finite new K/V sets.
    """

    rows: torch.Tensor
    row_ids: torch.Tensor
    page: torch.Tensor
    slot: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    err_idx: torch.Tensor

    @classmethod
    def allocate(cls, num_layers: int, batch_size: int, num_kv_heads: int, device: torch.device) -> DecodeBuffers:
        """Fresh buffers of a bucket of ``batch_size`` sequences, every sequence padding."""
        L, B, H = num_layers, batch_size, num_kv_heads
        i32 = dict(dtype=torch.int32, device=device)
        return cls(rows=torch.zeros(L, B, H, dtype=torch.int64, device=device), row_ids=torch.full((L, B, H), -1, **i32),
                   page=torch.full((L, B, H), -1, **i32), slot=torch.zeros(L, B, H, **i32),
                   positions=torch.zeros(B * H, **i32), scores=torch.zeros(B * H, dtype=torch.float32, device=device),
                   err_idx=torch.zeros(B * H, **i32))

    def located(self) -> tuple[torch.Tensor, ...]:
        """``(rows, row_ids, page, slot, positions, err_idx)``: the outputs of
        :func:`~trtllm_diffkv.kernels.decision_kernel.locate_rows`, in its order."""
        return self.rows, self.row_ids, self.page, self.slot, self.positions, self.err_idx


@dataclass(slots=True)
class StepPlan:
    """Host description of the planned step plus the device tensors its layers read (:meth:`~.cache.PagedDiffKVCache.plan`).

    Attributes:
        slots, seq_lens, positions: ``[n]`` the step's requests (prefill requests first), their tokens after the
            step and the position of their first new token.
        n_pre: how many of them are prefill requests.
        num_tokens: tokens the step carries (prefill chunks, then one per decode request, then padding).
        prompt_lens: ``[n]`` each prefill request's whole prompt tokens (``None`` given: ``seq_lens``; entries of
            decode requests unused).
        prefill_tokens: the packed tokens of the prefill requests (``sum(seq_lens - positions)`` over them).
        next_layer: the next layer ``forward`` runs (layers run 0..L-1 once each, in order).
        replayed: the step's layers ran as one CUDA-graph replay (no ``forward`` calls): set by the graph runner
            before :meth:`~.cache.PagedDiffKVCache.end_step` (decode-only steps none of whose layers ran).
        prefill: the prefill part (:class:`PrefillPlan`), ``None`` without prefill requests.
        decode: the decode part (:class:`DecodeBuffers`), ``None`` without decode requests or padding.
    """

    slots: list[int]
    seq_lens: list[int]
    positions: list[int]
    n_pre: int
    num_tokens: int
    prompt_lens: list[int] | None = None
    prefill_tokens: int = field(init=False)
    next_layer: int = 0
    replayed: bool = False
    prefill: PrefillPlan | None = None
    decode: DecodeBuffers | None = None

    def __post_init__(self) -> None:
        if self.prompt_lens is None:
            self.prompt_lens = list(self.seq_lens)
        n = self.n_pre
        self.prefill_tokens = sum(b - a for a, b in zip(self.positions[:n], self.seq_lens[:n]))


__all__ = ["DecodeBuffers", "PrefillChunk", "PrefillPlan", "StepPlan", "WholePrompts"]
