"""``trtllm-diffkv serve`` run as a real process (uvicorn), queried with the ``openai`` client package.

The model is a tiny random Llama with the default model's tokenizer (tests/tiny_checkpoint.py). Texts
are compared with the same prompt run alone, greedily, in an in-process ``LLM`` over the same
checkpoint and preset (chat prompts rendered with the tokenizer's chat template by the test).
"""
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_fixtures import checkpoint, client, reference, start_openai_server  # noqa: F401 (fixtures)
from trtllm_diffkv.serve.metrics import METRICS
from trtllm_diffkv.serve.process import group_pids

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Memory is", "Hello there",
           "A short poem about the sea:", "Three colours:", "Dear diary,"]
NAME = "tiny"


def _start(checkpoint, log_path):
    return start_openai_server(checkpoint, log_path, NAME)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    server = _start(checkpoint, tmp_path_factory.mktemp("serve") / "serve.log")
    yield server
    server.stop()


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


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_vllm_stop_token_ids_min_tokens_and_include_stop_str_are_honoured(server, reference, path):
    """Issue 44: vLLM's ``stop_token_ids`` returned the full text, ``min_tokens: 8`` gave 6 tokens and
    ``include_stop_str_in_output`` was dropped. Each now gives what the in-process LLM gives with the same
    SamplingParams (whose rules tests/runtime/test_sampling.py and tests/llmapi/test_llm_api.py check), and the
    stop id cuts the plain greedy run where it first comes."""
    from trtllm_diffkv.runtime.sampling import SamplingParams

    chat = path.startswith("chat")
    prompt = PROMPTS[1]
    tokenizer = reference.tokenizer
    ids = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)["input_ids"] \
        if chat else prompt
    plain = reference.llm.generate(ids, SamplingParams(max_tokens=12, temperature=0.0)).outputs[0]
    stop_id, stop_text = plain.token_ids[2], plain.text[2:6]
    first = plain.token_ids.index(stop_id)
    cases = [dict(stop_token_ids=[stop_id]), dict(stop_token_ids=[stop_id], include_stop_str_in_output=True),
             dict(stop_token_ids=[stop_id], min_tokens=8, ignore_eos=True), dict(stop=[stop_text]),
             dict(stop=[stop_text], include_stop_str_in_output=True), dict(min_tokens=12, max_tokens=12)]
    for fields in cases:
        body = {"model": NAME, "max_tokens": 12, "temperature": 0, **fields}
        body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
        answer = httpx.post(f"{server.base_url}/v1/{path}", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        out = answer.json()
        choice = out["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        want = reference.llm.generate(ids, SamplingParams(temperature=0.0, **{"max_tokens": 12, **fields})).outputs[0]
        assert (text, choice["finish_reason"], out["usage"]["completion_tokens"]) == (
            want.text, want.finish_reason, len(want.token_ids)), fields
        if fields.get("min_tokens"):
            assert len(want.token_ids) >= fields["min_tokens"]
            assert "stop_token_ids" not in fields or stop_id not in want.token_ids[:fields["min_tokens"]]
        elif "stop_token_ids" in fields:
            assert want.token_ids == plain.token_ids[:first + 1]
    bad = httpx.post(f"{server.base_url}/v1/{path}", timeout=60, json={
        "model": NAME, "max_tokens": 4, "min_tokens": 5, **({"messages": [{"role": "user", "content": prompt}]}
                                                           if chat else {"prompt": prompt})})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_tokens", bad.text


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
    ({"prompt": "", "max_tokens": 4}, "empty prompt"),
    ({"prompt": "hi", "temperature": -1.0}, "temperature"),
    ({"prompt": "hi", "n": 2, "best_of": 1}, "best_of must be None or an int >= n (2)"),
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


@pytest.mark.parametrize("path, content, message, param", [
    ("chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "not valid Unicode",
     "messages[0].content"),
    ("completions", b'{"prompt": "\\ud83d", "max_tokens": 2}', "'prompt' is not valid Unicode", "prompt"),
    ("completions", b'{"prompt": "hi", "stop": ["a\\udc00"]}', "'stop[0]' is not valid Unicode", "stop[0]"),
    ("completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}', "cannot be parsed as JSON", None),
    ("completions", b"[" * 5000 + b"]" * 5000, "cannot be parsed as JSON", None),
    ("completions", b'{"prompt": "hi", "max_tokens": }', "not valid JSON (Expecting value at character 31)", None),
    ("completions", b'{"prompt": "hi", "suffix": "end"}', "'suffix' = 'end' is not supported", "suffix"),
])
def test_bad_content_gets_a_400_in_openai_shape(server, client, reference, path, content, message, param):
    answer = httpx.post(f"{server.base_url}/v1/{path}", content=content, timeout=60,
                        headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert message in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    assert "Traceback" not in answer.text
    good = client.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=6, temperature=0)
    assert good.choices[0].text == reference(PROMPTS[4], 6)


def test_explicit_neutral_values_are_accepted(server, client, reference):
    neutral = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}}
    response = client.completions.create(model=NAME, prompt=PROMPTS[7], max_tokens=6, temperature=0, best_of=1,
                                         echo=False, suffix="", **neutral)
    assert response.choices[0].text == reference(PROMPTS[7], 6)
    messages = [{"role": "user", "content": "Hi"}]
    text = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = reference(list(reference.tokenizer(text, add_special_tokens=False)["input_ids"]), 4)
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0, logprobs=False,
                                          **neutral)
    assert chat.choices[0].message.content == expected
    for body, name in (({"best_of": 0}, "best_of"), ({"logit_bias": {"5": 1}}, "logit_bias"), ({"n": 0}, "n"),
                       ({"logprobs": 21}, "logprobs"), ({"presence_penalty": 2.5}, "presence_penalty")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=NAME, prompt="hi", max_tokens=2, **body)
        assert info.value.body["param"] == name
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs"


