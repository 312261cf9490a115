"""The plugins' Python implementations on plain torch tensors (no TensorRT import; tested on the CPU).

Each function runs one plugin's operation on its input tensors, updating the state tensors in place, by
calling the paged cache's own per-layer code (``paged/prefill.py::prefill_layer``,
``paged/decode.py::decode_layer``) and the page manager (``TritonPageManager.append_decode``) on a view
of those tensors, so a plugin computes exactly what :class:`~trtllm_diffkv.paged.cache.PagedDiffKVCache`
computes. ``use_triton``: the Triton kernels (CUDA; the TensorRT ``@trtp.impl`` path) or their torch
versions (``paged/torch_ops.py``; the CPU).

The prompt's host-side plan (``PagedDiffKVCache.plan``: prompt reservation) is the executor's; its per-token
tensors arrive as plugin inputs (:data:`.plugin_specs.PREFILL`). The decode step's plan can run as three plugins
(:func:`run_decode_decide`, :func:`run_page_update`, :func:`run_decode_locate`: ``paged/decode.py::plan_device``
split where the graph needs the page update's result), whose outputs are the :data:`.plugin_specs.DECODE` plugin's
plan inputs; they launch the Triton kernels of ``kernels/decision_kernel.py`` and ``TritonPageManager`` (CUDA, or
the CPU under ``TRITON_INTERPRET=1``).

The composite plugins of the exported ONNX graph (:data:`.plugin_specs.STEP_PAGE_UPDATE`,
:data:`.plugin_specs.LAYER_ATTENTION`) run a whole :class:`~trtllm_diffkv.paged.cache.PagedDiffKVCache` registered
under an integer handle (:func:`register_cache`; the graph's ``cache_handle`` input): the step's ``plan``
and one layer's ``forward``. The cache holds the state of record; the nodes' aliased state outputs receive
copies of its pool, page table and tier counts after the node (what onnxruntime runs; under TensorRT the
copies would write the engine's buffers).
"""
from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace

import torch

_CACHES: dict = {}
_LOCK = threading.Lock()
_NEXT = itertools.count(1)


def register_cache(cache) -> int:
    """Make ``cache`` (a ``PagedDiffKVCache``) reachable from the composite plugins; returns its handle
    (feed it as ``cache_handle`` int64 ``[1]``)."""
    with _LOCK:
        handle = next(_NEXT)
        _CACHES[handle] = cache
    return handle


def unregister_cache(handle: int) -> None:
    """Forget a handle (its cache is not touched)."""
    with _LOCK:
        _CACHES.pop(int(handle), None)


def cache_for(handle) -> object:
    """The cache registered under ``handle`` (an int or a one-element tensor / array).

    Raises:
        ValueError: no cache has that handle.
    """
    key = int(handle.reshape(-1)[0]) if hasattr(handle, "reshape") else int(handle)
    try:
        return _CACHES[key]
    except KeyError:
        raise ValueError(f"cache_handle {key} is not registered (register_cache)") from None


def _check_state(cache, pool, table, tokens) -> None:
    want = ((tuple(cache.pool.pages().shape), torch.uint8), (tuple(cache.manager.page_table.shape), torch.int32),
            (tuple(cache.manager.tokens.shape), torch.int32))
    for name, t, (shape, dtype) in zip(("kv_pool", "page_table", "tier_tokens"), (pool, table, tokens), want):
        if t is not None and (tuple(t.shape) != shape or t.dtype != dtype):
            raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}; the cache's is {dtype} {shape}")


def run_step_page_update(inputs: list, step_token: torch.Tensor) -> None:
    """``diffkv::DiffKVPageUpdate``: ``PagedDiffKVCache.plan`` of the step on the registered cache.

    Args:
        inputs: the tensors of :data:`.plugin_specs.STEP_PAGE_UPDATE`, in order; page_table and tier_tokens (aliased
            outputs) receive the cache's state after the plan.
        step_token: int64 ``[1]``, set to 1.

    Raises:
        ValueError: an unknown handle, state tensors that do not fit the cache, or a step the cache refuses.
    """
    handle, slots, seq_lens, positions, is_prefill, table, tokens = inputs
    cache = cache_for(handle)
    _check_state(cache, None, table, tokens)
    cache.plan(slots.tolist(), seq_lens.tolist(), positions.tolist(), [bool(x) for x in is_prefill.tolist()])
    table.copy_(cache.manager.page_table)
    tokens.copy_(cache.manager.tokens)
    step_token.fill_(1)


