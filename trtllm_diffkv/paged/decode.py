"""Decode step of the paged cache: batched decisions, one page-manager call, moves, new tokens (paper sections 4.2, 5).

Used by :class:`~.cache.PagedDiffKVCache`. :func:`plan_decode` (once per step,
before the layers) decides for every (request, layer, KV head) row from the
scores through the previous step (:func:`.decisions.decide`), makes ONE
``append_decode`` with all rows' (high, low) deltas in {0, +1}, then performs
every move to the low tier (demoted victim or departing candidate: dequantize
the high token, requantize it at the low tier into its low slot, keys in the
centered domain) and locates the high slot each new token goes to. On the
Triton path (``cache.use_triton``) the decisions and the locations are one
launch each (:mod:`trtllm_diffkv.kernels.decision_kernel`, bit-identical to
:func:`.decisions.decide`, which stays the reference and the torch path): a
decode plan is one small host-to-device copy and six launches, with no host
synchronization. ``pad_to`` pads the step to a bucket of sequences whose
tensors live in persistent buffers (CUDA-graph replay,
:mod:`trtllm_diffkv.runtime.cuda_graphs`).
:func:`decode_layer` (per layer, no host synchronization) quantizes the new
token into that slot and runs paged decode attention, which adds each token's
probability to its score.
"""
from __future__ import annotations

import warnings

import torch

from ..kernels import decision_kernel
from ..kernels import decode_attention as da
from . import decisions, torch_ops
from .gather import token_location
from .step_plan import DecodeBuffers


def host_inputs(step) -> list[int]:
    """The decode requests' slots then positions (``[2 * n]``), what :func:`plan_decode` needs on the device
    (copied in the step's one copy, :class:`~.host_inputs.StepInputs`)."""
    return step.slots[step.n_pre:] + step.positions[step.n_pre:]


def plan_decode(cache, step, inputs: torch.Tensor, pad_to: int | None = None) -> None:
    """Decisions of every layer, ONE ``append_decode``, the moves to the low tier, the new tokens' slots.

    Fills ``step.decode``, a :class:`~.step_plan.DecodeBuffers` for ``B = pad_to``
    sequences (``None``: the ``n`` real ones). Sequences ``b >= n`` are padding (row id
    and page -1: the write and attention kernels skip them). With ``pad_to`` the
    tensors are the cache's persistent buffers for that bucket (same addresses
    every step: CUDA-graph inputs). ``inputs``: int64 ``[2 * n]`` on the cache device,
    :func:`host_inputs` (the step's one host-to-device copy, non-blocking from a pinned
    buffer on CUDA: a blocking copy would wait for the stream, i.e. for the previous
    step's forward). Host syncs: none.
    """
    n = len(step.slots) - step.n_pre
    B = n if pad_to is None else pad_to
    seq = inputs.view(2, n)
    bufs = step_buffers(cache, B, persistent=pad_to is not None)
    if not cache.use_triton:
        _plan_torch(cache, step, seq[0], seq[1], bufs)
    elif pad_to is None:
        plan_device(cache, seq[0], seq[1], bufs)
    else:
        _plan_padded(cache, seq, n, B, bufs)
    step.decode = bufs


def _plan_padded(cache, seq: torch.Tensor, n: int, B: int, bufs: DecodeBuffers) -> None:
    """Padded Triton path: slots and positions (``seq``: int64 ``[2, n]`` on the device) copied into the cache's
    fixed input buffer (one device copy), then the plan graph of
    ``(n, B)`` replayed; without one, the launches run eagerly and, when ``cache.capture_plan_graphs``
    (set by ``DecodeGraphRunner``), the same launches are captured for the next steps of ``n`` requests
    (capturing records, it runs nothing: the eager run compiled exactly these specializations)."""
    if cache.plan_inputs is None:
        cache.plan_inputs = torch.zeros(2, cache.max_slots, dtype=torch.int64, device=cache.device)
    inputs = cache.plan_inputs
    inputs[:, :n].copy_(seq)
    args = (cache, inputs[0, :n], inputs[1, :n], bufs)
    graph = cache.plan_graphs.get((n, B))
    if graph is not None:
        graph.replay()
        return
    plan_device(*args)
    if cache.capture_plan_graphs and n:
        graph = capture_plan_graph(cache, args)
        if graph is not None:
            cache.plan_graphs[(n, B)] = graph


