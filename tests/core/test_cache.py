"""Reference DiffKV cache against dense float64 attention over the kept tokens (edge cases 4-8, 10).

Every run goes through ``drive``, whose checker compares each step, the
prefill included, with the independent oracles in ``tests/oracle``.
"""
import math

import pytest
import torch

from oracle import attention
from oracle.checked_cache import CheckedCache, format_token_bytes
from oracle.drive import random_qkv
from trtllm_diffkv.cache import DiffKVReferenceCache, attend_kept
from trtllm_diffkv.config import DiffKVConfig, TierConfig
from trtllm_diffkv.policy import TIER_HIGH, TIER_LOW, TIER_PRUNED

UNQUANTIZED = TierConfig(16, 16)


def dense_attention(q, k, v):
    """float64 attention of ``q [num_heads, d]`` over every token of ``k``/``v`` ``[num_kv_heads, n, d]`` (the oracle's)."""
    return attention.decode_attention(q, k, v, torch.ones(k.shape[:2], dtype=torch.bool))[0]


def drive(cfg, num_heads, num_kv_heads, head_dim, prompt_len, steps, seed=0, spiky=True):
    """Run prefill + ``steps`` decode steps of one layer on random data, every step (prefill included)
    checked against the independent oracle (:class:`oracle.checked_cache.CheckedCache`).

    Yields ``(checked, (q, k, v), out)`` after each step, prefill first; ``checked.cache`` is the cache.
    """
    total = prompt_len + steps
    q, k, v = random_qkv(total, num_heads, num_kv_heads, head_dim, seed, spiky)
    checked = CheckedCache(DiffKVReferenceCache(cfg, 1, num_heads, num_kv_heads, head_dim, total))
    yield checked, (q, k, v), checked.forward(0, q[:prompt_len], k[:prompt_len], v[:prompt_len])
    for t in range(prompt_len, total):
        yield checked, (q, k, v), checked.forward(0, q[t:t + 1], k[t:t + 1], v[t:t + 1])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (7, 1)])
def test_unquantized_keep_all_equals_dense(num_heads, num_kv_heads):
    cfg = DiffKVConfig(high=UNQUANTIZED, low=UNQUANTIZED, alpha_high=0.0, alpha_low=0.0, recent_window_tokens=4)
    prompt_len = 23
    for i, (checked, (q, k, v), out) in enumerate(drive(cfg, num_heads, num_kv_heads, 64, prompt_len, 12)):
        if i == 0:  # prefill: causal attention over the prompt at every position
            ref = attention.causal_attention(q[:prompt_len], k[:prompt_len], v[:prompt_len])
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
            continue
        t = prompt_len - 1 + i
        ref = dense_attention(q[t], k[:t + 1].transpose(0, 1), v[:t + 1].transpose(0, 1))
        torch.testing.assert_close(out[0].double(), ref, rtol=1e-5, atol=1e-5)
    assert int((checked.cache.tiers[0] == TIER_PRUNED).sum()) == 0


def test_prune_everything_outside_window_equals_window_attention():
    window = 8
    cfg = DiffKVConfig(high=UNQUANTIZED, low=UNQUANTIZED, alpha_high=1000.0, alpha_low=1000.0,
                       recent_window_tokens=window)
    prompt_len = 30
    for i, (checked, (q, k, v), out) in enumerate(drive(cfg, 6, 3, 64, prompt_len, 10)):
        cache = checked.cache
        if i == 0:  # the prompt attends at full precision before its tokens are tiered
            ref = attention.causal_attention(q[:prompt_len], k[:prompt_len], v[:prompt_len])
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
            assert int((cache.tiers[0, :, :prompt_len - window] != TIER_PRUNED).sum()) == 0
            continue
        t = prompt_len - 1 + i
        lo = t - window + 1  # the token leaving the window was pruned before this step's attention
        ref = dense_attention(q[t], k[lo:t + 1].transpose(0, 1), v[lo:t + 1].transpose(0, 1))
        torch.testing.assert_close(out[0].double(), ref, rtol=1e-5, atol=1e-5)
        assert int((cache.tiers[0, :, :lo] != TIER_PRUNED).sum()) == 0


