"""The OpenAI server's HTTP guards (issue 44): slow and idle clients, the ``Host`` rule, loose JSON types, bodies
that are not UTF-8.

Before: a client trickling one header line or one body byte every 2 s kept its connection for ever, 150 half-sent
requests stayed open, ``Host: attacker.example`` was served by a loopback server (the DNS-rebinding shape),
``stream_options: {"include_usage": "false"}`` turned the usage chunk on, and a UTF-16 body was parsed. The slow
clients are met by a real uvicorn server in a thread (``serve``'s own config, short deadlines); the rest by
FastAPI's TestClient. The app serves the recording stand-in LLM of test_openai_app_rules.py.
"""
import asyncio
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")

from test_openai_app_rules import RecordingLLM as _Recording  # noqa: E402

LOOPBACK = ["localhost", "127.0.0.0/8", "::1"]


class RecordingLLM(_Recording):
    """The stand-in, its outputs also streamable (``token_ids_diff``)."""

    def generate_async(self, prompt, params, streaming=False):
        handle = super().generate_async(prompt, params, streaming)
        completion = handle.output.outputs[0]
        completion.token_ids_diff, completion.logprobs = completion.token_ids, None
        return handle


@pytest.fixture()
def http():
    from fastapi.testclient import TestClient

    from trtllm_diffkv.serve.openai_server import create_app

    with TestClient(create_app(RecordingLLM(), "tiny", allowed_hosts=LOOPBACK), base_url="http://127.0.0.1:8000",
                    raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("host, served", [
    ("127.0.0.1:8000", True), ("localhost", True), ("LOCALHOST:1", True), ("127.3.4.5:80", True),
    ("[::1]:8000", True), ("[::1]", True), ("attacker.example:8000", False), ("attacker.example", False),
    ("127.0.0.1.attacker.example", False), ("localhost.attacker.example:8000", False), ("10.0.0.1:8000", False),
    ("[::2]:8000", False),
])
def test_a_loopback_server_answers_loopback_host_names_only(http, host, served):
    for answer in (http.get("/v1/models", headers={"host": host}),
                   http.post("/v1/completions", headers={"host": host}, json={"prompt": "hi", "max_tokens": 2})):
        if served:
            assert answer.status_code == 200, answer.text
        else:
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error" and f"Host {host!r} is not served here" in error["message"]


def test_allowed_hosts_names_networks_and_star():
    from trtllm_diffkv.serve.http_limits import check_allowed_hosts, host_allowed, is_loopback

    allowed = check_allowed_hosts(["api.example.com", "10.0.0.0/8", "[::1]"])
    assert host_allowed("API.example.com:443", allowed) and host_allowed("10.2.3.4:8000", allowed)
    assert host_allowed("[::1]:1", allowed) and not host_allowed("example.com", allowed)
    assert not host_allowed("11.0.0.1", allowed) and host_allowed("anything:1", ["*"]) and host_allowed("x", None)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")
    for bad in (["http://x"], ["x:80"], [""], []):
        with pytest.raises(ValueError, match="allowed-hosts"):
            check_allowed_hosts(bad)


@pytest.mark.parametrize("options, status", [
    ({"include_usage": "false"}, 400), ({"include_usage": 1}, 400), ({"include_usage": None}, 200),
    ({"include_usage": False}, 200), ({"continuous_usage_stats": "yes"}, 400), ({"continuous_usage_stats": True}, 400),
])
def test_stream_options_take_json_booleans_only(http, options, status):
    answer = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True,
                                                "stream_options": options})
    assert answer.status_code == status, answer.text
    if status == 400:
        assert answer.json()["error"]["param"].startswith("stream_options"), answer.json()
    else:
        chunks = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
        assert not any("usage" in c and not c["choices"] for c in chunks)  # false or null: no usage chunk


def test_include_usage_true_adds_the_usage_chunk(http):
    answer = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True,
                                                "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_a_body_that_is_not_utf8_is_a_400(http, encoding):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode(encoding)
    answer = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert "not UTF-8" in answer.json()["error"]["message"]
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


