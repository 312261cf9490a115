"""AOT cubins launched through the CUDA driver (CuPy ``RawModule``) with the manifest's parameters, and their
TensorRT-convention wrappers (PTX and cubin, launched with TensorRT's parameter list: :data:`MODES`), give the
Triton JIT path's outputs bit for bit (write, read, paged decode attention partial + merge + score update,
prompt-score kernels, page-manager decode update, the decode plan's decision + locate kernels).

How: each launcher (``write_tokens``, ``paged_decode_attention``, ``scored_prefill_attention``,
``TritonPageManager.append_decode``, ``decision_kernel.decide_rows`` / ``locate_rows``) is called once under :class:`trtllm_diffkv.export.launches.Recorder`
(records, launches nothing) to get the real arguments; the launch must match a manifest entry exactly
(signature, constexprs, options, and the JIT's divisibility specialization: this checks the CUDA-only launch
choices and the specialization the manifest states); the
cubin is launched with those arguments in the manifest's parameter order, grid from the manifest's
formula, ``num_warps * 32`` threads, its shared memory, null scratch pointers. Then the launcher runs
normally (JIT) on clones of the inputs and every output buffer is compared bytewise.
Run on the device: ``python3 -m pytest -q -m gpu tests/export/test_aot_gpu.py``.
"""
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy") if torch.cuda.is_available() else None

from trtllm_diffkv.export import aot, launches  # noqa: E402
from trtllm_diffkv.export.fields import EngineShape  # noqa: E402
from trtllm_diffkv.config import get_preset  # noqa: E402

SHAPE = dict(num_layers=2, num_heads=16, num_kv_heads=4, head_dim=128, dtype="float16", max_batch_size=4,
             max_seq_len=300)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    major, minor = torch.cuda.get_device_capability()
    cc = 90 if major >= 9 else 80
    shape = EngineShape(kv_config=get_preset("diffkv"), **SHAPE)
    out = tmp_path_factory.mktemp("aot_gpu")
    manifest = aot.build_kernels(shape, out, targets=(cc,))
    return shape, out, manifest, cc


def _entry(manifest, launch):
    signature, constexprs, _, options = launches.launch_signature(launch)
    name = getattr(launch[0], "fn", launch[0]).__name__
    divisible = [n for n, v in launches.jit_specialization(launch).items() if v == "D"]  # the JIT's tt.divisibility
    found = [e for e in manifest["kernels"] if e["kernel"].endswith(":" + name) and e["signature"] == signature
             and e["constexprs"] == constexprs and e["options"] == options and e["divisible"] == divisible]
    assert len(found) == 1, f"{name}: the JIT launch matches {len(found)} manifest entries " \
                            f"(constexprs {constexprs}, options {options}, divisible {divisible})"
    return found[0]


MODES = ("manifest", "trt_ptx", "trt_cubin")
"""How each recorded launch is replayed: the manifest's cubin with the kernel's own parameters (+ the two null
scratch pointers), or its TensorRT-convention wrapper (``export/trt_abi.py``: inputs, int32 extra args, outputs, and
nothing else), from the PTX (loaded and compiled by the CUDA driver: what TensorRT receives from ``aot_impl``) or from
the cubin assembled from that PTX."""
_MODE = ["manifest"]


@pytest.fixture(params=MODES, autouse=True)
def launch_mode(request):
    """Every test runs once per :data:`MODES`."""
    _MODE[0] = request.param
    yield request.param
    _MODE[0] = "manifest"


def _trt_values(manifest, cc, entry, bound):
    """(compiled wrapper, parameter values in TensorRT's order) of a launch: the wrapper of the entry as its launcher
    binds it; each input the buffer of its pointer parameters (one buffer: the pool's dtype views), the extras as
    int32 (fp32 as bits), the outputs = the inputs again (aliased)."""
    from trtllm_diffkv.export import trt_abi

    abi = trt_abi.from_launcher(entry)
    data = next(k for k in manifest["trt_abi"] if k["name"] == abi.name)  # StopIteration: not compiled
    c = data["compiled"][f"sm_{cc}"]
    inputs = [None] * len(abi.input_dtypes)
    for p in abi.pointers:
        j = abi.input_of[p]
        if inputs[j] is None:
            inputs[j] = bound[p]
        assert bound[p].data_ptr() == inputs[j].data_ptr(), f"{entry['name']}: {p} is not input {j}'s buffer"
    ptrs = [np.uint64(t.data_ptr()) for t in inputs]
    values = ptrs + [np.int32(trt_abi.scalar_bits(bound[p], abi.signature[p])) for p in abi.extras] + ptrs
    assert c["params"] == [".u64"] * len(ptrs) + [".u32"] * len(abi.extras) + [".u64"] * len(ptrs)
    return c, values


