"""Attention kernels against torch SDPA (flash) FP16, side by side, on the H200 (issue 6).

Decode: one query per sequence over paged DiffKV rows (score update included)
for Llama-3-8B (32/8 heads, d128) at 64 x 4096 and 16 x 16384, Qwen2.5-7B
(28/4, d128) at 128 x 8192 and the default model (9/3, d64) at 256 x 4096;
tier mixes all-high, all-low and 22 % high / 78 % low. SDPA reads the same
tokens as an FP16 cache. Prefill: :func:`scored_prefill_attention` (attention
and prompt scores) against causal SDPA at 4096 tokens.

Every timed kernel is first checked on the GPU: a small paged cache against
the float64 reference, and the poisoned (NaN) output of each benchmark shape
fully written and finite. Times are medians of CUDA-graph replays
(``triton.testing.do_bench_cudagraph``); every decode shape reads several
hundred MB, far more than the 60 MB L2, so one buffer set is not cached.

Usage: ``python benchmarks/bench_attention.py [--quick] [--tune | --configs C,...] [--decode-only]
[--shapes I,...] [--out PATH]``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import repo_paths  # noqa: E402 (benchmarks/ is on the path: the script's folder, or a tool's insert)

repo_paths.use_checkout()  # the package and tests/support

from trtllm_diffkv.config import DiffKVConfig  # noqa: E402
from trtllm_diffkv.kernels import DecodeWorkspace, decode_bytes, paged_decode_attention, scored_prefill_attention  # noqa: E402
from support.attention import build_paged_rows, decode_reference, read_scores, rel_err  # noqa: E402
from trtllm_diffkv.memory import KVCachePool, PageFormat  # noqa: E402

DECODE_SHAPES = [  # name, num_seqs, num_heads, num_kv_heads, head_dim, seq_len
    ("llama3-8b", 64, 32, 8, 128, 4096),
    ("llama3-8b", 16, 32, 8, 128, 16384),
    ("qwen2.5-7b", 128, 28, 4, 128, 8192),
    ("default", 256, 9, 3, 64, 4096),
]
PREFILL_SHAPES = [("llama3-8b", 1, 32, 8, 128, 4096), ("llama3-8b", 4, 32, 8, 128, 4096),
                  ("qwen2.5-7b", 1, 28, 4, 128, 4096), ("default", 1, 9, 3, 64, 4096)]
MIXES = {"all-high": 1.0, "all-low": 0.0, "22%-high": 0.22}
# decode launch configs: (tokens per step, warps, stages, partition multiplier, maxnreg (0: none, -1: the
# library's default, DEFAULT_MAX_REGISTERS where it applies), PTX code conversion)
DEFAULT_CONFIG = (64, 4, 2, 1, -1, 1)
FAST_OK = True  # cleared when the small GPU check fails with the PTX code conversion
TUNE_CONFIGS = [(64, 4, 2, 1, -1, 1), (64, 4, 3, 1, -1, 1), (64, 4, 2, 2, -1, 1), (64, 4, 2, 1, 96, 1),
                (64, 4, 2, 1, 0, 1), (32, 4, 2, 1, -1, 1), (64, 4, 2, 1, -1, 0)]


def bench(fn, graph: bool = True) -> float:
    """Median microseconds of CUDA-graph replays of ``fn`` (events on eager calls when ``graph`` is False
    or capture fails)."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    if not graph:
        return 1000.0 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    try:
        return 1000.0 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - report and fall back
        print(f"  graph capture failed ({type(exc).__name__}: {exc}); timing eager calls")
        return 1000.0 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy rate (bytes read plus written per second), best of graph and event timing."""
    a = torch.empty(2**28, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    import triton.testing

    for _ in range(50):  # wake the clocks
        b.copy_(a)
    t = min(bench(lambda: b.copy_(a)), 1000.0 * triton.testing.do_bench(lambda: b.copy_(a), warmup=100, rep=300,
                                                                         return_mode="median"))
    return 2 * a.numel() * 4 / (t * 1e-6) / 1e9


def check_small_on_gpu(backend: str | None = None) -> None:
    """Kernels against the float64 reference on small caches of every preset format (raises on mismatch)."""
    from trtllm_diffkv.config import PRESETS

    for preset, dtype in (("diffkv", torch.float16), ("k8v4", torch.bfloat16), ("fp16", torch.float16)):
        if backend == "cuda" and preset == "fp16":
            continue  # 16-bit tiers run on the Triton kernel
        cfg = PRESETS[preset]
        fmt = PageFormat.for_config(cfg, 128)
        rows = build_paged_rows(fmt, [(300, 500), (0, 0), (77, 0), (0, 1000), (33, 250), (200, 3)], device="cuda")
        row_ids = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32, device="cuda")
        q = torch.randn(3, 8, 128, device="cuda").to(dtype)
        out = torch.full_like(q, float("nan"))
        update = cfg.compress
        before = [read_scores(rows, r) for r in range(6)] if update else None
        paged_decode_attention(q, rows.pool.pages(), fmt, rows.page_table, rows.tier_tokens, row_ids, out,
                               sm_scale=128**-0.5, update_scores=update, backend=backend)
        ref, deltas = decode_reference(q.float(), rows, row_ids.cpu(), 128**-0.5)
        err = rel_err(out, ref)
        assert err < 1e-2, (preset, err)
        if update:
            for (s, kvh), dl in deltas.items():
                r = int(row_ids[s, kvh])
                got = read_scores(rows, r) - before[r]
                assert torch.allclose(got, dl, rtol=2e-2, atol=1e-4), (preset, r, (got - dl).abs().max())
        print(f"  small check {preset} {dtype} backend {backend or 'auto'}: rel err {err:.2e}")


def fill_random_pages(fmt: PageFormat, pool: KVCachePool) -> None:
    """Random codes, small scores and sane fp16 scale/zero in every page, as read by either tier.

    The tiers' segments overlap in bytes (a page is read as one tier), so the
    meta of both tiers is written last: whatever tier reads a page finds
    finite scales and zeros.
    """
    g = torch.Generator(device="cuda").manual_seed(0)
    pool.buffer.view(torch.int32).random_(generator=g)
    for tier in ("low", "high"):
        pool.segment(tier, "score").uniform_(0.0, 1.0, generator=g)
    for tier in ("low", "high"):
        for side in ("key", "value"):
            meta = pool.segment(tier, f"{side}_meta")
            if meta.numel():
                meta[..., 0].uniform_(0.001, 0.05, generator=g)
                meta[..., 1].uniform_(-1.0, 0.0, generator=g)


def decode_inputs(shape, high_frac):
    """Random pages for every row of a decode shape at one tier split: (fmt, pool, table, tokens, row_ids, q).

    Every (sequence, KV head) row holds ``seq_len`` tokens, ``high_frac`` of them high; page ids shuffled.
    """
    name, num_seqs, num_heads, num_kv_heads, head_dim, seq_len = shape
    fmt = PageFormat.for_config(DiffKVConfig(), head_dim)
    n_high = int(round(seq_len * high_frac))
    n_low = seq_len - n_high
    hp, lp = fmt.high_tokens_per_page, fmt.low_tokens_per_page
    nhp, nlp = -(-n_high // hp), -(-n_low // lp)
    r_max = -(-seq_len // hp) + 2
    rows = num_seqs * num_kv_heads
    pool = KVCachePool(fmt, rows * (nhp + nlp) + 1, device="cuda")
    fill_random_pages(fmt, pool)
    ids = torch.randperm(rows * (nhp + nlp), device="cuda").int().view(rows, nhp + nlp)
    table = torch.full((rows, r_max), -1, dtype=torch.int32, device="cuda")
    if nhp:
        table[:, :nhp] = ids[:, :nhp]
    if nlp:
        table[:, r_max - nlp:] = ids[:, nhp:].flip(1)
    tokens = torch.tensor([n_high, n_low], dtype=torch.int32, device="cuda").repeat(rows, 1).contiguous()
    row_ids = torch.arange(rows, dtype=torch.int32, device="cuda").view(num_seqs, num_kv_heads)
    q = torch.randn(num_seqs, num_heads, head_dim, device="cuda", dtype=torch.float16)
    return fmt, pool, table, tokens, row_ids, q


def decode_case(shape, mix_name, high_frac, tune, backend="triton"):
    name, num_seqs, num_heads, num_kv_heads, head_dim, seq_len = shape
    fmt, pool, table, tokens, row_ids, q = decode_inputs(shape, high_frac)
    n_high = int(tokens[0, 0])
    n_low = int(tokens[0, 1])
    r_max = table.shape[1]
    rows = num_seqs * num_kv_heads
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    configs = [tune] if isinstance(tune, tuple) else [DEFAULT_CONFIG]
    if tune is True:
        configs = TUNE_CONFIGS if backend == "triton" else [(64, 4, 2, pm, mb, 1) for pm in (1, 2) for mb in (-1, 4)]
    elif isinstance(tune, list):
        configs = tune
    from trtllm_diffkv.kernels import decode_attention as da
    from trtllm_diffkv.kernels.decode_attention import default_num_partitions

    best = None
    for tps, warps, stages, part_mult, maxnreg, fast in configs:
        fast = int(fast and FAST_OK)
        np_ = default_num_partitions(num_seqs, num_kv_heads, r_max, "cuda") * part_mult
        ws = DecodeWorkspace.allocate(num_seqs, num_heads, num_kv_heads, fmt, r_max, "cuda", num_partitions=np_)
        da.FAST_CONVERT = bool(fast)
        fn = lambda: paged_decode_attention(q, pool.pages(), fmt, table, tokens, row_ids, out, sm_scale=scale,  # noqa: E731
                                            workspace=ws, num_warps=warps, num_stages=stages, tokens_per_step=tps,
                                            max_registers=None if maxnreg < 0 else maxnreg, backend=backend,
                                            cuda_min_blocks=_min_blocks(backend, maxnreg))
        try:
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            bad = int((~torch.isfinite(out)).sum())
            assert bad == 0, f"{bad} of {out.numel()} outputs not written or not finite"
            t = bench(fn)
        except Exception as exc:  # noqa: BLE001
            print(f"  config {(tps, warps, stages, np_, maxnreg, fast)} failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        if len(configs) > 1:
            print(f"    tps {tps} warps {warps} stages {stages} partitions {np_} maxnreg {maxnreg} fast {fast}:"
                  f" {t:.1f} us", flush=True)
        if best is None or t < best[0]:
            best = (t, tps, warps, stages, part_mult, np_, maxnreg, fast)
    if best is None:
        da.FAST_CONVERT = True
        return dict(kernel="decode", model=name, tier_mix=mix_name, backend=backend, error="every launch config failed")
    t, tps, warps, stages, part_mult, np_, maxnreg, fast = best
    fast = int(fast and FAST_OK)
    ws = DecodeWorkspace.allocate(num_seqs, num_heads, num_kv_heads, fmt, r_max, "cuda", num_partitions=np_)
    da.FAST_CONVERT = bool(fast)
    t_noscore = bench(lambda: paged_decode_attention(q, pool.pages(), fmt, table, tokens, row_ids, out,
                                                     sm_scale=scale, update_scores=False, workspace=ws,
                                                     num_warps=warps, num_stages=stages, tokens_per_step=tps,
                                                     max_registers=None if maxnreg < 0 else maxnreg,
                                                     backend=backend, cuda_min_blocks=_min_blocks(backend, maxnreg)))
    da.FAST_CONVERT = True
    del pool
    sdpa_t = sdpa_decode_time(num_seqs, num_heads, num_kv_heads, head_dim, seq_len)
    nbytes = decode_bytes(fmt, n_high * rows, n_low * rows)
    fp16_bytes = 2 * rows * seq_len * head_dim * 2
    return dict(kernel="decode", model=name, backend=backend,
                shape=f"{num_seqs}x{seq_len} tokens, {num_heads}/{num_kv_heads} heads, d{head_dim}",
                tier_mix=mix_name, time_us=round(t, 2), time_no_score_update_us=round(t_noscore, 2),
                sdpa_time_us=round(sdpa_t, 2), bytes=nbytes, sdpa_bytes=fp16_bytes,
                compression_ratio=round(fp16_bytes / nbytes, 3),
                pct_copy_bandwidth=None, speedup_vs_sdpa=round(sdpa_t / t, 3),
                sdpa_pct_copy_bandwidth=None, config=(tps, warps, stages, part_mult, maxnreg, fast),
                config_desc=dict(tokens_per_step=tps, num_warps=warps, num_stages=stages, num_partitions=np_,
                                 max_registers="default" if maxnreg < 0 else (maxnreg or None),
                                 fast_convert=bool(fast)))


def _min_blocks(backend, maxnreg):
    """The CUDA kernel reads the config's register field as blocks per multiprocessor (-1: its default)."""
    return None if backend != "cuda" or maxnreg < 0 else maxnreg


