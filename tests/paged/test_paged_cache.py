"""The paged DiffKV cache against the reference cache, step by step, on tiny models (CPU, torch path).

Every step of every request compares kept positions, tiers, the page
manager's tier counts and pages, the paged oracle's dequantized K/V and the
logits with :class:`DiffKVReferenceCache` (``support.paged``).
Small windows (W = 4, S = 8) and a model with peaked attention make tiers
change (demotions, pruning, low victims) within a few steps.
"""
import pytest
import torch

from conftest import peaked_tiny_llama, random_llama, tiny_llama
from trtllm_diffkv.config import DiffKVConfig, get_preset
from trtllm_diffkv.model.attention_api import DenseCausalAttention
from trtllm_diffkv.engine_config import EngineConfig
from trtllm_diffkv.paged import OutOfPagesError, PagedDiffKVCache
from support.paged_oracle import gather_request
from support.paged import run_lockstep

CFG = DiffKVConfig(recent_window_tokens=4, prompt_score_window_tokens=8, alpha_high=1.0, alpha_low=0.3)
KV_ATOL = 1e-4  # beyond one quantization step: a demoted token requantized from rounding-different values


@pytest.fixture(scope="module")
def peaked_model():
    """tiny_llama with q/k projections scaled up so attention is peaked and tiers split."""
    return peaked_tiny_llama()


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def test_lockstep_with_reference_tiers_change(peaked_model):
    report = run_lockstep(peaked_model, CFG, _prompts((20, 7, 33)), 12, num_pages=200, kv_atol=KV_ATOL,
                          out_atol=1e-3, high_tokens_per_page=4)
    assert report.steps == 12
    assert sum(s.low_tokens for s in report.final_stats) > 0 and sum(s.pruned_tokens for s in report.final_stats) > 0
    for s in report.final_stats:  # what the pool really holds covers the accounted packed bytes
        assert s.pool_used_bytes >= s.kv_cache_bytes > 0



def test_lockstep_with_importances_exactly_on_a_zero_threshold():
    """alpha_low = 0 (several presets): a token whose importance is exactly 0 (probabilities underflowed in
    fp32, q/k scaled by 40) sits on the threshold and is LOW (``>=``), never pruned, as in the reference."""
    cfg = CFG.replace(alpha_low=0.0)
    report = run_lockstep(peaked_tiny_llama(40.0), cfg, _prompts((20, 7, 33)), 2, num_pages=200, kv_atol=KV_ATOL,
                          out_atol=1e-3, high_tokens_per_page=4)
    assert sum(s.low_tokens for s in report.final_stats) > 0
    assert sum(s.pruned_tokens for s in report.final_stats) == 0

def test_lockstep_default_page_size_and_gqa_groups(peaked_model):
    cfg = CFG.replace(alpha_low=0.5, prompt_threshold_base="position")
    run_lockstep(peaked_model, cfg, _prompts((40, 13), seed=3), 6, num_pages=100, kv_atol=KV_ATOL)


def test_page_boundaries_edge_case_4(peaked_model):
    """Prompt lengths P-1 .. 2P+1 around each tier's page capacity, then 8 decode steps."""
    probe = PagedDiffKVCache(CFG, 1, 8, 2, 64, EngineConfig(max_batch_size=1, max_seq_len=8, high_tokens_per_page=4),
                             num_pages=1)
    lengths = sorted({n for p in (probe.page_format.high_tokens_per_page, probe.page_format.low_tokens_per_page)
                      for n in range(p - 1, 2 * p + 2)})
    report = run_lockstep(peaked_model, CFG, _prompts(lengths, seed=4), 8, num_pages=600, kv_atol=KV_ATOL,
                          high_tokens_per_page=4, stable_check=True)
    assert report.steps == 8


def test_tiny_prompts_edge_case_8():
    """0/1/16/17-token prompts in one batch: the empty one fails alone and allocates nothing."""
    model = tiny_llama()
    cfg = get_preset("diffkv").replace(recent_window_tokens=32)
    from trtllm_diffkv.generation.reference import ReferenceGenerator
    from trtllm_diffkv.generation.static_batch import PagedGenerator

    prompts = _prompts((0, 1, 16, 17), seed=5)
    paged = PagedGenerator(model, None, model.config, cfg)
    results = paged.generate_batch(prompts, 8)
    assert results[0].finish_reason == "error" and "empty prompt" in results[0].error
    assert paged.last_cache.manager.max_slots == 3  # the empty prompt took no slot and no page
    reference = ReferenceGenerator(model, None, model.config, cfg)
    for prompt, got in zip(prompts[1:], results[1:]):
        want = reference.generate_ids(prompt, 8)
        assert got.token_ids == want.token_ids and got.kv_cache_bytes == want.kv_cache_bytes
        assert got.high_fraction == 1.0  # everything still fits in the recent window: no demotion, no pruning
    assert paged.last_cache.manager.free_pages() == paged.last_cache.manager.num_pages
    cache = PagedDiffKVCache(cfg, 3, 8, 2, 64, EngineConfig(max_batch_size=2, max_seq_len=32), num_pages=50)
    with pytest.raises(ValueError, match="empty prompt"):
        cache.plan([0, 1], [5, 0], [0, 0], [True, True])
    assert cache.manager.free_pages() == 50 and cache.active_slots == []


