"""Decode steps replayed from CUDA graphs over bucketed batch sizes (issue 7; nano-vllm's and vLLM's scheme).

A decode step's forward (embedding, every layer with the paged cache's
``forward``, final norm, LM head) launches a few hundred small kernels; at
small batches their launch overhead, not the GPU, sets the step time. The
:class:`DecodeGraphRunner` captures the forward once per bucket of batch sizes
``B`` and replays it: the host work of a step is then the cache's
:meth:`~trtllm_diffkv.paged.cache.PagedDiffKVCache.plan` (eager, a handful of
launches, no host synchronization) plus one graph launch.

What makes the forward capturable (all checked by ``tests/runtime/test_cuda_graphs_gpu.py``):

* ``plan(..., pad_to=B)`` writes every per-step tensor the layers read into
  persistent buffers of bucket ``B`` (``paged/decode.py`` :func:`step_buffers`):
  same addresses every step; sequences ``b >= n`` are padding (page id and row
  id -1), which the write and attention kernels skip, so the page manager never
  sees them;
* the cache's output buffer, error flags, row metadata, page table, token
  counts and the decode attention workspace are allocated once;
* no host synchronization inside the forward (the sliding-window check of
  ``LlamaForCausalLM.forward`` is the one exception: a model whose
  ``config.max_supported_positions`` is set, Mistral/Qwen2 with a window, is
  refused here; Gemma 3's sliding windows are applied by the cache, no check
  reads the device).

With ``capture_plan`` (default) the device work of the decode plan (decisions,
``append_decode``, locations, moves: six launches, ``paged/decode.py``
:func:`plan_device`) is replayed from graphs too, one small graph per number of
requests ``n`` (its launch grids depend on ``n``, and the page manager must not
see padding): ``plan(..., pad_to=B)`` copies the slots and positions into a
fixed input buffer and replays the graph of ``(n, B)``; the first padded plan
of each ``n`` runs eagerly (compiling its kernels) and captures it.

What the replay does not do is done by :meth:`DecodeGraphRunner.run`: the
step is marked replayed and ended (``seq_len`` advanced:
:meth:`~trtllm_diffkv.paged.cache.PagedDiffKVCache.end_step`).
Prefill and mixed steps run eagerly (their caller ends them).

Usage (one decode step of ``n`` requests)::

    B = runner.bucket_for(n)
    cache.plan(slots, seq_lens, positions, [False] * n, pad_to=B)
    logits = runner.run(input_ids, positions)   # [n, vocab] fp32, a view valid until the next run
"""
from __future__ import annotations

from typing import Sequence

import torch
from ..paged import torch_ops


