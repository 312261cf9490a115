"""Sliding-window layers (Gemma 3) through every cache path and engine, against transformers' Gemma3ForCausalLM.

Model: the tiny random Gemma 3 of ``tests/tiny_gemma.py`` (layers sliding / full / sliding / full, window 8, MQA
group 4, head_dim 64). Prompts of 29 tokens (3.6 windows) and of 5 (shorter than the window: decode crosses it),
decode steps past the window. Independent references only: transformers' greedy continuation and its teacher-forced
logits (fp32 model; relative error of the max |logit| <= 1e-4 where keys and values are kept in fp32, the reference
cache, and <= 1e-3 where the fp16 preset's pages round them to fp16, 2^-11 relative); for the DiffKV presets, the
window itself (the positions a sliding layer keeps are exactly the last ``W`` at every step, read from the pages).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_gemma import SLIDING_WINDOW as W, setup  # noqa: E402
from trtllm_diffkv.cache import DiffKVReferenceCache  # noqa: E402
from trtllm_diffkv.config import get_preset  # noqa: E402
from trtllm_diffkv.engine_config import EngineConfig  # noqa: E402
from trtllm_diffkv.paged.cache import PagedDiffKVCache  # noqa: E402
from trtllm_diffkv.paged.gather import gather_tier  # noqa: E402

DECODE_STEPS = 12
PROMPT_LENS = (29, 5)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(transformers model, our model, our config, prompts, {prompt index: (greedy tokens, teacher-forced logits)})."""
    return setup(tmp_path_factory.mktemp("tiny_gemma3"), PROMPT_LENS, DECODE_STEPS)


FP32_KV_TOL, FP16_KV_TOL = 1e-4, 1e-3


def _close(got: torch.Tensor, want: torch.Tensor, where: str, tol: float) -> None:
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < tol, f"{where}: relative logit error {err:.2e}"


def _paged(config, kv, max_slots=2, use_triton=False, num_pages=400):
    kv = kv.for_model(config)
    return PagedDiffKVCache(kv, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim,
                            EngineConfig(max_batch_size=max_slots, max_seq_len=64, max_num_tokens=64,
                                         use_triton=use_triton, high_tokens_per_page=4), num_pages=num_pages)


def _lockstep(model, cache, prompts, refs, paged: bool, check=None):
    """Prefill every prompt, then feed transformers' greedy tokens one step at a time; every logit row is compared
    with transformers' teacher-forced logits at the same position and its argmax with the greedy token.
    ``check(step)`` runs after each step."""
    lens = [len(p) for p in prompts]
    slots = list(range(len(prompts)))
    with torch.no_grad():
        if paged:
            cache.plan(slots, lens, [0] * len(prompts), [True] * len(prompts))
            logits = model(torch.tensor([t for p in prompts for t in p]),
                           torch.cat([torch.arange(n) for n in lens]), cache,
                           logits_indices=torch.tensor(lens).cumsum(0) - 1)
            cache.end_step()
        else:
            logits = torch.stack([model(torch.tensor(p), torch.arange(len(p)), c)[-1] for p, c in zip(prompts, cache)])
        for step in range(DECODE_STEPS):
            if check is not None:
                check(step)
            for i in slots:
                tokens, want = refs[i]
                _close(logits[i], want[lens[i] + step - 1], f"prompt {i}, step {step}",
                       FP16_KV_TOL if paged else FP32_KV_TOL)
                assert int(logits[i].argmax()) == tokens[step], f"prompt {i}, step {step}: greedy token differs"
            if step == DECODE_STEPS - 1:
                break
            pos = [n + step for n in lens]
            feed = [refs[i][0][step] for i in slots]
            if paged:
                cache.plan(slots, [p + 1 for p in pos], pos, [False] * len(prompts))
                logits = model(torch.tensor(feed), torch.tensor(pos), cache)
                cache.end_step()
            else:
                logits = torch.stack([model(torch.tensor([t]), torch.tensor([p]), c)[-1]
                                      for t, p, c in zip(feed, pos, cache)])


@pytest.mark.parametrize("engine", ["reference", "paged-torch"])
def test_fp16_caches_match_transformers_step_by_step(gemma, engine):
    _, model, config, prompts, refs = gemma
    kv = get_preset("fp16")
    if engine == "reference":
        caches = [DiffKVReferenceCache(kv.for_model(config), config.num_layers, config.num_heads, config.num_kv_heads,
                                       config.head_dim, 64) for _ in prompts]
        _lockstep(model, caches, prompts, refs, paged=False)
        for cache, p in zip(caches, prompts):  # FP16 holds only the window of a sliding layer: counted for both
            n = len(p) + DECODE_STEPS - 1
            stats = cache.stats()
            kept = config.num_kv_heads * (2 * n + 2 * min(n, W))
            assert (stats.high_tokens, stats.pruned_tokens) == (kept, 0)
            assert stats.kv_cache_bytes == stats.fp16_kv_cache_bytes == kept * 2 * config.head_dim * 2
    else:
        cache = _paged(config, kv)
        _lockstep(model, cache, prompts, refs, paged=True, check=lambda step: _check_window_rows(cache, config, None))
        _release_all(cache)


