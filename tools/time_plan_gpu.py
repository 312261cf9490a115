"""Per decode step: the paged cache's plan() against the model forward, eager vs CUDA-graph replay (issue 7).

Model: the default model's shape (SmolLM2-135M: hidden 576, 9/3 heads, head_dim 64, intermediate
1536, vocab 49152) with ``--layers`` layers (30) and random weights (q/k scaled so attention is
peaked and the tiers split), fp16, preset ``--preset`` (``diffkv``, the tiered point). For each batch in ``--batches``
(16 and 64 requests) of ``--context``-token prompts (1024), prefilled in chunks, then per mode:

* ``plan_torch``: ``plan()`` with the decisions in torch (``paged.decisions.decide``, the path
  before the decision kernel; ``cache.use_triton`` switched off for the plan only);
* ``eager``: ``plan()`` (decision kernel) + the eager forward;
* ``graph_fwd``: ``plan(..., pad_to=bucket)`` with its launches eager + the forward's graph replay;
* ``graph``: the same with the plan's device work replayed from its graph too
  (:class:`DecodeGraphRunner` with ``capture_plan=True``).

Reported per mode (medians over ``--steps`` steps): ``plan_ms`` (host call to device done: the
plan's full cost when nothing overlaps it), ``plan_host_ms`` (the Python call alone),
``plan_gpu_ms`` (CUDA events around the plan's launches), ``forward_ms`` (host call to device
done), ``step_ms`` (plan + forward + argmax + the token read, back to back) and
``bookkeeping_fraction = plan_ms / step_ms``. Then ``plan_kernels_us``: the device time of each
kernel of the padded plan (torch.profiler, 3 steps): decisions, the page manager's two launches,
locations, the moves' read and write, the host-to-device copy.

Usage (device): ``python3 tools/time_plan_gpu.py`` (writes ``$OUT/time_plan.json`` or ``--out``).
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from trtllm_diffkv.config import get_preset  # noqa: E402
from trtllm_diffkv.memory import PageFormat  # noqa: E402
from trtllm_diffkv.model import LlamaForCausalLM, ModelConfig  # noqa: E402
from trtllm_diffkv.engine_config import EngineConfig  # noqa: E402
from trtllm_diffkv.paged import PagedDiffKVCache  # noqa: E402
from trtllm_diffkv.runtime.cuda_graphs import DecodeGraphRunner  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per mode")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--preset", default="diffkv")
    p.add_argument("--prefill-chunk", type=int, default=8, help="requests per prefill step")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/time_plan.json)")
    p.add_argument("--device", default="cuda", help="cpu (with TRITON_INTERPRET=1, tiny sizes): a smoke run "
                   "of the same code without the graph mode")
    p.add_argument("--hidden-size", type=int, default=576)
    p.add_argument("--intermediate-size", type=int, default=1536)
    p.add_argument("--vocab-size", type=int, default=49152)
    return p.parse_args(argv)


def build_model(args) -> LlamaForCausalLM:
    cfg = ModelConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                      intermediate_size=args.intermediate_size, num_layers=args.layers, num_heads=9,
                      num_kv_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)
    g = torch.Generator().manual_seed(0)
    model = LlamaForCausalLM(cfg)
    weights = {name: torch.randn(size, generator=g) * (0.3 if "q_proj" in name or "k_proj" in name else 0.05)
               if len(size) > 1 else torch.ones(size) for name, size in model.expected_weight_shapes().items()}
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    return LlamaForCausalLM.from_weights(cfg, weights).to(args.device, dtype)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Batch:
    """The requests of one run: slots, lengths, next tokens (host lists)."""

    def __init__(self, model, cache, n: int, context: int, chunk: int) -> None:
        self.model, self.cache, self.slots = model, cache, list(range(n))
        self.lens, self.toks = [context] * n, [0] * n
        g = torch.Generator().manual_seed(1)
        with torch.inference_mode():
            for s0 in range(0, n, chunk):
                slots = self.slots[s0:s0 + chunk]
                ids = torch.randint(0, model.config.vocab_size, (len(slots) * context,), generator=g).to(model.device)
                positions = torch.arange(context, device=model.device).repeat(len(slots))
                cache.plan(slots, [context] * len(slots), [0] * len(slots), [True] * len(slots))
                last = torch.arange(1, len(slots) + 1, device=model.device) * context - 1
                logits = model(ids, positions, cache, logits_indices=last)
                cache.end_step()
                for i, s in enumerate(slots):
                    self.toks[s] = int(logits[i].argmax())

    def plan_args(self):
        n = len(self.slots)
        return self.slots, [x + 1 for x in self.lens], list(self.lens), [False] * n

    def advance(self, logits) -> None:
        self.toks = logits.argmax(-1).tolist()  # the step's one token read
        self.lens = [x + 1 for x in self.lens]


def _time_mode(batch: Batch, mode: str, runner, steps: int, warmup: int) -> dict:
    cache, model = batch.cache, batch.model
    n = len(batch.slots)
    rows = {k: [] for k in ("plan_ms", "plan_host_ms", "plan_gpu_ms", "forward_ms", "step_ms")}
    cuda = cache.device.type == "cuda"
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.inference_mode():
        for i in range(warmup + steps):
            sync()
            t0 = time.perf_counter()
            if cuda:
                start.record()
            if mode == "plan_torch":
                cache.use_triton = False
                try:
                    cache.plan(*batch.plan_args())
                finally:
                    cache.use_triton = True
            elif mode in ("graph", "graph_fwd"):
                cache.plan(*batch.plan_args(), pad_to=runner.bucket_for(n))
            else:
                cache.plan(*batch.plan_args())
            t1 = time.perf_counter()
            if cuda:
                end.record()
            sync()
            t2 = time.perf_counter()
            ids = torch.tensor(batch.toks, device=cache.device)
            positions = torch.tensor(batch.lens, device=cache.device)
            if mode in ("graph", "graph_fwd"):
                logits = runner.run(ids, positions)
            else:
                logits = model(ids, positions, cache)
                cache.end_step()
            sync()
            t3 = time.perf_counter()
            batch.advance(logits)
            t4 = time.perf_counter()
            if i >= warmup:
                rows["plan_ms"].append((t2 - t0) * 1e3)
                rows["plan_host_ms"].append((t1 - t0) * 1e3)
                rows["plan_gpu_ms"].append(start.elapsed_time(end) if cuda else 0.0)
                rows["forward_ms"].append((t3 - t2) * 1e3)
                rows["step_ms"].append((t4 - t0) * 1e3)
    out = {k: round(statistics.median(v), 4) for k, v in rows.items()}
    out["bookkeeping_fraction"] = round(out["plan_ms"] / out["step_ms"], 4)
    if not cuda:
        out["plan_gpu_ms"] = None
    return out


def profile_plan(batch: Batch, runner, steps: int = 3) -> dict:
    """Device time (us per step) of each kernel the padded plan launches (torch.profiler), plus the H2D copy."""
    from torch.profiler import ProfilerActivity, profile

    cache, n = batch.cache, len(batch.slots)
    names = ("_decide_kernel", "_count_kernel", "_scan_kernel", "_decode_apply_kernel", "_locate_kernel",
             "_read_tokens_kernel", "_write_tokens_kernel", "Memcpy HtoD")
    out = {}
    with torch.inference_mode():
        for _ in range(steps):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:  # the plan only
                cache.plan(*batch.plan_args(), pad_to=runner.bucket_for(n))
                torch.cuda.synchronize()
            for evt in prof.key_averages():
                for name in names:
                    if name in evt.key:
                        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
                        out[name] = round(out.get(name, 0.0) + total / steps, 2)
            logits = runner.run(torch.tensor(batch.toks, device="cuda"), torch.tensor(batch.lens, device="cuda"))
            batch.advance(logits)
    out["total"] = round(sum(out.values()), 2)
    return out


def run_batch(args, model, n: int) -> list[dict]:
    kv = get_preset(args.preset)
    mc = model.config
    decode_tokens = 4 * (args.warmup + args.steps) + 8  # four modes and the profiled steps, one token each
    total = args.context + decode_tokens
    fmt = PageFormat.for_config(kv, mc.head_dim, 32)
    per_row = fmt.prompt_reserve_pages(args.context) + fmt.pages_for_tokens("high", decode_tokens) + \
        fmt.pages_for_tokens("low", decode_tokens) + 4  # + the worst case of one step (plan's check)
    num_pages = n * mc.num_layers * mc.num_kv_heads * per_row
    cache = PagedDiffKVCache(kv, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                             EngineConfig(max_batch_size=n, max_seq_len=total,
                                          max_num_tokens=args.prefill_chunk * args.context, device=model.device,
                                          high_tokens_per_page=32), num_pages=num_pages, dtype=model.dtype)
    cuda = model.device.type == "cuda"
    t0 = time.perf_counter()
    runner = DecodeGraphRunner(model, cache, buckets=(n,)) if cuda else None
    capture_s = time.perf_counter() - t0
    batch = Batch(model, cache, n, args.context, args.prefill_chunk)
    plan_graphs = cache.plan_graphs
    rows = []
    for mode in ("plan_torch", "eager", "graph_fwd", "graph") if cuda else ("plan_torch", "eager"):
        # plan graphs only in "graph" (captured during its warm-up steps, then replayed)
        cache.plan_graphs, cache.capture_plan_graphs = (plan_graphs, True) if mode == "graph" else ({}, False)
        r = _time_mode(batch, mode, runner, args.steps, args.warmup)
        if mode == "graph":
            r["capture_s"] = round(capture_s, 2)
        r.update(batch=n, context=args.context, layers=mc.num_layers, mode=mode, preset=args.preset,
                 pool_pages=num_pages)
        print(json.dumps(r), flush=True)
        rows.append(r)
    if cuda:
        cache.plan_graphs, cache.capture_plan_graphs = {}, False  # the plan's kernels one by one
        rows.append(dict(batch=n, mode="plan_kernels_us", **profile_plan(batch, runner)))
        print(json.dumps(rows[-1]), flush=True)
    stats = [cache.request_stats(s) for s in batch.slots[:2]]
    print("tiers of two requests (high, low, pruned tokens):",
          [(s.high_tokens, s.low_tokens, s.pruned_tokens) for s in stats], flush=True)
    cache.release(batch.slots)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1 for a smoke run)", file=sys.stderr)
        return 2
    if args.device != "cuda":
        from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4

        patch_interpreter_for_numpy_2_4()
    model = build_model(args)
    rows = []
    for n in args.batches:
        rows += run_batch(args, model, n)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip() or os.environ.get("DIFFKV_COMMIT", "unknown")
    except OSError:
        commit = os.environ.get("DIFFKV_COMMIT", "unknown")
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke run)"
    command = "python3 " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:])
    result = dict(gpu=gpu, date=datetime.datetime.now(datetime.timezone.utc).isoformat(), commit=commit,
                  command=command, torch=torch.__version__, rows=rows)
    path = args.out or os.path.join(os.environ.get("OUT", "."), "time_plan.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)
    print(f"{'batch':>5} {'mode':>10} {'plan_ms':>8} {'host_ms':>8} {'gpu_ms':>7} {'fwd_ms':>7} {'step_ms':>8} "
          f"{'frac':>6}")
    for r in rows:
        if "plan_ms" in r:
            print(f"{r['batch']:>5} {r['mode']:>10} {r['plan_ms']:>8.3f} {r['plan_host_ms']:>8.3f} "
                  f"{r['plan_gpu_ms'] or 0:>7.3f} {r['forward_ms']:>7.3f} {r['step_ms']:>8.3f} "
                  f"{r['bookkeeping_fraction']:>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
