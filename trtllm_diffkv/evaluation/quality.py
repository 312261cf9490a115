"""Quality against KV memory: every method through the same cache protocol, metrics with noise bands.

For each case (:mod:`trtllm_diffkv.evaluation.tasks`) the gold span is teacher-forced through
the ``fp16`` cache (the reference) and through every method's cache
(:data:`METHOD_POINTS`: DiffKV presets and threshold points, and the baselines of
:mod:`trtllm_diffkv.evaluation.baselines`), one request at a time on the reference path.
Per case and method (:func:`case_metrics`):

* ``top1_agreement``: share of span steps whose argmax equals fp16's;
* ``mean_kl_nats``: mean over span steps of ``KL(p_fp16 || p)``;
* ``span_logprob``: mean log-probability of the gold span tokens (nats per token);
* ``span_top1``: share of span tokens that are the argmax (top-1 accuracy of the recalled span);
* ``span_exact``: 1 when every span token is the argmax. Under teacher forcing this equals
  "greedy decoding reproduces the span", so it is the task's generation accuracy;
* ``pass_at_1`` (``humaneval`` only): greedy completion graded by the unit tests.

Each figure is the mean over cases with a 95 % percentile bootstrap interval over cases
(:func:`bootstrap_ci`); ``*_delta_vs_fp16`` rows are paired differences against fp16 on the
same cases (the noise band of "within noise of FP16": the interval contains 0).
``kv_memory_fraction`` is the mean over cases of the cache's bytes / FP16 bytes at the end of
the forced span (:class:`~trtllm_diffkv.cache.CacheStats`).
"""
from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch

from .accuracy import teacher_forced_logits, teacher_forced_logits_shared_prefill
from ..cache import DiffKVReferenceCache
from ..config import DiffKVConfig, get_preset, replaced_atomically, resolve_kv_config
from ..generation.reference import ReferenceGenerator
from . import baselines
from .tasks import HUMANEVAL_STOP_SEQUENCES, Case, run_humaneval_tests, truncate_completion

BOOTSTRAP_RESAMPLES = 1000
CI_LEVEL = 0.95
REFERENCE_METHOD = "fp16"
PAIRED_METRICS = ("span_top1", "span_logprob", "span_exact", "pass_at_1")
PRIMARY_METRIC = {"humaneval": "pass_at_1"}
"""Metric of each task's Pareto panel (default ``span_top1``)."""


@dataclass(frozen=True)
class MethodPoint:
    """One memory point of one method.

    Attributes:
        method: the curve it belongs to (``fp16``, ``diffkv``, ``k8v8``, ``kivi``, ``snapkv`` ...).
        config: what distinguishes the point (preset, thresholds, bits, budget), for the JSON.
        build: ``(model_config, max_seq_len_tokens, device) -> cache`` (a one-request backend
            with ``stats()``).
        kv_config: the DiffKV configuration when the point is a DiffKV cache, else ``None``.
    """

    method: str
    config: str
    build: Callable
    kv_config: DiffKVConfig | None = None


def _diffkv_point(method: str, label: str, cfg: DiffKVConfig) -> MethodPoint:
    def build(mc, n, device):  # the model's sliding-window layers enter the policy here (DiffKVConfig.for_model)
        return DiffKVReferenceCache(cfg.for_model(mc), mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim, n,
                                    device)
    return MethodPoint(method, label, build, cfg)


def _baseline_point(method: str, label: str, cls, *args, **kw) -> MethodPoint:
    def build(mc, n, device):
        return cls(*args, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim, n, device, **kw)
    return MethodPoint(method, label, build)


EVICTION_BUDGETS = (0.2, 0.35)
"""Budget fractions of the eviction baselines (tokens kept per head / prompt tokens)."""


