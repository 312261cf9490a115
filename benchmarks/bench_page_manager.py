"""Per-step latency of the DiffKV page manager: GPU (Triton) against the CPU implementation.

For each batch of ``--requests`` requests x ``--layers`` layers x ``--kv-heads``
KV heads (Llama-3-8B shapes by default) with ``--context``-token prompts:

* ``prompt``: :meth:`reserve_prompt` + :meth:`commit_prompt` of the whole batch
  in one step (conservative reservation, then compaction to a random
  compressed split: 64 + 0-40 % high, 0-40 % low per head);
* ``decode``: one :meth:`append_decode` of a typical step (DiffKV's per-step
  count changes: new token high; the token leaving the window stays, is
  demoted or pruned), median over ``--decode-steps`` consecutive steps;
* ``decode_worst``: a step in which every row takes a high and a low page;
* ``release``: all requests finish at once.

GPU times are CUDA-event medians of eager calls (``gpu_us``) and, for decode,
of CUDA-graph replays (``gpu_graph_us``); CPU times are ``perf_counter``
medians of :class:`CpuPageManager` doing the same work on the same state.
References: a decode step's attention = fp16 SDPA of one new token per request
against ``--context`` cached tokens (GQA), measured for one layer x layers;
prefill = causal fp16 SDPA + the layer's bf16 matrix products over one
``--context``-token prompt, measured for one layer x layers x requests (norms,
RoPE and the LM head left out, so the fraction is an upper bound).

Writes ``--out`` (JSON: gpu, date, commit, command, rows, ...).
``--device cpu`` (with ``TRITON_INTERPRET=1``) is a slow smoke run of the same code.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trtllm_diffkv.config import get_preset  # noqa: E402
from trtllm_diffkv.memory import CpuPageManager, PageFormat, PageStatus  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=[16, 64, 256, 512])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden-size", type=int, default=4096)
    p.add_argument("--intermediate-size", type=int, default=14336)
    p.add_argument("--context", type=int, default=4096, help="prompt / cached tokens per request")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--reps", type=int, default=10, help="GPU repetitions of the prompt and worst-case steps")
    p.add_argument("--cpu-reps", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="benchmarks/results/page_manager.json")
    return p.parse_args(argv)


# ------------------------------------------------------------------ timing
def timed(fn, device) -> float:
    """Microseconds of ``fn()``: CUDA events on the GPU (queue drained first), perf_counter on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def bench_fn(fn, device) -> float:
    """Median microseconds of a pure function (references)."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    fn()
    return statistics.median(timed(fn, device) for _ in range(3))


def save_state(manager):
    if isinstance(manager, CpuPageManager):
        return manager.snapshot()
    return [t.clone() for t in (manager.ring, manager.ring_state, manager.page_table, manager.pages, manager.tokens,
                                manager.slot_state)]


def load_state(manager, saved) -> None:
    if isinstance(manager, CpuPageManager):
        manager.load_snapshot(saved)
        return
    for tensor, copy in zip((manager.ring, manager.ring_state, manager.page_table, manager.pages, manager.tokens,
                             manager.slot_state), saved):
        tensor.copy_(copy)


def expect_ok(manager) -> None:
    status = manager.read_status()
    assert status.status == PageStatus.OK, status


# ------------------------------------------------------------------ workloads
class Workload:
    """Inputs of one batch size, on the CPU and on the device."""

    def __init__(self, args, fmt, n, device):
        gen = torch.Generator().manual_seed(n)
        shape = (n, args.layers, args.kv_heads)
        ctx = args.context
        self.slots = torch.arange(n)
        self.prompts = torch.full((n,), ctx)
        window = min(64, ctx)
        self.high = window + (torch.rand(shape, generator=gen) * 0.4 * (ctx - window)).long()
        # at least one low token per decode step, so pruning (-1 low) never goes below zero
        self.low = args.decode_steps + (torch.rand(shape, generator=gen) * 0.4 * (ctx - window)).long()
        ph, pl = fmt.high_tokens_per_page, fmt.low_tokens_per_page
        self.high_full = (self.high // ph).clamp(min=1) * ph  # every tier's last page exactly full
        self.low_full = (self.low // pl).clamp(min=1) * pl
        case = (torch.rand((args.decode_steps, *shape), generator=gen) * 4).long()
        self.dh = torch.where((case == 0) | (case == 3), 1, 0).to(torch.int8)
        self.dl = torch.where(case == 1, 1, torch.where(case == 3, -1, 0)).to(torch.int8)
        self.ones = torch.ones(shape, dtype=torch.int8)
        self.device = device

    def on(self, device):
        names = ("slots", "prompts", "high", "low", "high_full", "low_full", "dh", "dl", "ones")
        return {k: getattr(self, k).to(device) for k in names}


def graph_decode(manager, w: dict, start, eager_end, steps: int) -> dict:
    """The decode steps again, from the same start, replayed from a CUDA graph with fixed input buffers."""
    device = manager.device
    load_state(manager, start)
    dh_buf, dl_buf = w["dh"][0].clone(), w["dl"][0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        manager.append_decode(w["slots"], dh_buf.zero_(), dl_buf.zero_())  # warm-up, no change
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        manager.append_decode(w["slots"], dh_buf, dl_buf)
    graph_t = []
    for t in range(steps):
        dh_buf.copy_(w["dh"][t])
        dl_buf.copy_(w["dl"][t])
        graph_t.append(timed(cuda_graph.replay, device))
        expect_ok(manager)
    assert all(torch.equal(a, b) for a, b in zip(save_state(manager), eager_end)), "graph replay != eager"
    return {"decode_graph": statistics.median(graph_t[1:])}


def run_manager(manager, w: dict, args, reps: int, graph: bool) -> dict:
    """Latencies (us, medians) of the four phases on one manager."""
    device = manager.device
    out = {}
    prompt_t, release_t = [], []
    for rep in range(reps + 1):  # first repetition warms up (kernel compilation)
        t = timed(lambda: (manager.reserve_prompt(w["slots"], w["prompts"]),
                           manager.commit_prompt(w["slots"], w["high"], w["low"])), device)
        expect_ok(manager)
        r = timed(lambda: manager.release(w["slots"]), device)
        expect_ok(manager)
        if rep:
            prompt_t.append(t)
            release_t.append(r)
    out["prompt"], out["release"] = statistics.median(prompt_t), statistics.median(release_t)

    manager.reserve_prompt(w["slots"], w["prompts"])
    manager.commit_prompt(w["slots"], w["high"], w["low"])
    expect_ok(manager)
    start = save_state(manager)
    steps = w["dh"].shape[0] if device.type == "cuda" else min(w["dh"].shape[0], args.cpu_reps * 3)
    decode_t = []
    for t in range(steps):
        decode_t.append(timed(lambda: manager.append_decode(w["slots"], w["dh"][t], w["dl"][t]), device))
        expect_ok(manager)
    out["decode"] = statistics.median(decode_t[1:] if len(decode_t) > 2 else decode_t)
    eager_end = save_state(manager) if graph else None

    if graph:  # the same steps replayed from a CUDA graph with fixed input buffers
        try:
            out.update(graph_decode(manager, w, start, eager_end, steps))
        except Exception as exc:  # keep the eager numbers if capture fails on this stack
            out["graph_error"] = repr(exc)
            print("CUDA graph failed:", repr(exc), flush=True)
            load_state(manager, eager_end)

    manager.release(w["slots"])
    manager.reserve_prompt(w["slots"], w["prompts"])
    manager.commit_prompt(w["slots"], w["high_full"], w["low_full"])
    expect_ok(manager)
    full = save_state(manager)
    free_before = manager.free_pages()
    worst_t = []
    for rep in range(reps + 1):
        load_state(manager, full)
        t = timed(lambda: manager.append_decode(w["slots"], w["ones"], w["ones"]), device)
        expect_ok(manager)
        if rep:
            worst_t.append(t)
    assert free_before - manager.free_pages() == 2 * w["ones"].numel(), "worst case did not take 2 pages per row"
    out["decode_worst"] = statistics.median(worst_t)
    if graph and "graph_error" not in out:
        cuda_graph = torch.cuda.CUDAGraph()
        ones = w["ones"].clone()
        load_state(manager, full)
        with torch.cuda.graph(cuda_graph):
            manager.append_decode(w["slots"], ones, ones)
        graph_t = []
        for _ in range(reps):
            load_state(manager, full)
            graph_t.append(timed(cuda_graph.replay, device))
            expect_ok(manager)
        out["decode_worst_graph"] = statistics.median(graph_t)
    manager.release(w["slots"])
    expect_ok(manager)
    assert manager.free_pages() == manager.num_pages
    return out


# ------------------------------------------------------------------ references
def decode_attention_us(args, n, device, dtype) -> float:
    """One decode step's attention: SDPA of 1 query token per request over ``context`` keys, x layers."""
    group = args.q_heads // args.kv_heads
    q = torch.randn(n, args.kv_heads, group, args.head_dim, device=device, dtype=dtype)  # GQA: group as queries
    k = torch.randn(n, args.kv_heads, args.context, args.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    per_layer = bench_fn(lambda: F.scaled_dot_product_attention(q, k, v), device)
    del q, k, v
    return per_layer * args.layers


def prefill_us_per_request(args, device, dtype) -> dict:
    """One request's prefill: causal SDPA + the layer's matrix products over ``context`` tokens, x layers."""
    ctx, hd = args.context, args.head_dim
    q = torch.randn(1, args.q_heads, ctx, hd, device=device, dtype=dtype)
    k = torch.randn(1, args.q_heads, ctx, hd, device=device, dtype=dtype)  # KV heads expanded: same FLOPs
    v = torch.randn_like(k)
    attn = bench_fn(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device)
    h, i = args.hidden_size, args.intermediate_size
    x = torch.randn(ctx, h, device=device, dtype=dtype)
    w_qkv = torch.randn(h, (args.q_heads + 2 * args.kv_heads) * hd, device=device, dtype=dtype) / h**0.5
    w_o = torch.randn(args.q_heads * hd, h, device=device, dtype=dtype) / h**0.5
    w_up = torch.randn(h, 2 * i, device=device, dtype=dtype) / h**0.5
    w_down = torch.randn(i, h, device=device, dtype=dtype) / i**0.5
    xa = torch.randn(ctx, args.q_heads * hd, device=device, dtype=dtype)
    xi = torch.randn(ctx, i, device=device, dtype=dtype)
    linear = bench_fn(lambda: (x @ w_qkv, xa @ w_o, x @ w_up, xi @ w_down), device)
    flops = 2 * ctx * (h * w_qkv.shape[1] + w_o.shape[0] * h + h * 2 * i + i * h)
    return {"attention_us": attn * args.layers, "linear_us": linear * args.layers, "total_us": (attn + linear) * args.layers,
            "linear_tflops": flops / linear / 1e6}


# ------------------------------------------------------------------ main
def git_commit() -> str:
    if os.environ.get("DIFFKV_COMMIT"):
        return os.environ["DIFFKV_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "uncommitted"


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        from trtllm_diffkv.memory.triton_page_manager import TritonPageManager
    else:  # smoke run: the interpreter executes the Triton kernels on CPU tensors
        assert os.environ.get("TRITON_INTERPRET") == "1", "--device cpu needs TRITON_INTERPRET=1"
        from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4

        patch_interpreter_for_numpy_2_4()
        from trtllm_diffkv.memory.triton_page_manager import TritonPageManager
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    fmt = PageFormat.for_config(get_preset("llama3-8b"), args.head_dim)
    max_seq = args.context + 512
    prefill = prefill_us_per_request(args, device, torch.bfloat16 if device.type == "cuda" else dtype)
    print(f"prefill per request: {prefill}", flush=True)
    rows, details = [], []
    for n in args.requests:
        rows_per_request = args.layers * args.kv_heads
        num_pages = n * rows_per_request * (fmt.prompt_reserve_pages(args.context) + 4)
        geometry = (fmt, num_pages, n, args.layers, args.kv_heads, max_seq)
        work = Workload(args, fmt, n, device)
        gpu = TritonPageManager(*geometry, device=device)
        gpu_t = run_manager(gpu, work.on(device), args, args.reps, graph=device.type == "cuda")
        del gpu
        cpu = CpuPageManager(*geometry)
        cpu_t = run_manager(cpu, work.on("cpu"), args, args.cpu_reps, graph=False)
        del cpu
        attention = decode_attention_us(args, n, device, dtype)
        prefill_total = prefill["total_us"] * n
        kv_bytes = 2 * n * args.kv_heads * args.context * args.head_dim * 2 * args.layers
        details.append({"num_requests": n, "num_pages": num_pages, "decode_attention_us": attention,
                        "decode_attention_GBps": kv_bytes / attention / 1e3, "prefill_us": prefill_total})
        for phase in ("prompt", "decode", "decode_worst", "release"):
            reference, reference_us = ("prefill", prefill_total) if phase == "prompt" else ("decode_attention", attention)
            row = {
                "num_requests": n,
                "phase": phase,
                "gpu_us": round(gpu_t[phase], 2),
                "cpu_us": round(cpu_t[phase], 1),
                "speedup_vs_cpu": round(cpu_t[phase] / gpu_t[phase], 1),
                "fraction_of_attention": gpu_t[phase] / reference_us,
                "reference": reference,
                "reference_us": round(reference_us, 1),
            }
            if phase + "_graph" in gpu_t:
                row["gpu_graph_us"] = round(gpu_t[phase + "_graph"], 2)
                row["fraction_of_attention_graph"] = gpu_t[phase + "_graph"] / reference_us
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter smoke run)",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": git_commit(),
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
        "rows": rows,
        "shapes": {"layers": args.layers, "kv_heads": args.kv_heads, "q_heads": args.q_heads, "head_dim": args.head_dim,
                   "context_tokens": args.context, "max_seq_len_tokens": max_seq, "decode_steps": args.decode_steps},
        "page_format": fmt.describe(),
        "references": {"prefill_per_request": prefill, "per_batch": details},
        "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__,
                     "python": sys.version.split()[0], "cpu_threads": torch.get_num_threads()},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{'requests':>8} {'phase':>13} {'gpu_us':>9} {'graph_us':>9} {'cpu_us':>11} {'speedup':>8} {'fraction':>10}")
    for r in rows:
        print(f"{r['num_requests']:>8} {r['phase']:>13} {r['gpu_us']:>9.1f} {r.get('gpu_graph_us', float('nan')):>9.1f} "
              f"{r['cpu_us']:>11.0f} {r['speedup_vs_cpu']:>8.0f} {r['fraction_of_attention']:>10.2e}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