def run_layer_attention(inputs: list, out: torch.Tensor, attrs: dict) -> None:
    """``diffkv::DiffKVAttention``: ``PagedDiffKVCache.forward`` of layer ``attrs["layer_idx"]`` on the registered
    cache (the step planned by ``DiffKVPageUpdate``). The last layer's call also ends the step
    (``PagedDiffKVCache.end_step``: the prompts' commit, the slots' lengths): an engine runs no node of ours after
    its last layer, so this op is the one place that knows the step's layers have all run.

    Args:
        inputs: the tensors of :data:`.plugin_specs.LAYER_ATTENTION`, in order; kv_pool, page_table and tier_tokens
            (aliased outputs) receive the cache's state after the layer.
        out: ``[T, H, D]`` attention output (written, converted to its dtype).

    Raises:
        ValueError: the step's page update failed (step token != 1), an unknown handle, state tensors that do
            not fit the cache, or an input the cache refuses (the planned step is then discarded,
            ``PagedDiffKVCache.discard_step``: the caller releases its requests, the next page update plans anew).
    """
    q, k, v, pool, table, tokens, handle, step_token = inputs
    if int(step_token.reshape(-1)[0]) != 1:
        raise ValueError("the step's page update failed")
    cache = cache_for(handle)
    as_cache = lambda t: t.to(cache.device, cache.dtype)  # noqa: E731
    layer = int(attrs["layer_idx"])
    try:
        _check_state(cache, pool, table, tokens)
        out.copy_(cache.forward(layer, as_cache(q), as_cache(k), as_cache(v)))
        if layer == cache.num_layers - 1:
            cache.end_step()  # before the copies: the prompts' commit moves pages in the table
    except BaseException:
        cache.discard_step()  # else every later DiffKVPageUpdate finds the step still planned (a stalled engine)
        raise
    pool.copy_(cache.pool.pages())
    table.copy_(cache.manager.page_table)
    tokens.copy_(cache.manager.tokens)


def _cache_view(cfg, attrs: dict, pool, table, tokens, key_offsets, flags, num_tokens: int, use_triton: bool):
    """An object with the attributes ``prefill_layer`` / ``decode_layer`` read, over the plugin's tensors."""
    from trtllm_diffkv.memory import PageFormat
    from trtllm_diffkv.paged.cache import kernel_functions

    ops, decode_attention, prefill_attention = kernel_functions(use_triton)
    fmt = PageFormat.for_config(cfg, attrs["head_dim"], attrs.get("high_tokens_per_page", 32))
    return SimpleNamespace(
        config=cfg, page_format=fmt, num_heads=attrs["num_heads"], num_kv_heads=attrs["num_kv_heads"],
        head_dim=attrs["head_dim"], device=pool.device, sm_scale=attrs["sm_scale"], ops=ops,
        decode_attention=decode_attention, prefill_attention=prefill_attention,
        score_sums=torch.zeros(num_tokens, attrs["num_kv_heads"], dtype=torch.float32, device=pool.device),
        row_meta=SimpleNamespace(key_offsets=key_offsets), error_flags=flags, pool=SimpleNamespace(pages=lambda: pool),
        manager=SimpleNamespace(page_table=table, tokens=tokens, max_pages_per_row=table.shape[1]),
        max_slots=max(1, num_tokens), decode_workspace=None)


def run_prefill(inputs: list, out: torch.Tensor, cfg, attrs: dict, use_triton: bool) -> None:
    """``diffkv::prefill_attention``: scored prefill, prompt tiers, tokens quantized into the reserved pages.

    Args:
        inputs: the tensors of :data:`.plugin_specs.PREFILL`, in order.
        out: ``[T, H, D]`` attention output (written).
        cfg: the :class:`~trtllm_diffkv.config.DiffKVConfig`; attrs: the plugin fields (``layer_idx``, shape, ``sm_scale``).
    """
    from trtllm_diffkv.paged import prefill
    from trtllm_diffkv.paged.step_plan import PrefillPlan

    (q, k, v, cu, req, t, count, thr_h, thr_l, window, start, row_base, reserved, err_idx,
     pool, table, tokens, key_offsets, tier_counts, flags) = inputs
    cache = _cache_view(cfg, attrs, pool, table, tokens, key_offsets, flags, q.shape[0], use_triton)
    plan = PrefillPlan(slots=torch.empty(0, dtype=torch.int64, device=q.device), cu=cu, cu_host=cu.tolist(), req=req, t=t, count=count,
                       thr_h=thr_h, thr_l=thr_l, window=window, start=start, row_base=row_base, reserved=reserved,
                       counts=tier_counts, err_idx=err_idx, finishing=list(range(len(cu) - 1)))  # whole prompts only
    step = SimpleNamespace(prefill=plan)
    prefill.prefill_layer(cache, step, int(attrs["layer_idx"]), q, k, v, out)