def sdpa_decode_time(num_seqs, num_heads, num_kv_heads, head_dim, seq_len) -> float:
    q = torch.randn(num_seqs, num_heads, 1, head_dim, device="cuda", dtype=torch.float16)
    k = torch.randn(num_seqs, num_kv_heads, seq_len, head_dim, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    try:
        run()
    except RuntimeError as exc:
        print(f"  flash SDPA refused ({str(exc)[:120]}); default SDPA backend")

        def run():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return bench(run)


def prefill_case(shape):
    name, num_seqs, num_heads, num_kv_heads, head_dim, seq_len = shape
    total = num_seqs * seq_len
    q = torch.randn(total, num_heads, head_dim, device="cuda", dtype=torch.float16)
    k = torch.randn(total, num_kv_heads, head_dim, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    cu = torch.arange(0, total + 1, seq_len, dtype=torch.int32)  # on the host: no device synchronisation
    sums = torch.full((total, num_kv_heads), float("nan"), device="cuda")
    scale = head_dim**-0.5
    out, _ = scored_prefill_attention(q, k, v, cu, sm_scale=scale, score_sums=sums)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(sums).all()
    # check the scores of the first prompt against a float32 reference (64 last queries)
    group = num_heads // num_kv_heads
    qs = q[seq_len - 64:seq_len].float().transpose(0, 1)
    ks = k[:seq_len].float().repeat_interleave(group, 1).transpose(0, 1)
    logits = qs @ ks.transpose(1, 2) * scale
    mask = torch.arange(seq_len, device="cuda")[None, :] > torch.arange(seq_len - 64, seq_len, device="cuda")[:, None]
    ref = torch.softmax(logits.masked_fill(mask, float("-inf")), -1).sum(1).view(num_kv_heads, group, -1).amax(1).T
    err = rel_err(sums[:seq_len], ref)
    assert err < 1e-2, err
    ref_out = F.scaled_dot_product_attention(q[:seq_len].transpose(0, 1), k[:seq_len].transpose(0, 1),
                                             v[:seq_len].transpose(0, 1), is_causal=True, enable_gqa=True)
    assert rel_err(out[:seq_len], ref_out.transpose(0, 1)) < 1e-2
    t = bench(lambda: scored_prefill_attention(q, k, v, cu, sm_scale=scale, score_sums=sums), graph=False)
    qb, kb, vb = (x.view(num_seqs, seq_len, -1, head_dim).transpose(1, 2) for x in (q, k, v))
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True), graph=False)
    return dict(kernel="prefill", model=name,
                shape=f"{num_seqs}x{seq_len} tokens, {num_heads}/{num_kv_heads} heads, d{head_dim}",
                tier_mix=None, time_us=round(t, 2), sdpa_time_us=round(t_sdpa, 2), bytes=None,
                compression_ratio=None, pct_copy_bandwidth=None, speedup_vs_sdpa=round(t_sdpa / t, 3),
                time_over_sdpa=round(t / t_sdpa, 3), score_rel_err=err)


