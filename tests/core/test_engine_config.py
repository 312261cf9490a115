"""The engine config (``trtllm_diffkv.engine_config``): its defaults, each field's rule and message, frozen, and
checked again on ``replace``."""
from __future__ import annotations

import dataclasses
import math

import pytest

from trtllm_diffkv.engine_config import DEFAULT_MAX_NUM_TOKENS, EngineConfig


def test_defaults_are_the_documented_ones():
    c = EngineConfig()
    assert (c.max_batch_size, c.max_num_tokens, c.max_seq_len, c.kv_memory_bytes, c.kv_memory_fraction) == \
        (64, None, None, None, None)
    assert (c.high_tokens_per_page, c.enable_chunked_prefill, c.chunk_staging_bytes) == (32, True, None)
    assert (c.use_cuda_graphs, c.split_mixed_steps, c.disable_overlap_scheduler, c.use_triton) == (None,) * 4
    assert (c.page_manager, c.read_path, c.device, c.profile) == ("auto", "auto", None, False)
    assert DEFAULT_MAX_NUM_TOKENS == 8192


@pytest.mark.parametrize("field, value, message", [
    ("max_batch_size", 0, "max_batch_size=0 must be a positive integer"),
    ("max_batch_size", True, "max_batch_size=True must be a positive integer"),
    ("max_batch_size", 4.0, "max_batch_size=4.0 must be a positive integer"),
    ("max_batch_size", None, "max_batch_size=None must be a positive integer"),
    ("max_num_tokens", 0, "max_num_tokens=0 must be a positive integer (or None)"),
    ("max_seq_len", -5, "max_seq_len=-5 must be a positive integer (or None)"),
    ("max_seq_len", 2.5, "max_seq_len=2.5 must be a positive integer (or None)"),
    ("kv_memory_bytes", 0, "kv_memory_bytes=0 must be a positive integer"),
    ("kv_memory_bytes", False, "kv_memory_bytes=False must be a positive integer"),
    ("kv_memory_fraction", 0.0, "kv_memory_fraction=0.0 must be in (0, 1]"),
    ("kv_memory_fraction", 1.5, "kv_memory_fraction=1.5 must be in (0, 1]"),
    ("kv_memory_fraction", math.nan, "kv_memory_fraction=nan must be in (0, 1]"),
    ("high_tokens_per_page", 0, "high_tokens_per_page=0 must be a positive integer"),
    ("enable_chunked_prefill", 1, "enable_chunked_prefill=1 must be True or False"),
    ("chunk_staging_bytes", -1, "chunk_staging_bytes=-1 must be an integer >= 0 (or None)"),
    ("use_cuda_graphs", "yes", "use_cuda_graphs='yes' must be True, False or None"),
    ("split_mixed_steps", 0, "split_mixed_steps=0 must be True, False or None"),
    ("disable_overlap_scheduler", "no", "disable_overlap_scheduler='no' must be True, False or None"),
    ("use_triton", 1, "use_triton=1 must be True, False or None"),
    ("page_manager", "gpu", "page_manager='gpu'; allowed: 'auto', 'cpu', 'triton'"),
    ("read_path", "cuda", "read_path='cuda'; allowed: 'auto', 'torch'"),
    ("profile", None, "profile=None must be True or False"),
])
def test_each_field_is_checked_and_named(field, value, message):
    with pytest.raises(ValueError) as info:
        EngineConfig(**{field: value})
    assert str(info.value) == message


@pytest.mark.parametrize("changes", [
    dict(max_batch_size=1), dict(max_num_tokens=1, max_seq_len=1), dict(kv_memory_bytes=1),
    dict(kv_memory_fraction=1), dict(kv_memory_fraction=1e-6), dict(chunk_staging_bytes=0),
    dict(enable_chunked_prefill=False), dict(use_cuda_graphs=True, split_mixed_steps=False),
    dict(page_manager="triton", read_path="torch"), dict(device="cpu", profile=True),
])
def test_the_edges_of_each_rule_are_allowed(changes):
    config = EngineConfig(**changes)
    assert all(getattr(config, k) == v for k, v in changes.items())


def test_one_budget_at_most():
    with pytest.raises(ValueError, match="^give one of kv_memory_bytes and kv_memory_fraction, not both$"):
        EngineConfig(kv_memory_bytes=1 << 20, kv_memory_fraction=0.5)


def test_unknown_fields_are_refused():
    with pytest.raises(TypeError, match="max_batch"):
        EngineConfig(max_batch=4)


def test_frozen_and_checked_again_on_replace():
    config = EngineConfig(max_batch_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch_size = 0
    assert config.replace(max_seq_len=64) == EngineConfig(max_batch_size=4, max_seq_len=64)
    with pytest.raises(ValueError, match="^max_seq_len=0 must be"):
        config.replace(max_seq_len=0)


def test_staging_limit_follows_chunked_prefill():
    assert EngineConfig(chunk_staging_bytes=1000).staging_limit_bytes == 1000
    assert EngineConfig(chunk_staging_bytes=1000, enable_chunked_prefill=False).staging_limit_bytes == 0
    assert EngineConfig().staging_limit_bytes is None
