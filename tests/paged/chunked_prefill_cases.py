"""Cache-level chunked prefill checks shared by the CPU and GPU tests (``PagedDiffKVCache.plan(prompt_lens=...)``).

The same random q/k/v of every layer go once through an unchunked prefill and once chunk by chunk into
two caches that start equal. Since non-final chunks write nothing to the pool and the final chunk
scores, tiers and quantizes the kept full-precision K/V with the last S queries of the whole prompt,
the two pools, page tables and tier counts must be bit-identical; each chunk's attention output must
equal dense fp32 causal attention over the prompt's tokens so far.
"""
import torch

from trtllm_diffkv.config import DiffKVConfig, TierConfig, get_preset
from trtllm_diffkv.engine_config import EngineConfig
from trtllm_diffkv.paged.cache import PagedDiffKVCache

SHAPE = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (5e-3, 2e-3), torch.bfloat16: (3e-2, 1.6e-2)}
"""(atol, rtol) of a chunk's attention output against dense fp32 attention, per model dtype (a few ulps)."""
K8V8 = DiffKVConfig(name="k8v8", high=TierConfig(8, 8), low=TierConfig(8, 8), alpha_low=0.0, alpha_high=0.0)


def kv_config(name: str) -> DiffKVConfig:
    """A preset by name, plus ``k8v8`` (8-bit keys and values in one tier) and ``small-window`` (S = W = 8,
    pruning on) for prompts of a few dozen tokens."""
    if name == "k8v8":
        return K8V8
    if name == "small-window":
        return DiffKVConfig(recent_window_tokens=8, prompt_score_window_tokens=8, alpha_high=1.0, alpha_low=0.3)
    return get_preset(name)


def make_cache(config, *, device, dtype, use_triton, prompt_tokens, staging=True):
    return PagedDiffKVCache(config, **SHAPE,
                            engine_config=EngineConfig(max_batch_size=2, max_seq_len=prompt_tokens + 8,
                                                       max_num_tokens=prompt_tokens, device=device,
                                                       high_tokens_per_page=16, use_triton=use_triton,
                                                       chunk_staging_bytes=1 << 28 if staging else 0),
                            num_pages=4096, dtype=dtype)


def random_qkv(prompt_tokens, *, device, dtype, seed=0):
    """Per layer (q ``[n, Hq, D]``, k, v ``[n, H, D]``): peaked keys so that tiers split."""
    g = torch.Generator().manual_seed(seed)
    L, Hq, H, D = (SHAPE[k] for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim"))
    out = []
    for _ in range(L):
        q = torch.randn(prompt_tokens, Hq, D, generator=g) * 0.6
        k = torch.randn(prompt_tokens, H, D, generator=g) * 0.6 + 0.3
        v = torch.randn(prompt_tokens, H, D, generator=g)
        out.append(tuple(x.to(device=device, dtype=dtype) for x in (q, k, v)))
    return out


def dense_causal(q, k, v, start, sm_scale):
    """fp32 reference: queries of positions ``start..`` over keys ``0..start+i`` (GQA by repetition)."""
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    logits = torch.einsum("qhd,khd->hqk", qf, kf) * sm_scale
    pos_q = torch.arange(start, start + q.shape[0], device=q.device)[:, None]
    logits = logits.masked_fill(torch.arange(k.shape[0], device=q.device)[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1), vf)


def prefill(cache, qkv, chunk_tokens=None, slot=0):
    """Prefill the prompt into ``slot``: whole (``chunk_tokens=None``) or in chunks; returns the outputs per layer
    (``[n, Hq, D]``, chunks concatenated) and checks each chunk against :func:`dense_causal`."""
    n = qkv[0][0].shape[0]
    chunk_tokens = chunk_tokens or n
    outs = [[] for _ in qkv]
    for start in range(0, n, chunk_tokens):
        end = min(n, start + chunk_tokens)
        cache.plan([slot], [end], [start], [True], prompt_lens=[n])
        for layer, (q, k, v) in enumerate(qkv):
            o = cache.forward(layer, q[start:end], k[start:end], v[start:end]).clone()
            want = dense_causal(q[:end][start:], k[:end], v[:end], start, cache.sm_scale)
            atol, rtol = TOLERANCE[o.dtype]
            torch.testing.assert_close(o.float(), want, atol=atol, rtol=rtol)
            outs[layer].append(o)
        cache.end_step()
        if end < n:  # nothing of the prompt is in the pool yet: its pages are reserved, its K/V staged
            assert cache.staging[slot].filled_tokens == end and int(cache.manager.tokens.sum()) == 0
    assert slot not in cache.staging and cache.prompt_len[slot] == n
    return [torch.cat(o) for o in outs]


def assert_same_cache(a, b):
    """Bit-identical pools, page tables, tier counts and ring state."""
    assert torch.equal(a.manager.page_table, b.manager.page_table)
    assert torch.equal(a.manager.tokens, b.manager.tokens) and torch.equal(a.manager.pages, b.manager.pages)
    assert a.manager.free_pages() == b.manager.free_pages()
    assert torch.equal(a.pool.buffer, b.pool.buffer)
    assert torch.equal(a.row_meta.key_offsets, b.row_meta.key_offsets)


def check_chunked_equals_unchunked(name, prompt_tokens, chunk_tokens, *, device, dtype, use_triton, decode=True):
    """The prompt chunked into ``chunk_tokens`` leaves the cache bit-identical to the unchunked prefill, and
    (``decode``) one decode step after it reads the same (same output, same scores written)."""
    config = kv_config(name)
    qkv = random_qkv(prompt_tokens, device=device, dtype=dtype)
    whole = make_cache(config, device=device, dtype=dtype, use_triton=use_triton, prompt_tokens=prompt_tokens)
    chunked = make_cache(config, device=device, dtype=dtype, use_triton=use_triton, prompt_tokens=prompt_tokens)
    prefill(whole, qkv)
    prefill(chunked, qkv, chunk_tokens)
    assert_same_cache(whole, chunked)
    held = whole.manager.num_pages - whole.manager.free_pages()
    assert held > 0
    if not decode:
        return whole
    step = random_qkv(1, device=device, dtype=dtype, seed=1)
    outs = []
    for cache in (whole, chunked):
        cache.plan([0], [prompt_tokens + 1], [prompt_tokens], [False])
        outs.append([cache.forward(layer, *x).clone() for layer, x in enumerate(step)])
        cache.end_step()
    for a, b in zip(*outs):
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())
    assert_same_cache(whole, chunked)
    return whole