def _commit() -> str:
    try:
        return os.environ.get("DIFFKV_COMMIT") or subprocess.check_output(
            ["git", "rev-parse", "--short=12", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def _write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/attention.json")
    ap.add_argument("--quick", action="store_true", help="one decode shape per model, one prefill shape")
    ap.add_argument("--tune", action="store_true", help="sweep partitions, warps and stages; report the best")
    ap.add_argument("--configs", default=None,
                    help="decode configs to sweep instead of --tune's: 'tps/warps/stages/partmult/maxnreg/fast,...'")
    ap.add_argument("--decode-only", action="store_true", help="skip the prefill rows")
    ap.add_argument("--backend", default="both", choices=["both", "cuda", "triton"],
                    help="decode partial kernel: the CUDA C++ one, the Triton one, or both side by side")
    ap.add_argument("--shapes", default=None, help="decode shape indices to run, e.g. '0,3' (default: all or --quick)")
    args = ap.parse_args()
    t0 = time.time()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    global FAST_OK
    try:
        check_small_on_gpu()
    except Exception as exc:  # noqa: BLE001 - the PTX code conversion is the newest part: fall back, say so
        print(f"  small check FAILED with the PTX code conversion ({type(exc).__name__}: {str(exc)[:300]});"
              " timing Triton's conversion only")
        from trtllm_diffkv.kernels import decode_attention as da
        da.FAST_CONVERT = False
        FAST_OK = False
        check_small_on_gpu()
        da.FAST_CONVERT = True
    backends = ["cuda", "triton"] if args.backend == "both" else [args.backend]
    if "cuda" in backends:
        check_small_on_gpu("cuda")
    bw = copy_bandwidth_gbps()
    print(f"copy bandwidth {bw:.0f} GB/s")
    rows = []
    meta = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=_commit(),
                command="python " + " ".join(sys.argv), copy_bandwidth_gbps=round(bw, 1),
                torch=torch.__version__, triton=__import__("triton").__version__)
    shapes = DECODE_SHAPES[:1] + DECODE_SHAPES[3:] if args.quick else DECODE_SHAPES
    if args.shapes:
        shapes = [DECODE_SHAPES[int(i)] for i in args.shapes.split(",")]
    sweep = [tuple(int(x) for x in c.split("/")) for c in args.configs.split(",")] if args.configs else None
    if sweep:
        args.tune = True
    tuned = {}  # head_dim -> best config over the tier mixes of the first shape with that head_dim
    for shape in shapes:
        head_dim = shape[4]
        mix_rows = []
        for mix, frac in MIXES.items():
            for backend in backends:
                r = decode_case(shape, mix, frac, tuned.get((head_dim, backend), sweep or args.tune), backend)
                if "error" in r:
                    print(r)
                    rows.append(r)
                    continue
                r["pct_copy_bandwidth"] = round(100 * r["bytes"] / (r["time_us"] * 1e-6) / 1e9 / bw, 1)
                r["sdpa_pct_copy_bandwidth"] = round(100 * r["sdpa_bytes"] / (r["sdpa_time_us"] * 1e-6) / 1e9 / bw, 1)
                rows.append(r)
                mix_rows.append(r)
                _write(args.out, dict(meta, rows=rows))
                print(f"{backend:6s} {r['model']:11s} {r['shape']:40s} {mix:9s} {r['time_us']:9.1f} us (no score {r['time_no_score_update_us']:8.1f})"
                      f" sdpa {r['sdpa_time_us']:9.1f}  {r['pct_copy_bandwidth']:5.1f}% copy  x{r['speedup_vs_sdpa']:.2f}"
                      f" (ratio {r['compression_ratio']:.2f}) cfg {r['config_desc']}", flush=True)
        for backend in backends:
            if args.tune and (head_dim, backend) not in tuned and mix_rows:
                votes = {}
                for r in mix_rows:
                    if r["backend"] == backend:
                        votes[r["config"]] = votes.get(r["config"], 0) + 1
                if votes:
                    tuned[(head_dim, backend)] = max(votes, key=votes.get)
                    print(f"  tuned config for head_dim {head_dim}, {backend}: {tuned[(head_dim, backend)]}")
    for shape in ([] if args.decode_only else PREFILL_SHAPES[:1] if args.quick else PREFILL_SHAPES):
        r = prefill_case(shape)
        rows.append(r)
        _write(args.out, dict(meta, rows=rows))
        print(f"prefill {r['model']:11s} {r['shape']:40s} {r['time_us']:9.1f} us sdpa {r['sdpa_time_us']:9.1f}"
              f" ratio {r['time_over_sdpa']:.3f}", flush=True)
    bw_end = copy_bandwidth_gbps()
    print(f"copy bandwidth at the end {bw_end:.0f} GB/s")
    _write(args.out, dict(meta, rows=rows, copy_bandwidth_end_gbps=round(bw_end, 1), wall_s=round(time.time() - t0, 1)))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
