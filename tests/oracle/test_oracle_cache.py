"""The reference cache, every step (prefill included) against the independent oracles in ``tests/oracle``.

Each test drives a ``DiffKVReferenceCache`` through a :class:`oracle.checked_cache.CheckedCache`,
which checks every prefill and decode step: output against dense float64
attention over the kept tokens, scores, tiers against the loop-based rules,
stored K/V against the per-group half-step bounds of their tier, and at the
end the memory accounting against counts the oracle keeps itself.
"""
import collections
import random

import pytest
import torch

from conftest import tiny_llama
from oracle import attention, rules
from oracle.checked_cache import CheckedCache
from oracle.drive import random_qkv, run_checked, spiky_tiny_llama, teacher_forced
from trtllm_diffkv import policy
from trtllm_diffkv.cache import DiffKVReferenceCache
from trtllm_diffkv.config import PRESETS, DiffKVConfig, get_preset

def test_tier_codes_are_the_oracles():
    assert (policy.TIER_PRUNED, policy.TIER_HIGH, policy.TIER_LOW) == (rules.PRUNED, rules.HIGH, rules.LOW)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_step_of_every_preset_matches_the_oracle(preset):
    """Random spiky q/k/v, GQA 8:2, two layers; windows shortened so most steps decide."""
    cfg = get_preset(preset).replace(recent_window_tokens=8, prompt_score_window_tokens=16)
    checked = run_checked(cfg, 8, 2, 64, prompt_len=37, steps=24, seed=11, num_layers=2)
    assert checked.ambiguous == 0
    checked.assert_stats()
    if cfg.compress and cfg.alpha_high > 0:  # tiered: every decode step decides
        assert sum(n for kind, n in checked.outcomes.items() if kind.startswith("cand=")) == 2 * 2 * 24


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,alpha_low,alpha_high", [
    (4, 4, 64, 0.3, 1.0), (8, 2, 80, 0.5, 1.5), (7, 1, 96, 1.0, 3.0), (6, 3, 128, 0.3, 1.0)])
def test_every_rule_fires_and_matches_the_oracle(num_heads, num_kv_heads, head_dim, alpha_low, alpha_high):
    """GQA ratios 1, 4, 7 (MQA), 2, with thresholds at which all three tiers occur in both phases."""
    cfg = DiffKVConfig(alpha_high=alpha_high, alpha_low=alpha_low, recent_window_tokens=6,
                       prompt_score_window_tokens=16)
    seen = collections.Counter()
    for seed in range(2):
        checked = run_checked(cfg, num_heads, num_kv_heads, head_dim, prompt_len=30, steps=30, seed=seed)
        assert checked.ambiguous == 0
        checked.assert_stats()
        seen.update(checked.outcomes)
    for kind in ("prompt HIGH", "prompt LOW", "prompt PRUNED", "cand=PRUNED", "cand=HIGH victim HIGH->HIGH",
                 "cand=LOW victim LOW->LOW"):
        assert seen[kind] > 0, (kind, seen)
    assert seen["cand=HIGH victim HIGH->LOW"] + seen["cand=LOW victim LOW->PRUNED"] > 0, seen


def _inject(checked: CheckedCache, pos: int, rng: random.Random) -> None:
    """Overwrite layer 0's tiers and scores before the step writing ``pos`` with tokens on the thresholds.

    Every token outside the window gets a random tier and an importance of
    ``alpha / pos`` times a factor just off 1 (0.3% away: inside the band a
    wrong N or a wrong query count would cross) or far from it, spaced apart
    so no two tie.
    """
    cache, cfg = checked.cache, checked.config
    cand = rules.decode_candidate(pos, cfg.recent_window_tokens)
    for head in range(cache.num_kv_heads):
        tiers = checked.tiers[0][head]
        for t in range(cand + 1):
            tier = rules.HIGH if t == cand else rng.choice([rules.HIGH, rules.LOW, rules.PRUNED])
            thr = rng.choice([cfg.alpha_high, cfg.alpha_low]) / pos
            factor = rng.choice([0.997, 1.003, 0.5, 2.0, 0.95, 1.05]) * (1 + 1e-3 * t / (cand + 1))
            count = rules.decode_query_count(t, pos, checked.prompt_len, cfg.prompt_score_window_tokens)
            cache.scores[0, head, t] = thr * factor * count
            cache.tiers[0, head, t] = tier
            tiers[t] = tier


def test_decode_decisions_on_states_at_the_thresholds():
    """Injected states put candidates and victims 0.3% from ``alpha / N``: N, the query counts and
    every candidate and victim outcome are decided exactly as the oracle decides them."""
    cfg = DiffKVConfig(alpha_high=1.0, alpha_low=0.3, recent_window_tokens=4, prompt_score_window_tokens=8)
    seen = collections.Counter()
    for trial in range(40):
        rng = random.Random(trial)
        prompt_len, steps = rng.randint(6, 24), rng.randint(0, 6)
        total = prompt_len + steps + 1
        q, k, v = random_qkv(total, 4, 2, 64, seed=trial)
        checked = CheckedCache(DiffKVReferenceCache(cfg, 1, 4, 2, 64, total))
        checked.forward(0, q[:prompt_len], k[:prompt_len], v[:prompt_len])
        for t in range(prompt_len, total - 1):
            checked.forward(0, q[t:t + 1], k[t:t + 1], v[t:t + 1])
        _inject(checked, total - 1, rng)
        before = sum(checked.outcomes.values())
        checked.forward(0, q[-1:], k[-1:], v[-1:])
        assert checked.ambiguous == 0 and sum(checked.outcomes.values()) == before + 2
        seen.update(checked.outcomes)
    for kind in ("cand=PRUNED", "cand=HIGH victim HIGH->HIGH", "cand=HIGH victim HIGH->LOW",
                 "cand=HIGH victim HIGH->PRUNED", "cand=LOW victim LOW->LOW", "cand=LOW victim LOW->PRUNED"):
        assert seen[kind] > 0, (kind, seen)


def test_fp16_preset_teacher_forced_equals_dense_attention_at_every_position():
    model = tiny_llama()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 512, (40,), generator=g).tolist()
    prompt, steps = tokens[:25], tokens[25:]
    cfg = model.config
    with torch.inference_mode():
        dense = model(torch.tensor(tokens), torch.arange(len(tokens)), attention.DenseBackend())
        cache = DiffKVReferenceCache(get_preset("fp16"), cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                                     cfg.head_dim, len(tokens))
        checked = CheckedCache(cache)
        cached = teacher_forced(model, checked, prompt, steps)
    assert cached.shape == dense.shape == (40, 512)
    torch.testing.assert_close(cached, dense, rtol=1e-4, atol=1e-4)
    checked.assert_stats()
    assert cache.stats().kv_cache_bytes == cfg.num_layers * cfg.num_kv_heads * 40 * cfg.head_dim * 2 * 2


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_tiny_llama_every_preset_checked_at_every_step(preset):
    """A teacher-forced 3-layer Llama at each preset's real windows (W = S = 64): 70 prompt tokens, 6 steps."""
    model = spiky_tiny_llama()
    cfg = model.config
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 512, (76,), generator=g).tolist()
    cache = DiffKVReferenceCache(get_preset(preset), cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                                 cfg.head_dim, len(tokens))
    checked = CheckedCache(cache)
    with torch.inference_mode():
        teacher_forced(model, checked, tokens[:70], tokens[70:])
    assert checked.layer_len == [76] * cfg.num_layers
    assert checked.ambiguous == 0
    checked.assert_stats()
