"""The Triton model repository, served by the real ``tritonserver`` from nvidia-pytriton 0.7.0 (CPU).

The repository holds a tiny random Llama with the default model's tokenizer (tests/tiny_checkpoint.py)
twice: ``diffkv`` (decoupled: gRPC streaming, HTTP generate/generate_stream) and ``diffkv_sync``
(one response per request: tritonclient.http infer). Every text is compared with the same prompt
run alone, greedily, through an in-process ``LLM`` with the same checkpoint and preset.
"""
import json
import queue
import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from serve_fixtures import KV_BYTES, checkpoint, reference  # noqa: F401 (fixtures)
from trtllm_diffkv.runtime.sampling import SamplingParams
from trtllm_diffkv.serve.process import group_pids
from trtllm_diffkv.serve.tritonserver_repo import model_config_text, write_repository
from trtllm_diffkv.serve.tritonserver_requests import parse_request

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Memory is", "Hello there",
           "A short poem about the sea:"]

# TensorRT-LLM's inflight_batcher_llm/ensemble/config.pbtxt (TensorRT-LLM main, triton_backend/all_models):
# name -> (data_type, dims) for the inputs and outputs we declare. Copied from that file, not from our code.
TRTLLM_ENSEMBLE = {
    "text_input": ("TYPE_STRING", "1"), "max_tokens": ("TYPE_INT32", "1"), "bad_words": ("TYPE_STRING", "-1"),
    "stop_words": ("TYPE_STRING", "-1"), "exclude_input_in_output": ("TYPE_BOOL", "1"),
    "end_id": ("TYPE_INT32", "1"), "pad_id": ("TYPE_INT32", "1"), "top_k": ("TYPE_INT32", "1"),
    "top_p": ("TYPE_FP32", "1"), "temperature": ("TYPE_FP32", "1"), "length_penalty": ("TYPE_FP32", "1"),
    "repetition_penalty": ("TYPE_FP32", "1"), "min_tokens": ("TYPE_INT32", "1"),
    "presence_penalty": ("TYPE_FP32", "1"), "frequency_penalty": ("TYPE_FP32", "1"), "seed": ("TYPE_UINT64", "1"),
    "return_log_probs": ("TYPE_BOOL", "1"), "return_context_logits": ("TYPE_BOOL", "1"),
    "return_generation_logits": ("TYPE_BOOL", "1"), "beam_width": ("TYPE_INT32", "1"),
    "stream": ("TYPE_BOOL", "1"), "num_return_sequences": ("TYPE_INT32", "1"),
    "text_output": ("TYPE_STRING", "-1"), "batch_index": ("TYPE_INT32", "1"), "num_input_tokens": ("TYPE_INT32", "1"),
    "num_output_tokens": ("TYPE_INT32", "1"), "cum_log_probs": ("TYPE_FP32", "-1"),
    "output_log_probs": ("TYPE_FP32", "-1, -1"),
}


def _tensors(text: str) -> dict[str, tuple[str, str]]:
    found = re.findall(r'name: "(\w+)"\s+data_type: (\w+)\s+dims: \[ ([-\d, ]+) \]', text)
    return {name: (dtype, dims) for name, dtype, dims in found}


def test_config_uses_tensorrt_llm_names_and_types():
    text = model_config_text("diffkv", max_batch_size=8, parameters={"model": "/m", "kv_config": "default"})
    tensors = _tensors(text)
    for name, expected in TRTLLM_ENSEMBLE.items():
        assert tensors.get(name) == expected, name
    assert tensors["random_seed"] == ("TYPE_UINT64", "1")  # tensorrt_llm_bls's older name of seed
    assert tensors["finish_reason"] == ("TYPE_STRING", "-1")  # the llmapi model's output
    assert "max_batch_size: 8" in text and "decoupled: true" in text and "dynamic_batching" not in text
    assert re.search(r'name: "text_input"\s+data_type: TYPE_STRING\s+dims: \[ 1 \]\n', text)  # required
    assert re.search(r'name: "max_tokens"[^}]*optional: true', text)
    assert 'key: "kv_config"\n  value: { string_value: "default" }' in text
    assert "decoupled: false" in model_config_text("x", decoupled=False)
    with pytest.raises(ValueError, match="model name"):
        model_config_text("bad name")
    with pytest.raises(ValueError, match="max_batch_size"):
        model_config_text("x", max_batch_size=0)


