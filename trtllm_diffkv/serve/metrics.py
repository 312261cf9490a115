"""Serving metrics from ``LLM.stats()``, named once for both servers.

The OpenAI-compatible server prints them at ``/metrics`` in the Prometheus text format
(:func:`prometheus_text`); the Triton model registers the same names as custom metrics
(``pb_utils.MetricFamily``), shown on Triton's metrics port next to Triton's own ``nv_*`` metrics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Metric", "METRICS", "metric_values", "prometheus_text"]


@dataclass(frozen=True)
class Metric:
    """One gauge (``kind == "gauge"``) or counter (``"counter"``) read from ``LLM.stats()``.

    Attributes:
        name: the Prometheus name (``trtllm_diffkv_*``; counters end in ``_total``).
        help: its ``# HELP`` text (units included).
        kind: ``"gauge"`` or ``"counter"``.
        key: the ``LLM.stats()`` key it reads (``None`` values print as ``NaN``).
    """

    name: str
    help: str
    kind: str
    key: str


METRICS: tuple[Metric, ...] = (
    Metric("trtllm_diffkv_requests_running", "Requests in the executor's running batch", "gauge", "running"),
    Metric("trtllm_diffkv_requests_waiting", "Requests queued for admission", "gauge", "waiting"),
    Metric("trtllm_diffkv_kv_pool_pages_used", "KV pool pages held by requests", "gauge", "used_pages"),
    Metric("trtllm_diffkv_kv_pool_pages_free", "KV pool pages free", "gauge", "free_pages"),
    Metric("trtllm_diffkv_kv_pool_pages", "KV pool pages in all", "gauge", "pool_pages"),
    Metric("trtllm_diffkv_kv_memory_fraction",
           "KV pool bytes used / FP16 KV bytes of the same tokens (NaN when no token is cached)", "gauge",
           "kv_memory_fraction"),
    Metric("trtllm_diffkv_generation_tokens_per_second",
           "Generated tokens per second of executor step time, since start", "gauge", "output_tokens_per_s"),
    Metric("trtllm_diffkv_generation_tokens_total", "Tokens generated since start", "counter", "output_tokens"),
    Metric("trtllm_diffkv_requests_submitted_total", "Requests submitted since start", "counter", "requests_submitted"),
    Metric("trtllm_diffkv_requests_finished_total", "Requests finished (stop or length) since start", "counter",
           "requests_finished"),
    Metric("trtllm_diffkv_requests_failed_total", "Requests failed (bad request or error) since start", "counter",
           "requests_failed"),
    Metric("trtllm_diffkv_requests_cancelled_total", "Requests cancelled (client gone or aborted) since start",
           "counter", "requests_cancelled"),
)


def metric_values(stats: dict) -> dict[str, float]:
    """Metric name -> value (float; ``NaN`` where ``stats`` has ``None`` or lacks the key)."""
    values = {}
    for metric in METRICS:
        value = stats.get(metric.key)
        values[metric.name] = math.nan if value is None else float(value)
    return values


def prometheus_text(stats: dict) -> str:
    """The metrics of ``stats`` (``LLM.stats()``) in the Prometheus text exposition format 0.0.4."""
    lines = []
    values = metric_values(stats)
    for metric in METRICS:
        value = values[metric.name]
        lines += [f"# HELP {metric.name} {metric.help}", f"# TYPE {metric.name} {metric.kind}",
                  f"{metric.name} {'NaN' if math.isnan(value) else repr(value)}"]
    return "\n".join(lines) + "\n"
