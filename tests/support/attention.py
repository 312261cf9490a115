"""Test helpers for the attention kernels: hand-built paged caches and float64 references.

Shared by the CPU (interpreter) and GPU tests and the benchmark's correctness
check. Pages are filled through :meth:`KVCachePool.segment` views with codes
from :func:`trtllm_diffkv.quant.quantize`, so the kernels are checked against
the one documented layout, not against the code that writes it in production.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trtllm_diffkv.memory.page_format import PageFormat
from trtllm_diffkv.memory.pool import KVCachePool
from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4  # noqa: F401 - re-exported for the tests
from trtllm_diffkv.quant import dequantize, quantize


@dataclass
class PagedRows:
    """A pool filled with random rows, and what the reference needs.

    Attributes:
        pool: the pool (pages hold the packed codes).
        page_table: int32 ``[num_rows, max_pages_per_row]``; tier_tokens: int32 ``[num_rows, 2]``.
        keys, values: per row, float64 ``[high + low, head_dim]`` dequantized
            stored tokens (high tier first, then low, in slot order).
        where: per row, list of (page, slot, tier) of each token, same order.
    """

    pool: KVCachePool
    page_table: torch.Tensor
    tier_tokens: torch.Tensor
    keys: list
    values: list
    where: list


def _store_side(pool: KVCachePool, tier: str, side: str, pages, slots, x: torch.Tensor, bits: int, groups: int):
    """Write rows ``x [n, head_dim]`` to (pages[i], slots[i]); return their stored values float64."""
    codes = pool.segment(tier, f"{side}_codes")
    if bits == 16:
        x16 = x.to(torch.float16)
        codes[pages, slots] = x16.view(torch.uint8).reshape(x.shape[0], -1)
        return x16.double()
    qx = quantize(x[None].float(), bits, groups)
    codes[pages, slots] = qx.codes[0]
    meta = pool.segment(tier, f"{side}_meta")
    meta[pages, slots, :, 0] = qx.scale[0]
    meta[pages, slots, :, 1] = qx.zero[0]
    return dequantize(qx, torch.float64)[0]


def build_paged_rows(page_format: PageFormat, counts, *, max_pages_per_row: int | None = None,
                     device="cpu", seed: int = 0, key_scale: float = 1.0, key_shift: float = 0.0,
                     spare_pages: int = 3) -> PagedRows:
    """Random keys/values for rows with ``counts[r] = (high_tokens, low_tokens)``, written into pages.

    Page ids are shuffled (the kernels must follow the table); the score
    segment gets random values and positions a permutation, so untouched
    tokens can be checked too. ``key_scale`` / ``key_shift`` shape the keys
    (``N(key_shift, key_scale)``).
    """
    g = torch.Generator().manual_seed(seed)
    hp, lp = page_format.high_tokens_per_page, page_format.low_tokens_per_page
    need = [-(-h // hp) + -(-l // lp) for h, l in counts]
    r_max = max_pages_per_row or max(1, max(need))
    total = sum(need) + spare_pages
    pool = KVCachePool(page_format, total, device="cpu")
    pool.buffer.copy_(torch.randint(0, 256, (pool.buffer.numel(),), generator=g, dtype=torch.uint8))
    perm = torch.randperm(total, generator=g).tolist()
    table = torch.full((len(counts), r_max), -1, dtype=torch.int32)
    tokens = torch.tensor(counts, dtype=torch.int32).reshape(len(counts), 2)
    keys, values, where = [], [], []
    d = page_format.head_dim
    for r, (nh, nl) in enumerate(counts):
        ks, vs, wh = [], [], []
        for tier, n, per, from_right in (("high", nh, hp, False), ("low", nl, lp, True)):
            npages = -(-n // per)
            for j in range(npages):
                table[r, r_max - 1 - j if from_right else j] = perm.pop()
            if n == 0:
                continue
            idx = torch.arange(n)
            pos = table[r, (r_max - 1 - idx // per) if from_right else idx // per].long()
            slot = idx % per
            lay = page_format.tier(tier).tier
            k = torch.randn(n, d, generator=g) * key_scale + key_shift
            v = torch.randn(n, d, generator=g)
            ks.append(_store_side(pool, tier, "key", pos, slot, k, lay.key_bits, lay.key_groups))
            vs.append(_store_side(pool, tier, "value", pos, slot, v, lay.value_bits, lay.value_groups))
            if page_format.tier(tier).score.size_bytes:
                pool.segment(tier, "score")[pos, slot] = torch.rand(n, generator=g) * 3
                pool.segment(tier, "position")[pos, slot] = torch.randperm(n, generator=g).int()
            wh += [(int(p), int(s), tier) for p, s in zip(pos, slot)]
        keys.append(torch.cat(ks) if ks else torch.zeros(0, d, dtype=torch.float64))
        values.append(torch.cat(vs) if vs else torch.zeros(0, d, dtype=torch.float64))
        where.append(wh)
    if device != "cpu":
        moved = KVCachePool(page_format, total, device=device)
        moved.buffer.copy_(pool.buffer)
        pool = moved
    return PagedRows(pool, table.to(device), tokens.to(device), keys, values, where)


def read_scores(rows: PagedRows, r: int) -> torch.Tensor:
    """float64 ``[tokens]`` scores of row ``r`` in :attr:`PagedRows.where` order (zeros without a score segment)."""
    out = torch.zeros(len(rows.where[r]), dtype=torch.float64)
    for tier in ("high", "low"):
        idx = [i for i, w in enumerate(rows.where[r]) if w[2] == tier]
        if idx and rows.pool.page_format.tier(tier).score.size_bytes:
            pages = torch.tensor([rows.where[r][i][0] for i in idx])
            slots = torch.tensor([rows.where[r][i][1] for i in idx])
            seg = rows.pool.segment(tier, "score")
            out[idx] = seg[pages.to(seg.device), slots.to(seg.device)].double().cpu()
    return out


def decode_reference(q: torch.Tensor, rows: PagedRows, row_ids: torch.Tensor, sm_scale: float):
    """float64 decode attention and score deltas.

    Returns:
        ``(out [num_seqs, num_heads, head_dim], deltas)`` with ``deltas[(s, kvh)]``
        the float64 ``[tokens]`` max-over-group probabilities of row
        ``row_ids[s, kvh]`` (absent for padding); zero-token rows give zeros.
    """
    num_seqs, num_heads, d = q.shape
    num_kv_heads = row_ids.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_seqs, num_heads, d, dtype=torch.float64)
    deltas = {}
    for s in range(num_seqs):
        for kvh in range(num_kv_heads):
            r = int(row_ids[s, kvh])
            if r < 0:
                continue
            k, v = rows.keys[r], rows.values[r]
            qs = q[s, kvh * group:(kvh + 1) * group].double().cpu()
            if k.shape[0] == 0:
                deltas[(s, kvh)] = torch.zeros(0, dtype=torch.float64)
                continue
            p = torch.softmax(qs @ k.T * sm_scale, dim=-1)
            out[s, kvh * group:(kvh + 1) * group] = p @ v
            deltas[(s, kvh)] = p.max(0).values
    return out, deltas


def prefill_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu, num_scoring: int, sm_scale: float,
                      sliding_window: int | None = None):
    """float64 reference of :func:`~.prefill_attention.scored_prefill_attention`, materializing each prompt's softmax.

    Args: packed ``q [total, num_heads, D]``, ``k``/``v [total, num_kv_heads, D]``, ``cu`` int
    ``[num_seqs + 1]`` prompt boundaries, ``num_scoring`` (S), ``sm_scale``; ``sliding_window`` ``W``: query ``i``
    also masks every key ``j <= i - W`` (the band ``torch.tril(-W)``).

    Returns:
        ``(out float64 [total, num_heads, D], score_sums float64 [total, num_kv_heads])``: causal
        attention per prompt, and per token the max over the KV head's query heads of the per-head
        sum of the probabilities the last ``min(S, n)`` queries give it (the authors' GQA rule).
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    sums = torch.zeros(q.shape[0], num_kv_heads, dtype=torch.float64)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = b - a
        if n == 0:
            continue
        s = min(num_scoring, n)
        qq = q[a:b].double().cpu().transpose(0, 1)
        kk = k[a:b].double().cpu().repeat_interleave(group, 1).transpose(0, 1)
        vv = v[a:b].double().cpu().repeat_interleave(group, 1).transpose(0, 1)
        masked = torch.ones(n, n, dtype=torch.bool).triu(1)
        if sliding_window is not None:
            masked |= torch.ones(n, n, dtype=torch.bool).tril(-sliding_window)
        p = torch.softmax((qq @ kk.transpose(1, 2) * sm_scale).masked_fill(masked, float("-inf")), -1)
        out[a:b] = (p @ vv).transpose(0, 1)
        sums[a:b] = p[:, n - s:].sum(1).view(num_kv_heads, group, n).amax(1).T
    return out, sums


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64 (NaN anywhere gives inf)."""
    x = x.double().cpu()
    ref = ref.double().cpu()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))
