"""The in-flight batching executor on the GPU: Triton kernels, TritonPageManager, pinned one-copy status read.

Run on the device: ``python3 -m pytest -q -s -m gpu tests/runtime/test_executor_gpu.py``. The core
checks of ``tests/runtime/test_executor.py`` (batch = each request alone, abort at every stage,
preemption, edge cases 8 and 9) on CUDA, plus the default model under the executor against the
reference generator and the static-batch paged generator.
"""
import random

import pytest
import torch

from conftest import peaked_tiny_llama
from test_executor import CFG, FP16, _greedy, _prompts, arrivals_params, check_pool, drive, make
from trtllm_diffkv.config import get_preset
from trtllm_diffkv.engine_config import EngineConfig
from trtllm_diffkv.runtime.executor import Executor
from trtllm_diffkv.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return peaked_tiny_llama().cuda()


def _make(model, kv=CFG, **kw):
    ex = make(model, kv, use_triton=None, **kw)
    assert ex.cache.use_triton and type(ex.cache.manager).__name__ == "TritonPageManager"
    return ex


def _solo(model, kv, prompt, params, **kw):
    return drive(_make(model, kv, **kw), {0: [(0, prompt, params)]})[0][0]


def test_staggered_batch_equals_each_request_alone_on_gpu(model):
    prompts = _prompts((20, 7, 33, 1, 12, 64))
    arrivals = {0: [(0, prompts[0], _greedy(10)), (1, prompts[1], _greedy(6))], 2: [(2, prompts[2], _greedy(9))],
                3: [(3, prompts[3], _greedy(8)), (5, prompts[5], _greedy(12))], 7: [(4, prompts[4], _greedy(5))]}
    got = drive(_make(model), arrivals)
    params = arrivals_params(arrivals)
    for key, (streamed, update) in got.items():
        assert update.finish_reason == "length" and update.result.token_ids == streamed
        assert streamed == _solo(model, CFG, prompts[key], params[key])


def test_cuda_graph_decode_equals_eager(model):
    """Decode-only steps replayed from CUDA graphs (bucketed batch sizes) give the eager path's tokens."""
    prompts = _prompts((20, 7, 33, 12, 40), seed=14)
    arrivals = {0: [(0, prompts[0], _greedy(10)), (1, prompts[1], _greedy(6))], 2: [(2, prompts[2], _greedy(9))],
                4: [(3, prompts[3], _greedy(8)), (4, prompts[4], _greedy(12))]}
    eager = drive(_make(model, use_cuda_graphs=False), arrivals)
    ex = _make(model, use_cuda_graphs=True)
    graphs = drive(ex, arrivals)
    assert ex._graphs is not None and ex._graphs._graphs, "no decode step was replayed from a graph"
    assert {k: v[0] for k, v in graphs.items()} == {k: v[0] for k, v in eager.items()}


def test_abort_and_preemption_return_every_page_on_gpu(model):
    prompts = _prompts((10, 13, 11, 9), seed=3)
    ex = _make(model, FP16, num_pages=90)
    got = drive(ex, {0: [(k, p, _greedy(14)) for k, p in enumerate(prompts)]}, aborts={3: [1]})
    assert ex.stats()["preemptions"] > 0 and got[1][1].finish_reason == "abort"
    for key in (0, 2, 3):
        assert got[key][0] == _solo(model, FP16, prompts[key], _greedy(14))


def test_edge_cases_8_and_9_on_gpu(model):
    prompts = _prompts((0, 1, 16, 17), seed=5)
    got = drive(_make(model), {0: [(k, p, _greedy(6)) for k, p in enumerate(prompts)]})
    assert got[0][1].finish_reason == "error" and "empty prompt" in got[0][1].error
    rng = random.Random(0)
    ex = _make(model, CFG, num_pages=130, max_batch_size=6)
    arrivals, aborts = {}, {}
    for key in range(24):
        n = rng.choice([4, 6, 8, 12, 18, 24] + list(range(1, 30)))
        params = SamplingParams(max_tokens=rng.randint(1, 10), temperature=rng.choice([0.0, 0.8]), seed=key)
        arrivals.setdefault(rng.randint(0, 20), []).append((key, _prompts((n,), seed=key)[0], params))
    aborts = {22: [3, 7]}
    got = drive(ex, arrivals, aborts)
    assert ex.stats()["preemptions"] > 0
    assert {u.finish_reason for _, u in got.values()} <= {"length", "abort"}


def test_status_read_is_one_pinned_copy_per_step(model):
    """The executor's own device-to-host read: exactly one copy into pinned memory per step (profiler count)."""
    from torch.profiler import ProfilerActivity, profile

    ex = _make(model)
    for p in _prompts((30, 20, 25), seed=6):
        ex.add_request(p, _greedy(8))
    ex.step()  # prefill
    steps = 4
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            ex.step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    pinned = [n for n in names if "DtoH" in n and "Pinned" in n]
    pageable = [n for n in names if "DtoH" in n and "Pageable" in n]
    print(f"per decode step: {len(pinned) / steps:.1f} pinned DtoH copies, {len(pageable) / steps:.1f} pageable "
          "(the pageable ones are in PagedDiffKVCache.plan: free page count, decisions)")
    assert len(pinned) == steps


