"""The OpenAI server's request rules in process (FastAPI's TestClient over a recording stand-in LLM).

The real-process tests (test_openai_server.py) check texts; these check the rules that a text does
not show: usage summed over every prompt of a completion request, the default ``max_tokens`` (16
for completions; the rest of the context for chat), ``max_completion_tokens`` over ``max_tokens``,
and the strict JSON types (``True`` is not ``1``, ``0`` is not ``False``).
The stand-in tokenizes by characters and answers each prompt with ``len(prompt) % 5 + 1`` tokens, so
that every prompt of a request has its own counts.
"""
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")  # the server extra (pydantic among it); before the protocol module imports it

from trtllm_diffkv.serve.openai_protocol import CHAT_NEUTRAL, NEUTRAL, is_neutral  # noqa: E402

MAX_SEQ_LEN = 64


class CharTokenizer:
    chat_template = "{{ messages }}"  # only tested for presence by the server

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, **kwargs):
        return "".join(chr(i) for i in ids)


class Handle:
    finished = True

    def __init__(self, output):
        self.output = output

    async def __anext__(self):
        return self.output

    def abort(self):
        pass


class RecordingLLM:
    """Answers every prompt at once; ``calls`` holds (prompt token ids, SamplingParams) per request."""

    tokenizer, max_seq_len = CharTokenizer(), MAX_SEQ_LEN

    def __init__(self):
        self.calls = []

    def generate_async(self, prompt, params, streaming=False):
        ids = [ord(c) for c in prompt] if isinstance(prompt, str) else list(prompt)
        self.calls.append((ids, params))
        n = min(params.max_tokens, len(ids) % 5 + 1)
        completion = SimpleNamespace(text="x" * n, token_ids=list(range(n)), finish_reason="length", text_diff="x" * n)
        return Handle(SimpleNamespace(error=None, prompt_token_ids=ids, finished=True, outputs=[completion],
                                      metrics=None))


@pytest.fixture()
def app():
    from fastapi.testclient import TestClient

    from trtllm_diffkv.serve.openai_server import create_app

    llm = RecordingLLM()
    with TestClient(create_app(llm, "tiny"), raise_server_exceptions=False) as http:
        yield http, llm


def test_usage_is_summed_over_every_prompt(app):
    http, llm = app
    prompts = ["ab", "hello world", "x", "seven!!"]
    answer = http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 4}).json()
    prompt_tokens = [len(p) for p in prompts]                     # the stand-in's tokenizer: one id per char
    completion_tokens = [min(4, len(p) % 5 + 1) for p in prompts]
    assert [c["text"] for c in answer["choices"]] == ["x" * n for n in completion_tokens]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    counts = {k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert counts == {"prompt_tokens": sum(prompt_tokens), "completion_tokens": sum(completion_tokens),
                      "total_tokens": sum(prompt_tokens) + sum(completion_tokens)}


def test_default_and_explicit_max_tokens(app):
    http, llm = app
    http.post("/v1/completions", json={"prompt": "hi"})
    assert llm.calls[-1][1].max_tokens == 16                      # OpenAI's completions default
    http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert llm.calls[-1][1].max_tokens == 3
    messages = [{"role": "user", "content": "hey"}]
    http.post("/v1/chat/completions", json={"messages": messages})
    ids = llm.calls[-1][0]
    assert ids == [ord(c) for c in "<user>hey<assistant>"]
    assert llm.calls[-1][1].max_tokens == MAX_SEQ_LEN - len(ids)  # chat: the rest of the context
    http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 7})
    assert llm.calls[-1][1].max_tokens == 7
    http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 7, "max_completion_tokens": 5})
    assert llm.calls[-1][1].max_tokens == 5                       # the newer field wins when both are sent
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 2}).json()
    n = min(2, len(ids) % 5 + 1)
    counts = {k: chat["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert counts == {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}


@pytest.mark.parametrize("name, value, table", [("logit_bias", {}, NEUTRAL), ("logit_bias", None, CHAT_NEUTRAL),
                                               ("suffix", "", NEUTRAL), ("suffix", None, NEUTRAL)])
def test_neutral_values_are_neutral(name, value, table):
    assert is_neutral(name, value, table)


@pytest.mark.parametrize("name, value", [("n", True), ("best_of", True), ("echo", 0), ("echo", 0.0),
                                         ("presence_penalty", False), ("frequency_penalty", False),
                                         ("logprobs", False), ("logprobs", 0.0)])
def test_a_value_of_the_wrong_json_type_is_refused_not_coerced(app, name, value):
    """``True`` is not ``n=1``, ``0`` is not ``echo=false``, ``false`` is not ``logprobs=0`` (strict types)."""
    http, llm = app
    answer = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, name: value})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == name, answer.text
    assert llm.calls == []


