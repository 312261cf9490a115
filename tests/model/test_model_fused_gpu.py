"""The fused decoder kernels on the GPU (issue 19): the same roundings as the PyTorch code they replace,
in fp16 and bf16, and a fused model's forward (eager and CUDA-graph replayed) against the unfused one.

Run on the device: ``python3 -m pytest -q -m gpu tests/model/test_model_fused_gpu.py``.
"""
import pytest
import torch

from conftest import random_llama
from trtllm_diffkv.model import fused
from trtllm_diffkv.model.attention_api import DenseCausalAttention
from trtllm_diffkv.model.rope import apply_rope

pytestmark = pytest.mark.gpu
DTYPES = [torch.float16, torch.bfloat16]


def _ulps(a, b):
    eps = torch.finfo(a.dtype).eps
    return (a.double() - b.double()).abs() / (b.double().abs() * eps).clamp_min(torch.finfo(a.dtype).tiny)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096])
def test_rms_norm_on_gpu(dtype, hidden):
    g = torch.Generator(device="cuda").manual_seed(hidden)
    x = (torch.randn(48, hidden, device="cuda", generator=g) * 3).to(dtype)
    residual = torch.randn(48, hidden, device="cuda", generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).to(dtype)
    for res in (None, residual):
        out, s = fused.rms_norm(x, weight, 1e-5, res)
        ref, ref_s = fused.rms_norm(x, weight, 1e-5, res, use_triton=False)
        assert torch.equal(s, ref_s)
        # the fp32 mean's summation order differs: a rounding flip of the normed value, rarely, which the
        # weight's product can carry to two ulps
        assert _ulps(out, ref).max() <= 2.0 and (out != ref).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_on_gpu(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(48, 2 * 14336, device="cuda", generator=g) * 4).to(dtype)
    out = fused.silu_mul(gate_up)
    ref = fused.silu_mul(gate_up, use_triton=False)
    assert _ulps(out, ref).max() <= 2.0 and (out != ref).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (9, 3, 64), (28, 4, 128), (8, 8, 256),
                                                            (6, 2, 80)])
def test_qkv_rope_on_gpu(dtype, num_heads, num_kv_heads, head_dim):
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    n = 37
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, device="cuda", generator=g).to(dtype)
    angles = torch.rand(n, head_dim // 2, device="cuda", generator=g) * 3000
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    q, k, v = fused.qkv_rope(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
    rq, rk, rv = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    ref_q = apply_rope(rq.reshape(n, num_heads, head_dim), cos, sin)
    ref_k = apply_rope(rk.reshape(n, num_kv_heads, head_dim), cos, sin)
    assert torch.equal(v, rv.reshape(n, num_kv_heads, head_dim))
    # one rounding against PyTorch's three: within 2 ulps of the terms' magnitude, and more accurate
    bound = 2 * torch.finfo(dtype).eps * 2 * qkv.float().abs().max()
    assert (q.float() - ref_q.float()).abs().max() <= bound and (k.float() - ref_k.float()).abs().max() <= bound
    x = qkv.double()[:, :(num_heads + num_kv_heads) * head_dim].reshape(n, num_heads + num_kv_heads, head_dim)
    exact = apply_rope(x, cos.double(), sin.double())
    ours, theirs = torch.cat([q, k], dim=1).double(), torch.cat([ref_q, ref_k], dim=1).double()
    assert (ours - exact).norm() < (theirs - exact).norm()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_model_forward_on_gpu(monkeypatch, dtype):
    model = random_llama(3, vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=8,
                         num_kv_heads=2, head_dim=32, max_position_embeddings=128).to("cuda", dtype)
    assert model.model.layers[0].self_attn._fused(torch.ones(1, device="cuda"))   # re-concatenated by .to()
    ids = torch.randint(0, 256, (40,), device="cuda")
    positions = torch.arange(40, device="cuda")
    backend = DenseCausalAttention()
    with torch.no_grad():
        out = model(ids, positions, backend)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(ids, positions, backend)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            replayed = model(ids, positions, backend)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out)
        monkeypatch.setattr(fused, "use_fused_kernels", lambda x: False)
        ref = model(ids, positions, backend)
        fp32 = random_llama(3, vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=8,
                            num_kv_heads=2, head_dim=32, max_position_embeddings=128).to("cuda")(ids, positions,
                                                                                                backend)
    err, ref_err = ((out - fp32).norm() / fp32.norm()).item(), ((ref - fp32).norm() / fp32.norm()).item()
    assert err < 1.5 * ref_err + 1e-3, (err, ref_err)   # as close to fp32 as the unfused path
    assert ((out - ref).norm() / ref.norm()).item() < 2 * ref_err + 1e-3       # apart by their own rounding
