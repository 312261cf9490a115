"""The OpenAI server's latency histograms (``serve/metrics.py``'s ``ServingMetrics.observe``) on real request handles.

An :class:`~trtllm_diffkv.llmapi.outputs.AsyncRequest` is fed events stamped at chosen times (the loop thread's
``RequestEvent.time``), so TTFT, TPOT and end-to-end latency are known here: TTFT = first token - arrival, TPOT =
(end - first token) / (tokens - 1), the first token excluded as vLLM defines it (``vllm/v1/metrics``), e2e =
end - arrival. The boundary is the token count: one token has no TPOT, two tokens have one interval.
"""
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")

from trtllm_diffkv.llmapi.outputs import AsyncRequest, RequestEvent  # noqa: E402
from trtllm_diffkv.runtime.sampling import SamplingParams  # noqa: E402
from trtllm_diffkv.serve.metrics import ServingMetrics  # noqa: E402

LABEL = {"model_name": "tiny"}


def _handle(arrival_s: float, token_times_s: list[float], kv_memory_fraction=None) -> AsyncRequest:
    """A finished request that got one token at each of ``token_times_s`` (the last event ends it)."""
    llm = SimpleNamespace(tokenizer=None, abort=lambda request_id: None)
    handle = AsyncRequest(llm, 0, None, [1, 2, 3], SamplingParams(max_tokens=len(token_times_s)), False, set())
    handle.arrival_time = arrival_s
    for i, t in enumerate(token_times_s):
        last = i == len(token_times_s) - 1
        handle._channel.put(RequestEvent([100 + i], finished=last, finish_reason="length" if last else None, time=t,
                                         metrics={"kv_memory_fraction": kv_memory_fraction} if last else None))
    handle.result(timeout=0)
    return handle


def _sample(metrics: ServingMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, LABEL) or 0.0


@pytest.mark.parametrize("token_times_s,tpot_s", [([10.0], None), ([10.0, 10.25], 0.25),
                                                  ([10.0, 10.1, 10.2, 10.5, 11.0], 0.25)])
def test_latencies_of_one_request(token_times_s, tpot_s):
    """Arrival at 9.5 s: TTFT 0.5 s; TPOT over the tokens after the first (none for a one-token request)."""
    metrics = ServingMetrics(SimpleNamespace(stats=dict), "tiny")
    metrics.observe(_handle(9.5, token_times_s, kv_memory_fraction=0.4))
    assert _sample(metrics, "vllm:time_to_first_token_seconds_count") == 1
    assert _sample(metrics, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert _sample(metrics, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(token_times_s[-1] - 9.5)
    if tpot_s is None:
        assert _sample(metrics, "vllm:time_per_output_token_seconds_count") == 0
    else:
        assert _sample(metrics, "vllm:time_per_output_token_seconds_count") == 1
        assert _sample(metrics, "vllm:time_per_output_token_seconds_sum") == pytest.approx(tpot_s)
    assert metrics._last["trtllm_diffkv_kv_memory_fraction"] == 0.4  # the idle gauge keeps the last request's


def test_a_request_without_tokens_is_not_observed():
    """A request that failed before its first token (one finishing event, no ids) adds to no histogram."""
    llm = SimpleNamespace(tokenizer=None, abort=lambda request_id: None)
    handle = AsyncRequest(llm, 0, None, [1], SamplingParams(max_tokens=2), False, set())
    handle._channel.put(RequestEvent([], finished=True, finish_reason="error", error="bad", time=3.0))
    handle.result(timeout=0)
    metrics = ServingMetrics(SimpleNamespace(stats=dict), "tiny")
    metrics.observe(handle)
    for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert _sample(metrics, f"vllm:{name}_seconds_count") == 0


def test_a_gauge_with_nothing_to_report_keeps_its_last_value_never_nan():
    """``metric_values``: a ``None`` or missing stat keeps the previous scrape's value (0 before any), and the pool
    usage percentage is used / pool pages x 100, kept as well when the pool size is unknown (0 pages)."""
    from trtllm_diffkv.serve.metrics import metric_values

    last = {}
    first = metric_values({"running": 2, "pool_pages": 200, "used_pages": 50, "kv_memory_fraction": 0.25}, last)
    assert first["trtllm_diffkv_requests_running"] == 2.0 and first["trtllm_diffkv_kv_pool_usage_percent"] == 25.0
    assert first["trtllm_diffkv_requests_waiting"] == 0.0  # never reported: 0, not NaN
    idle = metric_values({"running": 0, "pool_pages": 0, "used_pages": 0, "kv_memory_fraction": None}, last)
    assert idle["trtllm_diffkv_requests_running"] == 0.0
    assert idle["trtllm_diffkv_kv_memory_fraction"] == 0.25 and idle["trtllm_diffkv_kv_pool_usage_percent"] == 25.0
