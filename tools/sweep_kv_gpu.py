"""Issue 19's KV-part kernels on the GPU at one decode layer of Llama-3-8B 48 x 4096: variants side by side.

1. The CUDA partial kernel (``kernels/cuda_decode.py``) over page ring (``STAGES``), register cap (``MIN_BLOCKS``),
   the key-offset fold (``KEY_FOLD``) and partitions per row, at three tier mixes (all-high, all-low, 85 % high:
   what the ``llama3-8b`` preset keeps at this point in ``bench_step``); each variant's output checked
   against the Triton partial kernel's (relative error), its time the median of ``triton.testing.do_bench``,
   its bandwidth = the tokens' code and scale bytes plus the fp16 probabilities it writes, over the time,
   as a fraction of the measured device copy bandwidth.
2. The decision kernel (``kernels/decision_kernel.py``) over rows per program (1 = one program per row, the
   layout before issue 19; 8 = one layer's KV heads), loop block and warps, for the 48 x 32 x 8 rows of one
   step (random pool bytes: the work, not the outcome, is what is timed); every variant's actions must equal
   those of ``rows_per_program=1``. Bytes: each row's tokens' score and position (8 B a token).
3. ``diffkv_decode_merge`` (merge and score update in one launch, ``cuda/decode_merge.cu``) after the CUDA partial
   kernel at the 85 % high mix and the executor's CTAs a row, at several points (``--merge-points``): a baseline
   text (``--merge-baseline``, e.g. an earlier commit's file) against the current kernel at pages a warp and
   ``MERGE_MIN_BLOCKS`` (``--merge-variants``), timed replayed from a CUDA graph (as in the step; launch gaps between
   graph nodes count, host launch costs do not); each variant's output and pool must equal the first's bit for bit.

4. The fused launch (``diffkv_decode_attend``: partial kernel, merge and score update, the row's last CTA merging)
   against the two launches it replaces, at several points (``--fused-points``) and CTAs a row (``--slots``), bf16,
   85 % high, replayed from a CUDA graph; the fused result must equal the two launches' bit for bit.
5. The write kernel (``kernels/quant_write.py``) at a decode layer's rows (the new token of every (sequence, KV
   head), keys centered, score, position and error flag as ``paged/decode.py`` writes them) over warps a program
   (``WRITE_WARPS``): 32 launches (the layers) replayed from a CUDA graph, us a launch (median); each variant's pool
   must equal the 4-warp one's bit for bit.

Run on the GPU machine: ``python3 tools/sweep_kv_gpu.py --out $OUT/sweep_kv.json`` (a few minutes).
"""
import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

SHAPE = ("llama3-8b", 48, 32, 8, 128, 4096)  # name, num_seqs, num_heads, num_kv_heads, head_dim, seq_len
NUM_LAYERS = 32
DECIDE_VARIANTS = ((1, 128, 4), (1, 256, 4), (1, 256, 8), (1, 512, 8), (2, 256, 8), (4, 128, 4))
"""(rows per program, block tokens, warps) of the decision kernel."""
SMOLLM2_SHAPE = ("smollm2-135m", 64, 9, 3, 64, 1024)
WRITE_WARPS = (4, 1, 2, 8)
"""Warps a program of the write sweep (the first is the bit-equality baseline)."""
WRITE_POINTS = (("llama3-8b", 384, 128), ("fp16", 384, 128), ("diffkv", 192, 64))
"""(preset, rows a launch, head_dim): Llama-3-8B 48 sequences x 8 KV heads, SmolLM2's 64 x 3."""


