"""Scored prefill attention (Triton prompt-score kernel, run by the CPU interpreter) against float64.

The reference materializes the causal softmax of every prompt in float64:
score of token t = max over the KV head's query heads of the per-head sum of
the probabilities the last ``min(S, n)`` queries give it (the authors' GQA
rule, ``DiffKV.md`` "Policy details"). The kernel never builds that matrix.
"""
import math
import os

if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton defines the kernels

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4  # noqa: E402

patch_interpreter_for_numpy_2_4()

from trtllm_diffkv.kernels import scored_prefill_attention  # noqa: E402
from support.attention import prefill_reference as reference, rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run(lens, num_heads, num_kv_heads, head_dim, *, dtype=torch.float32, num_scoring=64, seed=0, key_scale=1.0,
        window=None):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    total = int(cu[-1])
    q = torch.randn(total, num_heads, head_dim, generator=g).to(dtype)
    k = (torch.randn(total, num_kv_heads, head_dim, generator=g) * key_scale).to(dtype)
    v = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    out = torch.full_like(q, float("nan")).to(DEVICE)
    sums = torch.full((total, num_kv_heads), float("nan")).to(DEVICE)
    scale = 1 / math.sqrt(head_dim)
    got_out, got_sums = scored_prefill_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu.to(DEVICE),
                                                 sm_scale=scale, num_scoring_queries=num_scoring, out=out,
                                                 score_sums=sums, sliding_window_tokens=window)
    assert got_out is out and got_sums is sums
    ref_out, ref_sums = reference(q, k, v, cu, num_scoring, scale, window)
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}[dtype]
    if total:
        assert rel_err(out, ref_out) < tol
        assert torch.isfinite(sums).all()
        assert torch.allclose(sums.double().cpu(), ref_sums, rtol=10 * tol, atol=10 * tol), \
            float((sums.double().cpu() - ref_sums).abs().max())
    return sums


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (28, 4), (40, 8), (12, 2), (8, 1), (32, 1)])
def test_group_sizes(num_heads, num_kv_heads):
    """Edge case 7 (groups); prompt lengths around the scoring window and key blocks."""
    run([1, 63, 65, 130], num_heads, num_kv_heads, 64)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims(head_dim):
    run([17, 70], 4, 2, head_dim)


@pytest.mark.parametrize("window,head_dim,num_heads", [(5, 64, 4), (70, 64, 8), (40, 256, 4)])
def test_sliding_window(window, head_dim, num_heads):
    """Sliding-window layers (Gemma 3; query i attends keys i - W < j <= i): prompts shorter than, around and
    several times the window, one KV head (MQA, gemma-3-270m's group 4 at head_dim 256); scoring queries reach
    back less than the prompt, so the scores of the tokens before their windows are zero."""
    sums = run([1, 7, 30, 130], num_heads, 1, head_dim, num_scoring=16, window=window)
    if window < 130 - 16:
        assert float(sums[38:38 + 130 - 16 - window].abs().max()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    run([5, 100], 6, 2, 64, dtype=dtype, key_scale=2.0)


def test_scoring_window_sizes_and_empty_prompts():
    """S = 1, S larger than every prompt, and zero-length prompts in the batch."""
    run([0, 9, 0, 40], 4, 1, 64, num_scoring=1)
    sums = run([3, 20], 4, 2, 64, num_scoring=1000)
    # S >= n: every query scores; token 0 is seen by all n queries of each head
    assert float(sums[3:].max()) <= 20 + 1e-4


def test_log_sum_exp_split_over_key_chunks(monkeypatch):
    """The split-K log-sum-exp pass merges several key chunks, empty chunks of short prompts included."""
    import trtllm_diffkv.kernels.prefill_attention as prefill

    monkeypatch.setattr(prefill, "LSE_CHUNK_TOKENS", 32)
    run([150, 7, 64], 4, 2, 64, num_scoring=40, key_scale=3.0)


def test_peaked_attention_scores():
    """Large logits (keys x 8): probabilities near 0 and 1 stay exact."""
    run([90], 8, 2, 64, key_scale=8.0, seed=5)


def test_refusals():
    q = torch.randn(4, 4, 64)
    k = torch.randn(4, 2, 64)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    cases = [
        (q, k, k, cu.long(), {}, "cu_seqlens"),
        (q, torch.randn(4, 3, 64), torch.randn(4, 3, 64), cu, {}, "multiple"),
        (torch.randn(4, 4, 72), torch.randn(4, 2, 72), torch.randn(4, 2, 72), cu, {}, "head_dim"),
        (q, k, k, torch.tensor([0, 5], dtype=torch.int32), {}, "cu_seqlens"),
        (q, k, k, cu, {"num_scoring_queries": 0}, "num_scoring_queries"),
        (q, k.half(), k.half(), cu, {}, "dtype"),
        (q, k, k, cu, {"score_sums": torch.empty(4, 2, dtype=torch.float64)}, "score_sums"),
    ]
    for qq, kk, vv, cc, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            scored_prefill_attention(qq, kk, vv, cc, sm_scale=0.1, **kw)