# ---------------------------------------------------------------------- slow clients, a real uvicorn server

RECEIVE_S = 1.0


class SlowLLM(RecordingLLM):
    """The stand-in, each answer 1.5 x the receive deadline late (a generation that outlasts it)."""

    def generate_async(self, prompt, params, streaming=False):
        handle = super().generate_async(prompt, params, streaming)
        output = handle.output

        async def late():
            await asyncio.sleep(1.5 * RECEIVE_S)
            return output

        handle.__anext__ = late
        return handle


@pytest.fixture(params=[RecordingLLM])
def live_server(request):
    """``serve``'s uvicorn config (receive deadline 1 s, at most 6 connections) over the stand-in, in a thread."""
    import uvicorn

    from trtllm_diffkv.commands.serve import uvicorn_config
    from trtllm_diffkv.serve.openai_server import create_app
    from trtllm_diffkv.serve.process import free_port

    port = free_port()
    app = create_app(request.param(), "tiny", allowed_hosts=LOOPBACK, receive_timeout_s=RECEIVE_S)
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, log_level="warning", receive_timeout_s=RECEIVE_S,
                                           max_connections=6))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def _connect(port):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def _closed_within(sock, seconds, trickle=b"") -> tuple[bool, bytes]:
    """Send ``trickle`` a byte every 0.2 s until the server answers; ``(closed by the server within seconds, what
    it sent)``."""
    sock.settimeout(0.2)
    start, got = time.monotonic(), b""
    while time.monotonic() - start < seconds:
        try:
            data = sock.recv(4096)
            if not data:
                return True, got
            got += data
        except socket.timeout:
            pass
        except ConnectionResetError:
            return True, got
        if trickle and not got:  # once the server answered, sending more only resets the connection
            try:
                sock.sendall(trickle)
            except OSError:
                return True, got
    return False, got


def _read_response(sock) -> bytes:
    """One whole HTTP response (head and its Content-Length of body) from ``sock``; what came before the server
    closed the connection if it did (b"" when nothing came)."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_request_head_trickled_byte_by_byte_is_cut_at_the_deadline(live_server):
    sock = _connect(live_server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    start = time.monotonic()
    closed, _ = _closed_within(sock, 4 * RECEIVE_S, trickle=b"X")  # "XXXX...": a header line that never ends
    assert closed and time.monotonic() - start < 2 * RECEIVE_S + 0.5
    idle = _connect(live_server)  # a connection that sends nothing at all
    closed, _ = _closed_within(idle, 4 * RECEIVE_S)
    assert closed


def test_a_body_trickled_byte_by_byte_gets_a_408_at_the_deadline(live_server):
    sock = _connect(live_server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 200\r\n\r\n{")
    start = time.monotonic()
    closed, got = _closed_within(sock, 4 * RECEIVE_S, trickle=b" ")
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert b"did not arrive within 1 s" in got and time.monotonic() - start < 2 * RECEIVE_S + 0.5
    assert closed


@pytest.mark.parametrize("live_server", [RecordingLLM, SlowLLM], indirect=True)
def test_a_request_after_a_response_keeps_its_connection_past_the_deadline(live_server):
    """The head deadline is re-armed per request and never cuts a response: a keep-alive client sending its next
    request promptly is served, also when the answer takes longer than the deadline (SlowLLM: 1.5 s)."""
    sock = _connect(live_server)
    body = b'{"prompt": "hi", "max_tokens": 2}'
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    for _ in range(3):
        sock.sendall(request)
        answer = _read_response(sock)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        time.sleep(0.6 * RECEIVE_S)  # 1.8 s in all: past one deadline, each head in time
    sock.close()


def test_connections_past_the_cap_are_closed_at_once(live_server):
    held = [_connect(live_server) for _ in range(6)]
    time.sleep(0.2)
    extra = _connect(live_server)
    closed, _ = _closed_within(extra, 0.5)
    assert closed  # the 7th, at once (the 6 others until their own deadline)
    for sock in held:
        sock.close()