def _launch_aot(out, manifest, cc, launch):
    entry = _entry(manifest, launch)
    c = entry["compiled"][f"sm_{cc}"]
    assert c["global_scratch_bytes"] == 0 and c["profile_scratch_bytes"] == 0
    kernel, grid, args, kwargs = launch
    names = [n for n, _, _ in launches.kernel_parameters(kernel)]
    bound = {**dict(zip(names, args)), **kwargs}
    if _MODE[0] == "manifest":
        values = []
        for name in entry["params"]:
            t, v = entry["signature"][name], bound[name]
            values.append(np.uint64(v.data_ptr()) if t.startswith("*") else np.float32(v) if t == "fp32" else
                          np.int64(v) if t == "i64" else np.int32(v))
        values += [np.uint64(0)] * c["extra_params"]
        path = out / c["cubin"]
    else:
        c, values = _trt_values(manifest, cc, entry, bound)
        path = out / c["ptx" if _MODE[0] == "trt_ptx" else "cubin"]
    fn = cupy.RawModule(path=str(path)).get_function(c["kernel_name"])
    if c["shared_bytes"] > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = c["shared_bytes"]
    fn(tuple(grid) + (1,) * (3 - len(grid)), (32 * c["num_warps"], 1, 1), tuple(values), shared_mem=c["shared_bytes"])


def _aot_vs_jit(built, modules, run, buffers):
    """Record ``run(*buffers)``, launch the cubins on ``buffers``, rerun JIT on clones; compare bytewise."""
    _, out, manifest, cc = built
    clones = [b.clone() for b in buffers]
    with launches.Recorder(modules) as rec:
        run(*buffers)
    assert rec.launches
    for launch in rec.launches:
        _launch_aot(out, manifest, cc, launch)
    run(*clones)
    torch.cuda.synchronize()
    for a, b in zip(buffers, clones):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return rec.launches


