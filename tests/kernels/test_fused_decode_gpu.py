"""The CUDA backend's fused decode launch (``diffkv_decode_attend``: partial kernel, merge and score update, the row's
last CTA merging) against the two launches it replaces (``diffkv_decode_partial`` + ``diffkv_decode_merge``) and a
float64 reference: outputs, log-sum-exps and every pool byte equal bit for bit, at every CTA count a row, with padding
sequences, empty rows and tiers, bf16/fp16, in a CUDA graph; the rows' counters are zero after every launch.

Run on the device: ``python -m pytest -q -m gpu tests/kernels/test_fused_decode_gpu.py``.
"""
import pytest
import torch
from conftest import capture_cuda_graph

from trtllm_diffkv.config import PRESETS, DiffKVConfig
from trtllm_diffkv.memory import PageFormat

pytestmark = pytest.mark.gpu

CASES = [  # (preset, head_dim, num_heads, num_kv_heads, dtype)
    ("llama3-8b", 128, 32, 8, torch.bfloat16),
    ("diffkv", 64, 9, 3, torch.bfloat16),
    ("k8v4", 128, 8, 1, torch.float16),
    ("default-k8v2", 64, 16, 2, torch.float16),  # group 8; 35-token low pages (odd probability stride)
    ("diffkv", 128, 28, 4, torch.float16),      # group 7
]