def run_decode(inputs: list, out: torch.Tensor, cfg, attrs: dict, use_triton: bool, scratch: dict | None = None) -> None:
    """``diffkv::decode_attention``: the new token written high into its planned slot, then paged decode
    attention with the score update.

    Args:
        inputs: the tensors of :data:`.plugin_specs.DECODE`, in order.
        out: ``[B, H, D]`` attention output (written).
        scratch: the tensors this op otherwise allocates (the AOT graph's recording names them,
            ``export/aot_graph.py``): ``rows`` int64 ``[B, Hkv]`` (``row_ids`` as int64: the key-offset rows),
            ``scores`` fp32 ``[B * Hkv]`` zeros (the new tokens' scores), ``workspace`` (a ``DecodeWorkspace``).
    """
    from trtllm_diffkv.paged import decode
    from trtllm_diffkv.paged.step_plan import DecodeBuffers

    scratch = scratch or {}
    q, k, v, row_ids, page, slot, positions, err_idx, pool, table, tokens, key_offsets, flags = inputs
    cache = _cache_view(cfg, attrs, pool, table, tokens, key_offsets, flags, q.shape[0], use_triton)
    cache.decode_workspace = scratch.get("workspace")
    rows = scratch.get("rows")
    scores = scratch.get("scores")
    if scores is None:
        scores = torch.zeros(positions.numel(), dtype=torch.float32, device=q.device)
    step = SimpleNamespace(decode=DecodeBuffers(rows=(row_ids.long() if rows is None else rows)[None],
                                                row_ids=row_ids[None], page=page[None], slot=slot[None],
                                                positions=positions, scores=scores, err_idx=err_idx))
    decode.decode_layer(cache, step, 0, q, k, v, out)


def run_page_update(inputs: list, cfg, attrs: dict, scratch: dict | None = None) -> None:
    """``diffkv::page_update``: one ``append_decode`` on a ``TritonPageManager`` whose state tensors are the
    plugin's inputs (updated in place; CUDA, or the CPU under ``TRITON_INTERPRET=1``). ``scratch``: the manager's
    own scratch tensors to use instead of fresh ones (``block_sum``, ``block_flag``, ``block_off``, ``ctrl``,
    ``claim``; ``claim`` all zero), as the AOT graph's recording names them."""
    from trtllm_diffkv.memory import PageFormat
    from trtllm_diffkv.memory.triton_page_manager import TritonPageManager

    slots, dh, dl, table, tokens, pages, slot_state, ring, ring_state = inputs
    fmt = PageFormat.for_config(cfg, attrs["head_dim"], attrs.get("high_tokens_per_page", 32))
    max_seq_len = (table.shape[1] - 1) * fmt.min_tokens_per_page  # max_pages_per_row = ceil(len / min) + 1
    mgr = TritonPageManager(fmt, ring.numel(), slot_state.numel(), attrs["num_layers"], attrs["num_kv_heads"],
                            max_seq_len, device=table.device)
    if mgr.page_table.shape != table.shape:
        raise ValueError(f"page_table {tuple(table.shape)} does not fit the fields (expected {tuple(mgr.page_table.shape)})")
    mgr.page_table, mgr.tokens, mgr.pages, mgr.slot_state, mgr.ring, mgr.ring_state = \
        table, tokens, pages, slot_state, ring, ring_state
    for name, t in (scratch or {}).items():
        setattr(mgr, f"_{name}", t)
    mgr.append_decode(slots, dh, dl)


def _plan_shape(cfg, attrs: dict):
    from trtllm_diffkv.memory import PageFormat

    fmt = PageFormat.for_config(cfg, attrs["head_dim"], attrs.get("high_tokens_per_page", 32))
    L, H = int(attrs["num_layers"]), int(attrs["num_kv_heads"])
    return fmt, L, H, L * H