def test_a_repository_without_kv_config_leaves_the_choice_to_the_llm(tmp_path):
    """``triton-repo`` / ``write_repository`` with no kv-config writes an empty ``kv_config`` parameter, which the model
    reads as ``None``: ``LLM`` then takes an engine dir's recorded configuration, else ``default`` (writing
    ``"default"`` replaced an engine built with another configuration by uniform K8V4)."""
    from trtllm_diffkv.cli import build_parser
    from trtllm_diffkv.serve.tritonserver_requests import llm_kwargs_from_parameters

    assert build_parser().parse_args(["triton-repo", "--out", str(tmp_path)]).kv_config is None
    for kv_config, expected in ((None, None), ("diffkv", "diffkv")):
        text = (write_repository(tmp_path / str(kv_config), model=tmp_path, name="m", kv_config=kv_config)
                / "config.pbtxt").read_text()
        value = re.search(r'key: "kv_config"\n  value: \{ string_value: "([^"]*)" \}', text).group(1)
        assert llm_kwargs_from_parameters({"kv_config": value})["kv_config"] == expected


def test_write_repository_layout_and_errors(tmp_path):
    model_dir = write_repository(tmp_path, model=tmp_path, name="m", kv_config="fp16", device="cpu")
    assert (model_dir / "1" / "model.py").read_text().startswith('"""Triton Inference Server Python backend')
    assert f'string_value: "{tmp_path.resolve()}"' in (model_dir / "config.pbtxt").read_text()
    with pytest.raises(FileExistsError):
        write_repository(tmp_path, model=tmp_path, name="m")
    write_repository(tmp_path, model=tmp_path, name="m", overwrite=True)
    with pytest.raises(ValueError, match="unknown kv-config preset"):
        write_repository(tmp_path, name="n", kv_config="nope")
    with pytest.raises(FileNotFoundError):
        write_repository(tmp_path, model=tmp_path / "missing", name="n")


def test_triton_repo_command(tmp_path, capsys):
    from trtllm_diffkv.commands.tritonserver_repo import main

    assert main(["--model", str(tmp_path), "--out", str(tmp_path / "repo"), "--name", "m", "--kv-config", "fp16",
                 "--max-batch-size", "4", "--no-decoupled", "--device", "cpu"]) == 0
    text = (tmp_path / "repo" / "m" / "config.pbtxt").read_text()
    assert "max_batch_size: 4" in text and "decoupled: false" in text and 'string_value: "fp16"' in text
    assert "wrote" in capsys.readouterr().out
    assert main(["--model", str(tmp_path), "--out", str(tmp_path / "repo"), "--name", "m"]) == 2  # exists
    assert "exists" in capsys.readouterr().err
    assert main(["--model", str(tmp_path)]) == 2 and "--out is required" in capsys.readouterr().err


def _column(values, dtype=None):
    return np.array(values, dtype=dtype if dtype is not None else object).reshape(len(values), 1)