def method_points() -> list[MethodPoint]:
    """The default sweep: fp16 first (the reference), DiffKV points, then the baselines."""
    # The `diffkv` curve is the unrotated tiers (`default-unrotated`, the default until the rotated point won;
    # quality.json rows measured before that name it "default (ah=1, al=0)"); `diffkv-rotated` is the `diffkv`
    # preset (the tiered point; `default` until issue 41 made `default` uniform K8V4).
    default = get_preset("default-unrotated")
    points = [_diffkv_point("fp16", "fp16", get_preset("fp16")),
              _diffkv_point("diffkv", "default-unrotated (ah=1, al=0)", default),
              _diffkv_point("diffkv", "ah=1, al=0.005", default.replace(alpha_low=0.005, name="al005")),
              _diffkv_point("diffkv", "ah=1, al=0.02 (paper llama3-8b)", get_preset("llama3-8b")),
              _diffkv_point("k8v4", "k8v4 preset (every token K8V4, centred keys)", get_preset("k8v4")),
              _baseline_point("k8v8", "K8V8 per token", baselines.UniformQuantCache, 8, 8),
              _baseline_point("k4v4", "K4V4 per token", baselines.UniformQuantCache, 4, 4),
              _baseline_point("kivi", "KIVI-4 (G=32, R=128)", baselines.KIVICache, 4),
              _baseline_point("kivi", "KIVI-2 (G=32, R=128)", baselines.KIVICache, 2)]
    # The low-tier options of issue 18 section 3 (config.py: key_rotation, score_pool_tokens, K8V2) and the paper's rules.
    k8v2, rotated = get_preset("default-k8v2"), get_preset("diffkv")
    pooled = default.replace(score_pool_tokens=5, name="pool5")
    points += [_diffkv_point("paper", "paper preset (alpha/i, no centring, ah=1, al=0.02)", get_preset("paper")),
               _diffkv_point("diffkv-k8v2", "low K8V2, ah=1, al=0", k8v2),
               _diffkv_point("diffkv-k8v2", "low K8V2, ah=1, al=0.02", k8v2.replace(alpha_low=0.02)),
               _diffkv_point("diffkv-rotated", "Hadamard keys, low K4V2, ah=1, al=0", rotated),
               _diffkv_point("diffkv-rotated", "Hadamard keys, low K4V2, ah=1, al=0.02", rotated.replace(alpha_low=0.02)),
               _diffkv_point("diffkv-pool", "score pool 5, ah=1, al=0.005", pooled.replace(alpha_low=0.005)),
               _diffkv_point("diffkv-pool", "score pool 5, ah=1, al=0.01", pooled.replace(alpha_low=0.01)),
               _diffkv_point("diffkv-pool", "score pool 5, ah=1, al=0.02", pooled.replace(alpha_low=0.02))]
    rotated_pooled = rotated.replace(score_pool_tokens=5, name="rotated-pool5")
    points += [_diffkv_point("diffkv-rotated-pool", f"Hadamard keys, score pool 5, ah=1, al={al}",
                             rotated_pooled.replace(alpha_low=al)) for al in (0.01, 0.02)]
    for cls, name in ((baselines.SnapKVCache, "snapkv"), (baselines.H2OCache, "h2o"),
                      (baselines.StreamingLLMCache, "streamingllm")):
        for budget in EVICTION_BUDGETS:
            points.append(_baseline_point(name, f"budget={budget}", cls, budget))
    return points


def custom_point(spec) -> MethodPoint:
    """A DiffKV point (curve ``custom``) from a preset name or a kv-config file (:func:`resolve_kv_config`).

    Raises:
        ValueError, FileNotFoundError: as :func:`~trtllm_diffkv.config.resolve_kv_config`.
    """
    cfg = resolve_kv_config(spec)
    return _diffkv_point("custom", f"{spec} ({cfg.name})", cfg)


def select_points(points: list[MethodPoint], methods: list[str] | None,
                  picks: list[str] | None = None) -> list[MethodPoint]:
    """The points of the named methods (curves) and the single points ``picks`` names (``"METHOD=CONFIG"``,
    ``CONFIG`` the point's exact label, e.g. ``"snapkv=budget=0.35"``); fp16 (first) and ``custom`` points
    (``--kv-config``) always. Neither given: every point.

    Raises:
        ValueError: an unknown method name or a pick that names no point, listing the known ones.
    """
    if not methods and not picks:
        return points
    known = sorted({p.method for p in points})
    unknown = sorted(set(methods or ()) - set(known))
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known methods: {known}")
    labels = {f"{p.method}={p.config}" for p in points}
    for pick in picks or ():
        if pick not in labels:
            raise ValueError(f"--point {pick!r} names no point; known points: {sorted(labels)}")
    return [p for p in points if p.method in (REFERENCE_METHOD, "custom") or p.method in (methods or ())
            or f"{p.method}={p.config}" in (picks or ())]


