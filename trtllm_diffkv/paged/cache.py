"""Paged DiffKV KV cache for a batch of requests: tokens live quantized in unified pages (paper section 5).

:class:`PagedDiffKVCache` implements the model's attention contract
(:class:`~trtllm_diffkv.model.attention_api.AttentionBackend`) over one
:class:`~trtllm_diffkv.memory.KVCachePool`, a page manager
(``TritonPageManager`` on CUDA, ``CpuPageManager`` on the CPU) and a per-row
metadata region (:mod:`.row_meta`). It is the paged twin of
:class:`~trtllm_diffkv.cache.DiffKVReferenceCache` and follows the same rules
(``DiffKV.md`` "Policy details", :mod:`trtllm_diffkv.policy`).

Step protocol (host-side planning apart from launch-only layers, as FlashInfer's plan/run):

1. :meth:`PagedDiffKVCache.plan` once per step, before the layers: which slots
   run, prefill requests first (their whole prompt), then decode requests (one
   token each). Prefill: ``reserve_prompt`` (all tokens counted high). Decode:
   the decisions of every layer from the scores through the previous step, in
   one batched pass (:mod:`.decisions`), then ONE ``append_decode`` for all
   rows, then every demotion / candidate move (dequantize the high token,
   requantize it into its low slot), so that each layer only writes and reads.
2. ``forward(layer_idx, q, k, v)`` per layer, packed tokens in the planned
   order: prefill requests run the scored prefill attention, get their tiers,
   and their tokens are quantized straight into the reserved pages at the
   places ``commit_prompt`` keeps (high pages on the left, the last reserved
   pages become the low pages). Decode requests write the new token
   at high precision into the slot its row's decision chose, then run paged
   decode attention, which adds each token's probability to its score. No
   host synchronization inside ``forward``.
3. :meth:`PagedDiffKVCache.end_step` once after the layers (the caller's, never
   a side effect of the last layer): one ``commit_prompt`` returns the prompts'
   surplus pages to the ring, the slots' lengths advance, the plan is cleared.
   A CUDA-graph replay (no ``forward`` calls) marks the step ``replayed`` first.
   A step whose layers failed is dropped with :meth:`discard_step` instead.
4. :meth:`PagedDiffKVCache.step_errors` after the step (one small device read):
   slots whose keys/values were not finite; :meth:`release` when a request
   ends or fails (every page goes back).

Sliding-window layers (``config.layers``, :meth:`DiffKVConfig.for_model`;
every preset, ``fp16`` included): the prefill attends within each such layer's
window ``W`` and keeps its prompt's last ``W`` tokens, at the high tier, in
position order at high-tier indices ``0..``; each decode step writes its token
into the high slot of the token at ``pos - W`` (pruned: out of every later
query's reach), or appends it while ``pos < W`` (:mod:`.decisions`), so the
row holds exactly the window and its attention reads nothing else.

Memory: the pool (pages held x page size) plus the row metadata of active
rows; :meth:`pool_used_bytes` and :meth:`request_stats` report both next to
the accounted bytes of the packed tokens (:class:`CacheStats`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..cache.reference import CacheStats
from ..config import DiffKVConfig
from ..engine_config import EngineConfig
from ..kernels import quant_write
from ..memory import CpuPageManager, KVCachePool, PageFormat
from ..policy import reachable_tokens
from ..validators import is_int, positive_int
from . import decode, prefill, torch_ops
from .host_inputs import StepInputs
from .row_meta import RowMetadata, RowMetadataFormat
from .staging import staging_bytes, staging_fits
from .step_plan import StepPlan


class OutOfPagesError(RuntimeError):
    """The pool has too few free pages for the planned step; nothing changed."""


NONFINITE_KV_ERROR = "a key or value is NaN/Inf or beyond the fp16 range"
"""Message of a request whose keys or values were not finite (edge case 1)."""


@dataclass(frozen=True)
class PagedCacheStats(CacheStats):
    """:class:`CacheStats` of one request plus what it really holds in the pool.

    Attributes:
        pool_pages: pages its rows hold.
        pool_used_bytes: ``pool_pages * page_size_bytes`` + its rows' metadata bytes.
    """

    pool_pages: int = 0
    pool_used_bytes: int = 0


def kernel_functions(use_triton: bool, read_path: str = "auto"):
    """(write ops module, decode attention, scored prefill attention) of a cache: the Triton kernels, or their
    torch versions (:mod:`.torch_ops`) with ``use_triton=False`` or for the attention with ``read_path="torch"``."""
    if not use_triton:
        return torch_ops, torch_ops.paged_decode_attention, torch_ops.scored_prefill_attention

    if read_path == "torch":
        return quant_write, torch_ops.paged_decode_attention, torch_ops.scored_prefill_attention

    try:
        from ..kernels.decode_attention import paged_decode_attention
    except ImportError:
        paged_decode_attention = torch_ops.paged_decode_attention
    try:
        from ..kernels.prefill_attention import scored_prefill_attention
    except ImportError:
        scored_prefill_attention = torch_ops.scored_prefill_attention
    return quant_write, paged_decode_attention, scored_prefill_attention


def prompt_scores_function(use_triton: bool, read_path: str = "auto"):
    """The scores-only half of the scored prefill attention that :func:`kernel_functions` picks (chunked prefill's
    final chunk): the Triton kernels' ``prompt_scores``, or the torch version."""
    if use_triton and read_path != "torch":
        try:
            from ..kernels.prefill_attention import prompt_scores
            return prompt_scores
        except ImportError:
            pass
    return torch_ops.prompt_scores