def test_parse_request_maps_inputs_to_sampling_params():
    rows = parse_request({"text_input": _column([b"Hi", "caf\u00e9".encode()]), "max_tokens": _column([5, 7], np.int32),
                          "temperature": _column([0.5, 0.0], np.float32), "top_k": _column([3, 0], np.int32),
                          "seed": _column([11, 12], np.uint64), "end_id": _column([2, 9], np.int32),
                          "stop_words": np.array([[b"a,b", b""], [b"", b""]], dtype=object),
                          "stream": _column([True, True], bool), "pad_id": _column([0, 0], np.int32),
                          "beam_width": _column([1, 1], np.int32)})
    assert [r.prompt for r in rows] == ["Hi", "caf\u00e9"] and all(r.stream for r in rows)
    assert rows[0].sampling_params == SamplingParams(max_tokens=5, temperature=0.5, top_k=3, seed=11,
                                                     stop=["a", "b"], end_id=2)
    assert rows[1].sampling_params == SamplingParams(max_tokens=7, temperature=0.0, top_k=0, seed=12,
                                                     end_id=9)
    only = parse_request({"text_input": _column([b"x"]), "random_seed": _column([4], np.uint64)})[0]
    assert only.sampling_params == SamplingParams(max_tokens=64, seed=4) and not only.stream
    no_end = parse_request({"text_input": _column([b"x"]), "end_id": _column([-1], np.int32)})[0]
    assert no_end.sampling_params == SamplingParams(end_id=-1) and no_end.sampling_params.ignore_eos  # no end token
    at_least = parse_request({"text_input": _column([b"x"]), "min_tokens": _column([6], np.int32)})[0]
    assert at_least.sampling_params == SamplingParams(min_tokens=6)  # issue 44: was refused unless 0


def test_parse_request_takes_log_probs_and_penalties():
    from trtllm_diffkv.runtime.sampling import Logprob
    from trtllm_diffkv.serve.tritonserver_requests import log_prob_values

    row = parse_request({"text_input": _column([b"x"]), "return_log_probs": _column([True], bool),
                         "presence_penalty": _column([0.5], np.float32),
                         "frequency_penalty": _column([-1.0], np.float32)})[0]
    assert row.return_log_probs and row.sampling_params == SamplingParams(logprobs=0, presence_penalty=0.5,
                                                                          frequency_penalty=-1.0)
    assert parse_request({"text_input": _column([b"x"])})[0].sampling_params.logprobs is None
    entries = [[{7: Logprob(-0.5, 1)}, {3: Logprob(-2.0, 4), 1: Logprob(-0.1, 1)}], None]
    cumulative, per_token = log_prob_values([[7, 3], [5]], entries)
    assert cumulative.shape == (2, 1) and per_token.shape == (2, 1, 2) and per_token.dtype == np.float32
    assert cumulative[:, 0].tolist() == [-2.5, 0.0] and per_token[0, 0].tolist() == [-0.5, -2.0]


def test_parse_request_passes_end_id_on_so_a_negative_id_other_than_minus_1_is_refused():
    """TensorRT-LLM's ``end_id`` is a token id or -1 (no end token); -5 was read as -1 and the request ran to
    ``max_tokens`` ignoring the model's stop ids. The row's params carry ``end_id``, and its check refuses it."""
    row = parse_request({"text_input": _column([b"x"]), "end_id": _column([-5], np.int32)})[0]
    assert not row.sampling_params.ignore_eos
    with pytest.raises(ValueError, match="end_id must be None, -1 .* got -5"):
        row.sampling_params.validate()


@pytest.mark.parametrize("extra, message", [
    ({"beam_width": _column([2], np.int32)}, "'beam_width' = 2 is not supported"),
    ({"bad_words": np.array([[b"foo"]], dtype=object)}, "'bad_words' is not supported"),
    ({"return_context_logits": _column([True], bool)}, "'return_context_logits' = True"),
    ({"max_tokens": _column([1, 2], np.int32)}, "expected batch size 1"),
    ({"text_input": _column([b"\xff\xfe"])}, "not UTF-8"),
    ({"temprature": _column([1.0], np.float32)}, "unknown inputs"),
])
def test_parse_request_refuses_unsupported_inputs(extra, message):
    with pytest.raises(ValueError, match=message):
        parse_request({"text_input": _column([b"x"]), **extra})