def test_fp16_preset_equals_dense_attention():
    model = tiny_llama()
    cfg = get_preset("fp16")
    mc = model.config
    prompt = _prompts((11,), seed=6)[0]
    cache = PagedDiffKVCache(cfg, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                             EngineConfig(max_batch_size=1, max_seq_len=16, high_tokens_per_page=4), num_pages=40)
    ids = list(prompt)
    with torch.inference_mode():
        cache.plan([0], [len(ids)], [0], [True])
        logits = model(torch.tensor(ids), torch.arange(len(ids)), cache)
        cache.end_step()
        dense = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention())
        torch.testing.assert_close(logits, dense, atol=1e-4, rtol=0)
        for step in range(4):
            ids.append(int(logits[-1].argmax()))
            n = len(ids)
            cache.plan([0], [n], [n - 1], [False])
            logits = model(torch.tensor(ids[-1:]), torch.tensor([n - 1]), cache)
            cache.end_step()
            dense = model(torch.tensor(ids), torch.arange(n), DenseCausalAttention())[-1:]
            torch.testing.assert_close(logits, dense, atol=1e-3, rtol=0)  # K/V stored as fp16
    rows = gather_request(cache, 0)
    assert all(torch.equal(r.positions, torch.arange(len(ids))) and bool((r.tiers == 1).all()) for l in rows for r in l)
    stats = cache.request_stats(0)
    assert stats.kv_memory_fraction == 1.0 and stats.pool_used_bytes == stats.pool_pages * cache.page_format.page_size_bytes
    cache.release([0])
    cache.manager.check_invariants()


def test_generator_matches_reference_and_reports_pool_bytes(peaked_model):
    from trtllm_diffkv.generation.reference import ReferenceGenerator
    from trtllm_diffkv.generation.static_batch import PagedGenerator

    prompts = _prompts((20, 7, 33), seed=1) + [[1, 2, 9999]]
    paged = PagedGenerator(peaked_model, None, peaked_model.config, CFG, high_tokens_per_page=4)
    results = paged.generate_batch(prompts, 12)
    assert results[-1].finish_reason == "error" and "vocabulary" in results[-1].error
    reference = ReferenceGenerator(peaked_model, None, peaked_model.config, CFG)
    page_bytes = paged.last_cache.page_format.page_size_bytes
    meta = paged.last_cache.rows_per_slot * paged.last_cache.row_meta.format.row_bytes
    for prompt, got in zip(prompts, results[:-1]):
        want = reference.generate_ids(prompt, 12)
        assert got.token_ids == want.token_ids
        assert got.kv_cache_bytes == want.kv_cache_bytes and got.kv_memory_fraction == want.kv_memory_fraction
        assert got.pool_used_bytes == got.pool_pages * page_bytes + meta >= got.kv_cache_bytes
    single = paged.generate_ids(prompts[1], 12)
    assert single.token_ids == results[1].token_ids
    assert paged.last_cache.manager.free_pages() == paged.last_cache.manager.num_pages


def test_mixed_prefill_and_decode_step(peaked_model):
    """A step may carry prefill requests (first) and decode requests together."""
    mc = peaked_model.config
    a, b = _prompts((9, 12), seed=7)
    cache = PagedDiffKVCache(CFG, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                             EngineConfig(max_batch_size=2, max_seq_len=24, high_tokens_per_page=4), num_pages=120)
    with torch.inference_mode():
        cache.plan([0], [9], [0], [True])
        tok_a = int(peaked_model(torch.tensor(a), torch.arange(9), cache)[-1].argmax())
        cache.end_step()
        cache.plan([1, 0], [12, 10], [0, 9], [True, False])
        ids = torch.tensor(b + [tok_a])
        pos = torch.cat([torch.arange(12), torch.tensor([9])])
        mixed = peaked_model(ids, pos, cache, logits_indices=torch.tensor([11, 12]))
        cache.end_step()
        solo = PagedDiffKVCache(CFG, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                                EngineConfig(max_batch_size=1, max_seq_len=24, high_tokens_per_page=4), num_pages=120)
        solo.plan([0], [9], [0], [True])
        peaked_model(torch.tensor(a), torch.arange(9), solo)
        solo.end_step()
        solo.plan([0], [10], [9], [False])
        alone = peaked_model(torch.tensor([tok_a]), torch.tensor([9]), solo)
    torch.testing.assert_close(mixed[1], alone[0], atol=1e-4, rtol=0)
    assert cache.seq_len[:2] == [10, 12]


