"""Pure DiffKV policy functions against the loop-based oracle (``tests/oracle/rules.py``), exactly.

Inputs put importances just off the thresholds (0.3% away, inside the band a
wrong N or a wrong count would cross) as well as far from them, so every
candidate and victim outcome occurs and each rule is pinned.
"""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oracle import rules
from trtllm_diffkv import policy
from trtllm_diffkv.policy import TIER_HIGH


# alpha 0 (the k8v4 preset's alpha_high, several presets' alpha_low) with exact-zero importances pins > vs >=.
ALPHA_HIGH = st.one_of(st.just(0.0), st.floats(0.5, 4.0))
LOW_SHARE = st.one_of(st.just(0.0), st.floats(0.01, 1.0))


def near_threshold_importances(n: int, length: float, alpha_high: float, alpha_low: float, rng: random.Random):
    """float32 ``[n]`` importances, each ``alpha / length`` times a factor near or far from 1, no two tied
    (except exact zeros, drawn when the chosen alpha is 0)."""
    values = []
    for t in range(n):
        thr = rng.choice([alpha_high, alpha_low]) / length
        factor = rng.choice([0.997, 1.003, 0.2, 4.0, 0.95, 1.05]) * (1 + 1e-3 * t / n)
        if thr == 0:  # alpha_low = 0: an importance of exactly 0 must still be kept (>=, not >)
            values.append(rng.choice([0.0, rng.random() * 1e-3 * (t + 1)]))
        else:
            values.append(thr * factor)
    return torch.tensor(values, dtype=torch.float32)


