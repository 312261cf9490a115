"""One decode step against its roofline: FP16, uniform K8V4 and a DiffKV preset side by side in one run (issues 19,
41: at equal batch, a DiffKV step should cost no more than a K8V4 step, since it reads fewer bytes).

For each point (model shape, batch, context) it measures, on one GPU:

* ``copy_bandwidth_gbps``: a device-to-device copy of 2 GiB (bytes read + bytes written over time),
  the ceiling every floor below divides by;
* ``weight_floor_ms``: the weight bytes one step must read (every parameter but the embedding table,
  which a step gathers ``batch`` rows of; a tied LM head is counted once) over the copy bandwidth;
* ``model_no_attention_ms``: the model's decode forward at ``batch`` tokens with attention replaced by
  the identity (:class:`NoAttention`: projections, norms, RoPE, MLP, LM head), one CUDA graph, replayed;
* ``step_ms``: the median of steady-state :meth:`Executor.step` calls through the public API, every
  request admitted and decoding (CUDA-graph decode, sampling and the host copy included);
* ``kv_bytes_read``: the pool bytes held by the batch at the timed steps (pages x page size + row
  metadata, :meth:`DiffKVResourceManager.stats` ``used_bytes``): the bytes one decode step reads
  when it reads every kept token of every row once; ``kv_floor_ms`` is that over the copy bandwidth.

The KV part of a step is ``step_ms - model_no_attention_ms``; its floor is ``kv_floor_ms``; the FP16
roofline is ``weight_floor_ms + kv_floor_ms`` of the ``fp16`` row. Models have random weights
(N(0, 0.02^2) matrices, :func:`trtllm_diffkv.evaluation.throughput.random_llama`) in bf16 and random prompt ids:
the step's cost depends on shapes and tier mixes, not on the weights' values (random weights give the
preset's alpha-driven tier split all the same; the preset's measured ``kv_bytes_read`` records it).

Writes ``benchmarks/results/step.json`` (``{"gpu", "date", "commit", "command",
"copy_bandwidth_gbps", "rows": [...]}``, row fields :data:`ROW_FIELDS`) and beside it
``step_profile.json``: the per-kernel device time of a few profiled steps (torch profiler) at each
shape's largest point.

    python benchmarks/bench_step.py                      # H200: Llama-3-8B shape at 4 points + SmolLM2 shape
    python benchmarks/bench_step.py --smoke --output /tmp/step.json    # CPU, a tiny model, seconds
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trtllm_diffkv.config import get_preset  # noqa: E402
from trtllm_diffkv.engine_config import EngineConfig  # noqa: E402
from trtllm_diffkv.model import ModelConfig  # noqa: E402
from trtllm_diffkv.runtime.executor import Executor  # noqa: E402
from trtllm_diffkv.runtime.sampling import SamplingParams  # noqa: E402
from trtllm_diffkv.evaluation.throughput import (LLAMA3_8B_SHAPE, TINY_SHAPE, environment,  # noqa: E402
                                      fp16_kv_bytes_per_token, random_llama)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULT_OUTPUT = os.path.join(RESULTS, "step.json")
ROW_FIELDS = ("shape", "batch", "context_tokens", "preset", "step_ms", "model_no_attention_ms", "kv_bytes_read",
              "kv_floor_ms", "weight_floor_ms", "overlap")
"""Keys of one ``rows`` entry of ``step.json``, in order (the issue's schema, then ``overlap``: whether the
executor ran with its overlap scheduler, ``disable_overlap_scheduler=False``)."""

SMOLLM2_135M_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                          max_position_embeddings=8192, tie_word_embeddings=True)
"""The default model's (SmolLM2-135M-Instruct) shape."""


@dataclass(frozen=True)
class StepShape:
    """A model shape, the DiffKV preset it runs and its ``(batch, context_tokens)`` points."""

    name: str
    config: dict
    preset: str
    points: tuple[tuple[int, int], ...]


