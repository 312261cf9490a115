"""Pure DiffKV policy functions: properties checked with hypothesis against brute force."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_diffkv import policy
from trtllm_diffkv.policy import TIER_HIGH, TIER_LOW, TIER_PRUNED


@given(st.integers(1, 4), st.sampled_from([1, 2, 3, 7]), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_gqa_merge_is_max_over_group(num_kv_heads, group, n, seed):
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(num_kv_heads * group, 3, n, generator=g)
    merged = policy.merge_query_heads(probs, num_kv_heads)
    for kv in range(num_kv_heads):
        expected = torch.stack([probs[kv * group + j] for j in range(group)]).max(0).values
        assert torch.equal(merged[kv], expected)


def test_gqa_merge_refuses_bad_ratio():
    import pytest
    with pytest.raises(ValueError, match="multiple"):
        policy.merge_query_heads(torch.zeros(6, 2), 4)


@given(st.integers(1, 40), st.integers(0, 30), st.integers(1, 20))
def test_query_counts_brute_force(prompt_len, extra, window):
    seq_len = prompt_len + extra
    counts = policy.query_counts(torch.arange(seq_len), prompt_len, seq_len, window)
    for p in range(seq_len):
        scoring = [q for q in range(seq_len) if q >= p and (q >= prompt_len or q >= prompt_len - window)]
        assert counts[p] == len(scoring)


@settings(max_examples=200)
@given(st.integers(1, 3), st.integers(1, 80), st.integers(0, 16), st.floats(0.0, 5.0), st.floats(0.0, 1.0),
       st.integers(0, 2**31 - 1), st.sampled_from(["position", "prompt_len"]))
def test_prompt_tiers_thresholds_and_window(num_kv_heads, prompt_len, window, alpha_high, low_share, seed, base):
    alpha_low = alpha_high * low_share
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_kv_heads, prompt_len, generator=g) ** 4
    tiers = policy.prompt_tiers(scores, alpha_high, alpha_low, window, 64, base)
    counts = policy.query_counts(torch.arange(prompt_len), prompt_len, prompt_len, 64)
    importance = scores / counts
    for h in range(num_kv_heads):
        for p in range(prompt_len):
            t = int(tiers[h, p])
            n = p + 1 if base == "position" else prompt_len
            if p >= prompt_len - window:
                assert t == TIER_HIGH  # recent window untouched
            elif importance[h, p] > alpha_high / n:
                assert t == TIER_HIGH  # above alpha_high / N: never pruned
            elif importance[h, p] >= alpha_low / n:
                assert t == TIER_LOW
            else:
                assert t == TIER_PRUNED


@settings(max_examples=300)
@given(st.integers(1, 4), st.integers(1, 60), st.integers(2, 200), st.floats(0.0, 4.0), st.floats(0.0, 1.0),
       st.integers(0, 2**31 - 1))
def test_decode_step_properties(num_kv_heads, n, seq_len, alpha_high, low_share, seed):
    alpha_low = alpha_high * low_share
    g = torch.Generator().manual_seed(seed)
    tiers = torch.randint(0, 3, (num_kv_heads, n), generator=g).to(torch.int8)
    tiers[:, -1] = TIER_HIGH  # the candidate comes out of the window at high precision
    importance = torch.rand(num_kv_heads, n, generator=g) * 4 / seq_len
    d = policy.decode_step(tiers, importance, seq_len, alpha_high, alpha_low)
    after = tiers.clone()
    after[:, -1] = d.candidate_tier
    for h in range(num_kv_heads):
        if d.victim_pos[h] >= 0:
            after[h, d.victim_pos[h]] = d.victim_tier[h]
    for h in range(num_kv_heads):
        imp_c = float(importance[h, -1])
        if imp_c > alpha_high / seq_len:
            assert d.candidate_tier[h] == TIER_HIGH
        # a token above alpha_high / N is never pruned or demoted
        above = importance[h] > alpha_high / seq_len
        assert bool((after[h][above & (tiers[h] == TIER_HIGH)] == TIER_HIGH).all())
        # only the candidate and at most one victim change
        changed = (after[h] != tiers[h]).nonzero().flatten().tolist()
        assert set(changed) <= {n - 1, int(d.victim_pos[h])}
        # the victim is the least important token of the tier the candidate joined
        if d.victim_pos[h] >= 0:
            joined = int(d.candidate_tier[h])
            members = importance[h][(tiers[h] == joined) | (torch.arange(n) == n - 1)]
            assert float(importance[h, d.victim_pos[h]]) == float(members.min())
        # tier counts (the candidate counted as high before: it sat in the window) change by <= 1
        for tier in (TIER_HIGH, TIER_LOW):
            before = int((tiers[h] == tier).sum())
            assert abs(int((after[h] == tier).sum()) - before) <= 1
        assert int((after[h] == TIER_PRUNED).sum()) - int((tiers[h] == TIER_PRUNED).sum()) <= 1


def test_prompt_tiers_unknown_base_refused():
    import pytest
    with pytest.raises(ValueError, match="threshold_base"):
        policy.prompt_tiers(torch.ones(1, 4), 1.0, 0.1, 0, 64, "nope")
