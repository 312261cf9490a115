"""DiffKVConfig validation and presets."""
import dataclasses

import pytest

from trtllm_diffkv.config import FP16_TIER, PRESETS, DiffKVConfig, TierConfig, get_preset


@pytest.mark.parametrize("field,value,words", [
    ("alpha_high", -1.0, "alpha_high"), ("alpha_high", float("nan"), "alpha_high"),
    ("alpha_low", 2.0, "alpha_low"),  # above alpha_high (1.0)
    ("recent_window_tokens", -1, "recent_window_tokens"), ("recent_window_tokens", 3.5, "recent_window_tokens"),
    ("prompt_score_window_tokens", 0, "prompt_score_window_tokens"),
    ("prompt_threshold_base", "median", "prompt_threshold_base"),
    ("high", TierConfig(2, 2), "high tier"),  # high below low (K4V2)
])
def test_invalid_fields_name_field_and_range(field, value, words):
    with pytest.raises(ValueError, match=words):
        DiffKVConfig(**{field: value})


def test_range_is_stated():
    with pytest.raises(ValueError, match=r"allowed range: \[0\.0, 1000\.0\]"):
        DiffKVConfig(alpha_high=1e9)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DiffKVConfig().alpha_high = 2.0


def test_tier_defaults_follow_authors_groups():
    assert (TierConfig(8, 4).key_groups, TierConfig(8, 4).value_groups) == (1, 2)
    assert (TierConfig(4, 2).key_groups, TierConfig(4, 2).value_groups) == (2, 4)
    # K8V4 at head_dim 128: 128 + 4 + 64 + 8 bytes; K4V2: 64 + 8 + 32 + 16 bytes
    assert TierConfig(8, 4).token_bytes(128) == 204 and TierConfig(4, 2).token_bytes(128) == 120
    assert TierConfig(16, 16).token_bytes(64) == 256


def test_presets():
    assert {"default", "diffkv", "fp16", "llama3-8b", "llama3-70b", "qwen2.5-7b", "qwen2.5-32b", "qwq-32b"} <= \
        PRESETS.keys()
    assert (get_preset("llama3-8b").alpha_low, get_preset("llama3-8b").alpha_high) == (0.02, 1.0)
    assert get_preset("qwen2.5-7b").alpha_low == get_preset("qwen2.5-7b").alpha_high == 0.04
    assert not get_preset("fp16").compress
    with pytest.raises(ValueError, match="known presets"):
        get_preset("llama9")


def _unnamed(cfg: DiffKVConfig) -> DiffKVConfig:
    return cfg.replace(name="-")


def test_diffkv_is_the_tiered_point():
    """``diffkv`` names the tiered DiffKV point (K8V4 high / K4V2 low, Hadamard keys, alpha_high 1, alpha_low 0)
    whatever ``default`` is; ``default-rotated`` is its old name for the measurements."""
    cfg = get_preset("diffkv")
    assert (cfg.name, cfg.high, cfg.low, cfg.alpha_high, cfg.alpha_low, cfg.key_rotation) == \
        ("diffkv", TierConfig(8, 4), TierConfig(4, 2), 1.0, 0.0, "hadamard")
    assert cfg.tiered and cfg.compress
    assert _unnamed(cfg) == _unnamed(get_preset("default-unrotated").replace(key_rotation="hadamard"))
    assert _unnamed(get_preset("default-rotated")) == _unnamed(cfg)


def test_default_is_another_named_point():
    """``default`` is docs/QUALITY.md's pick among the named points, not a configuration of its own."""
    default = _unnamed(get_preset("default"))
    assert get_preset("default").name == "default"
    assert any(_unnamed(cfg) == default for name, cfg in PRESETS.items() if name not in ("default", "default-rotated"))


def test_validate_for_model_refuses_at_configuration_time():
    cfg = DiffKVConfig()
    for head_dim in (64, 80, 96, 128, 256):
        cfg.validate_for_model(head_dim, 28, 4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        cfg.validate_for_model(128, 30, 4)
    with pytest.raises(ValueError, match="head_dim"):
        cfg.validate_for_model(100, 8, 8)
    get_preset("fp16").validate_for_model(100, 8, 8)  # no packed format needed without compression


@pytest.mark.parametrize("kwargs,words", [
    ({"key_bits": 8.0, "value_bits": 4}, "key_bits"), ({"key_bits": 8, "value_bits": 4, "key_groups": True}, "key_groups"),
    ({"key_bits": 8, "value_bits": 4, "value_groups": 1.0}, "value_groups"),
])
def test_tier_types_are_checked(kwargs, words):
    with pytest.raises(ValueError, match=words):
        TierConfig(**kwargs)


@pytest.mark.parametrize("field", ["compress", "center_keys"])
def test_flags_must_be_bool(field):
    with pytest.raises(ValueError, match=field):
        DiffKVConfig(**{field: "no"})


def test_uncompressed_bytes_are_fp16_whatever_the_tiers():
    assert DiffKVConfig(compress=False).token_bytes("high", 128) == 512
    odd = DiffKVConfig(compress=False, high=TierConfig(4, 2), low=TierConfig(16, 16))
    assert odd.high == odd.low == FP16_TIER == get_preset("fp16").high  # one layout for "no compression"
    assert get_preset("k8v4").low == get_preset("k8v4").high  # quantization only: one K8V4 format


def test_only_presets_that_tier_tokens_keep_token_metadata():
    """Uniform formats (alpha_high == alpha_low == 0) store what a uniform INT8/INT4 cache stores: codes and one fp16
    scale and zero per group, no fp32 score or int32 position per token."""
    d = 64
    k8v4, k8v8, diffkv, fp16 = (get_preset(n) for n in ("k8v4", "k8v8", "diffkv", "fp16"))
    assert (k8v4.tiered, k8v8.tiered, diffkv.tiered, fp16.tiered) == (False, False, True, False)
    # K8: 64 code bytes + one group's scale and zero (4 bytes); V4: 32 code bytes + two groups (8 bytes)
    assert k8v4.token_bytes("high", d) == 64 + 4 + 32 + 8
    assert k8v8.token_bytes("high", d) == 64 + 4 + 64 + 4
    # tiered: the same codes plus the fp32 score and int32 position of every token
    assert diffkv.token_bytes("high", d) == 64 + 4 + 32 + 8 + 4 + 4
    assert fp16.token_bytes("high", d) == 2 * d * 2
    assert k8v4.replace(alpha_high=0.5).tiered and k8v4.replace(alpha_high=0.5).token_bytes("high", d) == 116