def median_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def graph_ms(fn) -> float:
    """Median time of ``fn`` replayed from a CUDA graph (as the executor's decode step runs its kernels)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")


def copy_gbps() -> float:
    src = torch.randint(0, 2**15, (1 << 30,), dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / (median_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9


def timed_row(kernel: str, ms: float, nbytes: int, bw: float, **fields) -> dict:
    """One result row: the kernel, its ``fields``, time in us and bytes as a fraction of the copy bandwidth."""
    return dict(kernel=kernel, **fields, us=ms * 1e3, bytes=nbytes, fraction_of_copy_bw=nbytes / (ms * 1e-3) / 1e9 / bw)


def partial_sweep(bw: float, variants: list[tuple[int, int, int]], parts: list, log) -> list[dict]:
    """``variants``: (stages, min_blocks, key_fold) of the CUDA partial kernel, timed at each tier mix."""
    import bench_attention as ba
    from trtllm_diffkv.kernels import DecodeWorkspace, cuda_decode, paged_decode_attention
    from trtllm_diffkv.kernels.attn_decode_kernels import LOG2E

    rows_out = []
    name, num_seqs, num_heads, num_kv_heads, head_dim, seq_len = SHAPE
    for mix in (1.0, 0.0, 0.85):
        fmt, pool, table, tokens, row_ids, q = ba.decode_inputs(SHAPE, mix)
        n_high, n_low = int(tokens[0, 0]), int(tokens[0, 1])
        rows = num_seqs * num_kv_heads
        group = num_heads // num_kv_heads
        pmax = max(fmt.high_tokens_per_page, fmt.low_tokens_per_page)
        nbytes = rows * (n_high * fmt.high.tier.token_bytes(head_dim) + n_low * fmt.low.tier.token_bytes(head_dim))
        nbytes += rows * (n_high + n_low) * group * 2  # fp16 probabilities written for the score update
        r_max = table.shape[1]
        ref = torch.empty_like(q)
        paged_decode_attention(q, pool.pages(), fmt, table, tokens, row_ids, ref, sm_scale=head_dim**-0.5,
                               update_scores=False, backend="triton")
        for nparts in parts:
            ws = DecodeWorkspace.allocate(num_seqs, num_heads, num_kv_heads, fmt, r_max, "cuda", num_partitions=nparts)
            for st, mb, kf in variants:
                cuda_decode.KEY_FOLD = kf
                out = torch.full_like(q, float("nan"))
                cuda_decode.launch_partial(q, pool.pages(), fmt, table, tokens, row_ids, ws, head_dim**-0.5 * LOG2E,
                                           False, mb, st)(out)
                err = float((out.float() - ref.float()).norm() / ref.float().norm())
                call = lambda: cuda_decode.launch_partial(  # noqa: E731
                    q, pool.pages(), fmt, table, tokens, row_ids, ws, head_dim**-0.5 * LOG2E, True, mb, st)
                ms = median_ms(call)
                row = timed_row("diffkv_decode_partial", ms, nbytes, bw, high_fraction=mix,
                                num_partitions=ws.num_partitions, min_blocks=mb, stages=st, key_fold=kf,
                                rel_err_vs_triton=err,
                                finite=bool(torch.isfinite(out).all()))
                rows_out.append(row)
                log(f"partial high {mix:4.0%} parts {ws.num_partitions:2d} stages {st} min_blocks {mb} key_fold {kf}: "
                    f"{row['us']:7.1f} us  {row['fraction_of_copy_bw']:5.1%} of copy BW  err {err:.1e}")
        del pool
        torch.cuda.empty_cache()
    return rows_out


def merge_sweep(bw: float, shapes: list[tuple], baseline: str | None, variants: list[tuple[int, int]],
                log) -> list[dict]:
    """``diffkv_decode_merge`` (merge and score update) after the CUDA partial kernel, as the executor runs them (bf16
    query and output, 85 % high, the CTAs a row :func:`~trtllm_diffkv.kernels.cuda_decode.cuda_num_slots` picks),
    replayed from a CUDA graph: the merge of ``baseline`` (a ``decode_merge.cu`` text, e.g. ``git show
    <commit>:trtllm_diffkv/kernels/cuda/decode_merge.cu``; ``None``: none) against the current one at ``variants``
    = (pages a warp, ``MERGE_MIN_BLOCKS``). Each runs on its own copy of the pool after the same partial launch; its
    output and pool must equal the first variant's bit for bit (the same arithmetic). Bytes: part_acc and part_m/l
    read, the output written, the probabilities read (2 bytes a token and query head), the scores read and
    written."""
    import bench_attention as ba
    from trtllm_diffkv.kernels import DecodeWorkspace, cuda_decode
    from trtllm_diffkv.kernels.attn_decode_kernels import LOG2E

    device = torch.cuda.current_device()
    sources = ([("baseline", 4, 1, cuda_decode.merge_source(baseline))] if baseline else []) + \
        [("current", ppw, mb, cuda_decode.merge_source()) for ppw, mb in variants]
    rows_out = []
    for shape in shapes:
        name, num_seqs, num_heads, num_kv_heads, head_dim, seq_len = shape
        fmt, pool, table, tokens, row_ids, q = ba.decode_inputs(shape, 0.85)
        q = q.to(torch.bfloat16)
        group = num_heads // num_kv_heads
        rows = num_seqs * num_kv_heads
        ws = DecodeWorkspace.allocate(num_seqs, num_heads, num_kv_heads, fmt, table.shape[1], "cuda")
        gp, bd = ws.part_m.shape[-1], ws.part_acc.shape[-1]
        kernels = cuda_decode.CudaDecodeKernels.resolve(fmt, group, gp, bd, 2 * ws.num_partitions, q.dtype, True,
                                                         device)
        slots = kernels.slots_for(rows, table.shape[1])
        qk_scale = head_dim**-0.5 * LOG2E
        cuda_decode._run_partial(kernels.partial, kernels.shared_bytes, q, pool.pages(), table, tokens, row_ids, ws,
                                 qk_scale, device, slots)
        torch.cuda.synchronize()
        pages0 = pool.pages().clone()
        n_tok = int(tokens[0].sum())
        nbytes = rows * (slots * group * (head_dim + 2) * 4 + group * head_dim * 2 + n_tok * (group * 2 + 8))
        first = None
        for label, ppw, mb, text in sources:
            defines = cuda_decode.merge_defines(fmt, group, gp, bd, 2 * ws.num_partitions, q.dtype, True, ppw)
            defines["MERGE_MIN_BLOCKS"] = mb
            fn = cuda_decode._module(text, tuple(sorted(defines.items()))).get_function("diffkv_decode_merge")
            call = lambda pages, out: cuda_decode._run_merge(fn, ppw * cuda_decode.MERGE_WARPS, out, pages,  # noqa: E731
                                                             table, tokens, row_ids, ws, device, slots)
            pages = pages0.clone()
            out = torch.full_like(q, float("nan"))
            call(pages, out)
            torch.cuda.synchronize()
            if first is None:
                first = (out.clone(), pages.clone())
            same = torch.equal(out, first[0]) and torch.equal(pages, first[1])
            pages = pages0.clone()
            ms = graph_ms(lambda: call(pages, out))
            rows_out.append(row := timed_row("diffkv_decode_merge", ms, nbytes, bw, source=label, shape=list(shape),
                                             high_fraction=0.85, num_slots=slots, pages_per_warp=ppw,
                                             merge_min_blocks=mb, registers=fn.num_regs,
                                             equals_first_variant=same))
            log(f"merge {name} {num_seqs}x{seq_len} slots {slots} {label:8s} ppw {ppw} mb {mb} regs {fn.num_regs:3d}: "
                f"{row['us']:7.1f} us  {row['fraction_of_copy_bw']:5.1%} of copy BW  equal {same}")
        del pool, pages0
        torch.cuda.empty_cache()
    return rows_out


def fused_sweep(bw: float, shapes: list[tuple], slot_counts: list[int], log) -> list[dict]:
    """The CUDA decode attention of one layer as the executor runs it (bf16 query and output, scores updated, 85 % high),
    replayed from a CUDA graph: two launches (``diffkv_decode_partial`` + ``diffkv_decode_merge``) against the fused
    ``diffkv_decode_attend``, each at every CTA count a row of ``slot_counts`` and at the default
    (``2 * default_num_partitions``). The fused launch must equal the two launches bit for bit (output and every pool
    byte after one call from the same pool). Bytes: the codes and scales once, the probabilities written and read, the
    scores read and written."""
    import bench_attention as ba
    from trtllm_diffkv.kernels import DecodeWorkspace, cuda_decode
    from trtllm_diffkv.kernels.attn_decode_kernels import LOG2E
    from trtllm_diffkv.kernels.decode_attention import default_num_partitions
    from trtllm_diffkv.kernels.sizes import next_pow2

    rows_out = []
    device = torch.cuda.current_device()
    for shape in shapes:
        name, num_seqs, num_heads, num_kv_heads, head_dim, seq_len = shape
        fmt, pool, table, tokens, row_ids, q = ba.decode_inputs(shape, 0.85)
        q = q.to(torch.bfloat16)
        group = num_heads // num_kv_heads
        n_high, n_low = int(tokens[0, 0]), int(tokens[0, 1])
        rows = num_seqs * num_kv_heads
        nbytes = rows * (n_high * fmt.high.tier.token_bytes(head_dim) + n_low * fmt.low.tier.token_bytes(head_dim))
        nbytes += rows * (n_high + n_low) * (group * 2 * 2 + 8)
        default_slots = 2 * default_num_partitions(num_seqs, num_kv_heads, table.shape[1], "cuda")
        counts = sorted(set(slot_counts) | {default_slots})
        cap = max(counts)
        ws = DecodeWorkspace.allocate(num_seqs, num_heads, num_kv_heads, fmt, table.shape[1], "cuda",
                                      num_partitions=-(-cap // 2))
        gp, bd = ws.part_m.shape[-1], ws.part_acc.shape[-1]
        kernels = {fused: cuda_decode.CudaDecodeKernels.resolve(fmt, group, gp, bd, 2 * ws.num_partitions, q.dtype, True,
                                                               device, fused=fused) for fused in (False, True)}
        pages0 = pool.pages().clone()
        qk_scale = head_dim**-0.5 * LOG2E
        for slots in counts:
            got = {}
            for fused, k in kernels.items():
                pages = pages0.clone()
                out = torch.full_like(q, float("nan"))
                k.launch(q, pages, table, tokens, row_ids, ws, qk_scale, out, num_slots=slots)
                torch.cuda.synchronize()
                got[fused] = (out, pages)
            same_out = torch.equal(got[True][0], got[False][0])
            same_pool = torch.equal(got[True][1], got[False][1])
            del got
            for fused, k in kernels.items():
                pages = pages0.clone()
                out = torch.empty_like(q)
                ms = graph_ms(lambda: k.launch(q, pages, table, tokens, row_ids, ws, qk_scale, out, num_slots=slots))
                row = timed_row("diffkv_decode_attend" if fused else "diffkv_decode_partial + diffkv_decode_merge", ms,
                                nbytes, bw, shape=list(shape), high_fraction=0.85, num_slots=slots,
                                default_slots=slots == default_slots, fused=fused,
                                fused_equals_two_launches=same_out and same_pool)
                rows_out.append(row)
                log(f"{name} {num_seqs}x{seq_len} slots {slots:2d}{'*' if slots == default_slots else ' '} "
                    f"{'fused' if fused else 'two  '}: {row['us']:7.1f} us  {row['fraction_of_copy_bw']:5.1%}  "
                    f"equal {same_out} {same_pool}")
        del pool, pages0
        torch.cuda.empty_cache()
    return rows_out


def decision_sweep(bw: float, log) -> list[dict]:
    from trtllm_diffkv.config import get_preset
    from trtllm_diffkv.kernels.decision_kernel import alpha_tensor, decide_rows
    from trtllm_diffkv.memory import PageFormat

    name, num_seqs, num_heads, num_kv_heads, head_dim, seq_len = SHAPE
    cfg = get_preset("llama3-8b")
    fmt = PageFormat.for_config(cfg, head_dim)
    G = NUM_LAYERS * num_kv_heads
    n_high, n_low = int(seq_len * 0.85), seq_len - int(seq_len * 0.85)
    hp, lp = -(-n_high // fmt.high_tokens_per_page), -(-n_low // fmt.low_tokens_per_page)
    R = hp + lp + 2
    rows = num_seqs * G
    g = torch.Generator(device="cuda").manual_seed(0)
    pages = torch.randint(0, 256, (rows * (hp + lp), fmt.page_size_bytes), dtype=torch.uint8, device="cuda",
                          generator=g)
    ids = torch.randperm(rows * (hp + lp), device="cuda", generator=g).int().view(rows, hp + lp)
    table = torch.full((rows, R), -1, dtype=torch.int32, device="cuda")
    table[:, :hp] = ids[:, :hp]
    table[:, R - lp:] = ids[:, hp:].flip(1)
    tokens = torch.tensor([n_high, n_low], dtype=torch.int32, device="cuda").repeat(rows, 1).contiguous()
    slots = torch.arange(num_seqs, dtype=torch.int64, device="cuda")
    pos = torch.full((num_seqs,), seq_len, dtype=torch.int64, device="cuda")
    prompt_len = torch.full((num_seqs,), seq_len - 8, dtype=torch.int64, device="cuda")
    alphas = alpha_tensor(cfg.alpha_high, cfg.alpha_low, "cuda")
    nbytes = rows * seq_len * 8
    common = dict(rows_per_slot=G, recent_window_tokens=cfg.recent_window_tokens,
                  prompt_score_window_tokens=cfg.prompt_score_window_tokens)
    base = [t.clone() for t in decide_rows(pages, fmt, table, tokens, slots, pos, prompt_len, alphas,
                                           rows_per_program=1, **common)]
    out = []
    for rpp, block, warps in DECIDE_VARIANTS:
        call = lambda: decide_rows(pages, fmt, table, tokens, slots, pos, prompt_len, alphas,  # noqa: E731
                                   rows_per_program=rpp, block_tokens=block, num_warps=warps, **common)
        got = call()
        same = all(torch.equal(a, b) for a, b in zip(got, base))
        ms = median_ms(call)
        row = dict(kernel="_decide_kernel", rows_per_program=rpp, block_tokens=block, num_warps=warps, us=ms * 1e3,
                   bytes=nbytes, fraction_of_copy_bw=nbytes / (ms * 1e-3) / 1e9 / bw, equal_to_one_row_layout=same)
        out.append(row)
        log(f"decide rows/program {rpp:2d} block {block:3d} warps {warps}: {row['us']:7.1f} us  "
            f"{row['fraction_of_copy_bw']:5.1%} of copy BW  equal {same}")
    return out


def write_layers_us(preset: str, n_rows: int, warps: int, head_dim: int, layers: int = NUM_LAYERS):
    """us a launch of ``write_tokens`` at ``warps`` (``layers`` launches replayed from a CUDA graph, :func:`graph_ms`)
    and the pool after the writes."""
    from trtllm_diffkv.config import PRESETS
    from trtllm_diffkv.kernels import quant_write as qw
    from trtllm_diffkv.memory import KVCachePool, PageFormat

    torch.manual_seed(0)
    cfg = PRESETS[preset]
    fmt = PageFormat.for_config(cfg, head_dim)
    pool = KVCachePool(fmt, n_rows * layers + 8, device="cuda")
    pool.buffer.zero_()
    pages = pool.pages()
    g = torch.Generator(device="cpu").manual_seed(0)
    dest = [torch.randperm(n_rows * layers, generator=g)[:n_rows].to(torch.int32).cuda() for _ in range(layers)]
    slot = torch.randint(0, fmt.high.tokens_per_page, (n_rows,), generator=g, dtype=torch.int32).cuda()
    k = torch.randn(n_rows, head_dim, device="cuda", dtype=torch.bfloat16)  # contiguous, as decode_layer's
    v = torch.randn(n_rows, head_dim, device="cuda", dtype=torch.bfloat16)
    kw = dict(error_flags=torch.zeros(64, device="cuda", dtype=torch.int32),
              error_index=torch.arange(n_rows, device="cuda", dtype=torch.int32) % 48)
    if cfg.compress:
        kw.update(key_offsets=torch.randn(n_rows, head_dim, device="cuda").half(),
                  offset_rows=torch.arange(n_rows, device="cuda", dtype=torch.int32),
                  scores=torch.rand(n_rows, device="cuda"),
                  positions=torch.arange(n_rows, device="cuda", dtype=torch.int32))

    def run():
        for layer in range(layers):
            qw.write_tokens(pages, fmt, "high", dest[layer], slot, k, v, **kw)

    saved = qw.WRITE_NUM_WARPS
    qw.WRITE_NUM_WARPS = warps  # read at each launch, so also while graph_ms captures
    try:
        ms = graph_ms(run)
    finally:
        qw.WRITE_NUM_WARPS = saved
    return ms * 1e3 / layers, pool.buffer.clone()


def write_sweep(log) -> list[dict]:
    out = []
    for preset, n_rows, head_dim in WRITE_POINTS:
        ref = None
        for warps in WRITE_WARPS:
            us, buf = write_layers_us(preset, n_rows, warps, head_dim)
            same = ref is None or bool(torch.equal(ref, buf))
            ref = buf if ref is None else ref
            out.append(dict(kernel="_write_tokens_kernel", preset=preset, n_rows=n_rows, head_dim=head_dim,
                            num_warps=warps, us_per_launch_median=us, bit_equal_to_first=same))
            log(f"write {preset:10s} {n_rows:4d} rows head_dim {head_dim:3d} warps {warps}: {us:6.2f} us a launch"
                f"  equal {same}")
    return out


def points(spec: str) -> list[tuple]:
    """Shapes of ``BxT`` points (Llama-3-8B heads; ``smollm2:BxT``: SmolLM2-135M's), comma-separated."""
    shapes = []
    for point in spec.split(","):
        base = SMOLLM2_SHAPE if point.startswith("smollm2:") else SHAPE
        b, t = (int(x) for x in point.split(":")[-1].split("x"))
        shapes.append((base[0], b, *base[2:5], t))
    return shapes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", default="default,2,4", help="partitions per row ('default': the heuristic)")
    ap.add_argument("--variants", default="0:3:0,0:3:1,2:4:0,2:4:1",
                    help="stages:min_blocks:key_fold of the partial kernel, comma-separated (stages 0: the register path)")
    ap.add_argument("--shape", default=None,
                    help="num_seqs,seq_len[,num_heads,num_kv_heads,head_dim] (default 48,4096,32,8,128: Llama-3-8B)")
    ap.add_argument("--skip", default="", help="'partial', 'decide', 'merge', 'fused' and/or 'write'")
    ap.add_argument("--fused-points", default="48x4096,16x1024,64x1024,16x4096,smollm2:64x1024",
                    help="batch x context points of the fused sweep (Llama-3-8B heads; 'smollm2:' SmolLM2-135M's)")
    ap.add_argument("--slots", default="2,3,4,6,8,12", help="CTAs a row of the fused sweep")
    ap.add_argument("--merge-points", default="48x4096,16x1024,smollm2:64x1024",
                    help="batch x context points of the merge sweep (as --fused-points)")
    ap.add_argument("--merge-baseline", default=None,
                    help="a decode_merge.cu text to time beside the current one (e.g. an earlier commit's)")
    ap.add_argument("--merge-variants", default="4:1,2:1,8:1,4:6",
                    help="pages a warp:MERGE_MIN_BLOCKS of the current merge, comma-separated")
    args = ap.parse_args()
    from trtllm_diffkv.evaluation.throughput import environment

    if args.shape:
        global SHAPE
        num_seqs, seq_len, *heads = (int(x) for x in args.shape.split(","))
        SHAPE = (SHAPE[0] if not heads else "custom", num_seqs, *(heads or SHAPE[2:5]), seq_len)
    bw = copy_gbps()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    result = dict(**environment(), command="python3 tools/sweep_kv_gpu.py " + " ".join(sys.argv[1:]),
                  copy_bandwidth_gbps=bw, shape=SHAPE, rows=[])
    if "fused" not in args.skip:
        result["rows"] += fused_sweep(bw, points(args.fused_points), [int(x) for x in args.slots.split(",")], log)
    if "merge" not in args.skip:
        baseline = open(args.merge_baseline).read() if args.merge_baseline else None
        variants = [tuple(int(x) for x in v.split(":")) for v in args.merge_variants.split(",")]
        result["rows"] += merge_sweep(bw, points(args.merge_points), baseline, variants, log)
    if "decide" not in args.skip:
        result["rows"] += decision_sweep(bw, log)
    if "write" not in args.skip:
        result["rows"] += write_sweep(log)
    if "partial" not in args.skip:
        parts = [None if p == "default" else int(p) for p in args.parts.split(",")]
        variants = [tuple(int(x) for x in v.split(":")) for v in args.variants.split(",")]
        result["rows"] += partial_sweep(bw, variants, parts, log)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