@given(st.integers(1, 4), st.sampled_from([1, 2, 3, 7]), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_gqa_merge_is_max_over_group(num_kv_heads, group, n, seed):
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(num_kv_heads * group, 3, n, generator=g)
    merged = policy.merge_query_heads(probs, num_kv_heads)
    for kv in range(num_kv_heads):
        expected = torch.stack([probs[kv * group + j] for j in range(group)]).max(0).values
        assert torch.equal(merged[kv], expected)


def test_gqa_merge_refuses_bad_ratio():
    with pytest.raises(ValueError, match="multiple"):
        policy.merge_query_heads(torch.zeros(6, 2), 4)


@given(st.integers(1, 3), st.sampled_from([1, 2, 4, 7]), st.integers(1, 6), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_prompt_score_sums_sum_per_query_head_then_max(num_kv_heads, group, num_scoring, prompt_len, seed):
    """Per query head the sum over the scoring queries, then the max over the KV head's query heads."""
    g = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    probs = torch.rand(num_heads, num_scoring, prompt_len, generator=g)
    got = policy.prompt_score_sums(probs, num_kv_heads)
    assert got.shape == (num_kv_heads, prompt_len)
    for kv in range(num_kv_heads):
        for t in range(prompt_len):
            sums = [sum(float(probs[h, i, t]) for i in range(num_scoring))
                    for h in range(num_heads) if h // group == kv]
            assert float(got[kv, t]) == pytest.approx(max(sums), rel=1e-6)


@given(st.integers(1, 40), st.integers(0, 30), st.integers(1, 20))
def test_query_counts_equal_the_oracle(prompt_len, extra, window):
    seq_len = prompt_len + extra
    counts = policy.query_counts(torch.arange(seq_len), prompt_len, seq_len, window)
    for t in range(seq_len):
        assert counts[t] == rules.decode_query_count(t, seq_len, prompt_len, window)


@settings(max_examples=150)
@given(st.integers(1, 3), st.integers(1, 80), st.integers(0, 16), st.integers(1, 70), ALPHA_HIGH, LOW_SHARE,
       st.integers(0, 2**31 - 1), st.sampled_from(["position", "prompt_len"]))
def test_prompt_tiers_equal_the_oracle(num_kv_heads, prompt_len, window, score_window, alpha_high, low_share,
                                       seed, base):
    alpha_low = alpha_high * low_share
    rng = random.Random(seed)
    scores = torch.zeros(num_kv_heads, prompt_len)
    for head in range(num_kv_heads):
        for t in range(prompt_len):  # an importance near a threshold, times the token's query count
            length = prompt_len if base == "prompt_len" else t + 1
            imp = float(near_threshold_importances(1, length, alpha_high, alpha_low, rng)[0])
            scores[head, t] = imp * rules.prompt_query_count(t, prompt_len, score_window)
    tiers = policy.prompt_tiers(scores, alpha_high, alpha_low, window, score_window, base)
    for head in range(num_kv_heads):
        try:
            expected = rules.prompt_tiers(scores[head].tolist(), alpha_high, alpha_low, window, score_window, base)
        except rules.AmbiguousDecision:
            continue
        assert tiers[head].tolist() == expected


def test_prompt_tiers_default_base_is_prompt_len():
    """Token 0 of a 4-token prompt, scored by 4 queries with sum 1.25: importance 0.3125 lies between
    ``alpha_high / prompt_len`` = 0.125 and ``alpha_high / (0 + 1)`` = 0.5 (alpha_high 0.5)."""
    scores = torch.tensor([[1.25, 1.0, 1.0, 1.0]])
    assert policy.prompt_tiers(scores, 0.5, 0.0, 1, 64)[0, 0] == rules.HIGH
    assert policy.prompt_tiers(scores, 0.5, 0.0, 1, 64, "position")[0, 0] == rules.LOW


@settings(max_examples=300)
@given(st.integers(1, 4), st.integers(1, 60), st.integers(2, 200), ALPHA_HIGH, LOW_SHARE, st.integers(0, 2**31 - 1))
def test_decode_step_equals_the_oracle(num_kv_heads, n, seq_len, alpha_high, low_share, seed):
    """Candidate tier, victim position and victim tier, exactly as the loop-based rule decides."""
    alpha_low = alpha_high * low_share
    rng = random.Random(seed)
    tiers = torch.tensor([[rng.choice([rules.HIGH, rules.LOW, rules.PRUNED]) for _ in range(n)]
                          for _ in range(num_kv_heads)], dtype=torch.int8)
    tiers[:, -1] = TIER_HIGH  # the candidate comes out of the window at high precision
    importance = torch.stack([near_threshold_importances(n, seq_len, alpha_high, alpha_low, rng)
                              for _ in range(num_kv_heads)])
    d = policy.decode_step(tiers, importance, seq_len, alpha_high, alpha_low)
    for head in range(num_kv_heads):
        try:
            want = rules.decide(tiers[head].tolist(), importance[head].tolist(), n - 1, seq_len, alpha_high, alpha_low)
        except rules.AmbiguousDecision:
            continue
        assert int(d.candidate_tier[head]) == want.candidate_tier
        assert int(d.victim_pos[head]) == want.victim
        if want.victim >= 0:
            assert int(d.victim_tier[head]) == want.victim_tier


def test_decode_step_outcomes_cover_every_rule():
    """The generator above reaches every candidate and victim outcome (else the test above proves little)."""
    seen = set()
    for seed in range(300):
        rng = random.Random(seed)
        n, seq_len = rng.randint(1, 30), rng.randint(10, 100)
        tiers = [rng.choice([rules.HIGH, rules.LOW, rules.PRUNED]) for _ in range(n - 1)] + [rules.HIGH]
        importance = near_threshold_importances(n, seq_len, 1.0, 0.3, rng).tolist()
        seen.add(rules.decide(tiers, importance, n - 1, seq_len, 1.0, 0.3).kind.replace(" (self)", ""))
    assert seen >= {"cand=PRUNED", "cand=HIGH victim HIGH->HIGH", "cand=HIGH victim HIGH->LOW",
                    "cand=HIGH victim HIGH->PRUNED", "cand=LOW victim LOW->LOW", "cand=LOW victim LOW->PRUNED"}


@pytest.mark.parametrize("pos,window,expected", [(10, 4, 6), (3, 4, -1), (4, 4, 0), (10, 0, 9), (10, 1, 9)])
def test_decode_candidate_position(pos, window, expected):
    assert policy.decode_candidate_pos(pos, window) == rules.decode_candidate(pos, window) == expected


def test_prompt_tiers_unknown_base_refused():
    with pytest.raises(ValueError, match="threshold_base"):
        policy.prompt_tiers(torch.ones(1, 4), 1.0, 0.1, 0, 64, "nope")


@pytest.mark.parametrize("alpha_high,alpha_low", [(1.5, 0.3), (1.0, 0.1), (0.02, 0.02)])
def test_an_importance_exactly_on_a_threshold_is_tiered_by_the_fp64_quotient(alpha_high, alpha_low):
    """Issue 43: the threshold is ``alpha / N`` divided in float64 and rounded once to fp32 (numpy here), as the
    Triton decision kernel divides; an fp32 division is one ulp off for most of these N. An importance exactly
    on the high threshold is not high (> is strict) but low; exactly on the low threshold, low (>=); one ulp
    under it, pruned; one ulp over the high one, high. Scalar N and a tensor of N take the same thresholds."""
    import numpy as np

    lengths = np.arange(1, 200)
    high = (np.float64(alpha_high) / lengths).astype(np.float32)
    low = (np.float64(alpha_low) / lengths).astype(np.float32)
    fp32_off = (np.float32(alpha_low) / lengths.astype(np.float32)).astype(np.float32) != low
    assert fp32_off.sum() > 20  # the test tells the two divisions apart
    n = torch.from_numpy(lengths)
    torch.testing.assert_close(policy.tier_thresholds(alpha_high, n), torch.from_numpy(high), atol=0, rtol=0)
    torch.testing.assert_close(policy.tier_thresholds(alpha_low, n), torch.from_numpy(low), atol=0, rtol=0)
    cases = [(high, policy.TIER_LOW),
             (np.nextafter(high, np.float32(np.inf)), policy.TIER_HIGH),
             (low, policy.TIER_LOW), (np.nextafter(low, np.float32(0)), policy.TIER_PRUNED)]
    for importance, tier in cases:
        imp = torch.from_numpy(importance.astype(np.float32))
        assert policy.classify(imp, alpha_high, alpha_low, n).tolist() == [tier] * len(lengths)
        assert [int(policy.classify(imp[i:i + 1], alpha_high, alpha_low, int(lengths[i]))[0])
                for i in range(len(lengths))] == [tier] * len(lengths)
