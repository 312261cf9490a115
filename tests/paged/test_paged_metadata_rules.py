"""Per-row metadata sizes of the paged cache against the tensors really allocated (paged/row_meta.py).

The cache's byte accounting (``pool_used_bytes``, ``request_stats``, the executor's budget) reads
``RowMetadataFormat.row_bytes``; these tests hold it to the fp16 ``[head_dim]`` key offset the
cache allocates per row (``center_keys``), and to nothing without it.
"""
import pytest

from trtllm_diffkv.config import DiffKVConfig, get_preset
from trtllm_diffkv.engine_config import EngineConfig
from trtllm_diffkv.paged.cache import PagedDiffKVCache


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_row_bytes_are_the_allocated_fp16_key_offset(head_dim):
    cache = PagedDiffKVCache(DiffKVConfig(center_keys=True), 2, 4, 2, head_dim,
                             EngineConfig(max_batch_size=3, max_seq_len=64, use_triton=False), num_pages=64)
    offsets = cache.row_meta.key_offsets
    assert offsets.shape == (3 * 2 * 2, head_dim)                      # one row per (slot, layer, KV head)
    assert cache.row_meta.format.row_bytes == offsets[0].numel() * offsets.element_size() == 2 * head_dim
    assert cache.row_meta.size_bytes == offsets.numel() * offsets.element_size()


@pytest.mark.parametrize("config", [DiffKVConfig(center_keys=False), get_preset("fp16")])
def test_no_row_bytes_without_centered_keys(config):
    cache = PagedDiffKVCache(config, 2, 4, 2, 64, EngineConfig(max_batch_size=2, max_seq_len=64, use_triton=False),
                             num_pages=64)
    assert cache.row_meta.key_offsets.numel() == 0
    assert cache.row_meta.format.row_bytes == cache.row_meta.size_bytes == 0
