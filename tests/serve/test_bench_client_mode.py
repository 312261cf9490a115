"""``trtllm-diffkv bench --server-url`` against a real ``trtllm-diffkv serve`` (tiny model, CPU, loopback):
the JSON's counts equal the requests sent and the server's own metrics; percentiles are ordered."""
import json
import re

import httpx
import pytest

from serve_fixtures import checkpoint, start_openai_server  # noqa: F401 (fixture)
from trtllm_diffkv.evaluation.serving_client import percentile


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    values = [5.0, 1.0, 4.0, 2.5, 9.0, 7.0, 3.0]
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q * 100)))
    with pytest.raises(ValueError):
        percentile([], 0.5)


def _e2e_count(base_url) -> float:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    return float(re.search(r'^vllm:e2e_request_latency_seconds_count\{model_name="tiny"\} (\S+)$', text, re.M).group(1))


def test_client_mode_reports_what_it_sent(checkpoint, tmp_path, capsys):
    from trtllm_diffkv.cli import main

    server = start_openai_server(checkpoint, tmp_path / "serve.log", "tiny", "--threads", "1")
    try:
        before = _e2e_count(server.base_url)
        out = tmp_path / "client.json"
        code = main(["bench", "--server-url", server.base_url, "--num-requests", "6", "--concurrency", "3",
                     "--max-tokens", "5", "--warmup", "1", "--output", str(out)])
        after = _e2e_count(server.base_url)
    finally:
        server.stop()
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    stats = result["server"]
    assert {"gpu", "date", "commit", "command"} <= set(result) and stats["model"] == "tiny"
    assert stats["requests"] == stats["completed"] == 6 and stats["errors"] == []
    assert stats["output_tokens"] == 30  # ignore_eos: every request makes max_tokens tokens
    assert after - before == 7  # the warmup request and the six measured, as the server counted them
    for name in ("ttft", "tpot", "itl", "e2e"):
        p50, p90, p99 = (stats[f"{name}_p{q}_ms"] for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99, name
    assert stats["ttft_p99_ms"] <= stats["e2e_p99_ms"]
    assert stats["output_tokens_per_s"] == pytest.approx(30 / stats["wall_s"])
    assert out.with_suffix(".png").stat().st_size > 0
    assert "6/6 requests" in capsys.readouterr().out
