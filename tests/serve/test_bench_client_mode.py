"""``trtllm-diffkv bench --server-url`` against a real ``trtllm-diffkv serve`` (tiny model, CPU, loopback):
the JSON's counts equal the requests sent and the server's own metrics; percentiles are ordered."""
import json
import re

import pytest

from serve_fixtures import checkpoint, start_openai_server  # noqa: F401 (fixture)
from trtllm_diffkv.evaluation.serving_client import percentile

httpx = pytest.importorskip("httpx")


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


def _counter(base_url, name) -> float:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    return float(re.search(rf'^{re.escape(name)}\{{model_name="tiny"\}} (\S+)$', text, re.M).group(1))


def test_token_id_prompts_and_a_prompts_file_against_the_real_server(checkpoint, tmp_path, capsys):
    """The real ``serve`` process: a prompt of token ids gives the same greedy text as its text, and ``bench
    --prompts-file`` (text, ids and made-up lengths, each with its own token count) sends exactly those requests
    (the server's prompt and generation token counters agree)."""
    from transformers import AutoTokenizer

    from trtllm_diffkv.cli import main

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    text = "The capital of France is"
    ids = tokenizer.encode(text, add_special_tokens=False)
    lines = [{"prompt": text, "output_tokens": 2}, {"input_ids": [11, 12, 13, 14, 15], "output_length": 3},
             {"input_length": 9, "output_tokens": 4}]
    prompts_file = tmp_path / "mine.jsonl"
    prompts_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    server = start_openai_server(checkpoint, tmp_path / "serve.log", "tiny", "--threads", "1")
    try:
        url = server.base_url + "/v1/completions"
        body = {"max_tokens": 6, "temperature": 0}
        by_text = httpx.post(url, json={**body, "prompt": text}, timeout=60).json()
        by_ids = httpx.post(url, json={**body, "prompt": ids}, timeout=60).json()
        both = httpx.post(url, json={**body, "prompt": [ids, ids[:3]]}, timeout=60).json()
        alone = httpx.post(url, json={**body, "prompt": ids[:3]}, timeout=60).json()
        bad = httpx.post(url, json={**body, "prompt": [1, 10 ** 9]}, timeout=60)
        assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"], (by_ids, by_text)
        assert by_ids["usage"]["prompt_tokens"] == len(ids)
        assert [c["text"] for c in both["choices"]] == [by_text["choices"][0]["text"], alone["choices"][0]["text"]]
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.text
        assert f"token id {10 ** 9} is outside the model's vocabulary" in bad.json()["error"]["message"]
        prompt_before = _counter(server.base_url, "vllm:prompt_tokens_total")
        generated_before = _counter(server.base_url, "vllm:generation_tokens_total")
        out = tmp_path / "client.json"
        code = main(["bench", "--server-url", server.base_url, "--prompts-file", str(prompts_file), "--num-requests",
                     "6", "--concurrency", "2", "--warmup", "0", "--output", str(out), "--no-plot"])
        prompt_sent = _counter(server.base_url, "vllm:prompt_tokens_total") - prompt_before
        generated = _counter(server.base_url, "vllm:generation_tokens_total") - generated_before
    finally:
        server.stop()
    assert code == 0, capsys.readouterr().err
    stats = json.loads(out.read_text())["server"]
    assert stats["completed"] == 6 and stats["errors"] == [] and stats["prompts_file"] == str(prompts_file)
    assert stats["output_tokens"] == generated == 2 * (2 + 3 + 4)   # every line twice, each with its own count
    assert prompt_sent == 2 * (len(ids) + 5 + 9)                      # input_length 9: exactly 9 tokens sent
