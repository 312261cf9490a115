"""Serving metrics from ``LLM.stats()``, named once for both servers.

The OpenAI-compatible server exports them at ``/metrics`` through ``prometheus-client``
(:class:`ServingMetrics`): the ``trtllm_diffkv_*`` gauges and counters of :data:`METRICS`, vLLM's names
where vLLM has the metric (:data:`VLLM_METRICS`: ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:num_preemptions_total``, ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, label
``model_name``), and vLLM's latency histograms ``vllm:time_to_first_token_seconds``,
``vllm:time_per_output_token_seconds`` and ``vllm:e2e_request_latency_seconds`` observed per finished
request, so a dashboard built for vLLM reads this server. The Triton model registers the
``trtllm_diffkv_*`` names as custom metrics (``pb_utils.MetricFamily``), shown on Triton's metrics port
next to Triton's own ``nv_*`` metrics (Triton has its own request-latency metrics).

A gauge with nothing to report (``kv_memory_fraction`` with no token cached, tokens/s before the first
step) keeps its last value, 0 before the first one: never NaN (:func:`metric_values`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["Metric", "METRICS", "VLLM_METRICS", "metric_values", "prometheus_text", "ServingMetrics",
           "LATENCY_BUCKETS_S"]


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
           "KV pool bytes used / FP16 KV bytes of the same tokens (idle: the last finished request's)",
           "gauge", "kv_memory_fraction"),
    Metric("trtllm_diffkv_kv_pool_usage_percent", "KV pool pages used / pages in all, in percent", "gauge",
           "kv_pool_usage_percent"),
    Metric("trtllm_diffkv_generation_tokens_per_second",
           "Generated tokens per second of executor step time, since start", "gauge", "output_tokens_per_s"),
    Metric("trtllm_diffkv_generation_tokens_total", "Tokens generated since start", "counter", "output_tokens"),
    Metric("trtllm_diffkv_prompt_tokens_total", "Prompt tokens of the requests accepted since start", "counter",
           "prompt_tokens"),
    Metric("trtllm_diffkv_preemptions_total", "Requests preempted (recomputed later) since start", "counter",
           "preemptions"),
    Metric("trtllm_diffkv_requests_submitted_total", "Requests submitted since start", "counter", "requests_submitted"),
    Metric("trtllm_diffkv_requests_finished_total", "Requests finished (stop or length) since start", "counter",
           "requests_finished"),
    Metric("trtllm_diffkv_requests_failed_total", "Requests failed (bad request or error) since start", "counter",
           "requests_failed"),
    Metric("trtllm_diffkv_requests_cancelled_total", "Requests cancelled (client gone or aborted) since start",
           "counter", "requests_cancelled"),
)


VLLM_METRICS: tuple[Metric, ...] = (
    Metric("vllm:num_requests_running", "Number of requests in model execution batches.", "gauge", "running"),
    Metric("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "gauge", "waiting"),
    Metric("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "gauge", "kv_pool_usage"),
    Metric("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", "counter",
           "preemptions"),
    Metric("vllm:prompt_tokens_total", "Number of prefill tokens processed.", "counter", "prompt_tokens"),
    Metric("vllm:generation_tokens_total", "Number of generation tokens processed.", "counter", "output_tokens"),
)
"""vLLM's names (``vllm/v1/metrics/loggers.py``) for the metrics both servers have; label ``model_name``."""

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0)
"""Histogram bucket bounds (seconds) of the latency histograms (vLLM's TTFT buckets, used for all three)."""


def _with_derived(stats: dict) -> dict:
    pool, used = stats.get("pool_pages"), stats.get("used_pages")
    usage = used / pool if pool and used is not None else None
    return {**stats, "kv_pool_usage": usage, "kv_pool_usage_percent": None if usage is None else 100.0 * usage}


