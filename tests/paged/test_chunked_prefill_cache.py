"""Chunked prefill in the paged cache (CPU): bit-identical to the unchunked prefill, staging kept and dropped.

``chunked_prefill_cases`` has the checks (shared with the GPU file): the same q/k/v prefilled whole and
in chunks leave bit-identical pools (non-final chunks write nothing; the final chunk scores the whole
prompt with its last S queries, also those of earlier chunks), and every chunk's output equals dense
fp32 causal attention. Torch path at the default window (S = W = 64), the Triton interpreter at small shapes.
"""
import pytest
import torch

from chunked_prefill_cases import check_chunked_equals_unchunked, kv_config, make_cache, prefill, random_qkv
from conftest import poison_prompt_staging
from trtllm_diffkv.engine_config import EngineConfig
from trtllm_diffkv.paged.cache import OutOfPagesError, PagedDiffKVCache


@pytest.mark.parametrize("name", ["fp16", "k8v4", "diffkv", "llama3-8b", "k8v8"])
@pytest.mark.parametrize("chunk", [1, 63, 64, 90])  # 90: a final chunk of 10 < S; its scoring queries span 2 chunks
def test_chunked_cache_equals_unchunked_bit_for_bit(name, chunk):
    check_chunked_equals_unchunked(name, 100, chunk, device="cpu", dtype=torch.float32, use_triton=False)


def test_chunked_cache_on_the_triton_interpreter():
    """The Triton scores and quantized writes (interpreted: slow, so 12 tokens, S = 8, chunks 5 + 5 + 2)."""
    check_chunked_equals_unchunked("small-window", 12, 5, device="cpu", dtype=torch.float32, use_triton=True,
                                   decode=False)


def test_staging_is_counted_refused_beyond_its_limit_and_freed():
    config = kv_config("diffkv")
    cache = make_cache(config, device="cpu", dtype=torch.float32, use_triton=False, prompt_tokens=100)
    need = cache.staging_bytes_for(100)
    L, H, Hq, D = cache.num_layers, cache.num_kv_heads, cache.num_heads, cache.head_dim
    assert need == 4 * (2 * L * 100 * H * D + L * 64 * Hq * D)  # fp32 K and V of 100 tokens + 64 queries
    qkv = random_qkv(100, device="cpu", dtype=torch.float32)
    free = cache.manager.free_pages()
    cache.plan([0], [40], [0], [True], prompt_lens=[100])
    for layer, (q, k, v) in enumerate(qkv):
        cache.forward(layer, q[:40], k[:40], v[:40])
    cache.end_step()
    assert cache.staging_bytes_used() == need
    assert free - cache.manager.free_pages() == cache.manager.reserve_pages_needed([100])  # the whole reserve
    assert cache.active_slots == [0]
    with pytest.raises(ValueError, match="continue the slot's staged prompt"):
        cache.plan([0], [60], [30], [True], prompt_lens=[100])  # not where the staging stops
    cache.staging_limit_bytes = 2 * need - 1
    with pytest.raises(OutOfPagesError, match="staging"):
        cache.plan([1], [10], [0], [True], prompt_lens=[100])  # a second staging would exceed the limit
    assert cache.planned_step is None and 1 not in cache.staging
    cache.release([0])  # abort in the middle of the prompt
    assert cache.staging == {} and cache.manager.free_pages() == free and cache.active_slots == []
    cache.manager.check_invariants()


@pytest.mark.parametrize("spare_bytes,fits", [(0, True), (-1, False)])
def test_a_second_staging_that_exactly_fills_the_limit_is_planned(spare_bytes, fits):
    """The staging limit is inclusive (``paged/staging.py``'s ``staging_fits``, the rule the scheduler admits by):
    with one prompt staged, a second whose staging fills the limit to the byte is planned; one byte less of limit
    and the plan is refused, changing nothing. The limit is built from the prompt shape independently of the cache:
    fp32 K and V of 100 tokens plus the 64 scoring queries, per layer."""
    config = kv_config("diffkv")
    cache = make_cache(config, device="cpu", dtype=torch.float32, use_triton=False, prompt_tokens=100)
    L, H, Hq, D = cache.num_layers, cache.num_kv_heads, cache.num_heads, cache.head_dim
    one = 4 * (2 * L * 100 * H * D + L * 64 * Hq * D)
    cache.staging_limit_bytes = 2 * one + spare_bytes
    cache.plan([0], [40], [0], [True], prompt_lens=[100])
    for layer, (q, k, v) in enumerate(random_qkv(100, device="cpu", dtype=torch.float32)):
        cache.forward(layer, q[:40], k[:40], v[:40])
    cache.end_step()
    assert cache.staging_bytes_used() == one
    assert cache.staging_fits(one) is fits
    free = cache.manager.free_pages()
    if fits:
        cache.plan([1], [10], [0], [True], prompt_lens=[100])
        assert cache.planned_step is not None and 1 in cache.staging
        cache.discard_step()
    else:
        with pytest.raises(OutOfPagesError, match="staging"):
            cache.plan([1], [10], [0], [True], prompt_lens=[100])
        assert cache.planned_step is None and 1 not in cache.staging and cache.manager.free_pages() == free
    cache.release([0, 1] if fits else [0])
    assert cache.staging == {} and cache.staging_bytes_used() == 0


def test_unwritten_staging_rows_are_never_read(monkeypatch):
    """The staging is allocated uninitialized: rows past the chunks that ran must never reach an output (the
    public report "chunked prefill with an 8-bit KV cache produced NaN"). Poison them and check every output."""
    poison_prompt_staging(monkeypatch)
    for name in ("k8v4", "k8v8"):
        cache = make_cache(kv_config(name), device="cpu", dtype=torch.float32, use_triton=False, prompt_tokens=100)
        cache.pool.buffer.fill_(255)  # stale bytes in every page (fp16 NaN), as in a pool that served others
        outs = prefill(cache, random_qkv(100, device="cpu", dtype=torch.float32), 30)
        assert all(bool(torch.isfinite(o).all()) for o in outs)
        assert not bool(cache.error_flags.any())