def test_scores_are_group_max_probabilities_accumulated():
    # alpha_high > 0 tiers the tokens (so scores are kept); equal formats and alpha_low = 0 keep every token as is
    cfg = DiffKVConfig(high=UNQUANTIZED, low=UNQUANTIZED, alpha_high=1e-6, alpha_low=0.0,
                       recent_window_tokens=2, prompt_score_window_tokens=5)
    prompt_len, steps, num_heads, num_kv_heads = 12, 6, 4, 2
    *_, (checked, (q, k, v), _) = drive(cfg, num_heads, num_kv_heads, 64, prompt_len, steps)
    cache = checked.cache
    total = prompt_len + steps
    expected = torch.zeros(num_kv_heads, total, dtype=torch.float64)
    prompt_sums = torch.zeros(num_heads, total, dtype=torch.float64)
    for t in range(total):
        if t < prompt_len - 5:
            continue  # only the last 5 prompt queries score
        for kv in range(num_kv_heads):
            logits = k[:t + 1, kv].double() @ q[t, kv * 2:kv * 2 + 2].double().T / 8.0
            probs = torch.softmax(logits, 0)  # [t + 1, 2 query heads]
            if t < prompt_len:  # prompt: per query head summed over the scoring queries, max taken after
                prompt_sums[kv * 2:kv * 2 + 2, :t + 1] += probs.T
            else:  # decode: one query per step, max over the group's query heads
                expected[kv, :t + 1] += probs.max(1).values
    expected += prompt_sums.reshape(num_kv_heads, 2, total).amax(1)
    torch.testing.assert_close(cache.scores[0].double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (28, 4), (40, 8), (12, 2), (8, 1), (32, 1)])
def test_edge_case_7_head_dims_and_groups_match_reference(head_dim, num_heads, num_kv_heads):
    """Every step, prefill included, checked by the oracle (output, scores, tiers, stored K/V)."""
    cfg = DiffKVConfig(alpha_high=1.0, alpha_low=0.3, recent_window_tokens=8)
    *_, (checked, _, _) = drive(cfg, num_heads, num_kv_heads, head_dim, 40, 3, seed=head_dim)
    assert checked.layer_len == [43] and checked.ambiguous == 0


def test_stored_tokens_within_tier_bounds_and_window_untouched():
    """Stored K/V within half a step of their tier's format (checked per step), the window stays high,
    and the run demotes and prunes tokens (so the bounds of both tiers were exercised)."""
    window = 16
    cfg = DiffKVConfig(recent_window_tokens=window, alpha_high=1.0, alpha_low=0.3)
    prompt_len, steps = 70, 40
    for i, (checked, _, _) in enumerate(drive(cfg, 8, 2, 128, prompt_len, steps)):
        t = prompt_len - 1 + i  # last position written
        tiers = checked.cache.tiers[0, :, :t + 1]
        assert bool((tiers[:, max(t + 1 - window, 0):] == TIER_HIGH).all()), "recent window must stay high"
    final = checked.cache.tiers[0]
    assert int((final == TIER_LOW).sum()) > 0 and int((final == TIER_PRUNED).sum()) > 0
    assert checked.outcomes["cand=HIGH victim HIGH->LOW"] + checked.outcomes["cand=LOW victim LOW->LOW"] > 0


def test_tier_counts_change_by_at_most_one_per_head_per_step():
    cfg = DiffKVConfig(recent_window_tokens=8, alpha_high=1.5, alpha_low=0.5)
    prev = None
    for checked, *_ in drive(cfg, 4, 4, 64, 50, 60, seed=3):
        cache = checked.cache
        counts = torch.stack([(cache.tiers[0] == t).sum(1) for t in (TIER_HIGH, TIER_LOW)])
        if prev is not None:
            # +1 high for the new token; the compaction moves at most one token per tier
            assert int((counts[0] - prev[0]).max()) <= 1 and int((counts[0] - prev[0]).min()) >= -1
            assert int((counts[1] - prev[1]).abs().max()) <= 1
        prev = counts