def _rows(preset, head_dim, num_heads, num_kv_heads, dtype, seed):
    from support.attention import build_paged_rows

    fmt = PageFormat.for_config(PRESETS[preset] if preset in PRESETS else DiffKVConfig(), head_dim)
    g = torch.Generator().manual_seed(seed)
    num_seqs = 5
    # long and short rows, an empty row, a high-only and a low-only row; sequence 2 is padding (row id -1)
    counts = [(int(torch.randint(0, 900, (1,), generator=g)), int(torch.randint(0, 1400, (1,), generator=g)))
              for _ in range(num_seqs * num_kv_heads)]
    counts[0], counts[1 % len(counts)] = (0, 0), (130, 0)
    counts[-1] = (0, 77)
    rows = build_paged_rows(fmt, counts, device="cuda", seed=seed)
    row_ids = torch.arange(len(counts), dtype=torch.int32, device="cuda").view(num_seqs, num_kv_heads)
    row_ids[2] = -1
    q = torch.randn(num_seqs, num_heads, head_dim, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    return fmt, rows, row_ids, q.to(dtype)


def _kernels(fmt, num_heads, num_kv_heads, dtype, fused, max_pages):
    """A workspace of 16 slots a row and the kernels resolved for it (one compilation per case and variant: a launch
    takes any CTA count up to the capacity)."""
    from trtllm_diffkv.kernels import DecodeWorkspace, cuda_decode

    ws = DecodeWorkspace.allocate(5, num_heads, num_kv_heads, fmt, max_pages, "cuda", num_partitions=8)
    k = cuda_decode.CudaDecodeKernels.resolve(fmt, num_heads // num_kv_heads, ws.part_m.shape[-1],
                                              ws.part_acc.shape[-1], 2 * ws.num_partitions, dtype, True,
                                              torch.device("cuda"), fused=fused)
    return ws, k


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-d{c[1]}-{c[2]}x{c[3]}" for c in CASES])
@pytest.mark.parametrize("slots", [1, 3, 6, 16])
def test_fused_launch_equals_the_two_launches_bit_for_bit(case, slots):
    from trtllm_diffkv.kernels.attn_decode_kernels import LOG2E
    from support.attention import decode_reference, rel_err

    preset, head_dim, num_heads, num_kv_heads, dtype = case
    fmt, rows, row_ids, q = _rows(preset, head_dim, num_heads, num_kv_heads, dtype, seed=slots)
    pages0 = rows.pool.pages().clone()
    got = {}
    for fused in (False, True):
        ws, k = _kernels(fmt, num_heads, num_kv_heads, dtype, fused, rows.page_table.shape[1])
        assert k.fused is fused
        pages = pages0.clone()
        out = torch.full_like(q, float("nan"))
        ws.lse.fill_(float("nan"))
        k.launch(q, pages, rows.page_table, rows.tier_tokens, row_ids, ws, head_dim**-0.5 * LOG2E, out,
                 num_slots=slots)
        torch.cuda.synchronize()
        assert int(ws.row_done.abs().sum()) == 0  # the last CTA of every row set its counter back
        got[fused] = (out, pages, ws.lse.clone())
    (o2, p2, l2), (o1, p1, l1) = got[False], got[True]
    assert torch.equal(o1, o2)
    assert torch.equal(p1, p2)  # scores, and nothing else of the pool moved differently
    assert torch.equal(l1[:, :, :num_heads // num_kv_heads], l2[:, :, :num_heads // num_kv_heads])
    assert not torch.equal(p1, pages0)  # the scores were updated
    assert torch.all(o1[2] == 0)  # the padding sequence: zeros
    ref, _ = decode_reference(q.float(), rows, row_ids.cpu(), head_dim**-0.5)
    keep = torch.ones(q.shape[0], dtype=torch.bool)
    keep[2] = False
    assert rel_err(o1[keep], ref.to(o1.device)[keep]) < (1.5e-2 if dtype == torch.bfloat16 else 5e-3)


def test_fused_launch_replays_from_a_cuda_graph_and_keeps_its_counters_at_zero():
    """Captured once, replayed three times: each replay adds the same score deltas as an eager call on the same pool
    (the counters a launch leaves are the next launch's start), and the output equals the eager one."""
    from trtllm_diffkv.kernels.attn_decode_kernels import LOG2E

    fmt, rows, row_ids, q = _rows("llama3-8b", 128, 32, 8, torch.bfloat16, seed=7)
    ws, k = _kernels(fmt, 32, 8, torch.bfloat16, True, rows.page_table.shape[1])
    scale = 128**-0.5 * LOG2E
    pages = rows.pool.pages()
    out = torch.empty_like(q)
    call = lambda: k.launch(q, pages, rows.page_table, rows.tier_tokens, row_ids, ws, scale, out, num_slots=6)  # noqa: E731
    eager_pages = pages.clone()
    eager_out = torch.empty_like(q)
    for _ in range(4):  # the eager twin of the capture's warm-up call and the three replays
        k.launch(q, eager_pages, rows.page_table, rows.tier_tokens, row_ids, ws, scale, eager_out, num_slots=6)
    graph = capture_cuda_graph(call)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    assert int(ws.row_done.abs().sum()) == 0
    assert torch.equal(out, eager_out)
    assert torch.equal(pages, eager_pages)


def test_a_workspace_without_counters_runs_the_two_launches(monkeypatch):
    """With the fused launch switched on (``FUSED_MERGE``, off by default: measured slower), a view built from bare
    buffers (no ``row_done``) still merges in a second launch, with the same result."""
    from trtllm_diffkv.kernels import DecodeWorkspace, cuda_decode
    from trtllm_diffkv.kernels.decode_attention import DecodeAttention

    monkeypatch.setattr(cuda_decode, "FUSED_MERGE", 1)

    fmt, rows, row_ids, q = _rows("diffkv", 64, 9, 3, torch.bfloat16, seed=3)
    outs = []
    for counters in (True, False):
        ws = DecodeWorkspace.allocate(5, 9, 3, fmt, rows.page_table.shape[1], "cuda")
        if not counters:
            ws.row_done = None
        att = DecodeAttention(fmt, 9, 3, ws, rows.page_table.shape[1], q.dtype, q.device, sm_scale=0.125)
        assert att.use_cuda and att.cuda.fused is counters
        out = torch.full_like(q, float("nan"))
        att(q, rows.pool.pages().clone(), rows.page_table, rows.tier_tokens, row_ids, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
