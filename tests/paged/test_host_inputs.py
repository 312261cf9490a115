"""A step's host integers reach the device in ONE copy (``paged/host_inputs.py``), on the CPU as plain tensors.

The pinned, non-blocking path (CUDA) is compared with the plain one in ``tests/paged/test_paged_gpu.py``
(``test_pinned_step_inputs_equal_the_pageable_ones``).
"""
import pytest
import torch

from trtllm_diffkv.config import DiffKVConfig
from trtllm_diffkv.engine_config import EngineConfig
from trtllm_diffkv.paged import PagedDiffKVCache
from trtllm_diffkv.paged.host_inputs import StepInputs

CFG = DiffKVConfig(recent_window_tokens=4, prompt_score_window_tokens=8, alpha_high=1.0, alpha_low=0.3)


def test_to_device_splits_one_tensor_into_the_lists():
    inputs = StepInputs(torch.device("cpu"))
    assert not inputs.pinned
    parts = inputs.to_device([[3, 1], [], [7, 8, 9]])
    assert [p.tolist() for p in parts] == [[3, 1], [], [7, 8, 9]]
    assert all(p.dtype == torch.int64 for p in parts) and inputs.copies == 1
    assert parts[0].untyped_storage().data_ptr() == parts[2].untyped_storage().data_ptr()  # views of one copy


def test_pinning_needs_cuda_and_two_buffers():
    with pytest.raises(ValueError, match="CUDA"):
        StepInputs(torch.device("cpu"), pinned=True)
    with pytest.raises(ValueError, match="num_buffers"):
        StepInputs(torch.device("cpu"), num_buffers=1)


def test_every_plan_makes_one_copy():
    cache = PagedDiffKVCache(CFG, 2, 4, 2, 64, EngineConfig(max_batch_size=3, max_seq_len=64, high_tokens_per_page=4),
                             num_pages=200)
    g = torch.Generator().manual_seed(0)

    def run(num_tokens):
        for layer in range(2):
            cache.forward(layer, torch.randn(num_tokens, 4, 64, generator=g),
                          torch.randn(num_tokens, 2, 64, generator=g), torch.randn(num_tokens, 2, 64, generator=g))
        cache.end_step()

    steps = [(([0, 1], [20, 9], [0, 0], [True, True]), {}, 29),
             (([2, 0, 1], [5, 21, 10], [0, 20, 9], [True, False, False]), {}, 7),  # mixed: still one copy
             (([0, 1, 2], [22, 11, 6], [21, 10, 5], [False] * 3), {"pad_to": 3}, 3)]
    for i, (args, kwargs, num_tokens) in enumerate(steps):
        cache.plan(*args, **kwargs)
        assert cache.step_inputs.copies == i + 1
        run(num_tokens)
    cache.plan([0], [23], [22], [False])
    d = cache.planned_step.decode
    assert d.positions.tolist() == [22, 22] and d.err_idx.tolist() == [0, 0]  # per (sequence, KV head)
    assert cache.prompt_len_device.tolist() == [20, 9, 5]
