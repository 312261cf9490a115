"""PageFormat: page size, tokens per tier, segment offsets (DiffKV.md "Memory manager")."""
import pytest

from trtllm_diffkv.config import FP16_TIER, PRESETS, SUPPORTED_HEAD_DIMS, DiffKVConfig, TierConfig
from trtllm_diffkv.memory.page_format import SEGMENT_NAMES, TIERS, PageFormat, tier_layout


def test_authors_numbers_for_head_dim_128():
    """6784-byte pages: 32 tokens at K8V4, 60 at K4V2 (1 group), 24 at K8V8, 13 at FP16."""
    fmt = PageFormat.for_config(DiffKVConfig(low=TierConfig(4, 2, 1, 1)), 128)
    assert fmt.page_size_bytes == 6784
    assert fmt.high_tokens_per_page == 32
    assert fmt.low_tokens_per_page == 60
    assert tier_layout(TierConfig(8, 8), 128, 6784).tokens_per_page == 24
    assert tier_layout(FP16_TIER, 128, 6784).tokens_per_page == 13


def test_default_config_head_dim_128():
    fmt = PageFormat.for_config(DiffKVConfig(), 128)
    assert (fmt.page_size_bytes, fmt.high_tokens_per_page, fmt.low_tokens_per_page) == (6784, 32, 52)
    assert fmt.high.waste_bytes(fmt.page_size_bytes) == 0
    assert fmt.low.waste_bytes(fmt.page_size_bytes) == 6784 - 52 * 128
    assert "K8V4: 32 tokens" in fmt.describe()


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("config", [DiffKVConfig(), DiffKVConfig(low=TierConfig(4, 2, 1, 1)), PRESETS["fp16"], PRESETS["k8v4"]])
def test_segments_aligned_disjoint_and_inside_the_page(head_dim, config):
    fmt = PageFormat.for_config(config, head_dim)
    assert fmt.page_size_bytes % 128 == 0
    for tier in TIERS:
        layout = fmt.tier(tier)
        assert layout.token_bytes == config.token_bytes(tier, head_dim)
        end = 0
        for name in SEGMENT_NAMES:
            seg = layout.segment(name)
            assert seg.offset_bytes % fmt.alignment_bytes == 0 and seg.offset_bytes >= end
            end = seg.offset_bytes + seg.size_bytes
        assert end == layout.used_bytes <= fmt.page_size_bytes
        # one more token would not fit: the tier uses the page as fully as alignment allows
        with_one_more = tier_layout(layout.tier, head_dim, 10**6, fmt.alignment_bytes, config.compress)
        assert with_one_more.tokens_per_page > layout.tokens_per_page
        assert layout.waste_bytes(fmt.page_size_bytes) < 2 * layout.token_bytes + 6 * fmt.alignment_bytes
        assert layout.segment("key_codes").size_bytes >= layout.tokens_per_page * head_dim * layout.tier.key_bits // 8
    assert fmt.high_tokens_per_page == 32


def test_score_and_position_only_when_compressing():
    assert PageFormat.for_config(PRESETS["fp16"], 128).high.score.size_bytes == 0
    assert PageFormat.for_config(DiffKVConfig(), 128).high.score.size_bytes == 32 * 4


def test_pages_in_budget_and_pages_for_tokens():
    fmt = PageFormat.for_config(DiffKVConfig(), 128)
    assert fmt.pages_in_budget(100 * 2**30) == 100 * 2**30 // 6784 == 15827562
    assert fmt.pages_in_budget(6783) == 0
    assert fmt.pages_in_budget(2**60) == 2**31 - 1
    assert [fmt.pages_for_tokens("high", n) for n in (0, 1, 32, 33)] == [0, 1, 1, 2]
    assert [fmt.pages_for_tokens("low", n) for n in (52, 53)] == [1, 2]
    with pytest.raises(ValueError, match="memory_bytes"):
        fmt.pages_in_budget(-1)


@pytest.mark.parametrize("config", [DiffKVConfig(), DiffKVConfig(low=TierConfig(4, 2, 1, 1)), PRESETS["fp16"]])
def test_prompt_reservation_covers_every_split(config):
    """ceil(h/P_high) + ceil(l/P_low) <= prompt_reserve_pages(n) for all h + l <= n, and the +1 is needed."""
    fmt = PageFormat.for_config(config, 64, high_tokens_per_page=4)
    ph, pl = fmt.high_tokens_per_page, fmt.low_tokens_per_page
    needed_plus_one = False
    for n in range(1, 40):
        reserve = fmt.prompt_reserve_pages(n)
        worst = max(-(-h // ph) - (-l // pl) for h in range(n + 1) for l in range(n + 1 - h))
        assert worst <= reserve
        needed_plus_one |= worst == reserve and config.compress and pl != ph
    assert needed_plus_one or pl == ph


@pytest.mark.parametrize("bad", [dict(head_dim=100), dict(head_dim=0), dict(high_tokens_per_page=0),
                                 dict(high_tokens_per_page=True), dict(alignment_bytes=24)])
def test_bad_arguments_raise_value_error(bad):
    kwargs = dict(config=DiffKVConfig(), head_dim=128) | bad
    with pytest.raises(ValueError):
        PageFormat.for_config(**kwargs)


def test_unknown_tier_and_segment():
    fmt = PageFormat.for_config(DiffKVConfig(), 128)
    with pytest.raises(ValueError, match="tier"):
        fmt.tier("medium")
    with pytest.raises(ValueError, match="segment"):
        fmt.high.segment("keys")
    with pytest.raises(ValueError, match="prompt_tokens"):
        fmt.prompt_reserve_pages(0)