@pytest.mark.parametrize("lengths", [[1, 15, 16, 17], [255, 256, 257, 1]])
def test_edge_case_5_tail_masking_zero_query_is_mean_of_kept(lengths):
    num_kv_heads, n, d = len(lengths), 300, 128
    keys, values = torch.randn(num_kv_heads, n, d), torch.randn(num_kv_heads, n, d)
    kept = torch.zeros(num_kv_heads, n, dtype=torch.bool)
    for h, length in enumerate(lengths):
        kept[h, :length] = True
    out, probs = attend_kept(torch.zeros(num_kv_heads * 2, d), keys, values, kept)
    for h, length in enumerate(lengths):
        expected = values[h, :length].mean(0)
        torch.testing.assert_close(out[2 * h], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out[2 * h + 1], expected, rtol=1e-5, atol=1e-6)
        assert float(probs[2 * h, length:].abs().sum()) == 0.0


def test_edge_case_6_extreme_logits_no_sentinel():
    d = 64
    g = torch.Generator().manual_seed(6)
    q = torch.ones(1, d)
    unit = q[0] / math.sqrt(d)
    noise = torch.randn(1, 10, d, generator=g)
    noise -= (noise @ unit)[..., None] * unit  # orthogonal to q: the logit is the q component alone
    keys = noise + (-6e4) * unit  # every logit -6e4 (was: random keys rescaled by their own projection, which
    # blew up when a projection was near 0 and made the fp32 rounding, and the test, depend on the RNG state)
    keys[0, 3] *= 0.9999  # one slightly larger logit (~ -59994)
    values = torch.randn(1, 10, d, generator=g)
    kept = torch.ones(1, 10, dtype=torch.bool)
    out, probs = attend_kept(q, keys, values, kept)
    ref = dense_attention(q, keys, values)
    assert bool(torch.isfinite(out).all())
    # fp32 logits of magnitude 6e4 carry ~4e-3 absolute rounding: compare at that precision
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2)
    assert float(probs[0, 3]) > 0.95  # e^6 / (e^6 + 9): ordinary softmax, not a uniform average


def test_edge_case_6_empty_low_tier_and_window_only_heads_no_nan():
    cfg = DiffKVConfig(alpha_high=1000.0, alpha_low=1000.0, recent_window_tokens=4)
    for checked, _, out in drive(cfg, 4, 2, 64, 20, 5):
        assert bool(torch.isfinite(out).all())
    assert int((checked.cache.tiers[0] == TIER_LOW).sum()) == 0


@pytest.mark.parametrize("prompt_len", [1, 16, 17])
def test_edge_case_8_tiny_prompts_nothing_compressed_inside_window(prompt_len):
    cfg = DiffKVConfig(recent_window_tokens=64, alpha_high=1000.0, alpha_low=1000.0)
    for i, (checked, _, _) in enumerate(drive(cfg, 4, 2, 64, prompt_len, 8)):
        assert int((checked.cache.tiers[0, :, :prompt_len + i] != TIER_HIGH).sum()) == 0
    assert checked.layer_len == [prompt_len + 8]


def test_edge_case_8_empty_prompt_fails_and_allocates_nothing():
    cache = DiffKVReferenceCache(DiffKVConfig(), 1, 4, 2, 64, 16)
    with pytest.raises(ValueError, match="empty prompt"):
        cache.forward(0, torch.zeros(0, 4, 64), torch.zeros(0, 2, 64), torch.zeros(0, 2, 64))
    stats = cache.stats()
    assert stats.kv_cache_bytes == 0 and stats.seq_len_tokens == 0