def default_shapes(smoke: bool = False) -> list[StepShape]:
    """The issue's points: Llama-3-8B shape at 16/64 x 1024 and 16/48 x 4096 (``llama3-8b``), the default
    model's shape at 64 x 1024 (``diffkv``, the tiered point); ``smoke``: a 2-layer model at 2 x 24 and 3 x 40 (CPU)."""
    if smoke:
        return [StepShape("tiny", TINY_SHAPE, "diffkv", ((2, 24), (3, 40)))]
    return [StepShape("llama3-8b", LLAMA3_8B_SHAPE, "llama3-8b", ((16, 1024), (64, 1024), (16, 4096), (48, 4096))),
            StepShape("smollm2-135m", SMOLLM2_135M_SHAPE, "diffkv", ((64, 1024),))]


# --------------------------------------------------------------------------------------- timing
def median_ms(fn, device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in ms: CUDA events around each call on a GPU, ``perf_counter`` on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbps(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy bandwidth in GB/s (1e9 bytes): ``2 * nbytes`` (read + write) over the median
    copy time of a random ``nbytes`` buffer (random, not zeros: METHOD.md)."""
    src = torch.randint(0, 2**15, (nbytes // 2,), dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, repeats=20)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: every parameter once (shared ones once), less the embedding
    table (a step gathers only its tokens' rows) unless the LM head is that table."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    if model.lm_head.weight is not embed:
        total -= embed.numel() * embed.element_size()
    return total


class NoAttention:
    """An :class:`~trtllm_diffkv.model.attention_api.AttentionBackend` that returns ``q`` unchanged
    (``[num_tokens, num_heads, head_dim]``): the model's step with attention cut out, nothing stored."""

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q


def model_no_attention_ms(model, batch: int, context_tokens: int, repeats: int) -> float:
    """Median ms of the decode forward of ``batch`` tokens at position ``context_tokens`` with
    :class:`NoAttention`: one CUDA graph replayed on a GPU, eager on the CPU."""
    device = model.device
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch,), generator=g).to(device)
    positions = torch.full((batch,), context_tokens, dtype=torch.int64, device=device)
    backend = NoAttention()
    with torch.inference_mode():
        if device.type != "cuda":
            return median_ms(lambda: model(ids, positions, backend), device, repeats)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                model(ids, positions, backend)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(ids, positions, backend)
        ms = median_ms(graph.replay, device, repeats)
        del graph
        return ms


# --------------------------------------------------------------------------------------- executor steps
def kv_budget_bytes(config: ModelConfig, batch: int, max_seq_len: int) -> int:
    """One KV budget for both presets of a point: 1.5 x the FP16 bytes of ``batch`` full requests plus
    256 MiB (pages' rounding, the decode reserve, page-manager bookkeeping and row metadata)."""
    return int(1.5 * batch * max_seq_len * fp16_kv_bytes_per_token(config)) + (256 << 20)


