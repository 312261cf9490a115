"""SIGTERM to the real ``tritonserver`` (nvidia-pytriton 0.7.0) while decoupled streams generate (issue 21).

Before the model drained at SIGTERM, the streams went on generating, ``finalize()`` was never reached
and after ``--exit-timeout-secs`` tritonserver crashed (``Signal (11)``, ``malloc_consolidate()``) and
hung until SIGKILL. Now: the model's drain time (``shutdown_timeout_s``, 1 s here) passes, the
streams are aborted in the LLM and end with an ``UNAVAILABLE`` error, the client closes its gRPC
stream on their final responses (as a tritonclient user does), Triton finalizes the model (its log
says no KV page is held) and exits 0. Loopback only; every process stopped; bounded waits.
"""
import queue
import threading
import time

import numpy as np
import pytest

from serve_fixtures import KV_BYTES, checkpoint  # noqa: F401 (fixture)
from trtllm_diffkv.serve.process import group_pids
from trtllm_diffkv.serve.tritonserver_repo import write_repository

grpc = pytest.importorskip("tritonclient.grpc")


def _inputs(prompt: str, max_tokens: int):
    tensors = []
    for name, value, datatype, dtype in (("text_input", prompt.encode(), "BYTES", object),
                                         ("max_tokens", max_tokens, "INT32", np.int32),
                                         ("stream", True, "BOOL", bool), ("end_id", -1, "INT32", np.int32)):
        tensor = grpc.InferInput(name, [1, 1], datatype)
        tensor.set_data_from_numpy(np.array([[value]], dtype=dtype))
        tensors.append(tensor)
    return tensors


def _two_long_streams(client, responses, callback) -> None:
    """Start the gRPC stream with ``callback``, send two 1900-token streaming requests (far more than a drain lets
    them generate) and wait until both generate (4 responses without error)."""
    client.start_stream(callback=callback)
    for rid in ("a", "b"):
        client.async_stream_infer("diffkv", _inputs(f"Story {rid}:", 1900), request_id=rid,
                                  enable_empty_final_response=True)
    for _ in range(4):
        result, error = responses.get(timeout=120)
        assert error is None, error


def test_sigterm_with_live_streams_drains_cancels_and_exits_0(checkpoint, tmp_path):
    from trtllm_diffkv.serve.tritonserver_binary import TritonServer, TritonUnavailable

    write_repository(tmp_path / "repo", model=checkpoint, name="diffkv", max_batch_size=4, kv_memory_bytes=KV_BYTES,
                     device="cpu", dtype="float32", shutdown_timeout_s=1.0, num_threads=1)
    try:
        server = TritonServer(tmp_path / "repo", tmp_path / "ws", install_stub_numpy=True, exit_timeout_s=10)
    except TritonUnavailable as exc:
        pytest.skip(f"the bundled tritonserver cannot run here: {exc}")
    server.start()
    try:
        server.wait_ready(timeout_s=300)
        pgid = server.pid
        client = grpc.InferenceServerClient(server.grpc_url)
        responses, ends = queue.Queue(), {}

        def callback(result, error):
            responses.put((result, error))
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                ends[len(ends)] = error
                if len(ends) == 2:  # both requests ended: the client ends its stream, as a client does
                    threading.Thread(target=client.stop_stream, daemon=True).start()

        _two_long_streams(client, responses, callback)
        start = time.monotonic()
        code = server.stop(grace_s=40)
        elapsed = time.monotonic() - start
    finally:
        server.stop()
    log = server.log_tail(400000)
    assert code == 0 and elapsed < 10, (code, elapsed, log[-3000:])  # 1 s drain, then finalize: not the timeout
    assert group_pids(pgid) == []
    assert len(ends) == 2 and all(e is not None and "the server is shutting down" in str(e) for e in ends.values())
    assert "aborting 2 request(s) still in flight after 1.0 s" in log
    assert "finalized; KV pool pages held: 0" in log  # finalize() reached, the aborted requests' pages freed
    assert "Signal (11)" not in log and "Exit timeout expired" not in log