@pytest.mark.parametrize("name", ["diffkv", "fp16"])
def test_whole_prompts_beside_a_chunk_equal_an_unchunked_step(name):
    """A step with a chunk runs its whole prompts as one prefill call (``paged/prefill.py``): two whole prompts
    beside the first chunk of a third give the outputs, tier counts and decode reads of an unchunked step."""
    from chunked_prefill_cases import SHAPE

    config = kv_config(name)
    lens = (70, 100, 90)
    qkvs = [random_qkv(n, device="cpu", dtype=torch.float32, seed=s) for n, s in zip(lens, (3, 4, 5))]
    caches = [PagedDiffKVCache(config, **SHAPE,
                               engine_config=EngineConfig(max_batch_size=3, max_seq_len=128, max_num_tokens=256,
                                                          device="cpu", high_tokens_per_page=16, use_triton=False,
                                                          chunk_staging_bytes=1 << 28),
                               num_pages=4096, dtype=torch.float32) for _ in range(2)]
    caches[0].plan([0, 1], [70, 100], [0, 0], [True, True])
    caches[1].plan([0, 1, 2], [70, 100, 40], [0, 0, 0], [True] * 3, prompt_lens=list(lens))
    assert caches[1].planned_step.prefill.whole is not None
    outs = []
    for cache, parts in zip(caches, ([0, 1], [0, 1, 2])):
        layers = []
        for layer in range(SHAPE["num_layers"]):
            q, k, v = (torch.cat([qkvs[i][layer][j][:40 if i == 2 else None] for i in parts]) for j in range(3))
            layers.append(cache.forward(layer, q, k, v)[:170].clone())
        cache.end_step()
        outs.append(layers)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    for s in (0, 1):
        assert torch.equal(caches[0].manager.tokens[s], caches[1].manager.tokens[s])
    step = random_qkv(2, device="cpu", dtype=torch.float32, seed=9)
    reads = []
    for cache in caches:
        cache.plan([0, 1], [71, 101], [70, 100], [False, False])
        reads.append([cache.forward(layer, *x).clone() for layer, x in enumerate(step)])
        cache.end_step()
    for a, b in zip(*reads):
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())


@pytest.mark.parametrize("name", ["diffkv", "pooled", "fp16"])
def test_prompt_writes_in_layer_groups_equal_the_per_layer_writes(name, monkeypatch):
    """A planned prompt step runs its tiers and writes for groups of layers (``prefill.WRITE_GROUP_BYTES``):
    groups of 1 (the TensorRT plugin op's per-layer call), of 2 over 5 layers (the last group partial) and of
    all 5 leave bit-identical pools, tables, tier counts and key offsets, also in a step where a prompt's final
    chunk comes beside a whole one."""
    from dataclasses import replace

    from trtllm_diffkv.paged import prefill as paged_prefill

    config = replace(kv_config("diffkv"), score_pool_tokens=3) if name == "pooled" else kv_config(name)
    shape = dict(num_layers=5, num_heads=4, num_kv_heads=2, head_dim=64)
    g = torch.Generator().manual_seed(21)
    lens = (70, 90)
    qkv = [[(torch.randn(n, 4, 64, generator=g) * 0.6, torch.randn(n, 2, 64, generator=g) * 2,
             torch.randn(n, 2, 64, generator=g)) for _ in range(5)] for n in lens]
    layer_bytes = sum(lens) * 2 * (2 * 64 * 4 + 4)  # fp32 K, V and the score sum of every finishing token
    states = []
    for group in (1, 2, 5):
        monkeypatch.setattr(paged_prefill, "WRITE_GROUP_BYTES", group * layer_bytes)
        for chunked in (False, True):
            cache = PagedDiffKVCache(config, **shape,
                                     engine_config=EngineConfig(max_batch_size=2, max_seq_len=128,
                                                                max_num_tokens=256, device="cpu",
                                                                high_tokens_per_page=16, use_triton=False,
                                                                chunk_staging_bytes=1 << 28),
                                     num_pages=4096, dtype=torch.float32)
            if chunked:  # prompt 1's first 50 tokens in a step of their own, its last 40 beside prompt 0 whole
                cache.plan([1], [50], [0], [True], prompt_lens=[90])
                for layer in range(5):
                    cache.forward(layer, *(x[:50] for x in qkv[1][layer]))
                cache.end_step()
                cache.plan([0, 1], [70, 90], [0, 50], [True, True], prompt_lens=list(lens))
            else:
                cache.plan([0, 1], [70, 90], [0, 0], [True, True])
            assert cache.planned_step.prefill.write_group_layers == group
            for layer in range(5):
                second = tuple(x[50:] for x in qkv[1][layer]) if chunked else qkv[1][layer]
                cache.forward(layer, *(torch.cat([a, b]) for a, b in zip(qkv[0][layer], second)))
            cache.end_step()
            states.append((chunked, cache.pool.buffer.clone(), cache.manager.page_table.clone(),
                           cache.manager.tokens.clone(), cache.row_meta.key_offsets.clone()))
    for chunked in (False, True):  # (the chunked step reserves prompt 1's pages first: other page ids)
        same = [state[1:] for state in states if state[0] == chunked]
        for state in same[1:]:
            for got, want in zip(state, same[0]):
                assert torch.equal(got, want)
        assert int(same[0][2].sum()) > 0