class PointGenerator(ReferenceGenerator):
    """A :class:`ReferenceGenerator` whose caches come from a :class:`MethodPoint` (a DiffKV point's
    ``key_rotation`` rotates the model as ``ReferenceGenerator`` does)."""

    def __init__(self, model, tokenizer, model_config, point: MethodPoint, stop_token_ids=None):
        super().__init__(model, tokenizer, model_config, point.kv_config or get_preset("fp16"), stop_token_ids)
        self.point = point

    def new_cache(self, max_seq_len_tokens: int):
        return self.point.build(self.model_config, max_seq_len_tokens, self.device)


def forced_logits_of_points(generators: list[PointGenerator], caches: list, prompt_ids: list[int],
                            span_ids: list[int], fast: bool = True, batch_decode: bool = False) -> list[torch.Tensor]:
    """Teacher-forced logits of every point on one case (``caches[i]`` empty, of ``generators[i]``).

    ``fast``: the points that run the same model (rotated or not) share one prefill forward
    (:func:`~trtllm_diffkv.evaluation.accuracy.teacher_forced_logits_shared_prefill`; the prefill attends
    over the full-precision prompt for every method, so this is exact: every logit is bit-identical to
    the per-point path's). ``batch_decode`` also runs each group's decode steps as one batch of token
    rows (the reference alone): not the default, because a row's logits then differ from its own run's
    by fp32 reassociation (another matrix-product kernel for more rows), and on the GPU that was enough
    to flip near-threshold tier decisions of a random-weight model (max logit difference 3.0 on a
    600-token case, H200, 2026-12-02), so the figures would no longer be the per-point path's.
    ``fast=False``: :func:`teacher_forced_logits` per point.

    Returns:
        ``float32 [len(span_ids), vocab]`` CPU logits per generator, in order.
    """
    if not fast:
        return [teacher_forced_logits(g, prompt_ids, span_ids, cache=c) for g, c in zip(generators, caches)]
    groups: dict[int, list[int]] = {}
    for i, gen in enumerate(generators):
        groups.setdefault(id(gen.model), []).append(i)
    out: list = [None] * len(generators)
    for members in groups.values():  # the reference's group first: it holds index 0
        got = teacher_forced_logits_shared_prefill(generators[members[0]].model, [caches[i] for i in members],
                                                   prompt_ids, span_ids, batch_decode=batch_decode)
        for i, logits in zip(members, got):
            out[i] = logits
    return out


def greedy_completion(gen: ReferenceGenerator, prompt_ids: list[int], max_new_tokens: int,
                      stop=HUMANEVAL_STOP_SEQUENCES, *, return_cache: bool = False):
    """Greedy text through ``gen``'s cache, ended by a stop token, ``max_new_tokens`` or the first of ``stop``
    in the text (default :data:`~trtllm_diffkv.evaluation.tasks.HUMANEVAL_STOP_SEQUENCES`, the HumanEval rule;
    ``ReferenceGenerator.generate_ids`` knows no stop strings, and stopping early is what makes grading
    every method affordable).

    Returns:
        the decoded completion, cut before the stop string; with ``return_cache``, ``(completion, generated
        token ids, cache)`` (the cache as the request ends, for its ``stats()``).
    """
    model, device = gen.model, gen.device
    cache = gen.new_cache(len(prompt_ids) + max_new_tokens)
    out: list[int] = []
    with torch.inference_mode():
        logits = model(torch.tensor(prompt_ids, device=device), torch.arange(len(prompt_ids), device=device), cache,
                       logits_indices=torch.tensor([len(prompt_ids) - 1], device=device))
        while True:
            token = int(logits[-1].argmax())
            if token in gen.stop_token_ids:
                break
            out.append(token)
            text = gen.tokenizer.decode(out, skip_special_tokens=True)
            if len(out) >= max_new_tokens or truncate_completion(text, stop) != text:
                break
            pos = torch.tensor([len(prompt_ids) + len(out) - 1], device=device)
            logits = model(torch.tensor([token], device=device), pos, cache)
    text = truncate_completion(gen.tokenizer.decode(out, skip_special_tokens=True), stop)
    return (text, out, cache) if return_cache else text