def test_a_server_fault_is_a_logged_500_in_openai_shape(caplog):
    from fastapi.testclient import TestClient

    from trtllm_diffkv.serve.openai_server import create_app

    class Broken:  # an LLM whose submission fails: a server bug, not the request's fault
        tokenizer, max_seq_len = None, 64

        def generate_async(self, *args, **kwargs):
            raise RuntimeError("executor exploded")

    with TestClient(create_app(Broken(), NAME), raise_server_exceptions=False) as http:
        answer = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 500 and "Traceback" not in answer.text
    assert answer.json() == {"error": {"message": "internal server error (RuntimeError)", "type": "internal_error",
                                       "param": None, "code": None}}
    assert any("executor exploded" in str(r.exc_info[1]) for r in caplog.records if r.exc_info), caplog.records


@pytest.mark.parametrize("error, prompt_ids, status", [
    ("RuntimeError: the step failed: CUDA error", [1, 2], 500),  # the executor's fault (llm.py / executor.py)
    ("the LLM was shut down before the request finished", [1, 2], 500),
    ("prompt needs 9 pages, the KV pool has 4", [1, 2], 400),  # refused by the executor's admission check
    ("empty prompt", [], 400),  # refused before the executor
])
def test_llm_errors_map_to_the_right_status(error, prompt_ids, status):
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from trtllm_diffkv.serve.openai_server import create_app

    failed = SimpleNamespace(error=error, prompt_token_ids=prompt_ids, finished=True,
                             outputs=[SimpleNamespace(finish_reason="error", text="", token_ids=[])])

    class Handle:
        aborted = False

        async def __anext__(self):
            return failed

        def abort(self):
            Handle.aborted = True

    class Failing:
        tokenizer, max_seq_len = None, 64

        def generate_async(self, *args, **kwargs):
            return Handle()

    with TestClient(create_app(Failing(), NAME), raise_server_exceptions=False) as http:
        answer = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert answer.status_code == status and answer.json()["error"]["message"] == error
    assert answer.json()["error"]["type"] == ("internal_error" if status == 500 else "invalid_request_error")


_HAS_CUDA = __import__("torch").cuda.is_available()


@pytest.mark.parametrize("flags, message", [
    (["--port", "99999"], "--port 99999 is not a TCP port (1-65535)"),
    (["--port", "0"], "--port 0 is not a TCP port"),
    (["--device", "meta"], "--device 'meta': only cpu and cuda are supported"),
    (["--device", "gpu0"], "--device 'gpu0' is not a device"),
    pytest.param(["--device", "cuda"], "--device cuda: this torch build sees no CUDA GPU",
                 marks=pytest.mark.skipif(_HAS_CUDA, reason="this machine has a CUDA GPU")),
])
def test_serve_refuses_bad_flags_before_loading(tmp_path, capsys, flags, message):
    from trtllm_diffkv.commands.serve import main

    assert main(["--model", str(tmp_path / "missing"), *flags]) == 2  # the model is never looked at
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "missing" not in err, err