def test_edge_case_10_gqa_sizing_cache_holds_kv_heads_only():
    cfg = DiffKVConfig()
    cache = DiffKVReferenceCache(cfg, 1, 32, 8, 128, 1025)
    g = torch.Generator().manual_seed(0)
    cache.forward(0, torch.randn(1024, 32, 128, generator=g), torch.randn(1024, 8, 128, generator=g),
                  torch.randn(1024, 8, 128, generator=g))
    assert cache.keys.shape[:2] == (1, 8) and cache.tiers.shape[:2] == (1, 8)
    stats = cache.stats()
    assert stats.total_tokens == 8 * 1024
    high_bytes = format_token_bytes(8, 4, 1, 2, 128) + 8  # K8V4: 128 + 64 code bytes, 3 x (fp16 scale, zero), score, position
    low_bytes = format_token_bytes(4, 2, 2, 4, 128) + 8  # K4V2: 64 + 32 code bytes, 6 x (fp16 scale, zero), score, position
    assert (high_bytes, low_bytes) == (212, 128)
    expected_bytes = stats.high_tokens * high_bytes + stats.low_tokens * low_bytes + 8 * 128 * 2  # + key offsets
    assert stats.kv_cache_bytes == expected_bytes
    assert stats.fp16_kv_cache_bytes == 8 * 1024 * 128 * 2 * 2


@pytest.mark.parametrize("preset", ["fp16", "k8v4", "llama3-8b"])
def test_preset_accounting_equals_the_oracles_count(preset):
    """Two layers, 10 prompt tokens and 3 steps: counts and bytes rebuilt from the oracle's own tiers."""
    from trtllm_diffkv.config import get_preset
    cfg = get_preset(preset).replace(recent_window_tokens=2, prompt_score_window_tokens=4)
    cache = DiffKVReferenceCache(cfg, 2, 4, 2, 64, 13)
    checked = CheckedCache(cache)
    q, k, v = random_qkv(13, 4, 2, 64, seed=5)
    for layer in range(2):
        checked.forward(layer, q[:10], k[:10], v[:10])
    for t in range(10, 13):
        for layer in range(2):
            checked.forward(layer, q[t:t + 1], k[t:t + 1], v[t:t + 1])
    stats, expected = cache.stats(), checked.expected_stats()
    assert stats.seq_len_tokens == 13 and expected["fp16_kv_cache_bytes"] == 2 * 2 * 13 * 64 * 2 * 2
    for name, value in expected.items():
        assert getattr(stats, name) == value, name
    if preset == "fp16":  # nothing pruned, every token at 2 bytes per element of K and V
        assert stats.pruned_tokens == 0 and stats.kv_cache_bytes == 2 * 2 * 13 * 64 * 2 * 2
    else:
        assert stats.kv_memory_fraction < 0.5


@pytest.mark.parametrize("prompt_len", [31, 32, 33, 59, 60, 61, 63, 64, 65, 119, 120, 121])
def test_edge_case_4_lengths_around_page_capacities(prompt_len):
    """Prompt lengths around the K8V4 (32) and K4V2 (60) page capacities of head_dim 128, then 8 steps:
    every step checked by the oracle, which also asserts that tokens already stored never change."""
    cfg = DiffKVConfig(recent_window_tokens=16, alpha_high=1.0, alpha_low=0.2)
    *_, (checked, _, _) = drive(cfg, 8, 2, 128, prompt_len, 8, seed=prompt_len)
    assert checked.layer_len == [prompt_len + 8] and checked.ambiguous == 0


def test_bad_requests_fail_alone_in_the_generator():
    """Out-of-vocabulary ids, bad max_new_tokens, empty prompts come back as errors; the next request runs."""
    from conftest import tiny_llama
    from trtllm_diffkv.generation.reference import ReferenceGenerator

    model = tiny_llama()
    gen = ReferenceGenerator(model, None, model.config, DiffKVConfig(recent_window_tokens=4))
    for ids, n in (([512], 2), ([-1], 2), ([3, 4], 0), ([3, 4], 2.5), ([], 3)):
        result = gen.generate_ids(ids, n)
        assert result.finish_reason == "error" and result.error
    assert "empty prompt" in gen.generate("", 3).error
    assert "no tokenizer" in gen.generate("   ", 3).error  # whitespace is a prompt (past the empty check)
    ok = gen.generate_ids([3, 4, 5], 3)
    assert ok.error is None and ok.generated_tokens == 3