def test_kv_memory_fraction_sizes_the_pool_from_free_memory(model):
    free_before, _ = torch.cuda.mem_get_info()
    ex = Executor(model, model.config, CFG, EngineConfig(max_batch_size=4, max_seq_len=256, kv_memory_fraction=0.02))
    assert abs(ex.rm.budget_bytes - 0.02 * free_before) <= 0.001 * free_before
    assert ex.rm.allocated_bytes() <= ex.rm.budget_bytes


def test_default_model_executor_vs_reference_and_static_batch():
    """SmolLM2-135M, ``diffkv`` preset, greedy: the executor equals the static-batch paged generator (same
    kernels, same batch), and agrees with the reference generator as tests/paged/test_paged_gpu.py measures it
    (first token identical; identical sequences counted and printed: a deep model turns one-step rounding
    differences into code flips, see test_default_model_paged_vs_reference)."""
    from trtllm_diffkv.generation.reference import ReferenceGenerator
    from trtllm_diffkv.model import load_model
    from trtllm_diffkv.generation.static_batch import PagedGenerator

    try:
        model, tokenizer, model_config = load_model(None, device="cuda", dtype=torch.float32)
    except FileNotFoundError as exc:
        pytest.skip(f"default model not available on this machine: {exc}")
    from trtllm_diffkv.model.loader import stop_token_ids

    cfg = get_preset("diffkv")
    stops = stop_token_ids(None)
    reference = ReferenceGenerator(model, tokenizer, model_config, cfg, stops)
    prompts = [reference.encode(p) for p in ("Write a Python function that reverses a string.",
                                               "What is the capital of France?",
                                               "List three prime numbers greater than 100.")]
    # the static generator's geometry (slots, longest request): same decode split-K partitions, same reductions
    ex = Executor(model, model_config, cfg, EngineConfig(max_batch_size=len(prompts), max_seq_len=max(map(len, prompts)) + 32,
                                                         kv_memory_bytes=512 << 20),
                  tokenizer=tokenizer, stop_token_ids=reference.stop_token_ids)
    ids = [ex.add_request(p, _greedy(32)) for p in prompts]
    done = ex.run_until_done()
    static = PagedGenerator(model, tokenizer, model_config, cfg, reference.stop_token_ids).generate_batch(prompts, 32)
    same = 0
    for rid, prompt, want_static in zip(ids, prompts, static):
        got = done[rid].result
        want = reference.generate_ids(prompt, 32)
        assert got.finish_reason in ("stop", "length") and got.token_ids == want_static.token_ids
        assert got.token_ids[:1] == want.token_ids[:1]
        same += got.token_ids == want.token_ids
        assert got.text == tokenizer.decode([t for t in got.token_ids if t not in reference.stop_token_ids],
                                            skip_special_tokens=True)
    print(f"default model under the executor: {same}/{len(prompts)} prompts with the reference's greedy tokens")
    assert ex.cache.manager.free_pages() == ex.cache.manager.num_pages


@pytest.mark.parametrize("use_cuda_graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_default_model_throughput_smoke(use_cuda_graphs):
    """16 requests of 300 prompt tokens, 64 new tokens each: prints the executor's stats (profile=True)."""
    from trtllm_diffkv.model import load_model

    try:
        model, tokenizer, model_config = load_model(None, device="cuda", dtype=torch.float16)
    except FileNotFoundError as exc:
        pytest.skip(f"default model not available on this machine: {exc}")
    ex = Executor(model, model_config, get_preset("diffkv"),
                  EngineConfig(max_batch_size=16, max_seq_len=512, kv_memory_bytes=256 << 20, profile=True,
                               use_cuda_graphs=use_cuda_graphs), tokenizer=tokenizer)
    g = torch.Generator().manual_seed(0)
    for _ in range(16):
        ids = torch.randint(100, model_config.vocab_size - 100, (300,), generator=g).tolist()
        ex.add_request(ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    done = ex.run_until_done()
    stats = ex.stats()
    print(f"cuda graphs {use_cuda_graphs}:", {k: stats[k] for k in ("steps", "output_tokens_per_s", "mean_batch_size", "bookkeeping_fraction",
                                 "preemptions", "pool_pages")})
    assert all(r.result.generated_tokens == 64 for r in done.values())
    check_pool(ex)


@pytest.mark.parametrize("preset", ["k8v4", "k8v8"])
def test_uniform_formats_on_the_gpu_equal_the_reference_cache(model, preset):
    """The uniform formats (no tiers: no scores, no decisions, no metadata in the pages; the CUDA decode kernel
    without its score update) through the executor with CUDA graphs: the reference cache's greedy tokens, for
    requests alone and batched, and every page back."""
    from trtllm_diffkv.generation.reference import ReferenceGenerator

    kv = get_preset(preset)
    prompts = _prompts((20, 7, 33, 12), seed=21)
    arrivals = {0: [(i, p, _greedy(12)) for i, p in enumerate(prompts)]}
    ex = _make(model, kv, use_cuda_graphs=True)
    got = drive(ex, arrivals)
    assert ex.cache.page_format.high.score.size_bytes == 0
    reference = ReferenceGenerator(model, None, model.config, kv)
    for i, p in enumerate(prompts):
        assert got[i][0][:1] == reference.generate_ids(p, 12).token_ids[:1]
        assert got[i][0] == _solo(model, kv, p, _greedy(12))
    check_pool(ex)