def executor_steps(model, preset: str, batch: int, context_tokens: int, *, timed_steps: int, warm_steps: int,
                   profile_steps: int = 0, overlap: bool = True) -> dict:
    """Steady-state decode steps of ``batch`` requests of ``context_tokens``-token prompts.

    Every request is added at once; the executor prefills them (``max_num_tokens`` per step, decoding the
    admitted ones meanwhile); once every request is decoding, ``warm_steps`` steps run, then ``timed_steps``
    timed ones (each step returns after its one host read, so wall time is device time plus the host work not
    overlapped with it). ``overlap``: the executor's overlap scheduler (a step launches the next decode step
    before it reads the last one), else every step is read before it returns.

    Returns:
        dict: ``step_ms`` (median), ``step_ms_all`` (each timed step), ``kv_bytes_read`` (pool bytes used
        at the timed steps), ``kv_memory_fraction``, ``use_cuda_graphs``, ``profile`` (kernel rows of
        ``profile_steps`` profiled steps after the timed ones, or ``[]``), ``host`` (:func:`profile_host` of
        ``profile_steps`` more steps, or ``[]``).

    Raises:
        RuntimeError: a request failed or finished before the timed steps ended, or not every request
            was decoding.
    """
    device, config = model.device, model.config
    cuda = device.type == "cuda"
    max_num_tokens = max(8192, context_tokens + 1)
    prefill_steps = math.ceil(batch * context_tokens / max_num_tokens) + batch  # decodes while the rest prefill
    max_tokens = prefill_steps + warm_steps + timed_steps + 2 * profile_steps + 4
    max_seq_len = context_tokens + max_tokens
    engine = EngineConfig(max_batch_size=batch, max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
                          kv_memory_bytes=kv_budget_bytes(config, batch, max_seq_len),
                          use_triton=None if cuda else False, use_cuda_graphs=cuda, disable_overlap_scheduler=not overlap)
    executor = Executor(model, config, get_preset(preset), engine)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config.vocab_size, (batch, context_tokens), generator=g).tolist()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        executor.add_request(prompt, params)

    def step():
        updates = executor.step()
        bad = [u for u in updates if u.finished]
        if bad:
            raise RuntimeError(f"request {bad[0].request_id} ended early: {bad[0].finish_reason} {bad[0].error}")
        return updates

    for _ in range(prefill_steps + 1):  # the inbox drains at the first step
        if len(executor.running) == batch and all(r.output_token_ids for r in executor.running):
            break
        step()
    else:
        raise RuntimeError(f"{len(executor.running)} of {batch} requests decoding after {prefill_steps + 1} steps")
    for _ in range(warm_steps):
        step()
    stats = executor.stats()
    times = []
    for _ in range(timed_steps):
        t0 = time.perf_counter()
        updates = step()
        times.append((time.perf_counter() - t0) * 1e3)
        if len(updates) != batch:
            raise RuntimeError(f"a timed step advanced {len(updates)} of {batch} requests")
    kernels = profile_kernels(step, device, profile_steps) if profile_steps else []
    host = profile_host(step, profile_steps) if profile_steps else []
    out = dict(step_ms=statistics.median(times), step_ms_all=times, kv_bytes_read=int(stats["used_bytes"]),
               kv_memory_fraction=stats["kv_memory_fraction"], use_cuda_graphs=executor.use_cuda_graphs,
               profile=kernels, host=host)
    del executor
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def profile_kernels(step, device: torch.device, steps: int) -> list[dict]:
    """Device time per kernel of ``steps`` calls of ``step()`` (torch profiler; CPU ops on the CPU).

    Returns:
        ``[{"name", "us_per_step", "calls_per_step"}]``, the most expensive first.
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if on_device != cuda:
            continue
        us = event.device_time if cuda else event.cpu_time
        totals.setdefault(event.name, []).append(us)
    rows = [dict(name=name, us_per_step=sum(v) / steps, calls_per_step=len(v) / steps) for name, v in totals.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def profile_host(step, steps: int, top: int = 30) -> list[dict]:
    """Host time per Python function over ``steps`` calls of ``step()`` (cProfile; its own overhead included, so
    the sums exceed the unprofiled step: read the shares, not the totals).

    Returns:
        the ``top`` functions by own time: ``[{"function", "own_us_per_step", "cumulative_us_per_step",
        "calls_per_step"}]``.
    """
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
        where = f"{os.path.relpath(path) if path.startswith('/') else path}:{line}({name})"
        rows.append(dict(function=where, own_us_per_step=own / steps * 1e6, cumulative_us_per_step=cum / steps * 1e6,
                         calls_per_step=calls / steps))
    return sorted(rows, key=lambda r: -r["own_us_per_step"])[:top]


# --------------------------------------------------------------------------------------- the run
def step_presets(shape: StepShape) -> tuple[str, ...]:
    """The presets of each point, in order: ``fp16``, the uniform ``k8v4``, then the shape's DiffKV preset."""
    return tuple(dict.fromkeys(("fp16", "k8v4", shape.preset)))