def _random_pool(shape, rows, gen):
    """A pool with rows of random tokens in both tiers (JIT writes), its page table and tier counts."""
    from trtllm_diffkv.kernels import quant_write as qw

    fmt, R, D = shape.page_format, shape.max_pages_per_row, shape.head_dim
    table = torch.full((rows, R), -1, dtype=torch.int32, device="cuda")
    tokens = torch.zeros(rows, 2, dtype=torch.int32, device="cuda")
    pages = torch.zeros(rows * R, fmt.page_size_bytes, dtype=torch.uint8, device="cuda")
    nxt = 0
    for r in range(rows):
        for tier, col in (("high", 0), ("low", 1)):
            n = int(torch.randint(1, 90, (1,), generator=gen))
            per = fmt.tier(tier).tokens_per_page
            ids = torch.arange(nxt, nxt + -(-n // per), dtype=torch.int32)
            nxt += ids.numel()
            pos = torch.arange(ids.numel()) if tier == "high" else R - 1 - torch.arange(ids.numel())
            table[r, pos.cuda()] = ids.cuda()
            tokens[r, col] = n
            idx = torch.arange(n)
            k = torch.randn(n, D, generator=gen).half().cuda()
            qw.write_tokens(pages, fmt, tier, ids[idx // per].cuda(), (idx % per).int().cuda(), k, k * 0.5,
                            scores=torch.rand(n, generator=gen).cuda(), positions=idx.int().cuda())
    return pages, table, tokens


def test_write_and_read_kernels_bit_exact(built):
    from trtllm_diffkv.kernels import quant_write as qw

    shape = built[0]
    fmt, D, n = shape.page_format, shape.head_dim, 37
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(n, D, generator=gen) * 3).half().cuda()
    v = torch.randn(n, D, generator=gen).half().cuda()
    page = torch.randint(0, 8, (n,), generator=gen, dtype=torch.int32).cuda()
    page[::7] = -1  # skipped rows
    slot = torch.randint(0, fmt.low_tokens_per_page, (n,), generator=gen, dtype=torch.int32).cuda()
    offsets = torch.randn(5, D, generator=gen).half().cuda()
    rows = torch.randint(0, 5, (n,), generator=gen, dtype=torch.int32).cuda()
    err_idx = torch.zeros(n, dtype=torch.int32, device="cuda")
    scores, positions = torch.rand(n, generator=gen).cuda(), torch.arange(n, dtype=torch.int32, device="cuda")
    for tier in ("high", "low"):
        sl = slot % fmt.tier(tier).tokens_per_page
        _aot_vs_jit(built, [(qw, "_write_tokens_kernel")],
                    lambda pool, flags: qw.write_tokens(pool, fmt, tier, page, sl, k, v, key_offsets=offsets,
                                                        offset_rows=rows, scores=scores, positions=positions,
                                                        error_flags=flags, error_index=err_idx),
                    [torch.zeros(8, fmt.page_size_bytes, dtype=torch.uint8, device="cuda"),
                     torch.zeros(1, dtype=torch.int32, device="cuda")])
    pool = torch.randint(0, 255, (8, fmt.page_size_bytes), generator=gen, dtype=torch.uint8).cuda()
    pool.view(torch.float16)[pool.view(torch.float16).isnan() | pool.view(torch.float16).isinf()] = 0
    _aot_vs_jit(built, [(qw, "_read_tokens_kernel")],
                lambda ko, vo, so, po: qw.read_tokens(pool, fmt, "high", page, slot % fmt.high_tokens_per_page,
                                                      ko, vo, so, po),
                [torch.zeros(n, D, device="cuda"), torch.zeros(n, D, device="cuda"), torch.zeros(n, device="cuda"),
                 torch.zeros(n, dtype=torch.int32, device="cuda")])


def test_decode_attention_partial_merge_score_bit_exact(built):
    from trtllm_diffkv.kernels import decode_attention as da

    shape, _, manifest, _ = built
    gen = torch.Generator().manual_seed(1)
    B, H = shape.max_batch_size, shape.num_kv_heads
    rows = B * H
    pages, table, tokens = _random_pool(shape, rows, gen)
    q = torch.randn(B, shape.num_heads, shape.head_dim, generator=gen).half().cuda()
    row_ids = torch.arange(rows, dtype=torch.int32, device="cuda").reshape(B, H)
    row_ids[1, 2] = -1  # a padding row
    nparts = next(e for e in manifest["kernels"] if e["op"] == "decode_attention")["sizes"]["num_partitions"]
    ws = da.DecodeWorkspace.allocate(B, shape.num_heads, H, shape.page_format, shape.max_pages_per_row, "cuda",
                                     num_partitions=nparts)
    launches = _aot_vs_jit(
        built, [(da, "_decode_partial_kernel"), (da, "_decode_merge_kernel"), (da, "_decode_score_kernel")],
        lambda out, pool: da.paged_decode_attention(q, pool, shape.page_format, table, tokens, row_ids, out,
                                                    sm_scale=shape.head_dim ** -0.5, workspace=ws,
                                                    backend="triton"),  # the AOT set holds the Triton kernels
        [torch.zeros_like(q), pages])  # the output and the pool (every token's score updated in place)
    assert len(launches) == 3


def test_prompt_score_kernels_bit_exact(built):
    from trtllm_diffkv.kernels import prefill_attention as pa

    shape = built[0]
    gen = torch.Generator().manual_seed(2)
    lens = [200, 37, 1]
    T = sum(lens)
    q = torch.randn(T, shape.num_heads, shape.head_dim, generator=gen).half().cuda()
    k = torch.randn(T, shape.num_kv_heads, shape.head_dim, generator=gen).half().cuda()
    cu = torch.tensor([0, 200, 237, 238], dtype=torch.int32)
    _aot_vs_jit(built, [(pa, "_prompt_lse_kernel"), (pa, "_prompt_lse_merge_kernel"), (pa, "_prompt_score_kernel")],
                lambda out, sums: pa.scored_prefill_attention(q, k, k, cu, sm_scale=shape.head_dim ** -0.5,
                                                              num_scoring_queries=64, out=out, score_sums=sums),
                [torch.zeros_like(q), torch.zeros(T, shape.num_kv_heads, device="cuda")])


def test_page_manager_decode_update_bit_exact(built):
    from trtllm_diffkv.memory import triton_page_manager as tpm

    shape = built[0]
    mgr = tpm.TritonPageManager(shape.page_format, 4096, shape.max_batch_size, shape.num_layers, shape.num_kv_heads,
                                shape.max_seq_len, device="cuda")
    slots = torch.tensor([0, 2], dtype=torch.int64, device="cuda")
    mgr.reserve_prompt(slots, torch.tensor([40, 7], dtype=torch.int64, device="cuda"))
    counts = torch.tensor([[[30, 10]] * shape.num_kv_heads] * shape.num_layers, dtype=torch.int32)
    mgr.commit_prompt(slots, counts[None, ..., 0].repeat(2, 1, 1).cuda(), counts[None, ..., 1].repeat(2, 1, 1).cuda())
    dh = torch.ones(2, shape.num_layers, shape.num_kv_heads, dtype=torch.int32, device="cuda")
    state = [mgr.page_table, mgr.tokens, mgr.pages, mgr.slot_state, mgr.ring, mgr.ring_state]
    # the recorded launches point at the manager's own state tensors: launch the cubins on them, keep the
    # result, restore the starting state, run the JIT path, compare.
    start = [t.clone() for t in state]
    with launches.Recorder([(tpm, k) for k in ("_count_kernel", "_scan_kernel", "_decode_apply_kernel")]) as rec:
        mgr.append_decode(slots, dh, dh)
    for launch in rec.launches:
        _launch_aot(built[1], built[2], built[3], launch)
    torch.cuda.synchronize()
    aot_state = [t.clone() for t in state]
    for t, s in zip(state, start):
        t.copy_(s)
    mgr.append_decode(slots, dh, dh)
    torch.cuda.synchronize()
    for a, b in zip(aot_state, state):
        assert torch.equal(a, b)


def _plan_state(shape, gen, device="cuda"):
    """A pool whose rows hold distinct positions in both tiers with scores around the thresholds (ties, a NaN,
    the candidate in the high tier, in the low tier, or absent), for the decode plan's kernels.

    Returns (pages, table, tokens, slots, pos, prompt_len, alphas) as ``paged/decode.py::plan_device`` passes them.
    """
    from trtllm_diffkv.kernels import decision_kernel as dk
    from trtllm_diffkv.kernels import quant_write as qw

    cfg, fmt, R, D = shape.kv_config, shape.page_format, shape.max_pages_per_row, shape.head_dim
    B, G = shape.max_batch_size, shape.num_layers * shape.num_kv_heads
    W, S = max(cfg.recent_window_tokens, 1), cfg.prompt_score_window_tokens
    table = torch.full((B * G, R), -1, dtype=torch.int32)
    tokens = torch.zeros(B * G, 2, dtype=torch.int32)
    pages = torch.zeros(B * G * R, fmt.page_size_bytes, dtype=torch.uint8, device=device)
    slots = torch.tensor([0, 2, 3], dtype=torch.int64)  # slot 1 idle; the bucket of B = 4 has a padding sequence
    pos_by_slot = {0: 150, 2: 97, 3: 180}
    prompt_len = torch.tensor([40, 0, 90, 120], dtype=torch.int64)
    nxt = 0
    for slot, p_now in pos_by_slot.items():
        cand, plen = p_now - W, int(prompt_len[slot])
        thr = cfg.alpha_high / p_now
        for r in range(slot * G, (slot + 1) * G):
            kind = r % 4  # 0, 1: candidate high; 2: candidate low; 3: candidate absent
            others = [int(x) for x in torch.randperm(p_now, generator=gen) if int(x) != cand]
            n_high = int(torch.randint(1, 80, (1,), generator=gen))
            n_low = int(torch.randint(0, 70, (1,), generator=gen))
            high, low = others[:n_high], others[n_high:n_high + n_low]
            if kind < 2:
                high = [cand] + high[:-1]
            elif kind == 2:
                low = [cand] + low
            for tier, col, toks in (("high", 0, high), ("low", 1, low)):
                if not toks:
                    continue
                per = fmt.tier(tier).tokens_per_page
                n = len(toks)
                ids = torch.arange(nxt, nxt + -(-n // per), dtype=torch.int32)
                nxt += ids.numel()
                cols = torch.arange(ids.numel()) if tier == "high" else R - 1 - torch.arange(ids.numel())
                table[r, cols] = ids
                tokens[r, col] = n
                counted = [max((min(plen - p, S) if p < plen else 0) + max(p_now - max(p, plen), 0), 1) for p in toks]
                level = torch.tensor([0.25, 0.5, 1.0, 1.0, 2.0, 4.0])[torch.randint(0, 6, (n,), generator=gen)]
                scores = (level * thr * torch.tensor(counted, dtype=torch.float64)).float()
                if r == slot * G + 1 and tier == "low":
                    scores[-1] = float("nan")
                idx = torch.arange(n)
                k = torch.randn(n, D, generator=gen).half().to(device)
                qw.write_tokens(pages, fmt, tier, ids[idx // per].to(device), (idx % per).int().to(device), k,
                                k * 0.5, scores=scores.to(device), positions=torch.tensor(toks, dtype=torch.int32,
                                                                                           device=device))
    pos = torch.tensor([pos_by_slot[int(s)] for s in slots], dtype=torch.int64)
    alphas = dk.alpha_tensor(cfg.alpha_high, cfg.alpha_low, device)
    return (pages, table.to(device), tokens.to(device), slots.to(device), pos.to(device), prompt_len.to(device),
            alphas)


def _plan_buffers(shape, n, device="cuda"):
    """Output buffers of one decode plan: the actions (5), the bucket's step buffers (6), the moves (4)."""
    L, B, H = shape.num_layers, shape.max_batch_size, shape.num_kv_heads
    m = n * L * H
    i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
    actions = [torch.full((m,), -5, **i32), torch.full((m,), -5, **i32),
               *(torch.full((m,), -5, **i64) for _ in range(3))]
    steps = [torch.zeros(L, B, H, **i64), torch.full((L, B, H), -1, **i32), torch.full((L, B, H), -1, **i32),
             torch.zeros(L, B, H, **i32), torch.zeros(B * H, **i32), torch.zeros(B * H, **i32)]
    moves = [torch.full((m,), -5, **i32) for _ in range(4)]
    return actions + steps + moves


def _plan_run(shape, state):
    """``decide_rows`` then ``locate_rows`` on output buffers given positionally (as ``plan_device``, without the
    page manager's ``append_decode`` between them: the kernels' equality is what is tested)."""
    from trtllm_diffkv.kernels import decision_kernel as dk

    pages, table, tokens, slots, pos, prompt_len, alphas = state
    cfg, fmt, G = shape.kv_config, shape.page_format, shape.num_layers * shape.num_kv_heads

    def run(*bufs):
        act = dk.decide_rows(pages, fmt, table, tokens, slots, pos, prompt_len, alphas, rows_per_slot=G,
                             recent_window_tokens=cfg.recent_window_tokens,
                             prompt_score_window_tokens=cfg.prompt_score_window_tokens, out=tuple(bufs[:5]),
                             compress=cfg.compress)
        dk.locate_rows(table, fmt, slots, pos, act, tuple(bufs[5:11]), tuple(bufs[11:15]),
                       num_kv_heads=shape.num_kv_heads, rows_per_slot=G)
    return run


def test_decode_plan_kernels_bit_exact(built):
    """The decode plan's kernels (``kernels/decision_kernel.py``: the DiffKV decisions, then the token and move
    locations for a bucket with a padding sequence) launched from the AOT cubins == the JIT launches, every output
    byte; the decisions are not trivial (appends, demotions and moves to the low tier all occur)."""
    from trtllm_diffkv.kernels import decision_kernel as dk

    shape = built[0]
    state = _plan_state(shape, torch.Generator().manual_seed(3))
    buffers = _plan_buffers(shape, state[3].numel())
    launches = _aot_vs_jit(built, [(dk, "_decide_kernel"), (dk, "_locate_kernel")], _plan_run(shape, state), buffers)
    assert len(launches) == 2
    dh, dl, mf = buffers[0], buffers[1], buffers[3]
    assert bool((dh == 1).any()) and bool((dh == 0).any()) and bool((dl == 1).any()) and bool((mf >= 0).any())
