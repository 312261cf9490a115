"""Rule tests of the baseline caches (trtllm_diffkv.evaluation.baselines) against small independent references.

Each cache is driven directly through ``forward`` with random q/k/v (no model), and what it keeps and
stores is compared with a loop-by-loop re-implementation of the method's rule written here from the
papers and their public code (not from the module): per-token min/max quantization for the uniform
formats, KIVI's per-channel key groups / per-token value groups / residual, SnapKV's window voting
with average pooling, H2O's accumulated-attention eviction and StreamingLLM's sinks + window.
"""
from __future__ import annotations

import math

import pytest
import torch

from trtllm_diffkv.evaluation import baselines

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 1, 4, 2, 64
GROUP = NUM_HEADS // NUM_KV_HEADS


def _qkv(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=g) * 1.5
    k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g) * 1.5
    v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g)
    return q, k, v


def _run(cache, q, k, v, prompt_len: int):
    """Prefill ``prompt_len`` tokens, then decode the rest one at a time; returns the decode outputs."""
    cache.forward(0, q[:prompt_len], k[:prompt_len], v[:prompt_len])
    return [cache.forward(0, q[i:i + 1], k[i:i + 1], v[i:i + 1]) for i in range(prompt_len, q.shape[0])]


def _minmax(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Asymmetric min/max fake quantization of one 1-D group, fp16 scale and zero (the KIVI/LMDeploy rule)."""
    lo, hi = float(x.min()), float(x.max())
    scale = torch.tensor(max((hi - lo) / (2**bits - 1), 2.0**-14)).half().float()
    zero = torch.tensor(lo).half().float()
    return torch.clamp(torch.round((x - zero) / scale), 0, 2**bits - 1) * scale + zero


def _dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor):
    """fp32 attention of one query ``[num_heads, d]`` over the kept rows of each KV head; returns (out, probs)."""
    out = torch.zeros(NUM_HEADS, HEAD_DIM)
    probs = torch.zeros(NUM_HEADS, keys.shape[1])
    for h in range(NUM_HEADS):
        kv = h // GROUP
        idx = kept[kv].nonzero()[:, 0]
        logits = keys[kv, idx] @ q[h] / math.sqrt(HEAD_DIM)
        p = torch.softmax(logits, 0)
        probs[h, idx] = p
        out[h] = p @ values[kv, idx]
    return out, probs


def test_uniform_quant_stores_per_token_minmax_and_attends_over_it():
    q, k, v = _qkv(20, 0)
    cache = baselines.UniformQuantCache(4, 4, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 20)
    outs = _run(cache, q, k, v, 16)
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)
    want_k = torch.stack([torch.stack([_minmax(kh[h, t], 4) for t in range(20)]) for h in range(NUM_KV_HEADS)])
    want_v = torch.stack([torch.stack([_minmax(vh[h, t], 4) for t in range(20)]) for h in range(NUM_KV_HEADS)])
    torch.testing.assert_close(cache.keys[0, :, :20], want_k, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.values[0, :, :20], want_v, atol=1e-5, rtol=0)
    out, _ = _dense_attention(q[19], want_k, want_v, torch.ones(NUM_KV_HEADS, 20, dtype=torch.bool))
    torch.testing.assert_close(outs[-1][0], out, atol=1e-5, rtol=1e-5)
    # K4V4, one group: 32 + 32 code bytes + 2 x (fp16 scale + zero) per token per KV head
    assert cache.stats().kv_cache_bytes == 20 * NUM_KV_HEADS * (32 + 32 + 8)
    assert cache.stats().kv_memory_fraction == pytest.approx(72 / 256)


def _kivi_reference(kh, vh, length, bits, group_tokens, residual_tokens, value_group_channels, prompt_len):
    """KIVI's stored keys/values after ``length`` tokens (prompt then decode), built rule by rule."""
    key_end = prompt_len - prompt_len % residual_tokens if prompt_len >= residual_tokens else 0
    for t in range(prompt_len, length):  # decode: the residual is quantized when it holds R keys
        if t + 1 - key_end == residual_tokens:
            key_end = t + 1
    value_end = max(length - residual_tokens, 0)
    keys, values = kh[:, :length].clone(), vh[:, :length].clone()
    for h in range(kh.shape[0]):
        for start in range(0, key_end, group_tokens):
            for c in range(HEAD_DIM):
                keys[h, start:start + group_tokens, c] = _minmax(kh[h, start:start + group_tokens, c], bits)
        for t in range(value_end):
            for start in range(0, HEAD_DIM, value_group_channels):
                values[h, t, start:start + value_group_channels] = _minmax(
                    vh[h, t, start:start + value_group_channels], bits)
    return keys, values, key_end, value_end


@pytest.mark.parametrize("prompt_len,length", [(70, 70), (70, 95), (70, 96), (20, 40)])
def test_kivi_quantizes_keys_per_channel_values_per_token_with_residual(prompt_len, length):
    q, k, v = _qkv(length, 1)
    cache = baselines.KIVICache(2, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, length, group_tokens=16,
                                residual_tokens=32, value_group_channels=32)
    _run(cache, q, k, v, prompt_len)
    keys, values, key_end, value_end = _kivi_reference(k.transpose(0, 1), v.transpose(0, 1), length, 2, 16, 32, 32,
                                                       prompt_len)
    assert (cache.key_quantized_tokens[0], cache.value_quantized_tokens[0]) == (key_end, value_end)
    torch.testing.assert_close(cache.keys[0, :, :length], keys, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.values[0, :, :length], values, atol=1e-5, rtol=0)
    # bytes: 2-bit codes + 4 bytes (scale, zero) per channel per 16-token key group and per 32-channel value
    # group, 2 bytes per element in full precision
    per_head = (key_end * 16 + (key_end // 16) * HEAD_DIM * 4 + (length - key_end) * HEAD_DIM * 2
                + value_end * (16 + 2 * 4) + (length - value_end) * HEAD_DIM * 2)
    assert cache.stats().kv_cache_bytes == NUM_KV_HEADS * per_head


def _window_votes(q, k, n, window):
    """SnapKV votes: the last ``window`` queries' causal softmax rows, summed over the queries, on positions < n - window."""
    votes = torch.zeros(NUM_HEADS, n - window)
    for h in range(NUM_HEADS):
        for i in range(n - window, n):
            p = torch.softmax(k[:i + 1, h // GROUP] @ q[i, h] / math.sqrt(HEAD_DIM), 0)
            votes[h] += p[:n - window]
    return votes


def test_snapkv_keeps_pooled_top_votes_plus_window_and_never_evicts_while_decoding():
    n, window, kernel, budget_fraction = 60, 8, 5, 0.5
    q, k, v = _qkv(n + 4, 2)
    cache = baselines.SnapKVCache(budget_fraction, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, n + 4,
                                  window_tokens=window, kernel_tokens=kernel)
    _run(cache, q, k, v, n)
    votes = _window_votes(q, k, n, window)
    budget = 30
    for kv in range(NUM_KV_HEADS):
        merged = votes[kv * GROUP:(kv + 1) * GROUP].mean(0)
        padded = torch.cat([torch.zeros(2), merged, torch.zeros(2)])
        pooled = torch.tensor([float(padded[j:j + kernel].sum()) / kernel for j in range(n - window)])
        want = set(pooled.argsort(descending=True)[:budget - window].tolist()) | set(range(n - window, n + 4))
        assert set(cache.kept[0, kv, :n + 4].nonzero()[:, 0].tolist()) == want
    assert cache.stats().kv_cache_bytes == NUM_KV_HEADS * (budget + 4) * HEAD_DIM * 4


def test_h2o_evicts_the_lowest_accumulated_score_outside_the_recent_window():
    n, steps, budget_fraction = 40, 6, 0.5
    q, k, v = _qkv(n + steps, 3)
    cache = baselines.H2OCache(budget_fraction, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, n + steps)
    _run(cache, q, k, v, n)
    k16, v16 = k.half().float().transpose(0, 1), v.half().float().transpose(0, 1)
    budget, heavy = 20, 10
    recent = budget - heavy
    scores = torch.zeros(NUM_KV_HEADS, n + steps)
    for h in range(NUM_HEADS):  # prefill: every prompt query's causal softmax row, summed over the group
        for i in range(n):
            scores[h // GROUP, :i + 1] += torch.softmax(k[:i + 1, h // GROUP] @ q[i, h] / math.sqrt(HEAD_DIM), 0)
    kept = torch.zeros(NUM_KV_HEADS, n + steps, dtype=torch.bool)
    for kv in range(NUM_KV_HEADS):
        top = scores[kv, :n - recent].argsort(descending=True)[:heavy]
        kept[kv, top] = True
        kept[kv, n - recent:n] = True
    scores *= kept
    for pos in range(n, n + steps):
        kept[:, pos] = True
        _, probs = _dense_attention(q[pos], k16[:, :pos + 1], v16[:, :pos + 1], kept[:, :pos + 1])
        for h in range(NUM_HEADS):
            scores[h // GROUP, :pos + 1] += probs[h]
        older = pos + 1 - recent
        for kv in range(NUM_KV_HEADS):
            candidates = kept[kv, :older].nonzero()[:, 0]
            victim = candidates[scores[kv, candidates].argmin()]
            kept[kv, victim] = False
            scores[kv, victim] = 0
    assert torch.equal(cache.kept[0, :, :n + steps], kept)
    assert int(cache.kept[0, 0].sum()) == budget
    assert cache.stats().kv_cache_bytes == NUM_KV_HEADS * budget * (HEAD_DIM * 4 + 4)


def _dense_causal_probs(q: torch.Tensor, k: torch.Tensor, first_query_pos: int = 0) -> torch.Tensor:
    """float64 ``[num_heads, m, n]``: each query's causal softmax row over all ``n`` keys, in one piece."""
    qh, kh = q.double().transpose(0, 1), k.double().transpose(0, 1).repeat_interleave(GROUP, 0)
    logits = qh @ kh.transpose(1, 2) / math.sqrt(HEAD_DIM)
    rows = torch.arange(first_query_pos, first_query_pos + q.shape[0])[:, None]
    return torch.softmax(logits.masked_fill(torch.arange(k.shape[0])[None, :] > rows, float("-inf")), dim=-1)


@pytest.mark.parametrize("first_query_pos,chunk_queries", [(0, 4), (0, 7), (13, 5), (13, 256)])
def test_chunked_causal_probs_equal_one_dense_softmax(first_query_pos, chunk_queries):
    """``causal_probs_chunked`` yields the rows of the dense causal softmax, each chunk at its own positions (a
    chunk that restarted its rows at ``first_query_pos`` would let its queries see too few keys)."""
    n = 30
    q, k, _ = _qkv(n, 7)
    queries = q[first_query_pos:]
    want = _dense_causal_probs(queries, k, first_query_pos)
    got = torch.zeros_like(want)
    starts = []
    for start, probs in baselines.causal_probs_chunked(queries.transpose(0, 1), k.transpose(0, 1), GROUP,
                                                       first_query_pos, chunk_queries):
        got[:, start:start + probs.shape[1]] = probs.double()
        starts.append(start)
    assert starts == list(range(0, n - first_query_pos, chunk_queries))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_h2o_on_a_prompt_longer_than_one_chunk_keeps_the_dense_heavy_hitters():
    """Issue 43: a 300-token prompt (two chunks of prompt queries: 256 + 44). H2O's accumulated scores equal
    the column sums of the dense causal probabilities computed in one piece (float64), summed over each KV
    head's query heads, and the heavy hitters kept are their top half of the budget outside the recent window."""
    n, budget_fraction = 300, 0.3
    q, k, v = _qkv(n, 8)
    cache = baselines.H2OCache(budget_fraction, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, n)
    cache.forward(0, q, k, v)
    budget = 90
    heavy, recent = budget // 2, budget - budget // 2
    scores = _dense_causal_probs(q, k).sum(1).reshape(NUM_KV_HEADS, GROUP, n).sum(1)  # [kv heads, n]
    kept = cache.kept[0, :, :n]
    for kv in range(NUM_KV_HEADS):
        order = scores[kv, :n - recent].argsort(descending=True)
        gap = float(scores[kv, order[heavy - 1]] - scores[kv, order[heavy]])
        assert gap > 1e-4, "the reference's heavy-hitter cut must not be a near tie"
        want = set(order[:heavy].tolist()) | set(range(n - recent, n))
        assert set(kept[kv].nonzero()[:, 0].tolist()) == want
        torch.testing.assert_close(cache.scores[0, kv, :n][kept[kv]].double(), scores[kv][kept[kv]], atol=2e-4,
                                   rtol=1e-5)


@pytest.mark.parametrize("prompt_len,budget_fraction", [(40, 0.34), (40, 0.33), (60, 0.41), (40, 1.0), (40, 0.01)])
def test_eviction_budgets_round_to_the_nearest_token(prompt_len, budget_fraction):
    """Non-integer budgets (13.6 -> 14 tokens, 13.2 -> 13, 24.6 -> 25): every eviction baseline keeps the nearest
    whole number of prompt tokens per KV head (exact decimal arithmetic here), not the floor; a whole prompt at
    fraction 1; at a tiny fraction the method's fixed part (StreamingLLM: 4 sinks + 1, H2O: 2, SnapKV: window + 1)."""
    from fractions import Fraction

    nearest = math.floor(Fraction(str(budget_fraction)) * prompt_len + Fraction(1, 2))  # no exact halves here
    q, k, v = _qkv(prompt_len, 9)
    caches = {"streaming": (baselines.StreamingLLMCache, {}, 5), "h2o": (baselines.H2OCache, {}, 2),
              "snapkv": (baselines.SnapKVCache, {"window_tokens": 8}, 9)}
    for name, (cls, kwargs, minimum) in caches.items():
        cache = cls(budget_fraction, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, prompt_len, **kwargs)
        cache.forward(0, q, k, v)
        expected = min(prompt_len, max(minimum, nearest))
        assert cache.budget == expected, name
        assert cache.kept[0, :, :prompt_len].sum(-1).tolist() == [expected] * NUM_KV_HEADS, name


def test_streamingllm_keeps_sinks_and_the_newest_tokens():
    n, steps = 50, 7
    q, k, v = _qkv(n + steps, 4)
    cache = baselines.StreamingLLMCache(0.4, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, n + steps)
    outs = _run(cache, q, k, v, n)
    budget = 20
    want = torch.zeros(NUM_KV_HEADS, n + steps, dtype=torch.bool)
    want[:, :4] = True
    want[:, n + steps - (budget - 4):] = True
    assert torch.equal(cache.kept[0, :, :n + steps], want)
    k16, v16 = k.half().float().transpose(0, 1), v.half().float().transpose(0, 1)
    out, _ = _dense_attention(q[-1], k16, v16, want)
    torch.testing.assert_close(outs[-1][0], out, atol=1e-5, rtol=1e-5)


def test_bad_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="budget_fraction"):
        baselines.H2OCache(0.0, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 8)
    with pytest.raises(ValueError, match="kernel_tokens"):
        baselines.SnapKVCache(0.5, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 8, kernel_tokens=4)
    with pytest.raises(ValueError, match="residual_tokens"):
        baselines.KIVICache(2, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 8, group_tokens=32, residual_tokens=48)
    with pytest.raises(ValueError, match="num_heads"):
        baselines.StreamingLLMCache(0.5, NUM_LAYERS, 3, 2, HEAD_DIM, 8)
    cache = baselines.H2OCache(0.5, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 8)
    q, k, v = _qkv(9, 5)
    with pytest.raises(ValueError, match="capacity"):
        cache.forward(0, q, k, v)
