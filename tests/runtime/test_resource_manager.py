"""The page-pool runtime wrapper: budget accounting, the TensorRT-LLM resource-manager contract, errors (CPU).

Byte counts are checked against the tensors really allocated (their ``nbytes``), page counts
against the page manager's own tables.
"""
import pytest
import torch

from conftest import tiny_llama
from trtllm_diffkv.config import DiffKVConfig, get_preset
from trtllm_diffkv.engine_config import EngineConfig
from trtllm_diffkv.paged import OutOfPagesError
from trtllm_diffkv.runtime.executor import Executor
from trtllm_diffkv.runtime.request import Request
from trtllm_diffkv.runtime.resource_manager import DiffKVResourceManager, ScheduledBatch, resolve_engine_config
from trtllm_diffkv.runtime.sampling import SamplingParams

CFG = DiffKVConfig(recent_window_tokens=4, prompt_score_window_tokens=8, alpha_high=1.0, alpha_low=0.3)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _rm(model, kv_config=CFG, budget=1 << 20, **kw):
    kw = dict(dict(max_batch_size=4, max_seq_len=64, max_num_tokens=128, high_tokens_per_page=4,
                   use_triton=False), **kw)
    return DiffKVResourceManager(model.config, kv_config, EngineConfig(kv_memory_bytes=budget, **kw))


def _allocated(rm) -> int:
    """Bytes of every tensor the budget covers, summed from the tensors themselves."""
    m = rm.cache.manager
    tensors = [rm.cache.pool.buffer, m.ring, m.page_table, m.pages, m.tokens, m.slot_state, rm.cache.row_meta.key_offsets]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("preset", ["diffkv", "fp16"])
@pytest.mark.parametrize("budget", [200_000, 1_000_003, 5 << 20])
def test_budget_covers_pool_and_bookkeeping(model, preset, budget):
    rm = _rm(model, get_preset(preset), budget)
    allocated = _allocated(rm)
    assert rm.allocated_bytes() == allocated <= budget
    assert budget - allocated < rm.cache.page_format.page_size_bytes + 4  # one more page (+ its ring entry) would not fit
    assert rm.get_max_resource_count() == rm.cache.manager.num_pages == rm.cache.pool.buffer.numel() // \
        rm.cache.page_format.page_size_bytes
    stats = rm.stats()
    assert stats["bookkeeping_bytes"] == allocated - rm.cache.pool.buffer.numel()
    assert stats["free_pages"] == stats["pool_pages"] and stats["kv_memory_fraction"] is None


@pytest.mark.parametrize("kwargs, words", [
    (dict(kv_memory_bytes=None), "give kv_memory_bytes"),
    (dict(kv_memory_bytes=None, kv_memory_fraction=0.5), "give kv_memory_bytes"),
    (dict(kv_memory_bytes=10_000, kv_memory_fraction=0.5), "not both"),
    (dict(kv_memory_bytes=0), "positive integer"),
    (dict(kv_memory_bytes=2000), "holds no"),
    (dict(kv_memory_bytes=1 << 20, max_batch_size=0), "max_batch_size"),
])
def test_bad_budgets_are_clear_errors(model, kwargs, words):
    args = dict(max_batch_size=4, max_seq_len=64, max_num_tokens=64, use_triton=False)
    args.update(kwargs)
    with pytest.raises(ValueError, match=words):
        DiffKVResourceManager(model.config, CFG, EngineConfig(device="cpu", **args))


def _request(rid, prompt, max_tokens=8):
    request = Request(rid, prompt, SamplingParams.greedy_params(max_tokens))
    request.prefill_token_ids = list(prompt)
    return request


def _forward(model, rm, batch):
    """The model over the batch's packed tokens, then the step's end (what the executor does between prepare
    and update)."""
    ids, pos = [], []
    for r in batch.context_requests:
        ids += r.prefill_token_ids
        pos += range(len(r.prefill_token_ids))
    for r in batch.generation_requests:
        ids.append(1)
        pos.append(r.num_cached_tokens)
    with torch.inference_mode():
        model(torch.tensor(ids), torch.tensor(pos), rm.cache)
    rm.cache.end_step()


def test_trtllm_contract_round_trip(model):
    rm = _rm(model)
    total = rm.get_max_resource_count()
    a, b = _request("a", list(range(10, 23))), _request("b", list(range(40, 47)))
    batch = ScheduledBatch(context_requests=[a, b])
    rm.prepare_resources(batch)
    assert (a.slot, b.slot) == (0, 1) and rm.num_free_slots == 2
    assert rm.free_pages() == total - rm.cache.manager.reserve_pages_needed([13, 7])
    _forward(model, rm, batch)
    assert rm.update_resources(batch) == {}
    assert (a.num_cached_tokens, b.num_cached_tokens) == (13, 7) and rm.free_pages_after_step == rm.free_pages()
    held = int(rm.cache.manager.pages.sum())
    assert held + rm.free_pages() == total
    for _ in range(5):
        step = ScheduledBatch(generation_requests=[a, b])
        rm.prepare_resources(step)
        _forward(model, rm, step)
        assert rm.update_resources(step) == {}
    assert (a.num_cached_tokens, b.num_cached_tokens) == (18, 12) and rm.cache.seq_len[:2] == [18, 12]
    a_pages = rm.cache.request_stats(a.slot).pool_pages
    assert a_pages <= rm.get_needed_resource_to_completion(a)
    rm.free_resources(a)
    assert a.slot is None and a.num_cached_tokens == 0 and rm.num_free_slots == 3
    assert rm.free_pages() == total - int(rm.cache.manager.pages.sum())
    rm.free_resources(a)  # no slot: no-op
    rm.free_resources(b)
    assert rm.free_pages() == total and rm.num_free_slots == 4
    rm.cache.manager.check_invariants()


