"""``/v1/completions`` takes OpenAI's four prompt forms: a string, a list of strings, a list of token ids, and a list
of lists of token ids (one choice each); ids are checked against the model's vocabulary and positions before
anything is submitted. In process: FastAPI's TestClient over the recording stand-in LLM of test_openai_app_rules
(the real server is checked in test_bench_client_mode.py)."""
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from test_openai_app_rules import RecordingLLM  # noqa: E402 (after the skip)

VOCAB = 100


@pytest.fixture()
def app():
    from fastapi.testclient import TestClient

    from trtllm_diffkv.serve.openai_server import create_app

    llm = RecordingLLM()
    llm.model_config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=64, max_supported_positions=None)
    with TestClient(create_app(llm, "tiny"), raise_server_exceptions=False) as http:
        yield http, llm


def test_token_id_prompts_reach_the_llm_as_sent(app):
    http, llm = app
    one = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
    assert one.status_code == 200, one.text
    assert [ids for ids, _ in llm.calls] == [[5, 6, 7]]
    assert one.json()["usage"]["prompt_tokens"] == 3 and len(one.json()["choices"]) == 1
    many = http.post("/v1/completions", json={"prompt": [[1, 2], [99], [3, 4, 5, 6]], "max_tokens": 4}).json()
    assert [ids for ids, _ in llm.calls[1:]] == [[1, 2], [99], [3, 4, 5, 6]]
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert many["usage"]["prompt_tokens"] == 7
    assert many["usage"]["completion_tokens"] == sum(min(4, n % 5 + 1) for n in (2, 1, 4))  # the stand-in's rule
    text = http.post("/v1/completions", json={"prompt": ["ab", "c"], "max_tokens": 1})  # strings still tokenized
    assert text.status_code == 200 and [ids for ids, _ in llm.calls[-2:]] == [[97, 98], [99]]
    stream = http.post("/v1/completions", json={"prompt": [7, 8], "max_tokens": 1, "stream": True})
    assert stream.status_code == 200 and llm.calls[-1][0] == [7, 8]


@pytest.mark.parametrize("prompt, message", [
    ([5, VOCAB], f"'prompt': token id {VOCAB} is outside the model's vocabulary [0, {VOCAB})"),
    ([-1], "'prompt': token id -1 is outside"),
    ([[1], [2, 300]], "'prompt'[1]: token id 300 is outside"),
    ([[1], []], "'prompt'[1]: empty prompt"),
    ([], "'prompt' is an empty list"),
    (list(range(64)), "'prompt': prompt (64 tokens) + max_new_tokens (1) exceeds the model's 64 positions"),
])
def test_bad_token_ids_are_a_400_naming_prompt(app, prompt, message):
    http, llm = app
    answer = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "prompt" and message in error["message"], error
    assert llm.calls == []  # nothing was submitted


@pytest.mark.parametrize("prompt", [[1, True], [1.5], ["a", 1], [[1], "a"], [[1, "2"]], [["a"]], {"ids": [1]}])
def test_not_integer_ids_are_refused_not_coerced(app, prompt):
    http, llm = app
    answer = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert answer.status_code == 400 and answer.json()["error"]["param"].startswith("prompt"), answer.text
    assert llm.calls == []