@pytest.mark.parametrize("content, headers, message", [
    (b'{"prompt": "hi"}', {"content-type": "application/x-www-form-urlencoded"},  # curl -d's default
     "the request body was not read as JSON: send it with Content-Type: application/json (got "
     "'application/x-www-form-urlencoded')"),
    (b'{"prompt": "hi"}', {}, "the request body was not read as JSON: send it with Content-Type: application/json "
                              "(got none)"),
    (b"[1, 2]", {"content-type": "application/json"}, "the request body must be a JSON object, got an array"),
    (b'"hi"', {"content-type": "application/json"}, "the request body must be a JSON object, got a string"),
    (b"", {"content-type": "application/json"}, "the request body is empty: send a JSON object"),
])
def test_a_body_that_is_not_a_json_object_says_why(app, content, headers, message):
    """Each was answered "Input should be a valid dictionary or object to extract fields from" (pydantic's words
    for the whole body), which names neither the body nor the fix."""
    http, llm = app
    answer = http.post("/v1/completions", content=content, headers=headers)
    assert answer.status_code == 400 and answer.json()["error"]["message"] == message, answer.text
    assert llm.calls == []


def test_completion_logprobs_zero_asks_for_the_chosen_tokens_logprobs(app):
    http, llm = app
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 0}).status_code == 200
    assert llm.calls[-1][1].logprobs == 0 and llm.calls[-1][1].prompt_logprobs is None
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert llm.calls[-1][1].logprobs is None


def test_n_fans_out_into_seeded_requests_prompt_by_prompt(app):
    """``n`` choices per prompt: one request each, seeds ``seed + i * 0x9E3779B97F4A7C15 mod 2**64``, indices
    prompt by prompt, usage over all; more than 256 sequences per prompt is a 400 before anything runs."""
    http, llm = app
    out = http.post("/v1/completions", json={"prompt": ["ab", "abcd"], "max_tokens": 3, "n": 2, "seed": 5}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    stride = 0x9E3779B97F4A7C15
    assert [(len(ids), p.seed, p.n) for ids, p in llm.calls] == [(2, 5, 1), (2, 5 + stride, 1), (4, 5, 1),
                                                                  (4, 5 + stride, 1)]
    assert out["usage"]["completion_tokens"] == 4 * 3  # the stand-in answers min(max_tokens, len % 5 + 1) = 3 tokens
    assert out["usage"]["prompt_tokens"] == 2 + 4  # each prompt once (OpenAI, vLLM), not once per sequence
    messages = [{"role": "user", "content": "hello"}]
    one = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}).json()["usage"]
    two = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "n": 2}).json()["usage"]
    assert two["prompt_tokens"] == one["prompt_tokens"] and two["completion_tokens"] == 2 * one["completion_tokens"]
    del llm.calls[:]
    for body, param in (({"n": 257}, "n"), ({"n": 2, "best_of": 257}, "best_of"), ({"n": 10 ** 12}, "n")):
        answer = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    for field in ("best_of", "echo"):
        body = {"messages": [{"role": "user", "content": "hi"}], field: 2 if field == "best_of" else True}
        chat = http.post("/v1/chat/completions", json=body)  # completions-only fields: refused on chat, not ignored
        assert chat.status_code == 400 and chat.json()["error"]["param"] == field, chat.text
    many = http.post("/v1/completions", json={"prompt": [[1]] * 1000, "max_tokens": 2, "n": 5})
    assert many.status_code == 400 and "exceeds 4096 sequences per request" in many.json()["error"]["message"], many.text
    assert llm.calls == []
