"""Attention kernels on the GPU against float64 references: real shapes, fresh random inputs, fp16/bf16.

Run on the device: ``python -m pytest -q -m gpu tests/kernels/test_attention_gpu.py``.
"""
import math

import pytest
import torch
from conftest import capture_cuda_graph

from trtllm_diffkv.config import PRESETS, DiffKVConfig, TierConfig
from trtllm_diffkv.memory import PageFormat

pytestmark = pytest.mark.gpu

FORMATS = {
    "default": DiffKVConfig(),
    "k8v4": PRESETS["k8v4"],
    "k8v8": PRESETS["k8v8"],  # 8-bit values in both tiers: the uniform INT8 row of the quality tables
    "fp16": PRESETS["fp16"],
    "k4v2-1group": DiffKVConfig(low=TierConfig(4, 2, 1, 1)),
    "default-k8v2": PRESETS["default-k8v2"],  # 35-token low pages: an odd probability stride (CUDA merge)
}


def _decode_check(cfg, head_dim, num_heads, num_kv_heads, dtype, counts, seed, num_partitions=None, backend=None):
    from trtllm_diffkv.kernels import DecodeWorkspace, paged_decode_attention
    from support.attention import build_paged_rows, decode_reference, read_scores, rel_err

    fmt = PageFormat.for_config(cfg, head_dim)
    rows = build_paged_rows(fmt, counts, device="cuda", seed=seed)
    num_seqs = len(counts) // num_kv_heads
    row_ids = torch.arange(len(counts), dtype=torch.int32, device="cuda").view(num_seqs, num_kv_heads)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(num_seqs, num_heads, head_dim, device="cuda", generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    update = cfg.compress
    before = [read_scores(rows, r) for r in range(len(counts))] if update else None
    ws = DecodeWorkspace.allocate(num_seqs, num_heads, num_kv_heads, fmt, rows.page_table.shape[1], "cuda",
                                  num_partitions=num_partitions, update_scores=update)
    sm_scale = head_dim**-0.5
    paged_decode_attention(q, rows.pool.pages(), fmt, rows.page_table, rows.tier_tokens, row_ids, out,
                           sm_scale=sm_scale, update_scores=update, workspace=ws, backend=backend)
    ref, deltas = decode_reference(q.float(), rows, row_ids.cpu(), sm_scale)
    err = rel_err(out, ref)
    assert err < (1.5e-2 if dtype == torch.bfloat16 else 5e-3), err
    if update:
        for (s, kvh), dl in deltas.items():
            r = int(row_ids[s, kvh])
            got = read_scores(rows, r) - before[r]
            assert torch.allclose(got, dl, rtol=2e-2, atol=2e-4), (r, float((got - dl).abs().max()))
    return rows, out


BACKENDS = ["auto", "triton"]  # auto: the CUDA C++ partial kernel where it covers the case (kernels/cuda_decode.py)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (28, 4), (40, 8), (12, 2), (8, 1), (32, 1), (9, 3), (21, 3)])
def test_decode_head_dims_and_groups(head_dim, heads, backend):
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(head_dim * 100 + num_heads)
    rows = 2 * num_kv_heads if num_kv_heads <= 4 else num_kv_heads
    counts = [(int(torch.randint(0, 700, (1,), generator=g)), int(torch.randint(0, 1500, (1,), generator=g)))
              for _ in range(rows)]
    dtype = torch.float16 if head_dim % 64 == 0 else torch.bfloat16
    _decode_check(DiffKVConfig(), head_dim, num_heads, num_kv_heads, dtype, counts, seed=head_dim, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt_name", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_formats_long_rows(fmt_name, dtype, backend):
    """4096-8192-token rows, split into many partitions, every preset's tier formats."""
    counts = [(900, 3196), (4096, 0), (0, 8192), (1, 1), (0, 0), (2048, 2048), (17, 5000), (3000, 33)]
    _decode_check(FORMATS[fmt_name], 128, 16, 2, dtype, counts, seed=3, backend=backend)
    _decode_check(FORMATS[fmt_name], 128, 16, 2, dtype, counts, seed=4, num_partitions=37, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["tail-masking", "extreme-logits"])
def test_decode_edge_cases_5_and_6a_fp16(case, backend):
    """Edge case 5 (q = 0: the mean of exactly each head's stored V rows, lengths around 16) and 6a (every
    logit near -6e4: the ordinary softmax, no sentinel) with fp16 queries, which the CUDA kernel takes."""
    from trtllm_diffkv.kernels import DecodeWorkspace, paged_decode_attention
    from support.attention import build_paged_rows, decode_reference, rel_err

    fmt = PageFormat.for_config(DiffKVConfig(), 64, high_tokens_per_page=16)
    if case == "tail-masking":
        lengths = [1, 15, 16, 17, 255, 256, 257, 1]
        rows = build_paged_rows(fmt, [(n // 3, n - n // 3) for n in lengths], device="cuda", seed=5)
        q = torch.zeros(4, 8, 64, device="cuda", dtype=torch.float16)
    else:
        rows = build_paged_rows(fmt, [(10, 23), (40, 70)], device="cuda", seed=6, key_scale=0.5, key_shift=25.0)
        q = torch.full((1, 4, 64), -300.0, device="cuda")
        q[0, 1::2] = -310.0
        q = q.to(torch.float16)
    num_seqs, num_heads = q.shape[:2]
    num_kv_heads = rows.page_table.shape[0] // num_seqs
    row_ids = torch.arange(rows.page_table.shape[0], dtype=torch.int32, device="cuda").view(num_seqs, num_kv_heads)
    out = torch.full_like(q, float("nan"))
    ws = DecodeWorkspace.allocate(num_seqs, num_heads, num_kv_heads, fmt, rows.page_table.shape[1], "cuda",
                                  num_partitions=3)
    paged_decode_attention(q, rows.pool.pages(), fmt, rows.page_table, rows.tier_tokens, row_ids, out,
                           sm_scale=64**-0.5, workspace=ws, backend=backend)
    ref, _ = decode_reference(q.float().cpu(), rows, row_ids.cpu(), 64**-0.5)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 5e-3, rel_err(out, ref)
    if case == "tail-masking":
        for r in range(rows.page_table.shape[0]):
            s, kvh = divmod(r, num_kv_heads)
            group = num_heads // num_kv_heads
            mean = rows.values[r].mean(0).to(out.device)
            assert torch.allclose(out[s, kvh * group:(kvh + 1) * group].double(), mean.expand(group, -1), atol=5e-3)


def test_cuda_kernel_is_the_default_where_it_applies():
    """On the device (CuPy present) auto picks the CUDA partial kernel for the presets' d64/d128 formats."""
    from trtllm_diffkv.kernels.cuda_decode import resolve_backend, runtime_reason

    assert runtime_reason() is None, runtime_reason()
    q = torch.zeros(1, 8, 128, device="cuda", dtype=torch.float16)
    for cfg in (DiffKVConfig(), PRESETS["k8v4"], DiffKVConfig(low=TierConfig(4, 2, 1, 1))):
        assert resolve_backend(None, PageFormat.for_config(cfg, 128), 8, 2, q) == "cuda"
    assert resolve_backend(None, PageFormat.for_config(PRESETS["fp16"], 128), 8, 2, q) == "triton"


@pytest.mark.parametrize("head_dim,heads", [(128, (32, 8)), (128, (28, 4)), (64, (9, 3)), (64, (8, 1))])
def test_cuda_and_triton_partial_kernels_agree(head_dim, heads):
    """Both backends on the same pages: outputs and score updates agree to fp16 rounding, padding rows untouched."""
    from trtllm_diffkv.kernels import DecodeWorkspace, paged_decode_attention
    from support.attention import build_paged_rows, read_scores

    num_heads, num_kv_heads = heads
    fmt = PageFormat.for_config(DiffKVConfig(), head_dim)
    counts = [(1, 0), (0, 1), (31, 0), (32, 52), (33, 53), (700, 0), (0, 900), (64, 2000), (0, 0), (1500, 47)]
    counts = (counts * num_kv_heads)[: 3 * num_kv_heads]
    num_seqs = len(counts) // num_kv_heads + 1  # + one padding sequence
    ids = list(range(len(counts))) + [-1] * num_kv_heads
    row_ids = torch.tensor(ids, dtype=torch.int32, device="cuda").view(num_seqs, num_kv_heads)
    q = torch.randn(num_seqs, num_heads, head_dim, device="cuda", dtype=torch.float16)
    results = {}
    for backend in ("cuda", "triton"):
        rows = build_paged_rows(fmt, counts, device="cuda", seed=11)
        before = [read_scores(rows, r) for r in range(len(counts))]
        out = torch.full_like(q, float("nan"))
        ws = DecodeWorkspace.allocate(num_seqs, num_heads, num_kv_heads, fmt, rows.page_table.shape[1], "cuda")
        paged_decode_attention(q, rows.pool.pages(), fmt, rows.page_table, rows.tier_tokens, row_ids, out,
                               sm_scale=head_dim**-0.5, workspace=ws, backend=backend)
        deltas = [read_scores(rows, r) - before[r] for r in range(len(counts))]
        results[backend] = (out, deltas)
    (oc, dc), (ot, dt) = results["cuda"], results["triton"]
    assert torch.isfinite(oc).all()
    assert torch.equal(oc[-1], torch.zeros_like(oc[-1]))  # the padding sequence
    assert torch.allclose(oc.float(), ot.float(), rtol=1e-2, atol=2e-3), float((oc.float() - ot.float()).abs().max())
    for a, b in zip(dc, dt):
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-4), float((a - b).abs().max())


@pytest.mark.parametrize("head_dim,heads,num_partitions,high_tokens_per_page", [
    (128, (32, 8), 1, 32), (128, (28, 4), 3, 32), (64, (9, 3), 2, 32), (64, (8, 1), 5, 32), (64, (8, 1), 1, 32),
    (128, (32, 8), 1, 64), (64, (9, 3), 2, 64)])
def test_staged_partial_kernel_equals_the_register_path(head_dim, heads, num_partitions, high_tokens_per_page):
    """The page ring (``STAGES`` 2 and 3: ``cp.async`` into shared memory) runs the register path's arithmetic on the
    same bytes: its partial states, stored probabilities, merged outputs and score updates equal ``STAGES=0``'s to
    rounding (not bit for bit: ptxas contracts the two compilations' multiply-adds differently; seen on the H200,
    2026-12-02: 1 fp16 ulp in outputs, 1.3e-4 of the largest accumulator), over rows of 0, 1 and many pages, tier
    switches inside a warp's pages, and a padding sequence (outputs exactly 0). Slots neither path writes keep
    their NaN fill in both. Rows of 10k-12k tokens in one partition give a warp 58-78 pages of a tier (its page
    ids are read 32 at a time); 64-token high pages (105 / 92 low tokens a page) change every page constant,
    and the register path's outputs there are checked against the Triton kernel's too."""
    from trtllm_diffkv.kernels import DecodeWorkspace, cuda_decode, paged_decode_attention
    from trtllm_diffkv.kernels.attn_decode_kernels import LOG2E
    from support.attention import build_paged_rows, read_scores

    num_heads, num_kv_heads = heads
    fmt = PageFormat.for_config(DiffKVConfig(), head_dim, high_tokens_per_page=high_tokens_per_page)
    counts = [(10000, 0), (0, 12000), (1, 0), (0, 1), (31, 0), (32, 52), (33, 53), (700, 0), (0, 900), (64, 2000),
              (0, 0), (1500, 47), (97, 157), (5, 3), (4200, 6100)]
    counts = (counts * num_kv_heads)[: max(4 * num_kv_heads, len(counts))]
    num_seqs = len(counts) // num_kv_heads + 1
    row_ids = torch.tensor(list(range(len(counts))) + [-1] * num_kv_heads, dtype=torch.int32,
                           device="cuda").view(num_seqs, num_kv_heads)
    q = torch.randn(num_seqs, num_heads, head_dim, device="cuda", dtype=torch.float16)
    rows = build_paged_rows(fmt, counts, device="cuda", seed=5)
    pages0 = rows.pool.pages().clone()
    before = torch.cat([read_scores(rows, r) for r in range(len(counts))])
    got = {}
    for stages in (0, 2, 3):
        ws = DecodeWorkspace.allocate(num_seqs, num_heads, num_kv_heads, fmt, rows.page_table.shape[1], "cuda",
                                      num_partitions=num_partitions)
        for t in (ws.part_m, ws.part_l, ws.part_acc, ws.page_max):
            t.fill_(float("nan"))
        ws.page_probs.view(torch.int16).fill_(0x7E00)  # fp16 NaN bits: slots nobody writes stay equal, written ones must match
        out = torch.full_like(q, float("nan"))
        rows.pool.pages().copy_(pages0)
        cuda_decode.launch_partial(q, rows.pool.pages(), fmt, rows.page_table, rows.tier_tokens, row_ids, ws,
                                   head_dim**-0.5 * LOG2E, True, None, stages)(out)
        deltas = torch.cat([read_scores(rows, r) for r in range(len(counts))]) - before
        assert deltas.abs().max() > 0  # the update ran
        got[stages] = [out, ws.part_m, ws.part_l, ws.part_acc, ws.page_probs, ws.page_max, deltas]
    for stages in (2, 3):
        # page_probs / page_max are relative to a warp's running max, and a tier switch hands the pages to the
        # warps differently in the two loops; their product, the score update, is compared instead
        for name, a, b in zip(("out", "part_m", "part_l", "part_acc", "scores"),
                              [got[0][i] for i in (0, 1, 2, 3, 6)], [got[stages][i] for i in (0, 1, 2, 3, 6)]):
            assert torch.equal(a.isnan(), b.isnan()), (stages, name)
            fa, fb = a.float().nan_to_num(), b.float().nan_to_num()
            # fp16 values: 1 ulp; the running max and sum: fp32 rounding; the accumulated values and score updates
            # take the fp16-rounded probabilities, whose roundings a last-bit logit change can flip
            tol = {"out": 2e-3, "page_probs": 2e-3, "part_acc": 2e-3, "scores": 2e-3}.get(name, 1e-5)
            err = float((fa - fb).abs().max() / fa.abs().max().clamp_min(1e-30))
            assert err <= tol, (stages, name, err)
    assert torch.equal(got[2][0][-1], torch.zeros_like(got[2][0][-1]))
    out_triton = torch.full_like(q, float("nan"))
    rows.pool.pages().copy_(pages0)
    ws = DecodeWorkspace.allocate(num_seqs, num_heads, num_kv_heads, fmt, rows.page_table.shape[1], "cuda")
    paged_decode_attention(q, rows.pool.pages(), fmt, rows.page_table, rows.tier_tokens, row_ids, out_triton,
                           sm_scale=head_dim**-0.5, workspace=ws, backend="triton")
    err = float((got[0][0].float() - out_triton.float()).abs().max())
    assert torch.allclose(got[0][0].float(), out_triton.float(), rtol=1e-2, atol=2e-3), err


@pytest.mark.parametrize("preset,head_dim,group", [("default-k8v2", 64, 8), ("diffkv", 64, 3), ("llama3-8b", 128, 4)])
def test_the_ring_runs_a_kernel_without_local_memory(preset, head_dim, group):
    """CuPy's real function attributes drive the step-down (``_spill_free_kernel``): the kernel it returns uses at
    most ``LOCAL_BYTES_TOLERATED`` bytes of local memory (spills), or sits at the register path's cap; the default
    model's and Llama's shapes keep their preferred caps (6 and 4 CTAs a multiprocessor; NVRTC on the H200: no
    local memory at head_dim 64 group 3, 8 bytes for Llama's)."""
    from trtllm_diffkv.config import PRESETS
    from trtllm_diffkv.kernels import cuda_decode as cd

    fmt = PageFormat.for_config(PRESETS[preset], head_dim)
    device = torch.cuda.current_device()
    defines = cd.compile_defines(fmt, group, 16, head_dim, max(fmt.high_tokens_per_page, fmt.low_tokens_per_page),
                                 True, shared_limits=cd.device_shared_limits(device))
    assert defines["STAGES"] == cd.STAGES
    major, minor = torch.cuda.get_device_capability()
    partial, _, mb = cd._spill_free_kernel(tuple(sorted(defines.items())), f"sm_{major}{minor}",
                                           cd.partial_shared_bytes(fmt, defines["STAGES"]), device)
    assert partial.local_size_bytes <= cd.LOCAL_BYTES_TOLERATED or mb == cd.register_min_blocks(head_dim), (
        mb, partial.local_size_bytes)
    if preset != "default-k8v2":
        assert mb == defines["MIN_BLOCKS"], mb
    print(preset, head_dim, group, "min_blocks", mb, "local bytes", partial.local_size_bytes, "regs", partial.num_regs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_cuda_graph_replay_matches_eager(backend):
    """The call is graph-capturable with a preallocated workspace; replays give the eager result."""
    from trtllm_diffkv.kernels import DecodeWorkspace, paged_decode_attention
    from support.attention import build_paged_rows

    fmt = PageFormat.for_config(DiffKVConfig(), 128)
    rows = build_paged_rows(fmt, [(500, 1500)] * 8, device="cuda")
    row_ids = torch.arange(8, dtype=torch.int32, device="cuda").view(4, 2)
    q = torch.randn(4, 8, 128, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    ws = DecodeWorkspace.allocate(4, 8, 2, fmt, rows.page_table.shape[1], "cuda")
    call = lambda: paged_decode_attention(q, rows.pool.pages(), fmt, rows.page_table, rows.tier_tokens, row_ids,  # noqa: E731
                                          out, sm_scale=0.1, update_scores=False, workspace=ws, backend=backend)
    call()
    eager = out.clone()
    graph = capture_cuda_graph(call)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((28, 4), 128), ((9, 3), 64), ((40, 8), 80),
                                            ((12, 2), 96), ((8, 1), 256)])
def test_scored_prefill_against_float64(dtype, heads, head_dim):
    from trtllm_diffkv.kernels import scored_prefill_attention
    from support.attention import prefill_reference, rel_err

    num_heads, num_kv_heads = heads
    lens = [1, 63, 64, 65, 700, 1031]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    q = torch.randn(total, num_heads, head_dim, device="cuda").to(dtype)
    k = (torch.randn(total, num_kv_heads, head_dim, device="cuda") * 2).to(dtype)
    v = torch.randn(total, num_kv_heads, head_dim, device="cuda").to(dtype)
    out = torch.full_like(q, float("nan"))
    sums = torch.full((total, num_kv_heads), float("nan"), device="cuda")
    scale = 1 / math.sqrt(head_dim)
    scored_prefill_attention(q, k, v, cu, sm_scale=scale, out=out, score_sums=sums)
    ref = prefill_reference(q, k, v, cu, 64, scale)[1]
    assert rel_err(sums, ref) < 1e-2
    assert torch.allclose(sums.double().cpu(), ref, rtol=3e-2, atol=3e-3)
    group = num_heads // num_kv_heads
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        o = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].double().transpose(0, 1), k[a:b].double().repeat_interleave(group, 1).transpose(0, 1),
            v[a:b].double().repeat_interleave(group, 1).transpose(0, 1), is_causal=True, scale=scale)
        assert rel_err(out[a:b], o.transpose(0, 1)) < 1e-2
