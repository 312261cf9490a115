"""Fixtures shared by the server tests (test_tritonserver_repo.py, test_openai_server.py): a tiny checkpoint
with the default model's tokenizer, the reference texts both servers are compared with, and the
``trtllm-diffkv serve`` process of the OpenAI server tests."""
import sys

import pytest

from tiny_checkpoint import write_tiny_text_checkpoint
from trtllm_diffkv.runtime.sampling import SamplingParams

KV_BYTES = 32 << 20
"""KV pool bytes of every LLM in the server tests (server side and reference)."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama folder (2 layers) with the default model's tokenizer files."""
    return write_tiny_text_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def reference(checkpoint):
    """``(prompt text or token ids, max_tokens) -> text``: the prompt run alone, greedily, in an in-process
    ``LLM`` over the same checkpoint and preset as the servers; ``.tokenizer`` is that LLM's tokenizer, ``.llm``
    the LLM."""
    from trtllm_diffkv.llmapi.llm import LLM

    llm = LLM(str(checkpoint), device="cpu", kv_memory_bytes=KV_BYTES, max_batch_size=8)
    cache = {}

    def text(prompt, max_tokens):
        key = (tuple(prompt) if isinstance(prompt, list) else prompt, max_tokens)
        if key not in cache:
            out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
            assert out.error is None
            cache[key] = out.outputs[0].text
        return cache[key]

    text.tokenizer, text.llm = llm.tokenizer, llm
    yield text
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server):
    """An ``openai.OpenAI`` client (no retries, 120 s timeout) of the test module's ``server`` fixture."""
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def start_openai_server(checkpoint, log_path, name: str, *flags: str):
    """``trtllm-diffkv serve`` on the tiny checkpoint (CPU, ``KV_BYTES``, batch 8, model id ``name``) on a free
    loopback port, ready; ``.port`` and ``.base_url`` set. ``flags``: more command-line flags."""
    from trtllm_diffkv.serve.process import ServerProcess, free_port

    port = free_port()
    command = [sys.executable, "-m", "trtllm_diffkv.commands.serve", "--model", str(checkpoint), "--port", str(port),
               "--served-model-name", name, "--device", "cpu", "--kv-memory-bytes", str(KV_BYTES),
               "--max-batch-size", "8", *flags]
    server = ServerProcess(command, f"http://127.0.0.1:{port}/health", log_path).start()
    server.wait_ready(timeout_s=180)
    server.port, server.base_url = port, f"http://127.0.0.1:{port}"
    return server