# ---------------------------------------------------------------------------------------------- the real server
@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    from trtllm_diffkv.serve.tritonserver_binary import TritonServer, TritonUnavailable

    repo = tmp_path_factory.mktemp("repo")
    for name, decoupled in (("diffkv", True), ("diffkv_sync", False)):
        write_repository(repo, model=checkpoint, name=name, max_batch_size=8, kv_memory_bytes=KV_BYTES,
                         device="cpu", dtype="float32", decoupled=decoupled)
    try:
        srv = TritonServer(repo, tmp_path_factory.mktemp("ws"), install_stub_numpy=True)
    except TritonUnavailable as exc:
        pytest.skip(f"the bundled tritonserver cannot run here: {exc}")
    srv.start()
    srv.wait_ready(timeout_s=300)
    yield srv
    srv.stop()


def _grpc_inputs(grpc, prompt, max_tokens, stream, **extra):
    values = {"text_input": _column([prompt.encode()]), "max_tokens": _column([max_tokens], np.int32),
              "stream": _column([stream], bool), **{k: v for k, v in extra.items()}}
    types = {np.dtype(object): "BYTES", np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL",
             np.dtype(np.float32): "FP32", np.dtype(np.uint64): "UINT64"}
    tensors = []
    for name, array in values.items():
        tensor = grpc.InferInput(name, list(array.shape), types[array.dtype])
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _stream(server, requests, timeout=120):
    """Send (request_id, prompt, max_tokens, extra) over one gRPC stream; id -> (texts, errors, finals)."""
    import tritonclient.grpc as grpc

    results = {rid: ([], [], []) for rid, *_ in requests}
    pending, done = queue.Queue(), 0
    with grpc.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: pending.put((result, error)))
        for rid, prompt, max_tokens, extra in requests:
            client.async_stream_infer("diffkv", _grpc_inputs(grpc, prompt, max_tokens, True, **extra), request_id=rid,
                                      enable_empty_final_response=True)
        while done < len(requests):
            result, error = pending.get(timeout=timeout)
            if error is not None:  # a failed request's last message; it carries no request id, so only the
                results[requests[-1][0]][1].append(str(error))  # last request of a call may be a bad one
                done += 1
                continue
            response = result.get_response()
            texts, _, finals = results[response.id]
            if response.outputs:
                texts.append(result.as_numpy("text_output")[0, 0].decode())
            if response.parameters["triton_final_response"].bool_param:
                finals.append(True)
                done += 1
        client.stop_stream()
    return results


def test_grpc_streaming_matches_the_prompt_run_alone(server, reference):
    results = _stream(server, [("a", PROMPTS[0], 12, {})])
    texts, errors, finals = results["a"]
    assert not errors and finals == [True] and len(texts) > 1
    assert "".join(texts) == reference(PROMPTS[0], 12)


def test_concurrent_streams_give_the_same_greedy_text(server, reference):
    requests = [(f"r{i}", prompt, 10, {}) for i, prompt in enumerate(PROMPTS)]
    bad = ("bad", "hi", 10, {"temperature": _column([-1.0], np.float32)})  # fails alone, among the others
    results = _stream(server, requests + [bad])
    for rid, prompt, max_tokens, _ in requests:
        texts, errors, finals = results[rid]
        assert not errors and finals == [True] and "".join(texts) == reference(prompt, max_tokens), prompt
    assert results["bad"][0] == [] and "temperature" in results["bad"][1][0]


def test_grpc_non_streaming_returns_prompt_and_text(server, reference):
    import tritonclient.grpc as grpc

    with grpc.InferenceServerClient(server.grpc_url) as client:
        result = client.infer("diffkv_sync", _grpc_inputs(grpc, PROMPTS[1], 8, False))
    assert result.as_numpy("text_output")[0, 0].decode() == PROMPTS[1] + reference(PROMPTS[1], 8)
    assert result.as_numpy("num_output_tokens")[0, 0] == 8 and result.as_numpy("finish_reason")[0, 0] == b"length"


