"""Fixtures shared by the server tests (test_triton_repo.py, test_openai_server.py): a tiny checkpoint
with the default model's tokenizer and the reference texts both servers are compared with."""
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
    ``LLM`` over the same checkpoint and preset as the servers; ``.tokenizer`` is that LLM's tokenizer."""
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

    text.tokenizer = llm.tokenizer
    yield text
    llm.shutdown()
