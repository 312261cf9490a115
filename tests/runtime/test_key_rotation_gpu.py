"""``key_rotation="hadamard"`` on CUDA: the executor (Triton kernels, CUDA graphs) with rotation.

Run on the device: ``python3 -m pytest -q -s -m gpu tests/runtime/test_key_rotation_gpu.py`` (H200, commit
f1fa164, 2026-12-02: 2 passed). The CPU counterparts are in tests/model/test_key_rotation.py.
"""
import pytest
import torch

from conftest import peaked_tiny_llama
from test_executor import CFG, FP16, _greedy, _prompts, drive, make
from trtllm_diffkv.generation.reference import ReferenceGenerator

pytestmark = pytest.mark.gpu

ROT = dict(key_rotation="hadamard")


@pytest.fixture(scope="module")
def model():
    return peaked_tiny_llama().cuda()


def test_fp16_with_rotation_equals_without_on_gpu(model):
    prompts = _prompts((20, 33))
    arrivals = {0: [(i, p, _greedy(8)) for i, p in enumerate(prompts)]}
    plain = drive(make(model, FP16, use_triton=None), arrivals)
    ex = make(model, FP16.replace(**ROT), use_triton=None)
    assert ex.model.model.layers[0].self_attn.key_rotation.device.type == "cuda"
    rotated = drive(ex, arrivals)
    assert {k: v[0] for k, v in rotated.items()} == {k: v[0] for k, v in plain.items()}


def test_rotated_diffkv_executor_equals_the_rotated_reference_on_gpu(model):
    cfg = CFG.replace(**ROT)
    prompt = _prompts((40,), seed=5)[0]
    got = drive(make(model, cfg, use_triton=None), {0: [(0, prompt, _greedy(10))]})[0][0]
    ref = ReferenceGenerator(model, None, model.config, cfg).generate_ids(prompt, 10).token_ids
    assert got == ref
    half = peaked_tiny_llama().cuda().to(torch.bfloat16)  # bf16 weights, fp32 rotation
    ex = make(half, cfg, use_triton=None)
    assert ex.model.model.layers[0].self_attn.key_rotation.dtype == torch.float32
    assert drive(ex, {0: [(0, prompt, _greedy(4))]})[0][1].finished