def test_http_infer_generate_and_generate_stream(server, reference):
    import httpx
    import tritonclient.http as http

    with http.InferenceServerClient(server.http_url) as client:
        inputs = []
        for name, array, dtype in (("text_input", _column([PROMPTS[2].encode()]), "BYTES"),
                                   ("max_tokens", _column([8], np.int32), "INT32"),
                                   ("exclude_input_in_output", _column([True], bool), "BOOL")):
            inputs.append(http.InferInput(name, list(array.shape), dtype))
            inputs[-1].set_data_from_numpy(array)
        result = client.infer("diffkv_sync", inputs)
        assert result.as_numpy("text_output")[0, 0].decode() == reference(PROMPTS[2], 8)
    base = f"http://{server.http_url}/v2/models/diffkv"
    with httpx.Client(timeout=120) as client:
        body = {"text_input": PROMPTS[3], "max_tokens": 8, "bad_words": "", "stop_words": ""}  # TensorRT-LLM's curl
        answer = client.post(f"{base}/generate", json=body).json()
        assert answer["text_output"] == PROMPTS[3] + reference(PROMPTS[3], 8) and answer["finish_reason"] == "length"
        events = client.post(f"{base}/generate_stream", json={**body, "stream": True}).text
        chunks = [json.loads(line[len("data: "):]) for line in events.splitlines() if line.startswith("data: ")]
        assert "".join(c["text_output"] for c in chunks) == reference(PROMPTS[3], 8)
        assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["num_output_tokens"] == 8