def test_paged_triton_interpreter_matches_transformers(gemma):
    """The Triton kernels (write, decisions, decode attention, prompt scores) under the interpreter, fp16 preset and
    k8v4's sliding layers: the decisions kernel's window rows and the decode kernel read exactly the window."""
    _, model, config, prompts, refs = gemma
    cache = _paged(config, get_preset("fp16"), use_triton=True)
    _lockstep(model, cache, prompts, refs, paged=True, check=lambda step: _check_window_rows(cache, config, None))
    _release_all(cache)


def _check_window_rows(cache, config, full_expected):
    """Every sliding layer's rows hold (min(seq, W), 0) tokens; with position segments, exactly positions
    seq - min(seq, W) .. seq - 1. ``full_expected(seq)``: the full layers' (high, low) counts, or ``None``."""
    H = config.num_kv_heads
    for slot in cache.active_slots:
        seq = cache.seq_len[slot]
        for layer, window in enumerate(config.sliding_windows):
            rows = torch.arange(H) + slot * cache.rows_per_slot + layer * H
            counts = cache.manager.tokens[rows].tolist()
            if window is None:
                if full_expected is not None:
                    assert all(tuple(c) == full_expected(seq) for c in counts), (layer, seq, counts)
                continue
            assert all(tuple(c) == (min(seq, window), 0) for c in counts), (slot, layer, seq, counts)
            if cache.page_format.high.position.size_bytes:
                view = gather_tier(cache.pool, cache.manager.page_table, cache.manager.tokens, rows, "high",
                                   -(-64 // 4) * 4)
                for h in range(H):
                    kept = sorted(view.positions[h][view.valid[h]].tolist())
                    assert kept == list(range(seq - min(seq, window), seq)), (slot, layer, seq, kept)


def _release_all(cache):
    cache.release(list(range(cache.max_slots)))
    cache.manager.check_invariants()
    assert cache.manager.free_pages() == cache.manager.num_pages


@pytest.mark.parametrize("preset", ["k8v4", "diffkv"])
def test_diffkv_presets_keep_exactly_the_window_on_sliding_layers(gemma, preset):
    """k8v4 and default: every step, each sliding layer keeps exactly its last W positions (high tier), whatever the
    scores; k8v4's full layers keep every token. The greedy tokens stay transformers' at this size for k8v4."""
    _, model, config, prompts, refs = gemma
    kv = get_preset(preset)
    cache = _paged(config, kv)
    full = (lambda seq: (seq, 0)) if preset == "k8v4" else None
    lens = [len(p) for p in prompts]
    with torch.no_grad():
        cache.plan([0, 1], lens, [0, 0], [True, True])
        model(torch.tensor(prompts[0] + prompts[1]), torch.cat([torch.arange(n) for n in lens]), cache)
        cache.end_step()
        _check_window_rows(cache, config, full)
        for step in range(DECODE_STEPS):
            pos = [n + step for n in lens]
            cache.plan([0, 1], [p + 1 for p in pos], pos, [False, False])
            model(torch.tensor([refs[0][0][step], refs[1][0][step]]), torch.tensor(pos), cache)
            cache.end_step()
            _check_window_rows(cache, config, full)
    stats = cache.request_stats(0)
    n = lens[0] + DECODE_STEPS
    assert stats.total_tokens == config.num_kv_heads * (2 * n + 2 * W)  # reachable tokens only
    assert stats.fp16_kv_cache_bytes == stats.total_tokens * 2 * config.head_dim * 2
    _release_all(cache)
    reference = DiffKVReferenceCache(kv.for_model(config), config.num_layers, config.num_heads, config.num_kv_heads,
                                     config.head_dim, 64)
    with torch.no_grad():
        model(torch.tensor(prompts[0]), torch.arange(lens[0]), reference)
        for step in range(DECODE_STEPS):
            model(torch.tensor([refs[0][0][step]]), torch.tensor([lens[0] + step]), reference)
    for layer in (0, 2):  # the oracle cache, too: the window high, everything older pruned
        tiers = reference.tiers[layer, :, :n]
        assert (tiers[:, n - W:] == 1).all() and (tiers[:, :n - W] == 0).all()
    assert reference.stats().total_tokens == stats.total_tokens