def test_request_length_is_a_copy_of_the_caches(model):
    """The paged cache owns a request's length; ``update_resources`` copies it, it does not recompute it."""
    rm = _rm(model)
    a = _request("a", list(range(10, 23)))
    batch = ScheduledBatch(context_requests=[a])
    rm.prepare_resources(batch)
    _forward(model, rm, batch)
    assert rm.cache.seq_len[a.slot] == 13
    rm.cache.seq_len[a.slot] = 11  # what the owner says wins (a real cache never disagrees with its step)
    rm.update_resources(batch)
    assert a.num_cached_tokens == 11


def test_prepare_resources_out_of_pages_changes_nothing(model):
    rm = _rm(model, budget=45_000)
    total = rm.get_max_resource_count()
    big = _request("big", list(range(60)))
    assert rm.cache.manager.reserve_pages_needed([60]) > total
    with pytest.raises(OutOfPagesError):
        rm.prepare_resources(ScheduledBatch(context_requests=[big]))
    assert big.slot is None and rm.num_free_slots == 4 and rm.free_pages() == total
    assert rm.cache.active_slots == []


def test_update_resources_names_the_request_with_non_finite_keys(model):
    rm = _rm(model)
    a, b = _request("a", list(range(5))), _request("b", list(range(6)))
    batch = ScheduledBatch(context_requests=[a, b])
    rm.prepare_resources(batch)
    cache = rm.cache
    g = torch.Generator().manual_seed(0)
    for layer in range(cache.num_layers):
        q = torch.randn(11, cache.num_heads, cache.head_dim, generator=g)
        k = torch.randn(11, cache.num_kv_heads, cache.head_dim, generator=g)
        v = torch.randn(11, cache.num_kv_heads, cache.head_dim, generator=g)
        k[7, 1, 3] = float("inf")  # a token of request b
        cache.forward(layer, q, k, v)
    cache.end_step()
    assert rm.update_resources(batch) == {"b": "a key or value is NaN/Inf or beyond the fp16 range"}
    assert rm.update_resources(ScheduledBatch()) == {}  # flags were cleared


@pytest.mark.parametrize("preset", ["fp16", "tiered"])
def test_needed_to_completion_bounds_the_pages_held_at_the_end(model, preset):
    kv = CFG if preset == "tiered" else get_preset("fp16")
    ex = Executor(model, model.config, kv, EngineConfig(max_batch_size=2, max_seq_len=64, kv_memory_bytes=1 << 20,
                                                        high_tokens_per_page=4, use_triton=False))
    prompt = list(range(3, 22))
    rid = ex.add_request(prompt, SamplingParams.greedy_params(17))
    request = ex.requests[rid]
    result = ex.run_until_done()[rid].result
    need = ex.rm.get_needed_resource_to_completion(request)
    rows = ex.cache.rows_per_slot
    assert result.generated_tokens == 17 and 0 < result.pool_pages <= need
    if preset == "fp16":  # every token high: the bound is exact up to the last token, which is never stored
        assert need == rows * -(-(19 + 17) // 4) and need - result.pool_pages <= rows


def test_resolve_fills_the_model_derived_sizes_only(model):
    """``None`` sizes come from the model (4096 positions) and the rule of the defaults; given sizes stay."""
    mc = model.config
    got = resolve_engine_config(EngineConfig(max_batch_size=16), mc)
    assert (got.max_seq_len, got.max_num_tokens, got.chunk_staging_bytes) == (4096, 8192, None)
    assert got.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_engine_config(EngineConfig(max_batch_size=9000), mc).max_num_tokens == 9000
    unchunked = resolve_engine_config(EngineConfig(enable_chunked_prefill=False, max_seq_len=10_000), mc)
    assert (unchunked.max_seq_len, unchunked.max_num_tokens, unchunked.staging_limit_bytes) == (10_000, 10_000, 0)
    given = EngineConfig(max_seq_len=64, max_num_tokens=100, device="cpu")
    assert resolve_engine_config(given, mc) is given


def test_the_cache_sizes_a_default_staging_of_one_longest_prompt(model):
    """``chunk_staging_bytes=None``: K and V of ``max_seq_len`` tokens plus the scored queries, in the model dtype
    (3 layers, 2 KV / 8 query heads of 64); 0 without chunked prefill; a given value as it is."""
    window = CFG.prompt_score_window_tokens
    want = (2 * 3 * 64 * 2 * 64 + 3 * min(window, 64) * 8 * 64) * 4  # float32
    assert _rm(model, max_seq_len=64).cache.staging_limit_bytes == want
    assert _rm(model, max_seq_len=64, enable_chunked_prefill=False).cache.staging_limit_bytes == 0
    assert _rm(model, max_seq_len=64, chunk_staging_bytes=12345).cache.staging_limit_bytes == 12345


def test_the_manager_reads_its_sizes_from_the_engine_config(model):
    rm = _rm(model, max_batch_size=3, max_seq_len=48, max_num_tokens=96)
    assert (rm.max_batch_size, rm.max_seq_len_tokens, rm.max_num_tokens) == (3, 48, 96)
    assert (rm.cache.max_slots, rm.cache.max_seq_len_tokens, rm.cache.max_num_tokens) == (3, 48, 96)
    assert rm.cache.page_format.high_tokens_per_page == 4 and rm.cache.use_triton is False