def capture_plan_graph(cache, args: tuple):
    """A CUDA graph of ``plan_device(*args)``; ``None`` (plan graphs switched off, a warning) if capture fails."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            plan_device(*args)
    except Exception as exc:  # noqa: BLE001 - planning works eagerly; only the speed-up is lost
        cache.capture_plan_graphs = False
        warnings.warn(f"decode plan graph capture failed, planning eagerly: {type(exc).__name__}: {exc}",
                      RuntimeWarning, stacklevel=2)
        return None
    return graph


def step_buffers(cache, B: int, persistent: bool) -> DecodeBuffers:
    """The step tensors the layers read for a bucket of ``B`` sequences (module :func:`plan_decode`).

    ``persistent``: the cache keeps one set per ``B`` (graph-safe addresses); otherwise fresh tensors.
    """
    if persistent and B in cache.decode_buffers:
        return cache.decode_buffers[B]
    bufs = DecodeBuffers.allocate(cache.num_layers, B, cache.num_kv_heads, cache.device)
    if persistent:
        cache.decode_buffers[B] = bufs
    return bufs


def _scratch(cache) -> dict:
    """Per-item scratch of the Triton path for ``max_slots`` sequences, allocated once."""
    s = getattr(cache, "decision_scratch", None)  # absent on the plugins' cache views
    if s is None:
        from ..kernels.decision_kernel import alpha_tensor

        m, dev, D = cache.max_slots * cache.rows_per_slot, cache.device, cache.head_dim
        i32, i64, f32 = (dict(dtype=t, device=dev) for t in (torch.int32, torch.int64, torch.float32))
        s = dict(actions=(torch.empty(m, **i32), torch.empty(m, **i32), *(torch.empty(m, **i64) for _ in range(3))),
                 moves=tuple(torch.empty(m, **i32) for _ in range(4)), keys=torch.empty(m, D, **f32),
                 values=torch.empty(m, D, **f32), score=torch.empty(m, **f32), pos=torch.empty(m, **i32),
                 alphas=alpha_tensor(cache.config.alpha_high, cache.config.alpha_low, dev))
        cache.decision_scratch = s
    return s


def _windows_kwargs(cache) -> dict:
    """``decide_rows``'s sliding-window arguments for a cache with sliding-window layers, else ``{}``."""
    windows = getattr(cache, "sliding_windows", None)  # absent on the plugins' cache views
    if windows is None or all(w is None for w in windows):
        return {}
    return dict(layer_windows=cache.layer_windows, num_kv_heads=cache.num_kv_heads)


