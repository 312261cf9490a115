"""Per-kernel GPU time of one decode attention call (CUDA backend, with and without the score update).

Run on the GPU machine: ``python3 tools/profile_decode_gpu.py`` (prints a table per case). Uses the
attention benchmark's page setup (benchmarks/bench_attention.py) and torch.profiler (CUPTI sees the CuPy
launches too). ``--score-warps 4,8,16`` also times the score kernel at other CTA sizes.
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--score-warps", default="8")
    args = ap.parse_args()
    import bench_attention as ba
    from trtllm_diffkv.kernels import DecodeWorkspace, cuda_decode, paged_decode_attention

    for shape, frac in ((ba.DECODE_SHAPES[0], 1.0), (ba.DECODE_SHAPES[0], 0.0), (ba.DECODE_SHAPES[3], 0.0)):
        name, num_seqs, num_heads, num_kv_heads, head_dim, seq_len = shape
        fmt, pool, table, tokens, row_ids, q = ba.decode_inputs(shape, frac)
        r_max = table.shape[1]
        out = torch.empty_like(q)
        ws = DecodeWorkspace.allocate(num_seqs, num_heads, num_kv_heads, fmt, r_max, "cuda")
        for sw in [int(x) for x in args.score_warps.split(",")]:
            cuda_decode.SCORE_WARPS = sw
            for update in (True, False):
                call = lambda: paged_decode_attention(q, pool.pages(), fmt, table, tokens, row_ids, out,  # noqa: E731
                                                      sm_scale=head_dim**-0.5, update_scores=update, workspace=ws,
                                                      backend="cuda")
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(20):
                        call()
                    torch.cuda.synchronize()
                times = {}
                for e in prof.events():
                    if e.device_type == torch.autograd.DeviceType.CUDA:
                        times.setdefault(e.name, []).append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
                desc = f"{name} {num_seqs}x{seq_len} high {frac:.0%} score_update={update} score_warps={sw}"
                print(desc)
                for k, v in sorted(times.items(), key=lambda kv: -sum(kv[1])):
                    print(f"    {sum(v) / 20:9.1f} us/call  x{len(v) / 20:.0f}  {k[:90]}")
        del pool


if __name__ == "__main__":
    main()