def run_decode_decide(inputs: list, outputs: list, cfg, attrs: dict, alphas: torch.Tensor | None = None) -> None:
    """``diffkv::decode_decide``: the DiffKV decisions of every row of the step's ``n`` decode sequences
    (``kernels/decision_kernel.py::decide_rows``, as ``paged/decode.py::plan_device`` calls it; bit-identical to
    ``paged/decisions.py::decide``).

    Args:
        inputs: the tensors of :data:`.plugin_specs.DECODE_DECIDE`: slots, positions int64 ``[n]``, kv_pool uint8,
            page_table / tier_tokens int32 (the state before the step), prompt_len int64 ``[max_slots]``.
        outputs: high_delta, low_delta int32 ``[n, L, Hkv]``, new_index, move_from, move_to int64 ``[n * L * Hkv]``
            (written; contiguous).
        cfg: the :class:`~trtllm_diffkv.config.DiffKVConfig`; attrs: the plugin fields (``num_layers``,
            ``num_kv_heads``, ``head_dim``).
        alphas: fp64 ``[2]`` (``decision_kernel.alpha_tensor`` of the configuration; default: made here).

    Raises:
        ValueError: outputs too small, or a tiered preset whose pool format has no token metadata.
    """
    from trtllm_diffkv.kernels import decision_kernel

    slots, positions, pool, table, tokens, prompt_len = inputs
    fmt, _L, _H, G = _plan_shape(cfg, attrs)
    dh, dl, new, move_from, move_to = outputs
    if alphas is None:
        alphas = decision_kernel.alpha_tensor(cfg.alpha_high, cfg.alpha_low, pool.device)
    decision_kernel.decide_rows(pool, fmt, table, tokens, slots, positions, prompt_len, alphas, rows_per_slot=G,
                                recent_window_tokens=cfg.recent_window_tokens,
                                prompt_score_window_tokens=cfg.prompt_score_window_tokens,
                                out=(dh.view(-1), dl.view(-1), new, move_from, move_to), compress=cfg.tiered)


def run_decode_locate(inputs: list, outputs: list, cfg, attrs: dict, use_triton: bool,
                      scratch: dict | None = None) -> None:
    """``diffkv::decode_locate``: after the page update, the new tokens' high slots and the moves to the low tier
    (``decision_kernel.locate_rows``, then ``read_tokens`` high / ``write_tokens`` low: the tail of
    ``paged/decode.py::plan_device``).

    Args:
        inputs: the tensors of :data:`.plugin_specs.DECODE_LOCATE`: slots, positions int64 ``[n]``, token_positions int64
            ``[B]`` (only ``B``, the bucket, is used), new_index / move_from / move_to int64 ``[n * L * Hkv]``,
            page_table int32 (after the page update), kv_pool uint8 (moves written in place).
        outputs: kv_pool (the input itself), row_ids int32 ``[L, B, Hkv]``, dest_page / dest_slot int32
            ``[L, B * Hkv]``, decode_positions / err_idx int32 ``[B * Hkv]`` (written; sequences ``b >= n``:
            row id and page -1).
        use_triton: the moves' read/write kernels (Triton) or their torch versions (``paged/torch_ops.py``).
        scratch: the tensors this op otherwise allocates (as the AOT graph's recording names them): ``rows`` int64
            ``[L, B, Hkv]``, ``moves`` (4 int32 ``[n * L * Hkv]``: source page/slot, destination page/slot), ``keys``,
            ``values`` fp32 ``[n * L * Hkv, D]``, ``score`` fp32 and ``pos`` int32 ``[n * L * Hkv]``.

    Raises:
        ValueError: a bucket ``B`` smaller than the ``n`` sequences.
    """
    import torch

    from trtllm_diffkv.kernels import decision_kernel
    from trtllm_diffkv.paged.cache import kernel_functions

    slots, positions, token_positions, new, move_from, move_to, table, pool = inputs
    fmt, L, H, G = _plan_shape(cfg, attrs)
    B, n = token_positions.shape[0], slots.numel()
    if B < n:
        raise ValueError(f"decode_locate: {B} tokens for {n} sequences (the bucket must hold every sequence)")
    scratch = scratch or {}
    row_ids, page, slot, dpos, err_idx = outputs[1:]
    rows = scratch.get("rows")
    located = (torch.empty(L, B, H, dtype=torch.int64, device=pool.device) if rows is None else rows,
               row_ids, page.view(L, B, H), slot.view(L, B, H), dpos, err_idx)  # DecodeBuffers.located's order
    m = n * G
    moves = None
    if cfg.tiered:
        moves = scratch.get("moves") or tuple(torch.empty(m, dtype=torch.int32, device=pool.device) for _ in range(4))
    decision_kernel.locate_rows(table, fmt, slots, positions, (None, None, new, move_from, move_to), located, moves,
                                num_kv_heads=H, rows_per_slot=G)
    if moves is not None and m:
        ops = kernel_functions(use_triton)[0]
        src_page, src_slot, dst_page, dst_slot = moves
        D = int(attrs["head_dim"])
        new_t = lambda name, *shape, dtype=torch.float32: scratch[name] if name in scratch else \
            torch.empty(*shape, dtype=dtype, device=pool.device)  # noqa: E731
        k, v = new_t("keys", m, D), new_t("values", m, D)
        score, pos = new_t("score", m), new_t("pos", m, dtype=torch.int32)
        ops.read_tokens(pool, fmt, "high", src_page, src_slot, k, v, score, pos)
        ops.write_tokens(pool, fmt, "low", dst_page, dst_slot, k, v, scores=score, positions=pos)