def plan_device(cache, slots: torch.Tensor, pos_seq: torch.Tensor, bufs: DecodeBuffers) -> None:
    """Triton path: decide (one launch), append_decode (two), locate (one), moves (read + write).

    Device work only (no host synchronization, no allocation after the first call), so a
    CUDA graph can capture it for a fixed ``n`` (``slots``, ``pos_seq``: int64 ``[n]`` at fixed
    addresses) and bucket (``bufs`` of :func:`step_buffers`).
    """

    cfg, fmt, man = cache.config, cache.page_format, cache.manager
    G, n = cache.rows_per_slot, slots.numel()
    m, shape = n * G, (n, cache.num_layers, cache.num_kv_heads)
    s = _scratch(cache)
    act = decision_kernel.decide_rows(
        cache.pool.pages(), fmt, man.page_table, man.tokens, slots, pos_seq, cache.prompt_len_device, s["alphas"],
        rows_per_slot=G, recent_window_tokens=cfg.recent_window_tokens,
        prompt_score_window_tokens=cfg.prompt_score_window_tokens, out=s["actions"], compress=cfg.tiered,
        **_windows_kwargs(cache))
    man.append_decode(slots, act[0].view(shape), act[1].view(shape))
    moves = tuple(t[:m] for t in s["moves"]) if cfg.tiered else None
    decision_kernel.locate_rows(man.page_table, fmt, slots, pos_seq, act, bufs.located(), moves,
                                num_kv_heads=cache.num_kv_heads, rows_per_slot=G)
    if moves is not None and m:
        src_page, src_slot, dst_page, dst_slot = moves
        k, v, score, pos = s["keys"][:m], s["values"][:m], s["score"][:m], s["pos"][:m]
        pages = cache.pool.pages()
        cache.ops.read_tokens(pages, fmt, "high", src_page, src_slot, k, v, score, pos)
        cache.ops.write_tokens(pages, fmt, "low", dst_page, dst_slot, k, v, scores=score, positions=pos)


def _plan_torch(cache, step, slots, pos_seq, bufs: DecodeBuffers) -> None:
    """Torch path (the reference): :func:`.decisions.decide`, ``append_decode``, moves, token locations.
    ``slots``, ``pos_seq``: int64 ``[n]`` on the device."""
    cfg, dev, fmt = cache.config, cache.device, cache.page_format
    L, H, G = cache.num_layers, cache.num_kv_heads, cache.rows_per_slot
    pos_host = step.positions[step.n_pre:]
    n = len(pos_host)
    if n == 0:  # a step of padding only (graph capture)
        for t, pad in zip(bufs.located(), (0, -1, -1, 0, 0, 0)):
            t.fill_(pad)
        return
    rows = (slots[:, None] * G + torch.arange(G, device=dev)).reshape(-1)
    pos = pos_seq.repeat_interleave(G)
    table, tokens = cache.manager.page_table, cache.manager.tokens
    if cfg.tiered:
        act = decisions.decide(cache.pool, table, tokens, rows, pos, cache.prompt_len_device[slots].repeat_interleave(G),
                               alpha_high=cfg.alpha_high, alpha_low=cfg.alpha_low,
                               recent_window_tokens=cfg.recent_window_tokens,
                               prompt_score_window_tokens=cfg.prompt_score_window_tokens, max_pos=max(pos_host))
    else:
        act = decisions.append_only(rows, tokens)
    if any(w is not None for w in cache.sliding_windows):
        act = decisions.slide_windows(act, rows, tokens, pos, cache.prompt_len_device[slots].repeat_interleave(G),
                                      cache.layer_windows.repeat_interleave(H).repeat(n))
    shape = (n, L, H)
    cache.manager.append_decode(slots, act.high_delta.reshape(shape), act.low_delta.reshape(shape))
    if cfg.tiered:
        move_to_low(cache, rows, act)
    page, slot = token_location(table, rows, "high", act.new_index, fmt.high_tokens_per_page)
    layer_major = lambda t: t.reshape(shape).transpose(0, 1)  # noqa: E731 - [L, n, H]
    for buf, value, pad in ((bufs.rows, rows, 0), (bufs.row_ids, rows, -1), (bufs.page, page, -1),
                            (bufs.slot, slot, 0)):
        buf[:, :n] = layer_major(value)
        buf[:, n:] = pad
    bufs.positions.zero_()
    bufs.positions[:n * H] = pos_seq.to(torch.int32).repeat_interleave(H)
    bufs.err_idx.zero_()
    bufs.err_idx[:n * H] = slots.to(torch.int32).repeat_interleave(H)


