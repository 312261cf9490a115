"""``serve --tp 2`` after a rank dies (issue 44): the OpenAI app over a real 2-rank ``LLM`` (gloo on the CPU).

Before: the stream in flight ended with an error event, then ``/health`` kept answering 200 and every request got
a 400 ``invalid_request_error`` quoting ``RuntimeError: the tensor-parallel group is broken``. Now ``/health`` and
every request answer 503 (``service_unavailable``) as soon as a rank process is gone, so an orchestrator restarts
the server and clients retry elsewhere. The app runs in process (FastAPI's TestClient) over the real LLM and
ranks; the rank is killed as a crash or the OOM killer would.
"""
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")

from conftest import tiny_llama  # noqa: E402
from support.tensor_parallel import write_checkpoint  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41]


def test_a_dead_rank_turns_health_and_requests_into_503(tmp_path):
    from fastapi.testclient import TestClient

    from trtllm_diffkv import LLM
    from trtllm_diffkv.serve.openai_server import create_app

    checkpoint = write_checkpoint(tmp_path / "tiny", tiny_llama())
    llm = LLM(str(checkpoint), "fp16", tensor_parallel_size=2, device="cpu", num_threads=1, kv_memory_bytes=1 << 22)
    try:
        with TestClient(create_app(llm, "tiny"), raise_server_exceptions=False) as http:
            assert http.get("/health").json() == {"status": "ok"}
            ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
            body = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
            with ThreadPoolExecutor(1) as pool:  # a request in flight when the rank dies
                in_flight = pool.submit(http.post, "/v1/completions", json=body)
                deadline = time.monotonic() + 60
                while llm.stats()["running"] == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                rank = llm.executor._procs[1]
                rank.kill()  # SIGKILL: as the OOM killer would
                rank.join(10)
                failed = in_flight.result(timeout=60)
            assert failed.status_code == 500, failed.text  # a failed step: the server's fault (as before)
            health = http.get("/health")
            assert health.status_code == 503, health.text
            error = health.json()["error"]
            assert error["type"] == "service_unavailable" and "tensor-parallel group is broken" in error["message"]
            for path, request in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
                                  ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True})):
                answer = http.post(path, json=request)
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["type"] == "service_unavailable"
                assert "the LLM cannot serve requests" in answer.json()["error"]["message"]
    finally:
        llm.shutdown()