def metric_values(stats: dict, last: dict | None = None, metrics: tuple[Metric, ...] = METRICS) -> dict[str, float]:
    """Metric name -> value (float) of ``metrics`` read from ``stats`` (``LLM.stats()``).

    Where ``stats`` has ``None`` or lacks the key, the value in ``last`` (the previous call's, which this
    call updates) is kept, 0 when there is none: a gauge never goes NaN while the server is idle.
    """
    stats = _with_derived(stats)
    values = {}
    for metric in metrics:
        value = stats.get(metric.key)
        values[metric.name] = float(value) if value is not None else float((last or {}).get(metric.name, 0.0))
    if last is not None:
        last.update(values)
    return values


def prometheus_text(stats: dict, last: dict | None = None) -> str:
    """The :data:`METRICS` of ``stats`` (``LLM.stats()``) in the Prometheus text exposition format 0.0.4."""
    lines = []
    values = metric_values(stats, last)
    for metric in METRICS:
        lines += [f"# HELP {metric.name} {metric.help}", f"# TYPE {metric.name} {metric.kind}",
                  f"{metric.name} {values[metric.name]!r}"]
    return "\n".join(lines) + "\n"


class ServingMetrics:
    """The OpenAI server's ``/metrics``: :data:`METRICS` and :data:`VLLM_METRICS` read from ``llm.stats()``
    at each scrape, and the latency histograms observed per finished request (:meth:`observe`).

    Args:
        llm: the :class:`~trtllm_diffkv.llmapi.llm.LLM` (``stats()``).
        model_name: the ``model_name`` label of the vLLM-named metrics.

    Raises:
        ImportError: ``prometheus-client`` is not installed (``pip install trtllm-diffkv[serve]``).
    """

    def __init__(self, llm, model_name: str):
        from prometheus_client import CollectorRegistry, Histogram

        self.llm, self.model_name = llm, model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self._last: dict = {}
        self._lock = threading.Lock()
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=LATENCY_BUCKETS_S, registry=self.registry).labels(model_name)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                              "seconds.", labels, buckets=LATENCY_BUCKETS_S, registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in "
                             "seconds.", labels, buckets=LATENCY_BUCKETS_S, registry=self.registry).labels(model_name)
        self.registry.register(self)

    def observe(self, handle) -> None:
        """Record one finished request's latencies from its :class:`~trtllm_diffkv.llmapi.outputs.AsyncRequest`
        marks: TTFT = first token - arrival, TPOT = (end - first token) / (tokens - 1) when more than one
        token, e2e = end - arrival (seconds). A request with no token (failed, cancelled early) is skipped.
        Its KV memory fraction becomes the value the gauge keeps while no token is cached."""
        first, end = getattr(handle, "first_token_time", None), getattr(handle, "finished_time", None)
        if first is None or end is None:
            return
        fraction = (handle.result(timeout=0).metrics or {}).get("kv_memory_fraction")  # finished: no wait
        if fraction is not None:  # the idle gauge's value: the last finished request's
            with self._lock:
                self._last["trtllm_diffkv_kv_memory_fraction"] = float(fraction)
        arrival = handle.arrival_time
        self.ttft.observe(first - arrival)
        self.e2e.observe(end - arrival)
        tokens = len(getattr(handle, "_ids", ()))
        if tokens > 1:
            self.tpot.observe((end - first) / (tokens - 1))

    def collect(self):
        """prometheus-client's collector protocol: the ``LLM.stats()`` metrics now."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.llm.stats()
        with self._lock:
            values = metric_values(stats, self._last, METRICS + VLLM_METRICS)
        for metric in METRICS:
            family = GaugeMetricFamily if metric.kind == "gauge" else CounterMetricFamily
            yield family(metric.name, metric.help, value=values[metric.name])
        for metric in VLLM_METRICS:
            family = GaugeMetricFamily if metric.kind == "gauge" else CounterMetricFamily
            labelled = family(metric.name, metric.help, labels=["model_name"])
            labelled.add_metric([self.model_name], values[metric.name])
            yield labelled

    def text(self) -> bytes:
        """Everything in the Prometheus text format (reads ``llm.stats()``: call off the event loop)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
