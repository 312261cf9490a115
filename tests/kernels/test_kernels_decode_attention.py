"""Paged decode attention (Triton, run by the CPU interpreter) against float64 dense attention.

Pages are built by hand (``tests/support/attention.py``: ``quant.quantize`` into
``KVCachePool.segment`` views, shuffled page ids); the reference is float64
softmax attention over the dequantized stored tokens, and the score deltas
are float64 max-over-group probabilities. Covers every preset tier format,
head dims 64-256, query:KV ratios 1-8 and MQA, fp16/bf16/fp32 queries, edge
cases 5, 6 (a, b, c) and 7, padding sequences and NaN-poisoned outputs.
"""
import os

if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton defines the kernels

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from trtllm_diffkv.config import PRESETS, DiffKVConfig, TierConfig  # noqa: E402
from trtllm_diffkv.memory import PageFormat  # noqa: E402
from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4  # noqa: E402

patch_interpreter_for_numpy_2_4()

from trtllm_diffkv.kernels import DecodeWorkspace, paged_decode_attention  # noqa: E402
from support.attention import build_paged_rows, decode_reference, read_scores, rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
# score deltas: probabilities go through fp16 (relative 2**-11); fp16/bf16 queries add fp16 key rounding
SCORE_TOL = {torch.float32: (2e-3, 1e-6), torch.float16: (1e-2, 2e-4), torch.bfloat16: (1e-2, 2e-4)}


def run_decode(cfg_or_fmt, head_dim, num_heads, num_kv_heads, counts, *, dtype=torch.float32, seed=0,
               num_partitions=None, high_tokens_per_page=8, row_ids=None, q=None, update=None, **build):
    """Build rows, run the kernel on a NaN-poisoned output, check out and score deltas; return (rows, out)."""
    fmt = cfg_or_fmt if isinstance(cfg_or_fmt, PageFormat) else PageFormat.for_config(
        cfg_or_fmt, head_dim, high_tokens_per_page=high_tokens_per_page)
    rows = build_paged_rows(fmt, counts, seed=seed, device=DEVICE, **build)
    if row_ids is None:
        row_ids = torch.arange(len(counts), dtype=torch.int32).view(-1, num_kv_heads)
    row_ids = row_ids.to(DEVICE)
    num_seqs = row_ids.shape[0]
    if q is None:
        q = torch.randn(num_seqs, num_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    q = q.to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    update = fmt.high.score.size_bytes > 0 if update is None else update
    before = [read_scores(rows, r) for r in range(len(counts))]
    ws = DecodeWorkspace.allocate(num_seqs, num_heads, num_kv_heads, fmt, rows.page_table.shape[1], DEVICE,
                                  num_partitions=num_partitions or 1, update_scores=update)
    sm_scale = head_dim**-0.5
    paged_decode_attention(q, rows.pool.pages(), fmt, rows.page_table, rows.tier_tokens, row_ids, out,
                           sm_scale=sm_scale, update_scores=update, workspace=ws)
    ref, deltas = decode_reference(q.float().cpu(), rows, row_ids.cpu(), sm_scale)
    assert torch.isfinite(out).all(), "output not fully written or not finite"
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)
    touched = set()
    for (s, kvh), expect in deltas.items():
        r = int(row_ids[s, kvh])
        touched.add(r)
        got = read_scores(rows, r) - before[r]
        if not update:
            expect = torch.zeros_like(expect)
        rtol, atol = SCORE_TOL[dtype]
        assert torch.allclose(got, expect, rtol=rtol, atol=atol), (r, float((got - expect).abs().max()))
    for r in set(range(len(counts))) - touched:  # rows no sequence reads keep their scores
        assert torch.equal(read_scores(rows, r), before[r])
    return rows, out


@pytest.mark.parametrize("preset", ["diffkv", "k8v4", "fp16", "llama3-8b"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_preset_format(preset, dtype):
    counts = [(20, 41), (9, 0), (0, 30), (33, 7)]
    run_decode(PRESETS[preset], 64, 6, 2, counts, dtype=dtype, num_partitions=2)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims(head_dim):
    """Edge case 7 (head dims): 80 and 96 are padded to 128 and masked."""
    run_decode(DiffKVConfig(), head_dim, 4, 2, [(12, 20), (3, 9)], dtype=torch.float16, high_tokens_per_page=4)


@pytest.mark.parametrize("preset", ["diffkv", "k8v4", "fp16"])
def test_gemma3_270m_shape(preset):
    """gemma-3-270m's attention: head_dim 256, 4 query heads on one KV head (MQA, group 4), bf16 queries (the GPU
    dtype); a sliding layer's row holds only its window, in the high tier (the second sequence)."""
    run_decode(PRESETS[preset], 256, 4, 1, [(12, 20), (16, 0)], dtype=torch.bfloat16, high_tokens_per_page=4,
               num_partitions=2)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (28, 4), (40, 8), (12, 2), (8, 1), (32, 1), (6, 3)])