def move_to_low(cache, rows: torch.Tensor, act: "decisions.StepActions") -> None:
    """Demotions and candidate moves: dequantize the high token, requantize it into its low slot (centered keys)."""
    fmt, table = cache.page_format, cache.manager.page_table
    moving = act.move_from >= 0
    src_page, src_slot = token_location(table, rows, "high", act.move_from.clamp(min=0), fmt.high_tokens_per_page)
    dst_page, dst_slot = token_location(table, rows, "low", act.move_to.clamp(min=0), fmt.low_tokens_per_page)
    src_page = torch.where(moving, src_page, -1)
    dst_page = torch.where(moving, dst_page, -1)
    m, D = rows.numel(), cache.head_dim
    k = torch.empty(m, D, dtype=torch.float32, device=cache.device)
    v = torch.empty_like(k)
    score = torch.empty(m, dtype=torch.float32, device=cache.device)
    pos = torch.empty(m, dtype=torch.int32, device=cache.device)
    pages = cache.pool.pages()
    cache.ops.read_tokens(pages, fmt, "high", src_page, src_slot, k, v, score, pos)
    cache.ops.write_tokens(pages, fmt, "low", dst_page, dst_slot, k, v, scores=score, positions=pos)


def decode_layer(cache, step, layer, q, k, v, out) -> None:
    """Write the new token at high precision into its planned slot, then paged decode attention."""
    cfg, d = cache.config, step.decode
    D = cache.head_dim
    centered = cfg.compress and cfg.center_keys
    cache.ops.write_tokens(
        cache.pool.pages(), cache.page_format, "high", d.page[layer].reshape(-1), d.slot[layer].reshape(-1),
        k.reshape(-1, D), v.reshape(-1, D), key_offsets=cache.row_meta.key_offsets if centered else None,
        offset_rows=d.rows[layer].reshape(-1) if centered else None, scores=d.scores,
        positions=d.positions, error_flags=cache.error_flags, error_index=d.err_idx)
    pages, table, tokens = cache.pool.pages(), cache.manager.page_table, cache.manager.tokens
    # a query of another dtype or device than out takes the checked per-call path (no runner built for it)
    runner = decode_runner(cache, q.dtype) if out.dtype == q.dtype and q.device == out.device else None
    if runner is not None:
        runner(q, pages, table, tokens, d.row_ids[layer], out)
        return
    kwargs = {}
    if cache.decode_attention is not torch_ops.paged_decode_attention:
        kwargs["workspace"] = decode_workspace(cache)
    cache.decode_attention(q, pages, cache.page_format, table, tokens, d.row_ids[layer], out,
                           sm_scale=cache.sm_scale, update_scores=cfg.tiered, **kwargs)


def decode_runner(cache, q_dtype: torch.dtype):
    """The cache's :class:`~trtllm_diffkv.kernels.decode_attention.DecodeAttention` for queries of ``q_dtype``,
    resolved on first use (backend, tier arguments, grids, CUDA kernels) and reused by every layer and step, or
    ``None`` where the cache's decode function is not the kernels' ``paged_decode_attention`` (the torch read
    path, or a caller's stand-in), which then runs per call."""

    runners = getattr(cache, "decode_runners", None)  # None: a stand-in view (export/plugin_ops.py): checked per call
    if runners is None or cache.decode_attention is not da.paged_decode_attention:
        return None
    runner = runners.get(q_dtype)
    if runner is None:
        runner = cache.decode_runners[q_dtype] = da.DecodeAttention(
            cache.page_format, cache.num_heads, cache.num_kv_heads, decode_workspace(cache),
            cache.manager.max_pages_per_row, q_dtype, cache.device, sm_scale=cache.sm_scale,
            update_scores=cache.config.tiered)
    return runner


def decode_workspace(cache):
    """The read-path kernel's scratch, allocated once for ``max_slots`` sequences (graph-safe reuse)."""
    if cache.decode_workspace is None:
        from ..kernels.decode_attention import DecodeWorkspace

        cache.decode_workspace = DecodeWorkspace.allocate(
            cache.max_slots, cache.num_heads, cache.num_kv_heads, cache.page_format, cache.manager.max_pages_per_row,
            cache.device, update_scores=cache.config.tiered)
    return cache.decode_workspace