def run(shapes: list[StepShape], device: torch.device, *, timed_steps: int, warm_steps: int, repeats: int,
        profile_steps: int, copy_bytes: int, overlaps: tuple[bool, ...] = (True,), log=print) -> tuple[dict, dict]:
    """Measure every point of ``shapes`` (per ``overlaps`` entry, :func:`step_presets` in order; the profile with
    the first entry); ``(step, profile)`` JSON dicts."""
    env = environment()
    bandwidth = copy_bandwidth_gbps(device, copy_bytes)
    log(f"copy bandwidth {bandwidth:.0f} GB/s on {env['gpu']}")
    rows, profiles = [], []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for shape in shapes:
        model = random_llama(ModelConfig(**shape.config), device=device, dtype=dtype)
        weight_floor_ms = weight_bytes_per_step(model) / (bandwidth * 1e9) * 1e3
        largest = max(shape.points, key=lambda p: p[0] * p[1])
        for batch, context in shape.points:
            model_ms = model_no_attention_ms(model, batch, context, repeats)
            for overlap, preset in [(o, p) for o in overlaps for p in step_presets(shape)]:
                profiled = profile_steps if (batch, context) == largest and overlap == overlaps[0] else 0
                measured = executor_steps(model, preset, batch, context, timed_steps=timed_steps,
                                          warm_steps=warm_steps, profile_steps=profiled, overlap=overlap)
                row = dict(shape=shape.name, batch=batch, context_tokens=context, preset=preset,
                           step_ms=measured["step_ms"], model_no_attention_ms=model_ms,
                           kv_bytes_read=measured["kv_bytes_read"],
                           kv_floor_ms=measured["kv_bytes_read"] / (bandwidth * 1e9) * 1e3,
                           weight_floor_ms=weight_floor_ms, overlap=overlap)
                rows.append(row)
                log(f"{shape.name:13s} {batch:3d} x {context:5d} {preset:10s} overlap {overlap:d} "
                    f"step {row['step_ms']:8.3f} ms  "
                    f"model alone {model_ms:7.3f}  KV part {row['step_ms'] - model_ms:7.3f} (floor "
                    f"{row['kv_floor_ms']:.3f})  weights floor {weight_floor_ms:.3f}  graphs "
                    f"{measured['use_cuda_graphs']}")
                if profiled:
                    profiles.append(dict(shape=shape.name, batch=batch, context_tokens=context, preset=preset,
                                         overlap=overlap, steps=profiled, use_cuda_graphs=measured["use_cuda_graphs"],
                                         kernels=measured["profile"], host=measured["host"]))
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    step = dict(**env, command="", copy_bandwidth_gbps=bandwidth, rows=rows)
    return step, dict(**env, command="", rows=profiles)


