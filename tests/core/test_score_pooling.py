"""Score pooling (``DiffKVConfig.score_pool_tokens``): the prompt decision sees each token's
neighbourhood max importance (SnapKV-style), on the policy, the reference cache and the paged cache.

Checked against the loop-based oracle (``tests/oracle/rules.py``: a per-token max over the window,
written independently of ``max_pool1d``) and, for the paged cache, the reference cache step by step.
"""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import peaked_tiny_llama
from oracle import rules
from test_policy import ALPHA_HIGH, LOW_SHARE, near_threshold_importances
from trtllm_diffkv import policy
from trtllm_diffkv.cache import DiffKVReferenceCache
from trtllm_diffkv.config import DiffKVConfig
from support.paged import run_lockstep

CFG = DiffKVConfig(recent_window_tokens=4, prompt_score_window_tokens=8, alpha_high=1.0, alpha_low=0.3)


def test_pool_importance_is_the_window_max_clipped_at_the_ends():
    imp = torch.tensor([[0.0, 5.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    assert policy.pool_importance(imp, 1) is imp
    assert policy.pool_importance(imp, 3).tolist() == [[5.0, 5.0, 5.0, 0.0, 1.0, 1.0, 1.0]]
    assert policy.pool_importance(imp, 5).tolist() == [[5.0, 5.0, 5.0, 5.0, 1.0, 1.0, 1.0]]


@settings(max_examples=100)
@given(st.integers(1, 3), st.integers(1, 60), st.integers(0, 8), st.integers(1, 40), ALPHA_HIGH, LOW_SHARE,
       st.integers(0, 2**31 - 1), st.sampled_from([3, 5, 7]))
def test_pooled_prompt_tiers_equal_the_oracle(num_kv_heads, prompt_len, window, score_window, alpha_high,
                                              low_share, seed, pool):
    alpha_low = alpha_high * low_share
    rng = random.Random(seed)
    scores = torch.zeros(num_kv_heads, prompt_len)
    for head in range(num_kv_heads):
        for t in range(prompt_len):
            imp = float(near_threshold_importances(1, prompt_len, alpha_high, alpha_low, rng)[0])
            scores[head, t] = imp * rules.prompt_query_count(t, prompt_len, score_window)
    tiers = policy.prompt_tiers(scores, alpha_high, alpha_low, window, score_window, "prompt_len", pool)
    for head in range(num_kv_heads):
        try:
            expected = rules.prompt_tiers(scores[head].tolist(), alpha_high, alpha_low, window, score_window,
                                          "prompt_len", pool)
        except rules.AmbiguousDecision:
            continue
        assert tiers[head].tolist() == expected


@pytest.mark.parametrize("value", [0, 2, 64, True, 3.0])
def test_bad_pool_widths_are_refused_by_name(value):
    with pytest.raises(ValueError, match="score_pool_tokens"):
        DiffKVConfig(score_pool_tokens=value)


def test_pooling_keeps_neighbours_and_the_paged_cache_follows():
    model = peaked_tiny_llama()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (30, 17)]
    mc = model.config
    high = {}
    for pool in (1, 5):
        cache = DiffKVReferenceCache(CFG.replace(score_pool_tokens=pool), mc.num_layers, mc.num_heads,
                                     mc.num_kv_heads, mc.head_dim, 40)
        with torch.inference_mode():
            model(torch.tensor(prompts[0]), torch.arange(30), cache)
        high[pool] = cache.tiers[:, :, :30] == 1
    assert bool((high[5] | ~high[1]).all())  # pooling only raises importance: every high token stays high
    assert int(high[5].sum()) > int(high[1].sum())  # and some neighbours join
    report = run_lockstep(model, CFG.replace(score_pool_tokens=5), prompts, 6, num_pages=200, kv_atol=1e-4,
                          out_atol=1e-3, high_tokens_per_page=4)
    assert report.steps == 6