def test_group_sizes(num_heads, num_kv_heads):
    """Edge case 7 (groups 1, 7, 5, 6, 8, MQA 32, 2): all query heads of a group read the same row."""
    g = torch.Generator().manual_seed(num_heads)
    counts = [(int(torch.randint(0, 20, (1,), generator=g)), int(torch.randint(1, 30, (1,), generator=g)))
              for _ in range(num_kv_heads)]
    run_decode(DiffKVConfig(), 64, num_heads, num_kv_heads, counts, num_partitions=2)


@pytest.mark.parametrize("k_bits,k_groups,v_bits,v_groups", [(4, 1, 2, 1), (2, 4, 2, 2), (8, 2, 8, 4), (4, 4, 4, 1),
                                                             (8, 1, 2, 4)])  # K8V2: a low tier of issue 18
def test_other_tier_formats(k_bits, k_groups, v_bits, v_groups):
    """Any bits/groups combination a TierConfig allows, in the low tier (high K8V8)."""
    cfg = DiffKVConfig(high=TierConfig(8, 8), low=TierConfig(k_bits, v_bits, k_groups, v_groups))
    run_decode(cfg, 64, 4, 1, [(10, 37)], num_partitions=3)


def test_tail_masking_uniform_attention():
    """Edge case 5: q = 0 gives the mean of exactly each head's stored V rows; lengths differ per head."""
    lengths = [1, 15, 16, 17, 255, 256, 257]
    counts = [(n // 3, n - n // 3) for n in lengths] + [(0, 1)]
    fmt = PageFormat.for_config(DiffKVConfig(), 64, high_tokens_per_page=16)
    rows, out = run_decode(fmt, 64, 8, 2, counts, q=torch.zeros(4, 8, 64), num_partitions=3)
    for r, n in enumerate(lengths + [1]):
        s, kvh = divmod(r, 2)
        mean = rows.values[r].mean(0)
        assert torch.allclose(out[s, kvh * 4:(kvh + 1) * 4].double().cpu(), mean.expand(4, -1), atol=1e-5)


def test_extreme_logits_near_minus_6e4():
    """Edge case 6a: every logit near -6e4 gives the ordinary softmax, no sentinel in place of -inf."""
    fmt = PageFormat.for_config(DiffKVConfig(), 64, high_tokens_per_page=8)
    q = torch.full((1, 2, 64), -300.0)
    q[0, 1] = -310.0
    rows, out = run_decode(fmt, 64, 2, 1, [(10, 23)], q=q, dtype=torch.float16, num_partitions=2,
                           key_scale=0.5, key_shift=25.0)
    logits = (q[0].double() @ rows.keys[0].T) * 64**-0.5
    assert float(logits.max()) < -5e4 and float(logits.min()) > -7e4
    assert float(logits.max() - logits.min()) > 10  # the softmax is not uniform


def test_empty_rows_tiers_and_partitions():
    """Edge cases 6b and 6c: zero-token rows give zeros; an empty tier or partition contributes nothing."""
    counts = [(0, 0), (5, 0), (0, 5), (1, 1), (0, 0), (40, 0)]
    rows, out = run_decode(DiffKVConfig(), 64, 6, 2, counts, num_partitions=7)  # most partitions are empty
    assert torch.equal(out[0, :3], torch.zeros(3, 64, dtype=out.dtype, device=out.device))
    assert torch.equal(out[2, :3], torch.zeros(3, 64, dtype=out.dtype, device=out.device))


def test_padding_sequences_write_zeros_and_touch_nothing():
    counts = [(7, 9), (3, 30), (12, 0), (4, 4)]
    row_ids = torch.tensor([[0, 1], [-1, -1], [2, 3]], dtype=torch.int32)
    rows, out = run_decode(DiffKVConfig(), 64, 4, 2, counts, row_ids=row_ids, num_partitions=2)
    assert torch.equal(out[1], torch.zeros(4, 64, dtype=out.dtype, device=out.device))


def test_unread_rows_untouched_and_no_score_update():
    """Rows no sequence reads keep their scores; update_scores=False changes no score."""
    counts = [(7, 9), (3, 30), (12, 0), (4, 4)]
    row_ids = torch.tensor([[3, 1]], dtype=torch.int32)
    run_decode(DiffKVConfig(), 64, 4, 2, counts, row_ids=row_ids)
    run_decode(DiffKVConfig(), 64, 4, 2, counts, row_ids=row_ids, update=False)


def test_long_row_many_partitions_default_layout():
    """Head dim 128 with the production page (32 high / 52 low tokens), split into 4 partitions."""
    fmt = PageFormat.for_config(DiffKVConfig(), 128)
    run_decode(fmt, 128, 8, 2, [(100, 300), (64, 52)], dtype=torch.float16, num_partitions=4)


def test_refusals_before_launch():
    fmt = PageFormat.for_config(DiffKVConfig(), 64)
    rows = build_paged_rows(fmt, [(4, 4)], device=DEVICE)
    args = (rows.pool.pages(), fmt, rows.page_table, rows.tier_tokens)
    ok_ids = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 4, 64, device=DEVICE)
    cases = [
        (q.double(), ok_ids, q.double(), "q must be"),
        (torch.randn(1, 4, 128, device=DEVICE), ok_ids, torch.empty(1, 4, 128, device=DEVICE), "head_dim"),
        (q, ok_ids.long(), torch.empty_like(q), "row_ids"),
        (q, torch.zeros(1, 3, dtype=torch.int32, device=DEVICE), torch.empty_like(q), "multiple"),
        (q, ok_ids, torch.empty(1, 4, 64, dtype=torch.float16, device=DEVICE), "out must be"),
        (torch.randn(1, 65, 64, device=DEVICE), ok_ids, torch.empty(1, 65, 64, device=DEVICE), "ratio"),
    ]
    for qq, ids, out, msg in cases:
        with pytest.raises(ValueError, match=msg):
            paged_decode_attention(qq, *args, ids, out, sm_scale=0.1)
    with pytest.raises(ValueError, match="workspace"):
        ws = DecodeWorkspace.allocate(1, 8, 1, fmt, 1, DEVICE)
        paged_decode_attention(q, *args, ok_ids, torch.empty_like(q), sm_scale=0.1, workspace=ws)
    fp16 = PageFormat.for_config(PRESETS["fp16"], 64)
    rows16 = build_paged_rows(fp16, [(4, 4)], device=DEVICE)
    with pytest.raises(ValueError, match="score segment"):
        paged_decode_attention(q, rows16.pool.pages(), fp16, rows16.page_table, rows16.tier_tokens, ok_ids,
                               torch.empty_like(q), sm_scale=0.1, update_scores=True)


def test_a_resolved_decode_attention_serves_every_batch_it_holds():
    """:class:`DecodeAttention` resolves backend, tier arguments and grids once (the paged cache's per-layer call):
    calls at the workspace's batch and below equal the float64 reference over the kept tokens, score updates
    included, and a batch above its workspace is refused before any launch."""
    from trtllm_diffkv.kernels import DecodeAttention

    fmt = PageFormat.for_config(DiffKVConfig(), 64, high_tokens_per_page=8)
    counts = [(3, 5), (9, 0), (0, 11), (20, 13), (1, 1), (17, 30), (6, 2), (0, 0)]
    rows = build_paged_rows(fmt, counts, seed=3, device=DEVICE)
    ws = DecodeWorkspace.allocate(4, 6, 2, fmt, rows.page_table.shape[1], DEVICE, num_partitions=2)
    attention = DecodeAttention(fmt, 6, 2, ws, rows.page_table.shape[1], torch.float16, DEVICE, sm_scale=0.125)
    for row_ids in (torch.arange(8, dtype=torch.int32).view(4, 2), torch.tensor([[6, 1], [3, 4]], dtype=torch.int32)):
        q = torch.randn(row_ids.shape[0], 6, 64, generator=torch.Generator().manual_seed(int(row_ids.sum())))
        q = q.to(torch.float16).to(DEVICE)
        out = torch.full_like(q, float("nan"))
        before = [read_scores(rows, r) for r in range(len(counts))]
        attention(q, rows.pool.pages(), rows.page_table, rows.tier_tokens, row_ids.to(DEVICE), out)
        ref, deltas = decode_reference(q.float().cpu(), rows, row_ids, 0.125)
        assert rel_err(out, ref) < TOL[torch.float16], rel_err(out, ref)
        for (s, kvh), expect in deltas.items():
            r = int(row_ids[s, kvh])
            got = read_scores(rows, r) - before[r]
            assert torch.allclose(got, expect, rtol=1e-2, atol=2e-4), (r, float((got - expect).abs().max()))
    q = torch.zeros(5, 6, 64, dtype=torch.float16, device=DEVICE)
    out = torch.full_like(q, 7.0)
    with pytest.raises(ValueError, match="5 sequences, the workspace holds 4"):
        attention(q, rows.pool.pages(), rows.page_table, rows.tier_tokens,
                  torch.zeros(5, 2, dtype=torch.int32, device=DEVICE), out)
    assert torch.all(out == 7.0)