class PagedDiffKVCache:
    """DiffKV cache of up to ``max_batch_size`` requests in unified pages; the model's attention backend.

    Args:
        config: DiffKV policy (``compress=False``: the fp16 preset, every token
            kept at 16 bits in the high tier, no scores).
        num_layers, num_heads, num_kv_heads, head_dim: model shape.
        engine_config: the sizes and backends (:class:`~trtllm_diffkv.engine_config.EngineConfig`). Read here:
            ``max_batch_size`` (request slots), ``max_seq_len`` (longest request, prompt + generated; required),
            ``max_num_tokens`` (most tokens one step may carry, sizing the output buffer; ``None``: ``max_batch_size
            * max_seq_len``), ``device`` (where the pool lives; ``None``: the CPU), ``high_tokens_per_page`` (page
            sizing, :meth:`PageFormat.for_config`), ``use_triton`` (Triton kernels, default on CUDA; ``True`` on
            the CPU needs ``TRITON_INTERPRET=1``; otherwise the torch versions, :mod:`.torch_ops`),
            ``page_manager`` (``"triton"``: ``TritonPageManager``, ``"cpu"``: ``CpuPageManager``, ``"auto"``:
            Triton on CUDA), ``read_path`` (``"torch"`` runs the attention of the Triton path with the torch
            versions: tests of the write path on the GPU) and :attr:`EngineConfig.staging_limit_bytes`, the most
            bytes the full-precision staging of prompts prefilled in chunks may hold at once (:mod:`.staging`;
            outside the pool; 0 without chunked prefill; ``chunk_staging_bytes=None``: one prompt of
            ``max_seq_len`` tokens in ``dtype``, :func:`~.staging.staging_bytes`).
        num_pages: pages in the pool.
        dtype: the model dtype of the outputs (and of the staging).
        sm_scale: softmax scale (default ``1/sqrt(head_dim)``).
        kv_config_checked: the caller already ran ``config.validate_for_model`` for this model shape
            (:class:`~trtllm_diffkv.runtime.resource_manager.DiffKVResourceManager` does): not again here.

    Raises:
        ValueError: a configuration the model cannot run, or a bad size.

    Attributes other modules read (the step functions of :mod:`.prefill` and :mod:`.decode`, the CUDA-graph
    runner, the TensorRT layer's operations):
        ops, decode_attention, prefill_attention: the kernel functions (:func:`kernel_functions`);
            prompt_scores: :func:`prompt_scores_function`.
        sliding_windows: ``config.sliding_windows(num_layers)``, one ``int | None`` per layer (read by the model,
            :func:`~trtllm_diffkv.model.attention_api.check_backend_windows`); layer_windows: the same as int32
            ``[num_layers]`` on the device, 0 for full attention (the decode decisions' input).
        staging: ``{slot: PromptStaging}`` of the prompts whose later chunks are still to come (:mod:`.staging`).
        score_sums: fp32 ``[max_num_tokens, num_kv_heads]`` scratch of the scored prefill.
        prompt_len_device: int64 ``[max_slots]`` prompt length per slot on the device (written by each prompt's
            prefill; a released slot keeps its last value, read by no step).
        planned_step: the :class:`~.step_plan.StepPlan` :meth:`plan` made that :meth:`end_step` has not ended yet,
            else ``None``.
        decode_workspace, decode_buffers, plan_inputs, plan_graphs, decision_scratch: the decode step's
            persistent buffers and captured plan graphs (:mod:`.decode`), allocated on first use.
        decode_runners: ``{q dtype: DecodeAttention}``, the decode kernels resolved once (:func:`.decode.decode_runner`).
        step_inputs: the :class:`~.host_inputs.StepInputs` every plan copies its host integers through
            (pinned buffers in rotation on CUDA).
    """

    def __init__(self, config: DiffKVConfig, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 engine_config: EngineConfig, *, num_pages: int, dtype: torch.dtype = torch.float32,
                 sm_scale: float | None = None, kv_config_checked: bool = False) -> None:
        engine = engine_config
        max_slots, max_seq_len_tokens, max_num_tokens = engine.max_batch_size, engine.max_seq_len, engine.max_num_tokens
        use_triton, page_manager, read_path = engine.use_triton, engine.page_manager, engine.read_path
        for name, value in (("num_layers", num_layers), ("max_seq_len", max_seq_len_tokens)):
            positive_int(name, value)
        if not kv_config_checked:
            config.validate_for_model(head_dim, num_heads, num_kv_heads, num_layers)
        self.config = config
        self.device = torch.device("cpu" if engine.device is None else engine.device)
        self.sliding_windows = config.sliding_windows(num_layers)
        self.layer_windows = torch.tensor([w or 0 for w in self.sliding_windows], dtype=torch.int32,
                                          device=self.device)
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = num_layers, num_heads, num_kv_heads, head_dim
        self.dtype = dtype
        self.page_format = PageFormat.for_config(config, head_dim, engine.high_tokens_per_page)
        self.pool = KVCachePool(self.page_format, num_pages, self.device)
        self.pool.buffer.zero_()
        if page_manager == "triton" or (page_manager == "auto" and self.device.type == "cuda"):
            from ..memory.triton_page_manager import TritonPageManager

            self.manager = TritonPageManager(self.page_format, num_pages, max_slots, num_layers, num_kv_heads,
                                             max_seq_len_tokens, device=self.device)
        else:
            self.manager = CpuPageManager(self.page_format, num_pages, max_slots, num_layers, num_kv_heads,
                                          max_seq_len_tokens)
        self.rows_per_slot = num_layers * num_kv_heads
        self.row_meta = RowMetadata(RowMetadataFormat.for_config(config, head_dim), max_slots * self.rows_per_slot,
                                    self.device)
        if use_triton is None:
            use_triton = self.device.type == "cuda"  # the interpreter tests ask for Triton explicitly
        self.use_triton = use_triton
        if use_triton and self.device.type != "cuda":
            from ..kernels.interpreter import patch_interpreter_for_numpy_2_4

            patch_interpreter_for_numpy_2_4()  # Triton 3.6's interpreter under NumPy >= 2.4 (no-op otherwise)
        if use_triton and read_path == "auto":
            from ..kernels.decode_attention import MAX_GROUP

            if num_heads // num_kv_heads > MAX_GROUP:  # refused at configuration time (edge case 7)
                raise ValueError(f"query:KV head ratio {num_heads // num_kv_heads} exceeds the {MAX_GROUP} the decode "
                                 "attention kernel supports")
        self.ops, self.decode_attention, self.prefill_attention = kernel_functions(use_triton, read_path)
        self.prompt_scores = prompt_scores_function(use_triton, read_path)
        staging_limit = engine.staging_limit_bytes
        if staging_limit is None:  # chunked prefill, no limit given: one prompt of max_seq_len
            staging_limit = staging_bytes(num_layers, num_kv_heads, num_heads, head_dim, max_seq_len_tokens,
                                          config.prompt_score_window_tokens, dtype)
        self.staging_limit_bytes = staging_limit
        self.staging: dict = {}
        self.sm_scale = sm_scale if sm_scale is not None else torch_ops.default_sm_scale(head_dim)
        self.max_slots, self.max_seq_len_tokens = max_slots, max_seq_len_tokens
        self.max_num_tokens = max_num_tokens or max_slots * max_seq_len_tokens
        self._out = torch.empty(self.max_num_tokens, num_heads, head_dim, dtype=dtype, device=self.device)
        self.score_sums = torch.zeros(self.max_num_tokens, num_kv_heads, dtype=torch.float32, device=self.device)
        self.error_flags = torch.zeros(max_slots, dtype=torch.int32, device=self.device)
        self.prompt_len = [0] * max_slots  # host bookkeeping (0: slot free)
        self.seq_len = [0] * max_slots  # tokens stored
        self.prompt_len_device = torch.zeros(max_slots, dtype=torch.int64, device=self.device)
        self.planned_step = None
        self.step_inputs = StepInputs(self.device)  # the step's host integers: one (pinned) copy per plan
        self.decode_workspace = None
        self.decode_runners: dict = {}  # q dtype -> DecodeAttention (decode.decode_runner)
        self.decode_buffers = {}  # bucket size -> persistent decode step tensors (decode.step_buffers)
        self.plan_graphs = {}  # (decode requests, bucket) -> CUDA graph of decode.plan_device
        self.plan_inputs = None  # int64 [2, max_slots] (slots, positions) of padded plans: the graphs' inputs
        self.decision_scratch = None  # the Triton decisions' per-row scratch (decode._scratch)
        self.capture_plan_graphs = False  # padded plans capture their launches (set by DecodeGraphRunner)

    # ------------------------------------------------------------------ planning
    def plan(self, slots: Sequence[int], seq_lens: Sequence[int], positions: Sequence[int],
             is_prefill: Sequence[bool], *, pad_to: int | None = None,
             known_free_pages: int | None = None, prompt_lens: Sequence[int] | None = None,
             decoded_from: Sequence[int] | None = None) -> None:
        """Describe the next step (host side; before the layers run).

        Args:
            slots: ``[n]`` distinct request slots in ``[0, max_slots)``; prefill
                requests first, then decode requests.
            seq_lens: ``[n]`` tokens of each request after this step.
            positions: ``[n]`` position of each request's first new token
                (prefill: 0, or a later chunk's first position; decode: the tokens already stored).
            is_prefill: ``[n]`` whether the request brings its prompt or a chunk of it
                (the first chunk into a free slot) or one decode token (an active slot).
            pad_to: keyword-only bucket size: the decode part is padded to
                ``pad_to >= n - n_prefill`` sequences (``<= max_slots``) whose
                per-step tensors live in persistent buffers of that bucket
                (same addresses every step: CUDA-graph replay,
                :class:`~trtllm_diffkv.runtime.cuda_graphs.DecodeGraphRunner`).
                Padding sequences are skipped by every kernel; the step then
                carries ``pad_to`` decode tokens (the model gets any ids and
                positions for them, their outputs are zeros). ``None``: no padding.
            known_free_pages: keyword-only lower bound on the free pages that the
                caller knows (e.g. the ring's free count from its step's one status
                read, minus the worst case of the steps it planned since); skips the
                device read (a host synchronization) of the free count. ``None``:
                read it. A bound above the true count lets the page manager refuse
                the step on the device (status ``OUT_OF_PAGES``), so never guess.
            prompt_lens: keyword-only ``[n]`` (entries of decode requests ignored): each
                prefill request's whole prompt tokens. A prefill request then brings the
                chunk ``[positions[i], seq_lens[i])`` of it (chunked prefill, :mod:`.staging`):
                its first chunk (position 0) reserves the whole prompt's pages and, when
                more chunks follow, starts its staging (``staging_limit_bytes``); a later
                chunk continues the slot's staged prompt; the final chunk
                (``seq_lens[i] == prompt_lens[i]``) tiers and writes the whole prompt.
                ``None``: every prefill brings a whole prompt (``prompt_lens = seq_lens``).
            decoded_from: keyword-only ``[n]`` (entries of decode requests ignored): each prefill request's first
                position whose token was decoded before: a request re-prefilled after a preemption brings its
                prompt and then the tokens it generated. Without compression (``fp16``) those rows attend over
                keys and values rounded as the pool stores them, as their decode steps did
                (:func:`.prefill.prefill_layer`), so the recompute repeats the decode's numbers instead of
                attending over the model dtype's. ``None``: no decoded token in any prompt.

        The step's packed tokens are each prefill request's ``seq_len - position`` tokens,
        then one token per decode request (``cu_seqlens`` built here), then the padding.
        The step's host integers (slots, positions, prompt lengths, reserved pages) reach the device in one
        copy (:attr:`step_inputs`: non-blocking from pinned buffers on CUDA).

        Raises:
            ValueError: inconsistent arguments (order, lengths, slot states, an
                empty prompt, a request beyond ``max_seq_len_tokens``, a chunk that does not
                continue its slot's staged prompt), naming the request;
                or a step already planned and not ended (:meth:`end_step`).
            OutOfPagesError: too few free pages, or too few staging bytes; nothing changed.
            Anything the planning itself raises (a staging allocation out of memory, a kernel error): the new
            prompts' reservations and staging are undone, the decoding slots are left to their callers.
        """
        if self.planned_step is not None:
            raise ValueError(f"a step is already planned ({self._step_progress(self.planned_step)}): run its layers "
                             "and call end_step() (or discard_step()) before planning the next step")
        n = len(slots)
        if not (len(seq_lens) == len(positions) == len(is_prefill) == n):
            raise ValueError("slots, seq_lens, positions and is_prefill must have the same length")
        if prompt_lens is not None and len(prompt_lens) != n:
            raise ValueError("prompt_lens must have one entry per request")
        slots, seq_lens, positions = [int(s) for s in slots], [int(s) for s in seq_lens], [int(p) for p in positions]
        prompt_lens = list(seq_lens) if prompt_lens is None else [int(x) for x in prompt_lens]
        is_prefill = [bool(p) for p in is_prefill]
        n_pre = sum(is_prefill)
        if any(is_prefill[n_pre:]):
            raise ValueError("prefill requests must come before decode requests")
        if len(set(slots)) != n:
            raise ValueError(f"slots must be distinct, got {slots}")
        for i, (slot, total, first, pre) in enumerate(zip(slots, seq_lens, positions, is_prefill)):
            self.check_request(i, slot, total, first, pre, prompt_lens[i] if pre else None)
        if pad_to is not None and (not is_int(pad_to)
                                   or not n - n_pre <= pad_to <= self.max_slots or pad_to < 1):
            raise ValueError(f"pad_to={pad_to!r} must be an integer in [max(1, decode requests={n - n_pre}), "
                             f"max_slots={self.max_slots}]")
        num_tokens = sum(b - a for a, b in zip(positions[:n_pre], seq_lens[:n_pre])) + \
            (n - n_pre if pad_to is None else pad_to)
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"the step carries {num_tokens} tokens, more than max_num_tokens={self.max_num_tokens}")
        first_chunks = [i for i in range(n_pre) if positions[i] == 0]
        staged = sum(self.staging_bytes_for(prompt_lens[i]) for i in first_chunks if seq_lens[i] < prompt_lens[i])
        if staged and not self.staging_fits(staged):
            raise OutOfPagesError(f"the step's new chunked prompts need {staged} staging bytes; "
                                  f"{self.staging_limit_bytes - self.staging_bytes_used()} of "
                                  f"staging_limit_bytes={self.staging_limit_bytes} are free")
        need = self.manager.reserve_pages_needed([prompt_lens[i] for i in first_chunks]) + \
            self.decode_pages_needed(n - n_pre)
        free = self.manager.free_pages() if known_free_pages is None or need > known_free_pages else known_free_pages
        if need > free:
            raise OutOfPagesError(f"the step needs up to {need} free pages, {free} are free")
        if decoded_from is not None and len(decoded_from) != n:
            raise ValueError("decoded_from must have one entry per request")
        step = StepPlan(slots, seq_lens, positions, n_pre, num_tokens, prompt_lens,
                        None if decoded_from is None else [int(x) for x in decoded_from])
        decoding = bool(n - n_pre) or pad_to is not None
        parts = (prefill.host_inputs(self, step) if n_pre else []) + ([decode.host_inputs(step)] if decoding else [])
        inputs = self.step_inputs.to_device(parts)  # ONE host-to-device copy of the step's integers
        try:
            if n_pre:
                prefill.plan_prefill(self, step, inputs[:-1] if decoding else inputs)
            if decoding:
                decode.plan_decode(self, step, inputs[-1], pad_to=pad_to)
        except BaseException:
            # the new prompts' reservations and staging go back (an allocation or kernel failing after
            # reserve_prompt left their slots RESERVED and their pages taken for good); the decoding slots'
            # state is their callers' to release
            self.release([slots[i] for i in first_chunks])
            raise
        self.planned_step = step

    def check_request(self, i: int, slot: int, total: int, first: int, prefill: bool,
                      prompt_len: int | None = None) -> None:
        """The checks :meth:`plan` makes for request ``i`` of a step (also run by the TensorRT layer's graph steps).

        Args:
            i: the request's index in the step (for the message); slot: its slot.
            total: its tokens after the step; first: the position of its first new token.
            prefill: whether it brings its prompt (a free slot, position 0) or one decode token.
            prompt_len: a prefill's whole prompt tokens (``None``: ``total``, a whole prompt). A chunk
                ``[first, total)`` with ``first > 0`` must continue the slot's staged prompt of ``prompt_len``
                tokens at its next position.

        Raises:
            ValueError: a slot outside the cache, a request beyond ``max_seq_len_tokens``, an empty prompt, a
                prefill into an active slot, or a decode step at another position than the slot's next one.
        """
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"request {i}: slot {slot} is outside [0, {self.max_slots})")
        if total > self.max_seq_len_tokens:
            raise ValueError(f"request {i} (slot {slot}): {total} tokens exceed max_seq_len_tokens={self.max_seq_len_tokens}")
        if prefill:
            prompt_len = total if prompt_len is None else prompt_len
            if total < 1:
                raise ValueError(f"request {i} (slot {slot}): empty prompt, at least one token is needed")
            if not first < total <= prompt_len:
                raise ValueError(f"request {i} (slot {slot}): a prefill chunk [{first}, {total}) must be non-empty and "
                                 f"within its prompt of {prompt_len} tokens")
            if prompt_len > self.max_seq_len_tokens:
                raise ValueError(f"request {i} (slot {slot}): a prompt of {prompt_len} tokens exceeds "
                                 f"max_seq_len_tokens={self.max_seq_len_tokens}")
            staged = self.staging.get(slot)
            if first == 0:
                if self.prompt_len[slot] or staged is not None:
                    raise ValueError(f"request {i}: prefill needs a free slot and position 0 (slot {slot})")
            elif staged is None or staged.filled_tokens != first or staged.prompt_tokens != prompt_len:
                have = "no staged prompt" if staged is None else \
                    f"{staged.filled_tokens} of {staged.prompt_tokens} prompt tokens staged"
                raise ValueError(f"request {i} (slot {slot}): a prefill chunk from position {first} of a "
                                 f"{prompt_len}-token prompt must continue the slot's staged prompt; it has {have}")
        elif not self.prompt_len[slot] or first != self.seq_len[slot] or total != first + 1:
            raise ValueError(f"request {i} (slot {slot}): a decode step writes position {self.seq_len[slot]} "
                             f"(seq_len {self.seq_len[slot] + 1}) of an active slot; got position {first}, seq_len {total}")

    # ------------------------------------------------------------------ layers
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention for the planned step's packed tokens (``AttentionBackend.forward``).

        Args:
            layer_idx: 0-based layer; q ``[num_tokens, num_heads, head_dim]``,
                k/v ``[num_tokens, num_kv_heads, head_dim]`` in the planned order.

        Returns:
            ``[num_tokens, num_heads, head_dim]`` in the cache dtype: a view of
            the preallocated output buffer, valid until the next layer.

        The step stays planned after its last layer: the caller ends it (:meth:`end_step`).

        Raises:
            ValueError: no step planned, a layer out of order (each step runs
                layers 0..L-1 once each, in order), a step marked replayed, or shapes that disagree with the plan.
        """
        step = self.planned_step
        if step is None:
            raise ValueError("plan() the step before running the layers")
        if step.replayed:
            raise ValueError("the planned step is marked replayed (its layers ran as a CUDA graph): end_step() it")
        T, H, D = step.num_tokens, self.num_kv_heads, self.head_dim
        if q.shape != (T, self.num_heads, D) or k.shape != (T, H, D) or v.shape != (T, H, D):
            raise ValueError(f"layer {layer_idx}: q/k/v shapes {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} "
                             f"disagree with the planned step ({T} tokens)")
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx={layer_idx} outside [0, {self.num_layers})")
        if layer_idx != step.next_layer:
            raise ValueError(f"layer {layer_idx} out of order: the planned step runs layers 0..{self.num_layers - 1} "
                             f"once each, in order; layer {step.next_layer} is next")
        out = self._out[:T]
        tp = step.prefill_tokens
        if step.prefill is not None:
            prefill.prefill_layer(self, step, layer_idx, q[:tp], k[:tp], v[:tp], out[:tp])
        if step.decode is not None:
            decode.decode_layer(self, step, layer_idx, q[tp:], k[tp:], v[tp:], out[tp:])
        step.next_layer += 1
        return out

    # ------------------------------------------------------------------ end of step
    def end_step(self) -> None:
        """End the planned step: commit its prompts' tier counts to the page manager (``commit_prompt``: the
        surplus reserved pages go back to the ring), advance its slots' lengths (:attr:`seq_len`, and the prompt
        lengths or staging of its prefill requests), clear :attr:`planned_step`.

        The one end of every step, called by whoever ran its layers, once they all ran: the executor after the
        model, the CUDA-graph runner after a replay (it marks the step ``replayed`` first: a decode-only step
        none of whose layers ran eagerly), the TensorRT layer after its graph or its last layer's op. The slots'
        lengths and the page manager's prompt commit change here only, never inside ``forward``.

        Raises:
            ValueError: no step planned; a step not marked replayed whose layers have not all run (it stays
                planned: run the rest, or :meth:`discard_step`); a step marked replayed that has prefill
                requests or layers run eagerly.
        """
        step = self.planned_step
        if step is None:
            raise ValueError("end_step: no step is planned")
        if step.replayed:
            if step.n_pre or step.next_layer:
                raise ValueError("end_step: a replayed step must be decode-only with none of its layers run eagerly "
                                 f"({step.n_pre} prefill requests, {step.next_layer} layers run)")
        elif step.next_layer != self.num_layers:
            raise ValueError(f"end_step: the planned step {self._step_progress(step)}; run layers "
                             f"{step.next_layer}..{self.num_layers - 1} first (or discard_step())")
        if step.prefill is not None and step.prefill.finishing:
            counts = step.prefill.counts
            self.manager.commit_prompt(step.prefill.slots, counts[..., 0], counts[..., 1])
        for i, slot in enumerate(step.slots):
            if i < step.n_pre:
                if step.seq_lens[i] == step.prompt_lens[i]:  # the prompt is compacted: its staging goes
                    self.prompt_len[slot] = step.seq_lens[i]
                    self.staging.pop(slot, None)
                else:
                    self.staging[slot].filled_tokens = step.seq_lens[i]
            self.seq_len[slot] = step.seq_lens[i]
        self.planned_step = None

    def _step_progress(self, step: StepPlan) -> str:
        """How far ``step``'s layers ran, for messages."""
        if step.replayed:
            return "marked replayed"
        return f"has run {step.next_layer} of its {self.num_layers} layers"

    def finish_graph_step(self, slots: Sequence[int], seq_lens: Sequence[int], positions: Sequence[int],
                          num_tokens: int) -> None:
        """End a decode-only step that a graph planned and ran on this cache's tensors (the TensorRT layer's
        per-operation decode graph: no :meth:`plan`): the step is recorded as replayed and ended
        (:meth:`end_step`), so the slots' lengths advance as after any step.

        Args:
            slots, seq_lens, positions: ``[n]`` the step's requests, their tokens after the step and the
                positions they wrote; num_tokens: tokens the step carried (padding included).

        Raises:
            ValueError: a step is planned on the cache.
        """
        if self.planned_step is not None:
            raise ValueError("finish_graph_step: a step is planned on the cache; end or discard it first")
        self.planned_step = StepPlan([int(x) for x in slots], [int(x) for x in seq_lens],
                                     [int(x) for x in positions], 0, num_tokens, replayed=True)
        self.end_step()

    # ------------------------------------------------------------------ lifecycle and reports
    def step_errors(self) -> dict[int, str]:
        """Slots whose keys or values this step were not finite (edge case 1); clears the flags (one device read)."""
        bad = torch.nonzero(self.error_flags).flatten().tolist()
        if bad:
            self.error_flags.zero_()
        return {s: NONFINITE_KV_ERROR for s in bad}

    def take_error_flags(self) -> torch.Tensor:
        """int32 ``[max_slots]`` copy of the step's error flags (nonzero: :data:`NONFINITE_KV_ERROR`), flags cleared.

        Device ops only, no host synchronization: the executor folds the copy into its one
        device-to-host read of the step (:meth:`step_errors` reads them itself).
        """
        flags = self.error_flags.clone()
        self.error_flags.zero_()
        return flags

    def discard_step(self) -> None:
        """Forget a planned step that will not be ended (the model raised before :meth:`end_step`).

        Nothing of :meth:`end_step` happens (no prompt commit, no lengths advanced). The caller must :meth:`release` the step's slots: their pages and rows are in an
        unknown state. A no-op when no step is planned.
        """
        if self.planned_step is not None:
            for slot in self.planned_step.slots[:self.planned_step.n_pre]:
                self.prompt_len_device[slot] = 0
        self.planned_step = None

    def release(self, slots: Sequence[int]) -> None:
        """Return every page of ``slots`` to the ring and clear their error flags (finish or abort; a free slot is
        a no-op).

        Raises:
            ValueError: a slot outside ``[0, max_slots)``, or a slot of the planned step (its :meth:`end_step` would
                commit or advance the freed slot: end or discard the step first); nothing is released then.
        """
        slots = [int(s) for s in slots]
        for s in slots:
            if not 0 <= s < self.max_slots:
                raise ValueError(f"slot {s} is outside [0, {self.max_slots})")
        planned = set(self.planned_step.slots) if self.planned_step is not None else set()
        busy = sorted(planned.intersection(slots))
        if busy:
            raise ValueError(f"slots {busy} belong to the planned step: end_step() or discard_step() before "
                             "releasing them")
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)
        self.manager.release(index)
        self.error_flags[index] = 0  # a step's flag of a freed slot must not reach its next request
        for s in slots:
            self.prompt_len[s] = self.seq_len[s] = 0
            self.staging.pop(s, None)

    @property
    def active_slots(self) -> list[int]:
        """Slots holding a request: a compacted prompt (and its decode tokens) or a prompt half-prefilled in chunks."""
        return [s for s in range(self.max_slots) if self.prompt_len[s] or s in self.staging]

    def decode_pages_needed(self, num_requests: int) -> int:
        """Most pages one decode step of ``num_requests`` requests can take under this cache's policy
        (:meth:`~trtllm_diffkv.memory.PageManager.worst_case_decode_pages`: one per tier per row; one per row
        for a policy that never moves a token to the low tier: ``config.tiered`` false, e.g. ``fp16``, ``k8v4``)."""
        return self.manager.worst_case_decode_pages(num_requests, low_tier_grows=self.config.tiered)

    def staging_bytes_for(self, prompt_tokens: int) -> int:
        """Staging bytes a prompt of ``prompt_tokens`` tokens holds while prefilled in chunks (:mod:`.staging`)."""
        scoring = self.config.prompt_score_window_tokens if self.config.tiered else 0
        return staging_bytes(self.num_layers, self.num_kv_heads, self.num_heads, self.head_dim, prompt_tokens,
                             scoring, self.dtype)

    def staging_fits(self, new_bytes: int) -> bool:
        """Whether prompts staging ``new_bytes`` more may start beside the half-prefilled ones now
        (:func:`~.staging.staging_fits` against :attr:`staging_limit_bytes`: an exact fill fits)."""
        return staging_fits(new_bytes, self.staging_bytes_used(), self.staging_limit_bytes)

    def staging_bytes_used(self) -> int:
        """Bytes the staging of half-prefilled prompts holds now (host bookkeeping)."""
        return sum(st.size_bytes for st in self.staging.values())

    def pool_used_bytes(self) -> int:
        """Pool bytes really held: pages not free x page size + row metadata of active requests (a device read)."""
        held = self.manager.num_pages - self.manager.free_pages()
        return held * self.page_format.page_size_bytes + len(self.active_slots) * self.rows_per_slot * \
            self.row_meta.format.row_bytes

    def request_stats(self, slot: int) -> PagedCacheStats:
        """Tier counts, accounted packed bytes and really held pool bytes of one request (a device read); a
        sliding-window layer counts only its reachable tokens (:class:`CacheStats`)."""
        rows = torch.arange(slot * self.rows_per_slot, (slot + 1) * self.rows_per_slot, device=self.device)
        tokens = self.manager.tokens[rows].sum(0).tolist()
        pages = int(self.manager.pages[rows].sum())
        n = self.seq_len[slot]
        total = self.num_kv_heads * sum(reachable_tokens(n, w) for w in self.sliding_windows)
        fp16_bytes = total * 2 * self.head_dim * 2
        meta = self.rows_per_slot * self.row_meta.format.row_bytes if n else 0
        if self.config.compress:
            used = tokens[0] * self.config.token_bytes("high", self.head_dim) + \
                tokens[1] * self.config.token_bytes("low", self.head_dim) + meta
        else:
            used = fp16_bytes
        return PagedCacheStats(n, tokens[0], tokens[1], total - tokens[0] - tokens[1], used, fp16_bytes,
                               pages, pages * self.page_format.page_size_bytes + meta)