def default_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, ... below ``max_batch_size``, then ``max_batch_size`` itself."""
    buckets, b = [], 1
    while b < max_batch_size:
        buckets.append(b)
        b *= 2
    return tuple(buckets) + (max_batch_size,)


class DecodeGraphRunner:
    """CUDA graphs of the decode forward, one per bucket of batch sizes.

    Args:
        model: a ``LlamaForCausalLM`` on CUDA (no sliding window).
        cache: the model's :class:`~trtllm_diffkv.paged.cache.PagedDiffKVCache` (same device).
        buckets: batch sizes to capture, each in ``[1, cache.max_slots]``
            (default :func:`default_buckets` of ``cache.max_slots``).
        capture: capture every bucket now (default); otherwise call :meth:`capture`.
        capture_plan: also replay the padded decode plan's device work from graphs,
            captured at the first padded plan of each request count (needs the Triton
            page manager without ``validate``; otherwise the plan runs eagerly).

    Capturing needs no step planned in the cache and leaves it with none; it
    plans an all-padding step per bucket (nothing of the requests in the cache
    is touched). Graphs share one memory pool, captured largest first.

    Raises:
        ValueError: a model or cache not on CUDA, a cache on the torch fallbacks, a
            sliding-window model, bad buckets.
    """

    def __init__(self, model, cache, buckets: Sequence[int] | None = None, *, capture: bool = True,
                 capture_plan: bool = True) -> None:
        if cache.device.type != "cuda" or model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model and the cache on one CUDA device "
                             f"(model {model.device}, cache {cache.device})")
        if getattr(model.config, "max_supported_positions", None) is not None:
            raise ValueError("the decode forward of a sliding-window model reads positions on the host; "
                             "it cannot be captured (run it eagerly)")

        if not cache.use_triton or cache.decode_attention is torch_ops.paged_decode_attention:
            raise ValueError("CUDA graphs need the cache's Triton kernels (use_triton=True, read_path='auto'): "
                             "the torch fallbacks read tensor values on the host")
        buckets = sorted(set(default_buckets(cache.max_slots) if buckets is None else (int(b) for b in buckets)))
        if not buckets or buckets[0] < 1 or buckets[-1] > cache.max_slots:
            raise ValueError(f"buckets {buckets} must lie in [1, max_slots={cache.max_slots}]")
        self.model, self.cache, self.buckets = model, cache, tuple(buckets)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._ids: dict[int, torch.Tensor] = {}
        self._positions: dict[int, torch.Tensor] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._pool = None
        manager = cache.manager
        cache.capture_plan_graphs = bool(capture_plan) and hasattr(manager, "ring_state") and \
            not getattr(manager, "_validate_values", False)
        if capture:
            for b in reversed(self.buckets):
                self.capture(b)

    def bucket_for(self, num_seqs: int) -> int:
        """Smallest bucket holding ``num_seqs`` decode requests.

        Raises:
            ValueError: more requests than the largest bucket, or fewer than one.
        """
        for b in self.buckets:
            if b >= num_seqs >= 1:
                return b
        raise ValueError(f"{num_seqs} decode requests: buckets are {self.buckets}")

    def capture(self, bucket: int) -> None:
        """Warm up (eager, side stream) and capture the decode forward of ``bucket`` sequences.

        Raises:
            ValueError: a bucket not in :attr:`buckets`, or a step already planned in the cache.
        """
        if bucket not in self.buckets:
            raise ValueError(f"bucket {bucket} is not one of {self.buckets}")
        if self.cache.planned_step is not None:
            raise ValueError("capture needs no step planned in the cache")
        dev = self.cache.device
        ids = torch.zeros(bucket, dtype=torch.int64, device=dev)
        positions = torch.zeros(bucket, dtype=torch.int64, device=dev)
        with torch.no_grad():  # not inference_mode: persistent tensors made here are written outside it later
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile the Triton kernels, initialize cuBLAS outside the capture
                    self.cache.plan([], [], [], [], pad_to=bucket)
                    self.model(ids, positions, self.cache)
                    self.cache.end_step()
            torch.cuda.current_stream(dev).wait_stream(stream)
            self.cache.plan([], [], [], [], pad_to=bucket)
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self.model(ids, positions, self.cache)
            self.cache.end_step()  # host bookkeeping only (an all-padding step: no slot changes)
        self._graphs[bucket], self._ids[bucket], self._positions[bucket], self._logits[bucket] = \
            graph, ids, positions, logits

    def run(self, input_ids, positions) -> torch.Tensor:
        """Replay the planned decode step: ``[n]`` token ids and positions of the real requests, then end it.

        The cache must hold a planned decode-only step with ``pad_to`` equal to a
        bucket (:meth:`bucket_for`) and ``n`` real requests, in the planned order.
        After the replay the step is marked ``replayed`` and ended
        (:meth:`~trtllm_diffkv.paged.cache.PagedDiffKVCache.end_step`: the slots' lengths advance).

        Args:
            input_ids, positions: int ``[n]`` tensors (any device) or lists.

        Returns:
            fp32 ``[n, vocab_size]`` logits: a view of the graph's output buffer, valid
            until the next :meth:`run` of the same bucket.

        Raises:
            ValueError: no planned decode-only padded step, or ``n`` disagreeing with it.
        """
        step = self.cache.planned_step
        if step is None or step.n_pre or step.next_layer or step.decode is None:
            raise ValueError("run() needs a planned decode-only step (cache.plan(..., pad_to=bucket)) "
                             "none of whose layers ran")
        bucket, n = step.num_tokens, len(step.slots)
        if bucket not in self.buckets or step.decode is not self.cache.decode_buffers.get(bucket):
            raise ValueError(f"the planned step is not padded to a bucket of {self.buckets}: plan with "
                             f"pad_to=runner.bucket_for({n})")
        ids = torch.as_tensor(input_ids).reshape(-1)
        pos = torch.as_tensor(positions).reshape(-1)
        if ids.numel() != n or pos.numel() != n:
            raise ValueError(f"the planned step has {n} decode requests; got {ids.numel()} ids and "
                             f"{pos.numel()} positions")
        if bucket not in self._graphs:
            raise ValueError(f"bucket {bucket} was not captured: run this step eagerly "
                             f"(model(ids, positions, cache)) and capture({bucket}) before planning the next")
        self._ids[bucket][:n].copy_(ids, non_blocking=True)
        self._positions[bucket][:n].copy_(pos, non_blocking=True)
        self._graphs[bucket].replay()
        step.replayed = True
        self.cache.end_step()
        return self._logits[bucket][:n]


__all__ = ["DecodeGraphRunner", "default_buckets"]
