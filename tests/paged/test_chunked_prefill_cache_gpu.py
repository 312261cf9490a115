"""Chunked prefill in the paged cache on the GPU: the Triton kernels and TritonPageManager at the default window.

Run on the device: ``python3 -m pytest -q -m gpu tests/paged/test_chunked_prefill_cache_gpu.py``. The checks of
``test_chunked_prefill_cache.py`` (``chunked_prefill_cases``) in bf16, the serving dtype: a 300-token prompt prefilled
whole and in chunks of 1, 63, 64 and 250 (a final chunk of 50 < S = 64) leaves bit-identical pools.
"""
import pytest
import torch

from chunked_prefill_cases import check_chunked_equals_unchunked

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name,chunk", [("diffkv", 1), ("diffkv", 64), ("diffkv", 250), ("k8v4", 63),
                                        ("k8v8", 250), ("fp16", 250)])
def test_chunked_cache_equals_unchunked_on_gpu(name, chunk):
    cache = check_chunked_equals_unchunked(name, 300, chunk, device="cuda", dtype=torch.bfloat16, use_triton=True)
    assert cache.use_triton and type(cache.manager).__name__ == "TritonPageManager"
