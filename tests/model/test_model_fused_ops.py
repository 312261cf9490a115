"""The fused decoder steps (issue 19): each Triton kernel (under the interpreter on the CPU) against the
unfused PyTorch code it replaces, the concatenated projections' bookkeeping, and a whole model's fused
forward against its unfused forward (itself compared with transformers in test_model_llama.py)."""
import pytest
import torch

from trtllm_diffkv.model import fused
from trtllm_diffkv.model.attention_api import DenseCausalAttention
from trtllm_diffkv.model.rope import apply_rope

pytest.importorskip("triton")


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: |a - b| over one unit in the last place of the model dtype at |b|."""
    eps = torch.finfo(a.dtype).eps
    return (a.double() - b.double()).abs() / (b.double().abs() * eps).clamp_min(torch.finfo(a.dtype).tiny)


# Triton 3.6's interpreter casts fp32 to bf16 by truncation (the GPU rounds to nearest even), so a bf16
# result here may sit an ulp or two (one per rounding) off PyTorch's; tests/model/test_model_fused_gpu.py
# checks bf16 on the GPU, where the kernels round as PyTorch does.
BF16_INTERPRETER_ULPS = 3.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [96, 128])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_matches_torch(dtype, hidden, with_residual):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(5, hidden, generator=g) * 3).to(dtype)
    residual = torch.randn(5, hidden, generator=g).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    out, s = fused.rms_norm(x, weight, 1e-5, residual, use_triton=True)
    ref_s = x + residual if with_residual else x
    ref = fused.rms_norm_reference(ref_s, weight, 1e-5)
    assert _ulps_apart(s, ref_s).max() <= (0.0 if dtype == torch.float32 else 1.0)  # one rounding: fp32 exact
    # fp32: the mean's summation order moves the result by a few ulps at most
    assert _ulps_apart(out, ref).max() <= (4.0 if dtype == torch.float32 else BF16_INTERPRETER_ULPS)
    exact = weight.double() * (ref_s.double() * torch.rsqrt(ref_s.double().pow(2).mean(-1, keepdim=True) + 1e-5))
    assert ((out.double() - exact).norm() / exact.norm()) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_kernel_matches_torch(dtype):
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(3, 2 * 1100, generator=g) * 4).to(dtype)    # 1100: two column blocks, the last partial
    out = fused.silu_mul(gate_up, use_triton=True)
    ref = torch.nn.functional.silu(gate_up[:, :1100]) * gate_up[:, 1100:]
    assert out.shape == (3, 1100) and out.dtype == dtype
    assert _ulps_apart(out, ref).max() <= (4.0 if dtype == torch.float32 else BF16_INTERPRETER_ULPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 64), (6, 2, 80)])
def test_qkv_rope_kernel_matches_apply_rope(dtype, num_heads, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    n = 4
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    angles = torch.rand(n, head_dim // 2, generator=g) * 50
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    q, k, v = fused.qkv_rope(qkv, cos, sin, num_heads, num_kv_heads, head_dim, use_triton=True)
    rq, rk, rv = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    ref_q = apply_rope(rq.reshape(n, num_heads, head_dim), cos, sin)
    ref_k = apply_rope(rk.reshape(n, num_kv_heads, head_dim), cos, sin)
    # One rounding against PyTorch's three; x1 c - x2 s cancels, so the error is bounded in ulps of the
    # terms (|x| <= max |qkv|, |cos|, |sin| <= 1), not of the (maybe tiny) result.
    ulps = 3.0 if dtype == torch.float32 else BF16_INTERPRETER_ULPS + 3.0
    bound = ulps * torch.finfo(dtype).eps * 2 * qkv.float().abs().max()
    assert (q.float() - ref_q.float()).abs().max() <= bound and (k.float() - ref_k.float()).abs().max() <= bound
    x = qkv.double()[:, :(num_heads + num_kv_heads) * head_dim].reshape(n, num_heads + num_kv_heads, head_dim)
    exact = apply_rope(x, cos.double(), sin.double())
    ours, theirs = torch.cat([q, k], dim=1).double(), torch.cat([ref_q, ref_k], dim=1).double()
    if dtype == torch.float32:  # at least as accurate as the three roundings (the interpreter truncates bf16)
        assert (ours - exact).norm() <= (theirs - exact).norm() * 1.05
    assert torch.equal(v, rv.reshape(n, num_kv_heads, head_dim)) and v.is_contiguous()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="rms_norm"):
        fused.rms_norm(torch.ones(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="silu_mul"):
        fused.silu_mul(torch.ones(2, 7))
    with pytest.raises(ValueError, match="qkv_rope"):
        fused.qkv_rope(torch.ones(2, 10), torch.ones(2, 2), torch.ones(2, 2), 2, 1, 2)


def _tiny(**extra):
    from conftest import random_llama

    shape = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, max_position_embeddings=64)
    return random_llama(0, **{**shape, **extra})


def test_fused_projections_are_views_with_hf_names(monkeypatch):
    model = _tiny(qkv_bias=True, architecture="Qwen2ForCausalLM")
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    qkv, gate_up = attn._qkv_weight, mlp._gate_up_weight
    assert torch.equal(qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(attn._qkv_bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    assert torch.equal(gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    assert set(model.state_dict()) == set(model.expected_weight_shapes())
    with torch.no_grad():                                       # an in-place edit reaches the concatenation
        attn.k_proj.weight.mul_(2)
        mlp.up_proj.weight.add_(1)
    assert torch.equal(qkv[64:96], attn.k_proj.weight) and torch.equal(gate_up[96:], mlp.up_proj.weight)
    assert fused.use_fused_kernels(torch.ones(1)) is False      # CPU: the unfused, exact forward
    model = model.to(torch.float64)                             # .to() concatenates again
    attn = model.model.layers[1].self_attn
    assert attn._qkv_weight.dtype == torch.float64 and attn._qkv_weight.data_ptr() == attn.q_proj.weight.data_ptr()
    assert attn._fused(torch.ones(1, dtype=torch.float64)) is False  # still CPU
    monkeypatch.setattr(fused, "use_fused_kernels", lambda x: True)
    assert attn._fused(torch.ones(1))
    attn.v_proj.weight = torch.nn.Parameter(attn.v_proj.weight.clone())   # a replaced parameter: unfused again
    assert not attn._fused(torch.ones(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_matches_unfused_forward(monkeypatch, dtype):
    """The whole fused path (concatenated products, the three kernels, the carried residual) against the
    unfused forward, which test_model_llama.py compares with transformers."""
    model = _tiny(qkv_bias=True, architecture="Qwen2ForCausalLM").to(dtype)
    ids, positions = torch.tensor([3, 17, 5, 60, 22, 9]), torch.arange(6)
    with torch.no_grad():
        ref = model(ids, positions, DenseCausalAttention(), logits_indices=torch.tensor([2, 5]))
        monkeypatch.setattr(fused, "use_fused_kernels", lambda x: True)   # CPU tensors through the kernels
        assert model.model.layers[0].self_attn._fused(torch.ones(1))
        out = model(ids, positions, DenseCausalAttention(), logits_indices=torch.tensor([2, 5]))
    rel = (out - ref).norm() / ref.norm()
    assert out.shape == ref.shape == (2, 64)
    assert rel < (1e-5 if dtype == torch.float32 else 2e-2), rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads", [(64, (9, 3)), (80, (4, 4)), (128, (28, 4)), (64, (32, 1))])
def test_rotate_heads_kernel_matches_the_einsum(dtype, head_dim, heads):
    """The key-rotation kernel (the group's queries and the key as rows of one fp32 product per token and KV head)
    against the einsum it replaces: each head rotated by its own KV head's matrix (a head mapped to the wrong KV
    head, or the key written into a query row, is off by O(1)); fp32 to summation order, bf16 to the
    interpreter's roundings."""
    from trtllm_diffkv.model.rotation import key_rotation_matrices

    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(head_dim + num_heads)
    q = torch.randn(5, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(5, num_kv_heads, head_dim, generator=g).to(dtype)
    r = key_rotation_matrices(1, num_kv_heads, head_dim, seed=2)[0]
    want_q, want_k = fused.rotate_heads(q, k, r, use_triton=False)
    got_q, got_k = fused.rotate_heads(q, k, r, use_triton=True)
    assert got_q.shape == q.shape and got_k.shape == k.shape and got_q.dtype == dtype
    exact_q = torch.einsum("nhd,hde->nhe", q.double(), r.double().repeat_interleave(num_heads // num_kv_heads, 0))
    exact_k = torch.einsum("nhd,hde->nhe", k.double(), r.double())
    for got, want, exact in ((got_q, want_q, exact_q), (got_k, want_k, exact_k)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert _ulps_apart(got, want).max() <= BF16_INTERPRETER_ULPS + 1
        assert float((got.double() - exact).abs().max()) < (1e-5 if dtype == torch.float32 else 5e-2)
    empty = fused.rotate_heads(q[:0], k[:0], r, use_triton=True)
    assert empty[0].shape == (0, num_heads, head_dim)
    with pytest.raises(ValueError, match="rotate_heads"):
        fused.rotate_heads(q, k[:, :1] if num_kv_heads > 1 else k[:, :, :8], r, use_triton=True)