def test_bad_plans_change_nothing():
    cache = PagedDiffKVCache(CFG, 2, 4, 2, 64, EngineConfig(max_batch_size=2, max_seq_len=40), num_pages=20)
    cases = [
        (([0, 1], [5, 1], [0, 5], [False, True]), "prefill requests must come before"),
        (([0], [2], [1], [False]), "decode step"),
        (([0, 0], [3, 3], [0, 0], [True, True]), "distinct"),
        (([3], [3], [0], [True]), "outside"),
        (([0], [41], [0], [True]), "max_seq_len_tokens"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            cache.plan(*args)
    with pytest.raises(OutOfPagesError):
        cache.plan([0, 1], [40, 40], [0, 0], [True, True])
    assert cache.manager.free_pages() == 20 and cache.active_slots == []
    with pytest.raises(ValueError, match="plan"):
        cache.forward(0, torch.zeros(1, 4, 64), torch.zeros(1, 2, 64), torch.zeros(1, 2, 64))


def test_non_finite_keys_fail_their_request_only():
    """A request whose keys overflow fp16 is flagged after the step; the other one goes on."""
    cfg = CFG
    cache = PagedDiffKVCache(cfg, 1, 4, 2, 64, EngineConfig(max_batch_size=2, max_seq_len=16), num_pages=40)
    q, k, v = torch.randn(9, 4, 64), torch.randn(9, 2, 64), torch.randn(9, 2, 64)
    k[6, 1, 3] = 1e6  # token 1 of request 1
    cache.plan([0, 1], [5, 4], [0, 0], [True, True])
    cache.forward(0, q, k, v)
    cache.end_step()
    assert cache.step_errors() == {1: "a key or value is NaN/Inf or beyond the fp16 range"}
    cache.release([1])
    cache.plan([0], [6], [5], [False])
    out = cache.forward(0, q[:1], k[:1], v[:1])
    cache.end_step()
    assert bool(torch.isfinite(out).all())
    cache.release([0])
    assert cache.manager.free_pages() == 40


def test_tiny_model_with_mqa_and_head_dim_80():
    model = random_llama(2, vocab_size=128, hidden_size=160, intermediate_size=256, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=80, max_position_embeddings=256)
    run_lockstep(model, CFG, [list(range(3, 21)), list(range(40, 45))], 8, num_pages=100, kv_atol=KV_ATOL,
                 high_tokens_per_page=4)


@pytest.mark.parametrize("preset", ["k8v4", "k8v8"])
def test_uniform_formats_keep_every_token_high_with_no_scores(peaked_model, preset):
    """A uniform format (not tiered): the reference cache's tokens, no token metadata in the pages, no low tier, no
    score updates, one decode page a row at most; memory = codes + scales (+ the row's key offsets)."""
    from trtllm_diffkv.generation.reference import ReferenceGenerator
    from trtllm_diffkv.generation.static_batch import PagedGenerator

    cfg = get_preset(preset).replace(recent_window_tokens=4, prompt_score_window_tokens=8)
    prompts = _prompts((20, 9), seed=3)
    paged = PagedGenerator(peaked_model, None, peaked_model.config, cfg, high_tokens_per_page=4)
    reference = ReferenceGenerator(peaked_model, None, peaked_model.config, cfg)
    cache = None
    for prompt, got in zip(prompts, paged.generate_batch(prompts, 10)):
        want = reference.generate_ids(prompt, 10)
        assert got.token_ids == want.token_ids and got.kv_cache_bytes == want.kv_cache_bytes
        mc = peaked_model.config
        d, n = mc.head_dim, len(prompt) + len(got.token_ids) - 1  # the last token is never written
        tier = cfg.high
        per_token = d * tier.key_bits // 8 + d * tier.value_bits // 8 + 4 * (tier.key_groups + tier.value_groups)
        rows = mc.num_layers * mc.num_kv_heads
        assert got.kv_cache_bytes == rows * (n * per_token + 2 * d)  # + one fp16 key offset vector a row
        assert got.high_fraction == 1.0 and got.low_fraction == 0.0
    cache = paged.last_cache
    fmt = cache.page_format
    assert fmt.high.score.size_bytes == fmt.high.position.size_bytes == 0
    assert cache.decode_pages_needed(1) == cache.rows_per_slot
