"""``trtllm-diffkv serve`` as a real process against clients that break things (issue 21).

One request must not stall the others: an oversized body is a 413 within a second while ``/health``
answers, a prompt too long for the context is refused before it is tokenized, a request of 3,000
prompts is tokenized off the event loop. Fields OpenAI types as integers refuse booleans and numeric
strings. ``usage`` carries DiffKV's numbers (checked against the same prompts run alone in an
in-process ``LLM``). Shutdown with requests in flight: each stream ends with an error event and
``[DONE]``, a waiting request gets a 503 in OpenAI's shape, no traceback, exit 0. Loopback only,
every process stopped, each wait bounded.
"""
import json
import os
import re
import signal
import socket
import threading
import time

import pytest

from serve_fixtures import KV_BYTES, checkpoint, client, start_openai_server  # noqa: F401 (fixtures)
from trtllm_diffkv.serve.process import group_pids

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

NAME = "tiny"
BODY_CAP = 1_000_000


def _start(checkpoint, log_path, *flags):
    return start_openai_server(checkpoint, log_path, NAME, "--threads", "1", "--max-body-bytes", str(BODY_CAP), *flags)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    server = _start(checkpoint, tmp_path_factory.mktemp("serve") / "serve.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def solo(checkpoint):
    """The same checkpoint and preset in-process: ``prompt -> final RequestOutput`` run alone, greedily."""
    from trtllm_diffkv.llmapi.llm import LLM
    from trtllm_diffkv.runtime.sampling import SamplingParams

    llm = LLM(str(checkpoint), device="cpu", kv_memory_bytes=KV_BYTES, max_batch_size=8)

    def run(prompt, max_tokens):
        out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        assert out.error is None
        return out

    run.llm = llm
    yield run
    llm.shutdown()


class _HealthProbe:
    """Polls ``/health`` on its own connection while a test runs; records the slowest answer (s)."""

    def __init__(self, base_url):
        self.base_url, self.slowest_s, self.answers, self._stop = base_url, 0.0, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                start = time.monotonic()
                assert http.get(self.base_url + "/health").status_code == 200
                self.slowest_s = max(self.slowest_s, time.monotonic() - start)
                self.answers += 1
                time.sleep(0.05)

    def _wait_for_answers(self, count):
        deadline = time.monotonic() + 30
        while self.answers < count and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def __enter__(self):
        self._thread.start()
        self._wait_for_answers(1)
        return self

    def __exit__(self, *exc):
        self._wait_for_answers(self.answers + 1)  # one answer at least after the work
        self._stop.set()
        self._thread.join(timeout=35)


def _read_response(sock: socket.socket, timeout_s: float) -> tuple[int, dict]:
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(head.split()[1]), json.loads(rest[:length])


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_oversized_body_is_a_413_within_a_second_and_health_answers(server, client, chunked):
    head = ("POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            + ("transfer-encoding: chunked\r\n" if chunked else f"content-length: {24 << 20}\r\n") + "\r\n")
    with _HealthProbe(server.base_url) as probe, socket.create_connection(("127.0.0.1", server.port)) as sock:
        start = time.monotonic()
        sock.sendall(head.encode())
        piece = b'{"prompt": "' + b"a" * (256 << 10)
        if chunked:  # a chunked body has no length up front: the server counts it as it arrives
            for _ in range(BODY_CAP // len(piece) + 1):
                sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        else:
            sock.sendall(piece)  # 256 KiB of the 24 MiB announced; the answer must not wait for the rest
        status, body = _read_response(sock, timeout_s=10)
        elapsed = time.monotonic() - start
    assert status == 413 and elapsed < 1.0, (status, elapsed)
    assert body == {"error": {"message": f"the request body is larger than {BODY_CAP} bytes",
                              "type": "invalid_request_error", "param": None, "code": None}}
    assert probe.answers >= 2 and probe.slowest_s < 1.0
    assert client.completions.create(model=NAME, prompt="Hello", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_a_prompt_longer_than_the_context_is_refused_before_tokenizing(server, solo):
    limit = solo.llm.max_prompt_chars()  # max_seq_len x the longest vocabulary entry
    for path, body in (("completions", {"prompt": "ab " * (limit // 3 + 1), "max_tokens": 2}),
                       ("chat/completions", {"messages": [{"role": "user", "content": "ab " * (limit // 3 + 1)}]})):
        start = time.monotonic()
        answer = httpx.post(f"{server.base_url}/v1/{path}", json=body, timeout=60)
        assert answer.status_code == 400 and time.monotonic() - start < 2.0, answer.text
        error = answer.json()["error"]
        assert f"more than max_seq_len {solo.llm.max_seq_len} tokens can hold" in error["message"]
        assert error["param"] == ("prompt" if path == "completions" else "messages")


def test_a_bad_prompt_of_several_cancels_the_others_at_once(solo):
    """A completion of several prompts, one of them refused (``""``; a text too long for the context is found only
    once tokenized, the same way): the server waited for every other prompt to run to its end (here 1,500 tokens)
    before answering 400. Now the refusal aborts the others at once, and the error names the prompt."""
    from fastapi.testclient import TestClient

    from trtllm_diffkv.serve.openai_server import create_app

    llm = solo.llm
    before = llm.stats()
    with TestClient(create_app(llm, NAME), raise_server_exceptions=False) as http:
        reply = http.post("/v1/completions", json={"model": NAME, "prompt": ["Once upon a time", ""], "n": 2,
                                                   "max_tokens": 1500, "ignore_eos": True, "temperature": 1.0})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["message"] == "'prompt'[1]: empty prompt: at least one character is needed"
    assert reply.json()["error"]["param"] == "prompt"
    deadline = time.monotonic() + 30
    while llm.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = llm.stats()
    assert after["requests_cancelled"] - before["requests_cancelled"] == 2  # prompt 0's two sequences
    assert after["requests_finished"] == before["requests_finished"]
    assert after["free_pages"] == after["pool_pages"]


def test_three_thousand_prompts_do_not_stall_health(server, solo):
    prompts = [f"Item {i}: " + "the quick brown fox jumps over the lazy dog " * 5 for i in range(3000)]
    with _HealthProbe(server.base_url) as probe:
        answer = httpx.post(server.base_url + "/v1/completions", timeout=300,
                            json={"model": NAME, "prompt": prompts, "max_tokens": 1, "temperature": 0})
    assert answer.status_code == 200, answer.text[:500]
    body = answer.json()
    tokenizer = solo.llm.tokenizer
    assert len(body["choices"]) == 3000 and [c["index"] for c in body["choices"]] == list(range(3000))
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert body["usage"]["completion_tokens"] == 3000
    print(f"/health: {probe.answers} answers, slowest {probe.slowest_s:.3f} s")
    assert probe.answers >= 3 and probe.slowest_s < 1.0, (probe.answers, probe.slowest_s)


@pytest.mark.parametrize("path, field, value", [
    ("completions", "n", True), ("completions", "best_of", True), ("completions", "max_tokens", True),
    ("completions", "max_tokens", "5"), ("completions", "n", "1"), ("completions", "logprobs", False),
    ("completions", "seed", True), ("completions", "temperature", True), ("completions", "top_p", "0.5"),
    ("completions", "stream", "yes"), ("completions", "echo", 0),
    ("chat/completions", "top_logprobs", False), ("chat/completions", "max_completion_tokens", True),
    ("chat/completions", "logprobs", 0), ("chat/completions", "n", 1.0),
])
def test_booleans_and_numeric_strings_are_refused_where_openai_says_integer(server, path, field, value):
    base = {"prompt": "hi"} if path == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(f"{server.base_url}/v1/{path}", json={**base, "max_tokens": 2, field: value}, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error", error


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]), ("tool_choice", "auto"),
    ("response_format", {"type": "json_object"}), ("functions", [{"name": "f"}]),
])
def test_tools_and_response_format_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={field: value})
    assert info.value.body["param"] == field and "not supported" in info.value.body["message"]
    answer = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                            extra_body={field: None})  # null is absent
    assert answer.usage.completion_tokens == 2


def test_usage_carries_diffkv_numbers_of_the_prompts_run_alone(server, client, solo):
    prompts = ["The capital of France is", "Memory is"]
    response = client.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0)
    usage = response.usage.model_dump()
    alone = [solo(p, 6).metrics for p in prompts]
    fp16 = [m["fp16_kv_cache_bytes"] for m in alone]
    assert usage["kv_pool_bytes"] == sum(m["pool_used_bytes"] for m in alone) > 0
    assert usage["kv_memory_fraction"] == pytest.approx(sum(m["kv_cache_bytes"] for m in alone) / sum(fp16))
    for name in ("high_fraction", "low_fraction", "pruned_fraction"):
        assert usage[name] == pytest.approx(sum(m[name] * w for m, w in zip(alone, fp16)) / sum(fp16)), name
    assert usage["high_fraction"] + usage["low_fraction"] + usage["pruned_fraction"] == pytest.approx(1.0)
    assert 0 < usage["kv_memory_fraction"] < 1  # the default preset compresses
    stream = list(client.completions.create(model=NAME, prompt=prompts[1], max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert stream[-1].usage.model_dump()["kv_pool_bytes"] == alone[1]["pool_used_bytes"]
    log = server.log_tail(200000)  # the access log: one line per request, its tokens included
    line = f"POST /v1/completions 200 .* prompt_tokens={response.usage.prompt_tokens} completion_tokens=12"
    assert re.search(line, log), log[-2000:]


def test_draining_refuses_new_requests_with_a_503_in_openai_shape():
    from fastapi.testclient import TestClient

    from trtllm_diffkv.serve.openai_server import create_app

    class Idle:  # never asked to generate: the draining state answers first
        tokenizer, max_seq_len = None, 64

        def generate_async(self, *args, **kwargs):
            raise AssertionError("a request reached the LLM while draining")

    app = create_app(Idle(), NAME)
    app.state.drain.draining = True
    with TestClient(app) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            answer = http.post(path, json={"prompt": "hi"})
            assert answer.status_code == 503
            assert answer.json() == {"error": {"message": "the server is shutting down", "type": "service_unavailable",
                                               "param": None, "code": None}}
        assert http.get("/health").status_code == 200  # probes still answer while draining


def test_shutdown_ends_streams_with_an_error_event_and_waiting_requests_with_a_503(checkpoint, tmp_path):
    server = _start(checkpoint, tmp_path / "serve.log", "--shutdown-timeout-s", "2")
    pgid = server.pid
    results, threads = {}, []

    def stream(key):
        with httpx.Client(timeout=60) as http, http.stream(
                "POST", server.base_url + "/v1/completions",
                json={"prompt": f"Story {key}:", "max_tokens": 1900, "stream": True, "ignore_eos": True}) as r:
            results[key] = [line for line in r.iter_lines() if line]

    def whole(key):
        with httpx.Client(timeout=60) as http:
            answer = http.post(server.base_url + "/v1/completions",
                               json={"prompt": f"Story {key}:", "max_tokens": 1900, "ignore_eos": True})
            results[key] = (answer.status_code, answer.json())

    for key, target in (("s1", stream), ("s2", stream), ("w1", whole)):
        threads.append(threading.Thread(target=target, args=(key,), daemon=True))
        threads[-1].start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # all three running in the executor
        text = httpx.get(server.base_url + "/metrics", timeout=30).text
        if re.search(r"^trtllm_diffkv_requests_running 3", text, re.M):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the requests did not start: {text}")
    os.killpg(pgid, signal.SIGTERM)
    probe, deadline = None, time.monotonic() + 10
    while time.monotonic() < deadline:  # during the 2 s drain a new connection is answered: a 503, not refused
        try:
            probe = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        except httpx.TransportError as exc:
            probe = exc
            break
        if probe.status_code == 503:
            break
        time.sleep(0.05)
    assert isinstance(probe, httpx.Response) and probe.status_code == 503, probe
    assert probe.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200  # probes still answer
    assert server.stop(grace_s=30) == 0
    assert group_pids(pgid) == []
    for thread in threads:
        thread.join(timeout=10)
    for key in ("s1", "s2"):
        lines = results[key]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2][len("data: "):])["error"]
        assert error["type"] == "service_unavailable" and "shutting down" in error["message"], error
        assert all(json.loads(line[6:])["choices"][0]["finish_reason"] is None for line in lines[:-2])
    status, body = results["w1"]
    assert status == 503 and body["error"]["type"] == "service_unavailable", body
    assert "shutting down" in body["error"]["message"]
    log = server.log_tail(200000)
    assert "Traceback" not in log and "ASGI" not in log, log[-3000:]
    assert "aborting 3 request(s) still in flight after 2.0 s" in log


def _scrape(server) -> dict[str, float]:
    """Every sample of /metrics: 'name{labels}' (or 'name') -> value."""
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([^#\s][^ ]*) (\S+)$", text, re.M)}


def test_metrics_count_the_requests_sent_and_never_go_nan(server, client, solo):
    label = f'{{model_name="{NAME}"}}'
    prompts, max_tokens = ["Memory is", "Hello there", "Three colours:"], [3, 5, 7]
    before = _scrape(server)
    for prompt, tokens in zip(prompts, max_tokens):
        client.completions.create(model=NAME, prompt=prompt, max_tokens=tokens, temperature=0)
    list(client.completions.create(model=NAME, prompt=prompts[0], max_tokens=4, temperature=0, stream=True))
    after = _scrape(server)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    tokenizer = solo.llm.tokenizer
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in prompts + prompts[:1])
    assert delta["vllm:prompt_tokens_total" + label] == delta["trtllm_diffkv_prompt_tokens_total"] == prompt_tokens
    assert delta["vllm:generation_tokens_total" + label] == sum(max_tokens) + 4
    for name in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                 "vllm:time_per_output_token_seconds"):  # every request had more than one token
        assert delta[f"{name}_count{label}"] == 4, name
    assert 0 < delta["vllm:time_to_first_token_seconds_sum" + label] < delta["vllm:e2e_request_latency_seconds_sum"
                                                                                + label]
    assert after["vllm:num_preemptions_total" + label] == after["trtllm_diffkv_preemptions_total"] == 0
    assert after["vllm:kv_cache_usage_perc" + label] == after["trtllm_diffkv_kv_pool_usage_percent"] / 100 == 0  # idle
    assert not any(v != v for v in after.values()), [k for k, v in after.items() if v != v]  # no NaN
    assert 0 < after["trtllm_diffkv_kv_memory_fraction"] < 1  # idle: the last value, not NaN