@pytest.mark.parametrize("body, message", [
    ({"text_input": "", "max_tokens": 4}, "empty prompt"),
    ({"text_input": "hi", "max_tokens": 4, "temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "max_tokens": 4, "beam_width": 2}, "beam_width"),
    ({"text_input": "hi", "max_tokens": 100000}, "exceeds"),
])
def test_bad_request_gets_an_error_and_the_next_succeeds(server, reference, body, message):
    import httpx

    base = f"http://{server.http_url}/v2/models/diffkv"
    with httpx.Client(timeout=120) as client:
        bad = client.post(f"{base}/generate", json=body)
        assert bad.status_code == 400 and message in bad.json()["error"]
        good = client.post(f"{base}/generate", json={"text_input": PROMPTS[4], "max_tokens": 6}).json()
    assert good["text_output"] == PROMPTS[4] + reference(PROMPTS[4], 6)


@pytest.mark.parametrize("prompt, extra, message", [
    ("", {}, "empty prompt"),
    ("hi", {"max_tokens": _column([0], np.int32)}, "max_tokens"),
    ("hi", {"beam_width": _column([2], np.int32)}, "beam_width"),
])
def test_sync_model_answers_bad_requests_with_invalid_argument(server, reference, prompt, extra, message):
    """The non-decoupled model's infer: a client error is HTTP 400 / gRPC INVALID_ARGUMENT (not 500 / INTERNAL)."""
    import tritonclient.grpc as grpc
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    values = {"text_input": _column([prompt.encode()]), "max_tokens": _column([4], np.int32), **extra}
    types = {np.dtype(object): "BYTES", np.dtype(np.int32): "INT32"}
    for module, url in ((http, server.http_url), (grpc, server.grpc_url)):
        inputs = []
        for name, array in values.items():
            inputs.append(module.InferInput(name, list(array.shape), types[array.dtype]))
            inputs[-1].set_data_from_numpy(array)
        with module.InferenceServerClient(url) as client:
            with pytest.raises(InferenceServerException) as info:
                client.infer("diffkv_sync", inputs)
            assert message in info.value.message()
            assert info.value.status() == ("400" if module is http else "StatusCode.INVALID_ARGUMENT"), info.value
    with http.InferenceServerClient(server.http_url) as client:  # the model still serves
        inputs = [http.InferInput("text_input", [1, 1], "BYTES"), http.InferInput("max_tokens", [1, 1], "INT32")]
        inputs[0].set_data_from_numpy(_column([PROMPTS[4].encode()]))
        inputs[1].set_data_from_numpy(_column([6], np.int32))
        text = client.infer("diffkv_sync", inputs).as_numpy("text_output")[0, 0].decode()
    assert text == PROMPTS[4] + reference(PROMPTS[4], 6)


def _metrics(server, model="diffkv") -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    pattern = r'^(trtllm_diffkv_\w+)\{model="' + model + r'",version="1"\} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}


def test_client_cancellation_frees_the_pages(server):
    import tritonclient.grpc as grpc

    before = _metrics(server)
    got = queue.Queue()
    client = grpc.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("diffkv", _grpc_inputs(grpc, PROMPTS[5], 1500, True), request_id="long")
    result, error = got.get(timeout=120)  # the first token: the request holds pages now
    assert error is None
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        metrics = _metrics(server)
        if (metrics["trtllm_diffkv_requests_cancelled_total"] > before["trtllm_diffkv_requests_cancelled_total"] and metrics["trtllm_diffkv_requests_running"] == 0
                and metrics["trtllm_diffkv_kv_pool_pages_used"] == 0):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"cancelled request still running or holding pages: {metrics}")
    generated = metrics["trtllm_diffkv_generation_tokens_total"] - before["trtllm_diffkv_generation_tokens_total"]
    assert generated < 1500  # stopped long before its max_tokens


def test_shutdown_leaves_no_process_and_no_shared_memory(checkpoint, tmp_path):
    from trtllm_diffkv.serve.tritonserver_binary import TritonServer, TritonUnavailable

    write_repository(tmp_path / "repo", model=checkpoint, name="diffkv", max_batch_size=2,
                     kv_memory_bytes=KV_BYTES, device="cpu")
    try:
        server = TritonServer(tmp_path / "repo", tmp_path / "ws", install_stub_numpy=True)
    except TritonUnavailable as exc:
        pytest.skip(f"the bundled tritonserver cannot run here: {exc}")
    server.start()
    server.wait_ready(timeout_s=300)
    pgid = server.pid
    assert len(group_pids(pgid)) >= 2  # tritonserver and the Python backend stub
    assert list(Path("/dev/shm").glob(server.shm_prefix + "*"))
    assert server.stop() == 0  # graceful: the model's finalize shut the LLM down
    assert group_pids(pgid) == [] and not list(Path("/dev/shm").glob(server.shm_prefix + "*"))


def test_return_log_probs_gives_tensorrt_llms_outputs(server, checkpoint):
    """``return_log_probs``: ``cum_log_probs`` [batch, 1] and ``output_log_probs`` [batch, 1, tokens], equal to the
    in-process LLM's log-probabilities of the same greedy tokens; the streamed pieces concatenate to them."""
    import httpx
    import tritonclient.grpc as grpc

    from trtllm_diffkv.llmapi.llm import LLM

    with LLM(str(checkpoint), device="cpu", kv_memory_bytes=KV_BYTES, max_batch_size=2) as llm:
        want = llm.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)).outputs[0]
    per_token = [entry[token].logprob for entry, token in zip(want.logprobs, want.token_ids)]
    with grpc.InferenceServerClient(server.grpc_url) as client:
        result = client.infer("diffkv_sync", _grpc_inputs(grpc, PROMPTS[1], 8, False, temperature=_column(
            [0.0], np.float32), return_log_probs=_column([True], bool)))
    output, cumulative = result.as_numpy("output_log_probs"), result.as_numpy("cum_log_probs")
    assert output.shape == (1, 1, 8) and cumulative.shape == (1, 1)
    assert output[0, 0].tolist() == pytest.approx(per_token, abs=1e-4)
    assert float(cumulative[0, 0]) == pytest.approx(want.cumulative_logprob, abs=1e-3)
    body = {"text_input": PROMPTS[1], "max_tokens": 8, "temperature": 0.0, "return_log_probs": True, "stream": True}
    with httpx.Client(timeout=120) as client:
        events = client.post(f"http://{server.http_url}/v2/models/diffkv/generate_stream", json=body).text
    chunks = [json.loads(line[len("data: "):]) for line in events.splitlines() if line.startswith("data: ")]
    streamed = [v for c in chunks for v in np.ravel(c.get("output_log_probs", []))]
    assert streamed == pytest.approx(per_token, abs=1e-4)