def test_sigterm_to_the_command_with_a_client_stream_left_open_exits_0_after_the_drain(checkpoint, tmp_path):
    """Issue 44: a client that keeps its gRPC stream open (no ``stop_stream()``) kept Triton 2.51 up after the
    drain (its gRPC server waits for every open stream): "Exit timeout expired", then a hang until SIGKILL.
    Now ``triton-repo --serve`` at SIGTERM: the streams end with the shutdown error after the 1 s drain, the
    model reports no KV page held, the launcher stops tritonserver and exits 0, well before the exit timeout."""
    import sys

    from trtllm_diffkv.serve.process import ServerProcess, free_port
    from trtllm_diffkv.serve.tritonserver_binary import TritonUnavailable, find_triton

    try:
        find_triton()
    except TritonUnavailable as exc:
        pytest.skip(f"the bundled tritonserver cannot run here: {exc}")
    http, grpc_port, metrics = free_port(), free_port(), free_port()
    command = [sys.executable, "-m", "trtllm_diffkv.commands.tritonserver_repo", "--out", str(tmp_path / "repo"), "--model",
               str(checkpoint), "--name", "diffkv", "--max-batch-size", "4", "--kv-memory-bytes", str(KV_BYTES),
               "--device", "cpu", "--dtype", "float32", "--threads", "1", "--shutdown-timeout-s", "1", "--serve",
               "--http-port", str(http), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics)]
    command_log = tmp_path / "command.log"
    launcher = ServerProcess(command, f"http://127.0.0.1:{http}/v2/health/ready", command_log).start()
    client = None
    try:
        launcher.wait_ready(timeout_s=300)
        client = grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        responses, ends = queue.Queue(), {}

        def callback(result, error):
            responses.put((result, error))
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                ends[len(ends)] = error  # the stream is left open: no stop_stream()

        _two_long_streams(client, responses, callback)
        start = time.monotonic()
        code = launcher.stop(grace_s=60)  # SIGTERM to the command's group: the command alone
        elapsed = time.monotonic() - start
    finally:
        launcher.stop()
        if client is not None:
            client.close()
    out = command_log.read_text(errors="replace")
    assert code == 0 and elapsed < 15, (code, elapsed, out[-3000:])  # 1 s drain + 5 s: not the 11 s exit timeout
    first = [ends.get(0), ends.get(1)]  # then the stream itself breaks as tritonserver goes away
    assert all(e is not None and "the server is shutting down" in str(e) for e in first), ends
    assert "every request drained (KV pool pages held: 0)" in out
    assert group_pids(launcher.pid) == []


def test_trtllm_optional_inputs_and_diffkv_outputs(checkpoint, tmp_path):
    """TensorRT-LLM's ensemble's return_num_*_tokens inputs are accepted; the final response carries the
    DiffKV outputs, equal to the same prompt run alone in an in-process LLM (its RequestOutput.metrics)."""
    from trtllm_diffkv.llmapi.llm import LLM
    from trtllm_diffkv.runtime.sampling import SamplingParams
    from trtllm_diffkv.serve.tritonserver_binary import TritonServer, TritonUnavailable

    write_repository(tmp_path / "repo", model=checkpoint, name="diffkv", max_batch_size=4, kv_memory_bytes=KV_BYTES,
                     device="cpu", dtype="float32", num_threads=1)
    try:
        server = TritonServer(tmp_path / "repo", tmp_path / "ws", install_stub_numpy=True)
    except TritonUnavailable as exc:
        pytest.skip(f"the bundled tritonserver cannot run here: {exc}")
    prompt = "The capital of France is"
    with LLM(str(checkpoint), device="cpu", kv_memory_bytes=KV_BYTES, max_batch_size=4) as llm:
        alone = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0)).metrics
    server.start()
    try:
        server.wait_ready(timeout_s=300)
        with grpc.InferenceServerClient(server.grpc_url) as client:
            tensors = _inputs(prompt, 6)[:2]  # text_input, max_tokens; not streaming: one response
            for name in ("return_num_input_tokens", "return_num_output_tokens"):
                flag = grpc.InferInput(name, [1, 1], "BOOL")
                flag.set_data_from_numpy(np.array([[True]]))
                tensors.append(flag)
            results = queue.Queue()
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            client.async_stream_infer("diffkv", tensors, enable_empty_final_response=True)
            result, error = results.get(timeout=120)
            client.stop_stream()
        assert error is None, error
        assert result.as_numpy("num_output_tokens")[0, 0] == 6
        assert result.as_numpy("kv_pool_bytes")[0, 0] == alone["pool_used_bytes"] > 0
        for name in ("kv_memory_fraction", "high_fraction", "low_fraction", "pruned_fraction"):
            assert result.as_numpy(name)[0, 0] == pytest.approx(alone[name], rel=1e-6), name
    finally:
        assert server.stop() == 0
