"""Bad input on the paged path fails alone, with a clear message, and never leaks pages (found by attack).

Each test is a reproducer of a failure seen before the fix: key centering pushing in-range keys
beyond fp16 (silent NaN on the Triton path, the whole batch failing on the torch path, a
misleading value in the reference's message), a static batch the pool cannot take at once, the
step protocol (plan twice, layers out of order), group sizes the kernel cannot run, token ids of
other integer types, and decode errors naming token 0 instead of the position.
"""
import numpy as np
import pytest
import torch

from conftest import tiny_llama
from trtllm_diffkv.cache import DiffKVReferenceCache
from trtllm_diffkv.config import DiffKVConfig, get_preset
from trtllm_diffkv.generation.reference import ReferenceGenerator
from trtllm_diffkv.engine_config import EngineConfig
from trtllm_diffkv.paged import PagedDiffKVCache
from trtllm_diffkv.generation.static_batch import PagedGenerator

CFG = DiffKVConfig(recent_window_tokens=4)


def _far_keys():
    """Three prompt tokens whose keys are within fp16's range but 80000 from their mean (channel 0, head 0)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 64, generator=g), torch.randn(3, 2, 64, generator=g), torch.randn(3, 2, 64, generator=g)
    k[0, 0, 0], k[1, 0, 0], k[2, 0, 0] = -60000.0, 60000.0, 60000.0
    return q, k, v


def test_a_decode_query_of_another_dtype_than_the_cache_is_refused():
    """Review finding: the decode attention a cache resolves once (``paged.decode.decode_runner``) skips the
    per-call checks, so a query of another dtype than the cache's output buffer was launched into it (on CUDA,
    bf16 bits into an fp16 buffer). Such a call takes the checked path and is refused."""
    from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4

    patch_interpreter_for_numpy_2_4()
    cache = PagedDiffKVCache(CFG, 1, 4, 2, 64, EngineConfig(max_batch_size=1, max_seq_len=32, high_tokens_per_page=4,
                                                            use_triton=True), num_pages=60, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    cache.plan([0], [6], [0], [True])
    cache.forward(0, *(torch.randn(6, h, 64, generator=g) for h in (4, 2, 2)))
    cache.end_step()
    cache.plan([0], [7], [6], [False])
    q = torch.randn(1, 4, 64, generator=g).half()
    with pytest.raises(ValueError, match="float16"):
        cache.forward(0, q, torch.randn(1, 2, 64, generator=g), torch.randn(1, 2, 64, generator=g))
    cache.discard_step()
    cache.release([0])
    assert cache.manager.free_pages() == 60


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton-interpreter"])
def test_keys_beyond_fp16_once_centered_flag_their_request(use_triton):
    if use_triton:
        from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4

        patch_interpreter_for_numpy_2_4()
    q, k, v = _far_keys()
    cache = PagedDiffKVCache(CFG, 1, 4, 2, 64, EngineConfig(max_batch_size=1, max_seq_len=16, use_triton=use_triton),
                             num_pages=40)
    cache.plan([0], [3], [0], [True])
    cache.forward(0, q, k, v)  # never raises: the request is flagged, no NaN is stored as a success
    cache.end_step()
    assert cache.step_errors() == {0: "a key or value is NaN/Inf or beyond the fp16 range"}
    cache.release([0])
    assert cache.manager.free_pages() == 40


def test_reference_names_the_real_key_when_centering_overflows():
    q, k, v = _far_keys()
    cache = DiffKVReferenceCache(CFG, 1, 4, 2, 64, 16)
    with pytest.raises(ValueError) as err:
        cache.forward(0, q, k, v)
    message = str(err.value)
    # the mean of the fp16 keys is 20000: token 0's key -60000 is 80000 away
    assert "value -60000.0 at layer 0, KV head 0, token 0, channel 0" in message
    assert "-80000" in message and "key offset 20000" in message


def test_reference_decode_error_names_the_position():
    cache = DiffKVReferenceCache(get_preset("diffkv"), 1, 4, 2, 64, 32)
    g = torch.Generator().manual_seed(1)
    cache.forward(0, torch.randn(10, 4, 64, generator=g), torch.randn(10, 2, 64, generator=g),
                  torch.randn(10, 2, 64, generator=g))
    k = torch.randn(1, 2, 64, generator=g)
    k[0, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="at layer 0, KV head 1, token 10 "):
        cache.forward(0, torch.randn(1, 4, 64, generator=g), k, torch.randn(1, 2, 64, generator=g))


def test_overflow_after_centering_fails_only_its_request_in_a_batch():
    q1, k1, v1 = _far_keys()
    g = torch.Generator().manual_seed(2)
    q0, k0, v0 = torch.randn(5, 4, 64, generator=g), torch.randn(5, 2, 64, generator=g), torch.randn(5, 2, 64, generator=g)
    cache = PagedDiffKVCache(CFG, 1, 4, 2, 64, EngineConfig(max_batch_size=2, max_seq_len=16), num_pages=40)
    cache.plan([0, 1], [5, 3], [0, 0], [True, True])
    cache.forward(0, torch.cat([q0, q1]), torch.cat([k0, k1]), torch.cat([v0, v1]))
    cache.end_step()
    assert set(cache.step_errors()) == {1}
    cache.release([1])
    cache.plan([0], [6], [5], [False])  # the other request decodes on
    out = cache.forward(0, torch.randn(1, 4, 64), torch.randn(1, 2, 64), torch.randn(1, 2, 64))
    assert bool(torch.isfinite(out).all())
    cache.end_step()
    cache.release([0])
    assert cache.manager.free_pages() == 40


def test_static_batch_the_pool_cannot_take_at_once_runs_in_waves():
    model = tiny_llama()
    gen = PagedGenerator(model, None, model.config, get_preset("diffkv"), num_pages=60)
    short, huge = [5, 6, 7], list(range(1, 300))
    alone = [gen.generate_ids(p, 4).token_ids for p in (short, [8, 9])]
    results = gen.generate_batch([short, huge, [8, 9]], 4)
    assert results[1].finish_reason == "error" and "pages" in results[1].error  # needs more than the pool
    assert [results[0].token_ids, results[2].token_ids] == alone  # the others run, with the same tokens
    assert gen.last_cache.manager.free_pages() == 60


def test_a_wave_that_raises_fails_only_its_own_requests():
    """Breaker finding: a model error in one wave of a static batch failed every pending request, the deferred
    ones that never ran too. They now run in the next wave (30 pages: one of these prompts a wave)."""
    model = tiny_llama()
    gen = PagedGenerator(model, None, model.config, get_preset("diffkv"), num_pages=30)
    alone = gen.generate_ids([8, 9], 4).token_ids
    model = gen.model  # the rotated copy the generator runs
    real, calls = model.forward, []

    def first_call_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("planted: the first wave's forward fails")
        return real(*args, **kwargs)

    model.forward = first_call_fails
    try:
        results = gen.generate_batch([[5, 6, 7], [8, 9]], 4)
    finally:
        del model.forward
    assert results[0].finish_reason == "error" and "planted" in results[0].error
    assert results[1].finish_reason != "error" and results[1].token_ids == alone
    assert gen.last_cache.manager.free_pages() == 30


def test_step_protocol_is_enforced():
    cache = PagedDiffKVCache(CFG, 2, 4, 2, 64, EngineConfig(max_batch_size=2, max_seq_len=16), num_pages=40)
    q, k, v = torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    cache.plan([0], [3], [0], [True])
    with pytest.raises(ValueError, match="already planned"):
        cache.plan([1], [3], [0], [True])
    with pytest.raises(ValueError, match="layer 1 out of order"):
        cache.forward(1, q, k, v)
    cache.forward(0, q, k, v)
    with pytest.raises(ValueError, match="layer 0 out of order"):
        cache.forward(0, q, k, v)
    cache.forward(1, q, k, v)
    with pytest.raises(ValueError, match="already planned"):  # every layer ran; the step is not ended yet
        cache.plan([0], [4], [3], [False])
    cache.end_step()
    cache.plan([0], [4], [3], [False])  # the step is ended: the next one plans
    assert cache.active_slots == [0]


def test_group_size_beyond_the_kernel_is_refused_at_configuration():
    with pytest.raises(ValueError, match="query:KV head ratio 80 exceeds"):
        PagedDiffKVCache(CFG, 1, 80, 1, 64, EngineConfig(max_batch_size=1, max_seq_len=8, use_triton=True), num_pages=8)


@pytest.mark.parametrize("engine", [ReferenceGenerator, PagedGenerator])
def test_token_ids_of_any_integer_type_and_clear_errors(engine):
    model = tiny_llama()
    gen = engine(model, None, model.config, get_preset("diffkv"))
    plain = gen.generate_ids([5, 6, 7], 2)
    assert plain.error is None
    assert gen.generate_ids([np.int64(5), np.int32(6), 7], 2).token_ids == plain.token_ids
    assert "not an integer" in gen.generate_ids([5, 6.0], 2).error
    assert "list of token ids" in gen.generate_ids("5 6", 2).error
    assert "list of token ids" in gen.generate_ids(None, 2).error


def test_paged_generator_refuses_an_empty_pool():
    model = tiny_llama()
    with pytest.raises(ValueError, match="num_pages=0"):
        PagedGenerator(model, None, model.config, get_preset("diffkv"), num_pages=0)