def summary(step: dict) -> str:
    """A text table of ``step.json``: each point's FP16 roofline, model alone, the fp16, k8v4 and DiffKV steps, the
    DiffKV step over fp16's and over k8v4's, and each step's KV part over its floor."""
    lines = [f"{'shape':13s} {'point':>11s} {'overlap':>7s} {'roofline fp16':>13s} {'model alone':>11s} "
             f"{'fp16 step':>9s} {'k8v4 step':>9s} {'DiffKV step':>11s} {'/fp16':>6s} {'/k8v4':>6s} "
             f"{'KV part/floor fp16':>18s} {'k8v4':>6s} {'DiffKV':>7s}"]
    by_point: dict[tuple, dict] = {}
    for row in step["rows"]:
        key = (row["shape"], row["batch"], row["context_tokens"], row.get("overlap", False))
        by_point.setdefault(key, {})[row["preset"]] = row
    part = lambda r: (r["step_ms"] - r["model_no_attention_ms"]) / r["kv_floor_ms"]  # noqa: E731
    for (shape, batch, context, overlap), rows in by_point.items():
        fp16, k8v4 = rows.pop("fp16"), rows.pop("k8v4", None)
        diffkv = next(iter(rows.values()), k8v4)
        roof = fp16["weight_floor_ms"] + fp16["kv_floor_ms"]
        k8v4_ms = f"{k8v4['step_ms']:9.2f}" if k8v4 else f"{'':9s}"
        over_k8v4 = f"{diffkv['step_ms'] / k8v4['step_ms']:6.2f}" if k8v4 else f"{'':6s}"
        k8v4_part = f"{part(k8v4):6.2f}" if k8v4 else f"{'':6s}"
        lines.append(f"{shape:13s} {batch:4d}x{context:<6d} {'on' if overlap else 'off':>7s} {roof:13.2f} "
                     f"{fp16['model_no_attention_ms']:11.2f} {fp16['step_ms']:9.2f} {k8v4_ms} {diffkv['step_ms']:11.2f} "
                     f"{diffkv['step_ms'] / fp16['step_ms']:6.2f} {over_k8v4} {part(fp16):18.2f} {k8v4_part} "
                     f"{part(diffkv):7.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="bench_step.py", description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (a CI check, seconds)")
    ap.add_argument("--device", default=None, help="default: cuda when available (cpu with --smoke)")
    ap.add_argument("--output", default=DEFAULT_OUTPUT, help="step.json path (step_profile.json goes beside it)")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names to run (default: all)")
    ap.add_argument("--timed-steps", type=int, default=None, help="timed executor steps per row (default 20; 3)")
    ap.add_argument("--profile-steps", type=int, default=None, help="profiled steps at each shape's largest point")
    ap.add_argument("--points", default=None, help="comma-separated BATCHxCONTEXT points to run, e.g. 48x4096 "
                    "(default: every point of each shape)")
    ap.add_argument("--overlap", choices=("on", "off", "both"), default="on",
                    help="the executor's overlap scheduler: on (its GPU default), off, or both side by side "
                         "(profiled: the first, on)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    shapes = default_shapes(args.smoke)
    if args.shapes:
        wanted = args.shapes.split(",")
        unknown = sorted(set(wanted) - {s.name for s in shapes})
        if unknown:
            ap.error(f"--shapes: unknown {unknown}; known: {[s.name for s in shapes]}")
        shapes = [s for s in shapes if s.name in wanted]
    if args.points:
        try:
            wanted = {tuple(int(x) for x in point.split("x")) for point in args.points.split(",")}
        except ValueError:
            ap.error(f"--points: {args.points!r} is not BATCHxCONTEXT[,BATCHxCONTEXT...]")
        shapes = [dataclasses.replace(s, points=tuple(p for p in s.points if p in wanted)) for s in shapes]
        shapes = [s for s in shapes if s.points]
        if not shapes:
            ap.error(f"--points: none of {sorted(wanted)} is a point of the shapes run")
    timed = args.timed_steps or (3 if args.smoke else 20)
    profile_steps = args.profile_steps if args.profile_steps is not None else (1 if args.smoke else 3)
    step, prof = run(shapes, device, timed_steps=timed, warm_steps=1 if args.smoke else 5,
                     repeats=3 if args.smoke else 50, profile_steps=profile_steps,
                     copy_bytes=(8 << 20) if args.smoke else (2 << 30),
                     overlaps={"on": (True,), "off": (False,), "both": (True, False)}[args.overlap])
    step["command"] = prof["command"] = "python benchmarks/bench_step.py " + shlex.join(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(step, f, indent=1)
    with open(os.path.join(os.path.dirname(os.path.abspath(args.output)), "step_profile.json"), "w") as f:
        json.dump(prof, f, indent=1)
    print(summary(step))
    for p in prof["rows"]:
        print(f"profile {p['shape']} {p['batch']}x{p['context_tokens']} {p['preset']} (us per step, top 12)")
        for k in p["kernels"][:12]:
            print(f"    {k['us_per_step']:9.1f} us  x{k['calls_per_step']:5.0f}  {k['name'][:90]}")
        print(f"  host, own time per step (cProfile, top 8): " + "; ".join(
            f"{h['function'].rsplit('/', 1)[-1][:48]} {h['own_us_per_step']:.0f} us" for h in p["host"][:8]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