def run_abi_kernel(tensors: list, attrs: dict) -> None:
    """``diffkv::aot_<wrapper>`` through Triton's JIT: launch the node's TensorRT-convention wrapper
    (``trtllm_diffkv/export/trt_abi.py``) with the argument list TensorRT passes - the inputs, the int32 extra args, the
    outputs (the inputs again: aliased) - and the node's grid, warps and stages (CUDA, or the CPU under
    ``TRITON_INTERPRET=1``). The inputs are written in place.

    Args:
        tensors: the node's inputs (the launch's distinct buffers, in the wrapper's input order and dtypes; torch
            tensors, each its own memory).
        attrs: the node's attributes (``export/onnx_export.py::aot_node_attrs``; JSON strings or decoded): ``abi`` (the
            wrapper), ``grid``, ``sizes``, ``dims``, ``extras``, ``constexprs``, ``num_warps``, ``num_stages``; the grid
            and extras come from :func:`trtllm_diffkv.export.trt_abi.launch_plan`, as TensorRT's ``aot_impl`` gets them.

    Raises:
        ValueError: not as many tensors as the wrapper has inputs; an input whose dtype is not the wrapper's (or has
            no Triton element type); two inputs that share memory (the same ``data_ptr``, both non-empty: the inputs
            are distinct buffers updated in place, so an optimizer that merged two identical inputs - e.g.
            onnxruntime's common-subexpression elimination of two zero tensors - would make them one buffer);
            as :func:`~trtllm_diffkv.export.trt_abi.launch_plan`.
    """
    from . import trt_abi
    from .launches import TORCH_TO_TRITON, decode_constexpr

    abi = trt_abi.AbiKernel.from_json(attrs["abi"])
    tensors = list(tensors)
    if len(tensors) != len(abi.input_dtypes):
        raise ValueError(f"{abi.name}: {len(tensors)} tensors for a wrapper of {len(abi.input_dtypes)} inputs")
    for j, (t, want) in enumerate(zip(tensors, abi.input_dtypes)):
        have = TORCH_TO_TRITON.get(str(t.dtype).removeprefix("torch."))
        if have != want:
            raise ValueError(f"{abi.name}: input {j} is {t.dtype}, the wrapper takes {want}")
    first = {}
    for j, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        i = first.setdefault(t.data_ptr(), j)
        if i != j:
            raise ValueError(f"{abi.name}: inputs {i} and {j} share memory (data_ptr {t.data_ptr():#x}); the wrapper "
                             "updates its inputs in place as distinct buffers (were two identical inputs merged, e.g. "
                             "by an optimizer's common-subexpression elimination?)")
    grid, extras = trt_abi.launch_plan(attrs, lambda j, axis: int(tensors[j].shape[axis]))
    kernel = getattr(trt_abi.load_wrappers([abi]), abi.function)
    constexprs = {k: decode_constexpr(v) for k, v in abi.constexprs.items()}
    kernel[grid](*tensors, *extras, *tensors, **constexprs, num_warps=int(attrs["num_warps"]),
                 num_stages=int(attrs["num_stages"]))
