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


def test_rotated_copy_runs_the_rope_kernel_and_equals_the_rotated_model():
    """A rotated copy (its own concatenated q/k/v buffer on CUDA: its v rows are its own) runs one product and the
    fused RoPE kernel, as the model rotated in place does, and their logits agree to fp16 noise; the
    forward of the copy with the fused kernels off (PyTorch's RoPE) agrees too."""
    import copy

    from trtllm_diffkv.model import fused
    from trtllm_diffkv.model.rotation import rotate_model, rotate_model_
    from oracle.attention import DenseBackend

    base = peaked_tiny_llama().cuda().half()
    in_place = rotate_model_(copy.deepcopy(base), seed=3)
    assert in_place.model.layers[0].self_attn._qkv_weight is not None
    rotated = rotate_model(base, seed=3)
    attn, src = rotated.model.layers[0].self_attn, base.model.layers[0].self_attn
    assert attn._qkv_weight is not None and attn._qkv_weight.data_ptr() != src._qkv_weight.data_ptr()
    assert torch.equal(attn._qkv_weight[:-attn.v_proj.weight.shape[0]], src._qkv_weight[:-src.v_proj.weight.shape[0]])
    assert attn.q_proj.weight.data_ptr() == attn._qkv_weight.data_ptr()  # the copy's own one q/k/v product
    ids = torch.arange(40, device="cuda") % base.config.vocab_size
    pos = torch.arange(40, device="cuda")
    calls = []
    real = fused.qkv_rope
    with torch.inference_mode():
        want = in_place(ids, pos, DenseBackend()).float()
        fused_qkv_rope = lambda *a, **k: (calls.append(1), real(*a, **k))[1]  # noqa: E731
        import trtllm_diffkv.model.llama as llama
        llama.qkv_rope, saved = fused_qkv_rope, llama.qkv_rope
        try:
            got = rotated(ids, pos, DenseBackend()).float()
        finally:
            llama.qkv_rope = saved
        fused.use_fused_kernels, saved_use = (lambda x: False), fused.use_fused_kernels
        try:
            eager = rotated(ids, pos, DenseBackend()).float()
        finally:
            fused.use_fused_kernels = saved_use
    assert len(calls) == base.config.num_layers
    scale = want.abs().max()  # fp16 through 3 layers: the rotation's roundings (H200: 0.8 % with three products)
    errs = float((got - want).abs().max() / scale), float((eager - want).abs().max() / scale)
    assert max(errs) < 2e-2, errs