def test_serve_and_triton_repo_refuse_a_port_in_use(tmp_path, capsys):
    import socket

    from trtllm_diffkv.commands import serve, tritonserver_repo

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve.main(["--model", str(tmp_path / "missing"), "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert err == (f"trtllm-diffkv serve: cannot listen on 127.0.0.1:{port} (--port {port}): "
                       "Address already in use\n")
        assert tritonserver_repo.main(["--model", str(tmp_path), "--out", str(tmp_path / "repo"), "--serve",
                                 "--grpc-port", str(port)]) == 2
        assert f"(--grpc-port {port})" in capsys.readouterr().err and not (tmp_path / "repo").exists()
    assert tritonserver_repo.main(["--model", str(tmp_path), "--out", str(tmp_path / "repo"), "--serve",
                             "--metrics-port", "65536"]) == 2
    assert "--metrics-port 65536 is not a TCP port" in capsys.readouterr().err


def test_metrics_and_disconnect_frees_pages(server):
    before = _metrics(server)
    assert set(before) == {m.name for m in METRICS}
    assert before["trtllm_diffkv_kv_pool_pages"] == before["trtllm_diffkv_kv_pool_pages_free"] + \
        before["trtllm_diffkv_kv_pool_pages_used"] > 0
    with httpx.Client(timeout=120) as http:  # a long stream, dropped after its first chunk
        with http.stream("POST", server.base_url + "/v1/completions",
                         json={"model": NAME, "prompt": PROMPTS[5], "max_tokens": 1500, "temperature": 0,
                               "stream": True, "ignore_eos": True}) as response:
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
                                              json={"prompt": PROMPTS[6], "max_tokens": 1500, "stream": True,
                                                    "ignore_eos": True})  # sampled: EOS could end it first
    response = stream.__enter__()  # a request in flight while the server stops
    lines = response.iter_lines()
    next(lines)
    ended = []

    def drain():
        try:
            ended.extend(line for line in lines if line)
        except httpx.HTTPError as exc:  # the server cut the stream without ending it
            ended.append(type(exc).__name__)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    assert server.stop(grace_s=30) == 0  # graceful: uvicorn stopped, the LLM shut down
    assert group_pids(pgid) == []
    reader.join(timeout=10)
    assert ended[-1] == "data: [DONE]" and 'shutting down' in ended[-2]  # ended by the drain, with an error event
    log = server.log_tail(20000)  # the drain aborted it after --shutdown-timeout-s (5 s); uvicorn cancelled nothing
    assert "aborting 1 request(s) still in flight after 5.0 s" in log and "graceful shutdown exceeded" not in log


def _llm_kwargs_of_serve(monkeypatch, capsys, flags) -> dict:
    """The keyword arguments ``serve`` gives ``LLM`` (a stand-in that records them and stops the command)."""
    from trtllm_diffkv.commands.serve import main
    from trtllm_diffkv.llmapi import llm
    from trtllm_diffkv.serve.process import free_port

    seen = {}

    def recording_llm(*args, **kwargs):
        seen.update(kwargs)
        raise ValueError("stand-in LLM: stop before serving")

    monkeypatch.setattr(llm, "LLM", recording_llm)
    assert main(["--device", "cpu", "--port", str(free_port()), *flags]) == 2
    assert "stand-in LLM" in capsys.readouterr().err
    return seen


@pytest.mark.parametrize("flags, expected", [([], None), (["--disable-overlap-scheduler"], True)])
def test_serve_passes_the_overlap_flag_to_the_llm(monkeypatch, capsys, flags, expected):
    assert _llm_kwargs_of_serve(monkeypatch, capsys, flags)["disable_overlap_scheduler"] is expected


@pytest.mark.parametrize("flags, expected", [([], None), (["--kv-config", "diffkv"], "diffkv")])
def test_serve_without_kv_config_leaves_the_choice_to_the_llm(monkeypatch, capsys, flags, expected):
    """``serve`` with no ``--kv-config`` passes ``None``: ``LLM`` then takes an engine dir's recorded configuration
    (``trtllm-diffkv build --kv-config``), else ``default``. Passing ``"default"`` replaced an engine built with
    ``--kv-config diffkv`` (or before issue 41 made ``default`` uniform K8V4) by K8V4."""
    assert _llm_kwargs_of_serve(monkeypatch, capsys, flags)["kv_config"] == expected
