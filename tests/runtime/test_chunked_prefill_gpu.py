"""Chunked prefill in the executor on the GPU: Triton kernels, TritonPageManager, CUDA-graph decode steps.

Run on the device: ``python3 -m pytest -q -s -m gpu tests/runtime/test_chunked_prefill_gpu.py``. The checks of
``test_chunked_prefill.py`` on CUDA with the tiny peaked model: fp32 outputs equal the one-step prefill (greedy
tokens, tier fractions and bytes; logits within ``LOGIT_ATOL``) for chunks of 1, 63, 64 and 90 of a
100-token prompt (a subset of the CPU file's presets: the device time is short); in bf16 the 8-bit presets give finite logits after stale pages; decodes keep running
beside a chunked prompt; an abort in the middle of a prompt returns every page.
"""
import pytest
import torch

from conftest import peaked_tiny_llama
from test_chunked_prefill import LOGIT_ATOL, PROMPT, preset, run
from test_executor import CFG, _greedy, _prompts, drive, make

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return peaked_tiny_llama().cuda()


def _make(model, kv, **kw):
    ex = make(model, kv, use_triton=None, **kw)
    assert ex.cache.use_triton and type(ex.cache.manager).__name__ == "TritonPageManager"
    return ex


@pytest.mark.parametrize("name,chunk", [("diffkv", 1), ("diffkv", 64), ("diffkv", 90), ("k8v4", 63), ("fp16", 90),
                                        ("k8v8", 90)])
def test_chunked_prefill_equals_the_one_step_prefill_on_gpu(model, name, chunk):
    kv = preset(name)
    want, want_logits = run(model, kv, PROMPT, 6, ex=_make(model, kv, max_batch_size=1, max_num_tokens=128,
                                                              enable_chunked_prefill=False))
    ex = _make(model, kv, max_batch_size=1, max_num_tokens=chunk)
    got, logits = run(model, kv, PROMPT, 6, ex=ex)
    print(f"{name} chunk {chunk}: max |logit diff| {float((logits - want_logits).abs().max()):.3g}")
    assert got.output_token_ids == want.output_token_ids and bool(torch.isfinite(logits).all())
    torch.testing.assert_close(logits, want_logits, atol=LOGIT_ATOL[name], rtol=0)
    for field in ("kv_cache_bytes", "high_fraction", "low_fraction", "pruned_fraction", "pool_pages"):
        assert getattr(got.result, field) == getattr(want.result, field), field


@pytest.mark.parametrize("name", ["k8v4", "k8v8"])
def test_chunked_prefill_with_an_8_bit_cache_gives_no_nan_in_bf16(name):
    """The public report ("chunked prefill with an 8-bit KV cache produced NaN") in the serving dtype."""
    model = peaked_tiny_llama().cuda().to(torch.bfloat16)
    kv = preset(name)
    want, want_logits = run(model, kv, PROMPT, 6, ex=_make(model, kv, max_batch_size=1, max_num_tokens=128,
                                                              enable_chunked_prefill=False))
    ex = _make(model, kv, max_batch_size=1, max_num_tokens=30)
    run(model, kv, _prompts((70,), seed=9)[0], 3, ex=ex)  # stale bytes in the pages
    got, logits = run(model, kv, PROMPT, 6, ex=ex)
    diff = float((logits[0] - want_logits[0]).abs().max())
    print(f"bf16 {name}: first-token max |logit diff| {diff:.3g}; tokens {got.output_token_ids} vs {want.output_token_ids}")
    assert bool(torch.isfinite(logits).all())
    assert got.output_token_ids[0] == want.output_token_ids[0] and diff < 0.25


def test_decodes_run_beside_a_chunked_prompt_on_gpu(model):
    kv, short = preset("diffkv"), _prompts((10,), seed=4)[0]
    got = drive(_make(model, kv, max_batch_size=2, max_num_tokens=16),
                {0: [("short", short, _greedy(12))], 2: [("long", PROMPT, _greedy(4))]})
    solo = {key: run(model, kv, prompt, n, ex=_make(model, kv, max_batch_size=1, max_num_tokens=128,
                                                    enable_chunked_prefill=False))[0].output_token_ids
            for key, prompt, n in (("short", short, 12), ("long", PROMPT, 4))}
    assert {k: v[0] for k, v in got.items()} == solo


def test_abort_in_the_middle_of_a_chunked_prompt_on_gpu(model):
    short, long = _prompts((8, 90), seed=8)
    ex = _make(model, CFG, max_num_tokens=10)
    got = drive(ex, {0: [("short", short, _greedy(10)), ("long", long, _greedy(5))]}, aborts={4: ["long"]})
    assert got["long"][1].finish_reason == "abort" and ex.cache.staging == {}
    assert ex.cache.manager.free_pages() == ex.cache.manager.num_pages
