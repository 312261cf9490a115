"""``trtllm-diffkv serve`` run as a real process (uvicorn), queried with the ``openai`` client package.

The model is a tiny random Llama with the default model's tokenizer (tests/tiny_checkpoint.py). Texts
are compared with the same prompt run alone, greedily, in an in-process ``LLM`` over the same
checkpoint and preset (chat prompts rendered with the tokenizer's chat template by the test).
"""
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_fixtures import KV_BYTES, checkpoint, reference  # noqa: F401 (fixtures)
from trtllm_diffkv.serve.metrics import METRICS
from trtllm_diffkv.serve.process import ServerProcess, free_port, group_pids

openai = pytest.importorskip("openai")

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Memory is", "Hello there",
           "A short poem about the sea:", "Three colours:", "Dear diary,"]
NAME = "tiny"


def _start(checkpoint, log_path):
    port = free_port()
    command = [sys.executable, "-m", "trtllm_diffkv.commands.serve", "--model", str(checkpoint), "--port", str(port),
               "--served-model-name", NAME, "--device", "cpu", "--kv-memory-bytes", str(KV_BYTES),
               "--max-batch-size", "8"]
    server = ServerProcess(command, f"http://127.0.0.1:{port}/health", log_path).start()
    server.wait_ready(timeout_s=180)
    server.base_url = f"http://127.0.0.1:{port}"
    return server


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    server = _start(checkpoint, tmp_path_factory.mktemp("serve") / "serve.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(trtllm_diffkv_\w+) (\S+)$", text, re.M)}


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.base_url + "/health", timeout=30).json() == {"status": "ok"}


def test_completion_matches_the_prompt_run_alone(client, reference):
    response = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    choice = response.choices[0]
    assert choice.text == reference(PROMPTS[0], 10) and choice.finish_reason == "length"
    assert response.usage.completion_tokens == 10
    assert response.usage.prompt_tokens == len(reference.tokenizer(PROMPTS[0])["input_ids"])


def test_streaming_completion_concatenates_to_the_same_text(client, reference):
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 1 and "".join(texts) == reference(PROMPTS[1], 10)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_chat_completion_and_streaming_use_the_chat_template(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a planet."}]
    text = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = reference(list(reference.tokenizer(text, add_special_tokens=False)["input_ids"]), 8)
    response = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    assert response.choices[0].message.content == expected and response.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_concurrent_requests_give_the_same_greedy_text(client, reference):
    def ask(prompt):
        if prompt in PROMPTS[::2]:
            stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in stream)
        return client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(ask, PROMPTS))
    assert texts == [reference(p, 8) for p in PROMPTS]


@pytest.mark.parametrize("body, message", [
    ({"prompt": " ", "max_tokens": 4}, "empty prompt"),
    ({"prompt": "hi", "temperature": -1.0}, "temperature"),
    ({"prompt": "hi", "n": 2}, "'n' = 2 is not supported"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 100000}, "exceeds"),
    ({"prompt": "hi", "stream": True, "top_p": 2.0}, "top_p"),
    ({"prompt": "hi", "model": "other"}, "does not exist"),
])
def test_bad_request_gets_an_error_and_the_next_succeeds(client, reference, body, message):
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**{"model": NAME, **body})
    assert info.value.status_code in (400, 404) and message in info.value.body["message"]
    good = client.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=6, temperature=0)
    assert good.choices[0].text == reference(PROMPTS[4], 6)


def test_metrics_and_disconnect_frees_pages(server):
    before = _metrics(server)
    assert set(before) == {m.name for m in METRICS}
    assert before["trtllm_diffkv_kv_pool_pages"] == before["trtllm_diffkv_kv_pool_pages_free"] + \
        before["trtllm_diffkv_kv_pool_pages_used"] > 0
    with httpx.Client(timeout=120) as http:  # a long stream, dropped after its first chunk
        with http.stream("POST", server.base_url + "/v1/completions",
                         json={"model": NAME, "prompt": PROMPTS[5], "max_tokens": 1500, "temperature": 0,
                               "stream": True}) as response:
            lines = response.iter_lines()  # kept: a collected line iterator closes the connection
            assert next(lines).startswith('data: {"id"')
            during = _metrics(server)
            assert during["trtllm_diffkv_requests_running"] == 1 and during["trtllm_diffkv_kv_pool_pages_used"] > 0, during
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = _metrics(server)
        if after["trtllm_diffkv_requests_cancelled_total"] == before["trtllm_diffkv_requests_cancelled_total"] + 1 \
                and after["trtllm_diffkv_kv_pool_pages_used"] == 0 and after["trtllm_diffkv_requests_running"] == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the dropped stream was not cancelled or still holds pages: {after}")
    assert after["trtllm_diffkv_generation_tokens_total"] - before["trtllm_diffkv_generation_tokens_total"] < 1500
    assert after["trtllm_diffkv_requests_submitted_total"] == before["trtllm_diffkv_requests_submitted_total"] + 1


def test_shutdown_leaves_no_process(checkpoint, tmp_path):
    server = _start(checkpoint, tmp_path / "serve.log")
    pgid = server.pid
    assert group_pids(pgid) == [pgid]
    stream = httpx.Client(timeout=120).stream("POST", server.base_url + "/v1/completions",
                                              json={"prompt": PROMPTS[6], "max_tokens": 1500, "stream": True})
    response = stream.__enter__()  # a request in flight while the server stops
    lines = response.iter_lines()
    next(lines)
    ended = []

    def drain():
        try:
            list(lines)
            ended.append("complete")
        except httpx.HTTPError as exc:  # the server cut the stream at its shutdown timeout
            ended.append(type(exc).__name__)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    assert server.stop(grace_s=30) == 0  # graceful: uvicorn stopped, the LLM shut down
    assert group_pids(pgid) == []
    reader.join(timeout=10)
    assert ended == ["RemoteProtocolError"]  # the client saw its stream end, not hang
    log = server.log_tail(20000)  # uvicorn cancels the stream left after --shutdown-timeout-s (5 s), and says so
    assert "timeout graceful shutdown exceeded" in log