def case_metrics(ref_logits: torch.Tensor, logits: torch.Tensor, span_ids: list[int]) -> dict[str, float]:
    """Per-case metrics of one method (module docstring), from ``[span, vocab]`` logits.

    Raises:
        ValueError: shapes that differ or do not match the span.
    """
    if ref_logits.shape != logits.shape or logits.shape[0] != len(span_ids):
        raise ValueError(f"logits {tuple(logits.shape)} / reference {tuple(ref_logits.shape)} do not match a span "
                         f"of {len(span_ids)} tokens")
    log_p = torch.log_softmax(ref_logits.double(), -1)
    log_q = torch.log_softmax(logits.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)
    gold = torch.tensor(span_ids, dtype=torch.long)
    top1 = logits.argmax(-1)
    correct = (top1 == gold).double()
    return {"top1_agreement": float((top1 == ref_logits.argmax(-1)).double().mean()),
            "mean_kl_nats": float(kl.mean()),
            "span_logprob": float(log_q.gather(1, gold[:, None]).mean()),
            "span_top1": float(correct.mean()),
            "span_exact": float(correct.min())}


def bootstrap_ci(values, resamples: int = BOOTSTRAP_RESAMPLES, level: float = CI_LEVEL,
                 seed: int = 0) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean and its percentile bootstrap interval over cases.

    One value gives a zero-width interval (no noise can be estimated from one case).

    Raises:
        ValueError: no value.
    """
    x = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if x.numel() == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    mean = float(x.mean())
    if x.numel() == 1:
        return mean, mean, mean
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, x.numel(), (resamples, x.numel()), generator=g)
    means = x[idx].mean(1)
    tail = (1.0 - level) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return mean, min(low, mean), max(high, mean)


def evaluate(model, tokenizer, model_config, cases: list[Case], points: list[MethodPoint], *,
             stop_token_ids=None, humaneval_new_tokens: int = 128, graded_methods: set[str] | None = None,
             time_limit_s: float | None = None, fast: bool = True,
             progress: bool = True, on_case: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Run every point on every case; returns one record per (case, point).

    Args:
        points: ``points[0]`` must be the fp16 reference.
        fast: one prefill per model and batched decode steps (:func:`forced_logits_of_points`);
            ``False``: every point on its own (the slow path the fast one is tested against).
        humaneval_new_tokens: greedy tokens per graded ``humaneval`` completion.
        graded_methods: methods whose ``humaneval`` completions are generated and graded
            (``None``: all); the others get only the teacher-forced metrics.
        time_limit_s: start no case after this many seconds (records so far are returned).
        on_case: called with all records so far after every case (e.g. to write the JSON).

    Returns:
        dicts with ``task, case_id, method, config, kv_memory_fraction`` and the metrics of
        :func:`case_metrics` (+ ``pass_at_1`` for graded cases).

    Raises:
        ValueError: ``points[0]`` is not the reference; a case whose reference run fails.
    """
    if not points or points[0].method != REFERENCE_METHOD:
        raise ValueError(f"the first point must be the {REFERENCE_METHOD} reference")
    generators = [PointGenerator(model, tokenizer, model_config, p, stop_token_ids) for p in points]
    records: list[dict] = []
    start = time.perf_counter()
    bar = _progress(len(cases) * len(points), progress)
    for case in cases:
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            break
        caches = [gen.new_cache(len(case.prompt_ids) + len(case.span_ids)) for gen in generators]
        all_logits = forced_logits_of_points(generators, caches, case.prompt_ids, case.span_ids, fast=fast)
        ref_logits = all_logits[0]
        for gen, cache, logits in zip(generators, caches, all_logits):
            stats = cache.stats()
            record = {"task": case.task, "case_id": case.case_id, "method": gen.point.method,
                      "config": gen.point.config, "kv_memory_fraction": stats.kv_memory_fraction,
                      "prompt_tokens": len(case.prompt_ids), **case_metrics(ref_logits, logits, case.span_ids)}
            if case.problem is not None and (graded_methods is None or gen.point.method in graded_methods):
                completion = greedy_completion(gen, case.prompt_ids, humaneval_new_tokens)
                record["pass_at_1"] = float(run_humaneval_tests(case.problem, completion))
            records.append(record)
            bar.update(1)
        if on_case is not None:
            on_case(records)
        if not progress:  # one line per case instead of the bar (logs of unattended runs)
            print(f"[eval] case {case.task}/{case.case_id} ({len(case.prompt_ids)} prompt tokens) done at "
                  f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    bar.__exit__(None, None, None)
    return records


def _progress(total: int, enabled: bool):
    """A tqdm bar over (case, method) runs; nothing when tqdm is missing (a bare device image)."""
    try:
        from tqdm import tqdm
    except ImportError:
        from .throughput import NullProgress

        return NullProgress()
    return tqdm(total=total, disable=not enabled, unit="run", dynamic_ncols=True, file=sys.stderr)


METRICS = ("top1_agreement", "mean_kl_nats", "span_logprob", "span_top1", "span_exact", "pass_at_1")


def aggregate(records: list[dict]) -> list[dict]:
    """Rows of ``quality.json``: per (method, config, task, metric) the mean, its bootstrap interval and n.

    Adds ``<metric>_delta_vs_fp16`` rows for :data:`PAIRED_METRICS`: the paired difference
    against the fp16 record of the same case.
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    ref: dict[tuple, dict] = {}
    for r in records:
        groups[(r["method"], r["config"], r["task"])].append(r)
        if r["method"] == REFERENCE_METHOD:
            ref[(r["task"], r["case_id"])] = r
    rows = []
    for (method, config, task), group in groups.items():
        memory = sum(r["kv_memory_fraction"] for r in group) / len(group)
        for metric in METRICS:
            values = [r[metric] for r in group if metric in r]
            if not values:
                continue
            rows.append(_row(method, config, task, memory, metric, values))
            if metric in PAIRED_METRICS and method != REFERENCE_METHOD:
                deltas = [r[metric] - ref[(task, r["case_id"])][metric] for r in group
                          if metric in r and (task, r["case_id"]) in ref]
                if deltas:
                    rows.append(_row(method, config, task, memory, f"{metric}_delta_vs_fp16", deltas))
    return rows


def _row(method, config, task, memory, metric, values) -> dict:
    mean, low, high = bootstrap_ci(values)
    return {"method": method, "config": config, "task": task, "kv_memory_fraction": round(memory, 4),
            "metric": metric, "value": mean, "ci_low": low, "ci_high": high, "n": len(values)}


def plot_pareto(rows: list[dict], path, title: str = "", metric_of: Callable[[str], str] | None = None) -> None:
    """Memory fraction against each task's primary metric, one curve per method, 95 % bands as error bars.

    ``metric_of(task)``: the metric of a task's panel (default :data:`PRIMARY_METRIC`, else ``span_top1``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows})
    cols = min(3, len(tasks))
    nrows = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.9 * nrows), squeeze=False)
    methods = sorted({r["method"] for r in rows})
    palette = plt.cm.tab20 if len(methods) > 10 else plt.cm.tab10  # one colour per curve
    colors = {m: palette(i % palette.N) for i, m in enumerate(methods)}
    for ax, task in zip(axes.flat, tasks):
        metric = metric_of(task) if metric_of is not None else PRIMARY_METRIC.get(task, "span_top1")
        if not any(r["task"] == task and r["metric"] == metric for r in rows):
            metric = "span_top1"  # e.g. humaneval run without grading
        for method in methods:
            pts = sorted((r["kv_memory_fraction"], r["value"], r["ci_low"], r["ci_high"]) for r in rows
                         if r["task"] == task and r["method"] == method and r["metric"] == metric)
            if not pts:
                continue
            x, y, lo, hi = zip(*pts)
            err = [[v - a for v, a in zip(y, lo)], [b - v for v, b in zip(y, hi)]]
            style = dict(marker="*", markersize=11, linestyle="none") if method == REFERENCE_METHOD else \
                dict(marker="s" if method.startswith(("diffkv", "paper", "custom")) else "o", markersize=4,
                     linestyle="-")
            ax.errorbar(x, y, yerr=err, label=method, color=colors[method], capsize=2, linewidth=1.2, **style)
        ax.axvline(0.35, color="grey", linestyle=":", linewidth=0.8)
        ax.set_title(f"{task}: {metric}", fontsize=10)
        ax.set_xlabel("KV memory / FP16")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    with replaced_atomically(path) as tmp:  # a killed run leaves the old PNG, never half a new one
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
