"""KVCachePool: one byte buffer sized from a budget, typed segment views at the PageFormat offsets."""
import pytest
import torch

from trtllm_diffkv.config import PRESETS, DiffKVConfig
from trtllm_diffkv.memory import KVCachePool, PageFormat
from trtllm_diffkv.memory.page_format import SEGMENT_NAMES, TIERS

FMT = PageFormat.for_config(DiffKVConfig(), 128)


def test_sized_from_memory_budget():
    pool = KVCachePool.from_budget(FMT, kv_cache_memory_bytes=10 * 6784 + 6783, device="cpu")
    assert pool.num_pages == 10 and pool.size_bytes == 10 * 6784
    assert pool.pages().shape == (10, 6784)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(kv_cache_memory_bytes=10**6, gpu_memory_fraction=0.5), dict(kv_cache_memory_bytes=100),
    dict(gpu_memory_fraction=0.5), dict(gpu_memory_fraction=1.5),
])
def test_bad_budgets_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        KVCachePool.from_budget(FMT, device="cpu", **kwargs)


@pytest.mark.parametrize("config", [DiffKVConfig(), PRESETS["fp16"]])
@pytest.mark.parametrize("head_dim", [80, 128])
def test_segment_views_alias_the_buffer_at_the_format_offsets(config, head_dim):
    fmt = PageFormat.for_config(config, head_dim)
    pool = KVCachePool(fmt, 3, device="cpu")
    for tier in TIERS:
        layout = fmt.tier(tier)
        for name in SEGMENT_NAMES:
            view = pool.segment(tier, name)
            seg = layout.segment(name)
            assert view.shape[0] == 3 and view.shape[1] in (0, layout.tokens_per_page)
            assert view.numel() * view.element_size() <= 3 * seg.size_bytes
            if view.numel() == 0:
                continue
            pool.buffer.zero_()
            view[1].view(torch.uint8).fill_(0xAB)
            touched = torch.nonzero(pool.pages() != 0)
            assert set(touched[:, 0].tolist()) == {1}, "wrote outside page 1"
            cols = touched[:, 1]
            assert int(cols.min()) == seg.offset_bytes
            assert int(cols.max()) < seg.offset_bytes + seg.size_bytes


def test_score_and_position_round_trip():
    pool = KVCachePool(FMT, 4, device="cpu")
    scores = pool.segment("low", "score")
    positions = pool.segment("low", "position")
    scores[2] = torch.arange(FMT.low_tokens_per_page, dtype=torch.float32) / 3
    positions[2] = torch.arange(FMT.low_tokens_per_page, dtype=torch.int32) * 7
    raw = pool.pages()[2]
    off = FMT.low.score.offset_bytes
    assert torch.equal(raw[off:off + 4 * FMT.low_tokens_per_page].view(torch.float32), scores[2])
    assert torch.equal(pool.segment("low", "position")[2], torch.arange(FMT.low_tokens_per_page, dtype=torch.int32) * 7)
