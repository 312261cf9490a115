"""``trtllm-diffkv serve`` (a real process) with logprobs, echo, n / best_of and the penalties, through the
``openai`` client: response shapes as OpenAI's API reference gives them, values against a dense forward of
the same checkpoint (``torch.log_softmax``) and against the in-process ``LLM``; lm-evaluation-harness's
``local-completions`` loglikelihood request (token-id prompts, ``max_tokens`` 1, ``logprobs`` 1, ``echo``)."""
import json

import pytest
import torch

from serve_fixtures import checkpoint, client, start_openai_server  # noqa: F401 (fixtures)

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
NAME = "tiny-logprobs"
TOL = 5e-3  # the server's float32 CPU run against the test's dense float32 forward


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    server = start_openai_server(checkpoint, tmp_path_factory.mktemp("serve") / "serve.log", NAME)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def dense(checkpoint):
    """``ids -> [len(ids), V]`` log_softmax of one dense forward (fp16 preset cache: nothing compressed);
    ``.tokenizer`` the checkpoint's tokenizer."""
    from trtllm_diffkv.cache.reference import DiffKVReferenceCache
    from trtllm_diffkv.config import get_preset
    from trtllm_diffkv.model.loader import load_model

    model, tokenizer, config = load_model(str(checkpoint), device="cpu", dtype=torch.float32)

    def forward(ids):
        cache = DiffKVReferenceCache(get_preset("fp16"), config.num_layers, config.num_heads, config.num_kv_heads,
                                     config.head_dim, len(ids), torch.device("cpu"), torch.float32)
        with torch.inference_mode():
            logits = model(torch.tensor(ids), torch.arange(len(ids)), cache, logits_indices=torch.arange(len(ids)))
        return torch.log_softmax(logits.float(), dim=-1)

    forward.tokenizer = tokenizer
    return forward


def _post(server, path, body):
    answer = httpx.post(f"{server.base_url}/v1/{path}", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_lm_eval_loglikelihood_request(server, dense):
    """What lm-eval 0.4's local-completions sends for loglikelihood, and what its parse_logprobs reads."""
    tok = dense.tokenizer
    prompts = [tok("The capital of France is")["input_ids"] + tok(" Paris")["input_ids"],
               tok("Two plus two is four")["input_ids"]]
    out = _post(server, "completions", {"model": NAME, "prompt": prompts, "temperature": 0, "max_tokens": 1,
                                        "logprobs": 1, "seed": 1234, "echo": True})
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for ids, choice in zip(prompts, out["choices"]):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = dense(ids)
        for i, token in enumerate(ids[1:]):
            assert lp["token_logprobs"][i + 1] == pytest.approx(float(ref[i, token]), abs=TOL)
            best = int(ref[i].argmax())
            assert max(lp["top_logprobs"][i + 1].values()) == pytest.approx(float(ref[i, best]), abs=TOL)
        generated = int(ref[-1].argmax())  # greedy: the generated token is the dense forward's argmax
        assert lp["token_logprobs"][-1] == pytest.approx(float(ref[-1, generated]), abs=TOL)
        assert choice["text"].startswith(tok.decode(ids))
        assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
        ctxlen = len(tok("The capital of France is")["input_ids"]) if ids is prompts[0] else 1
        loglikelihood = sum(lp["token_logprobs"][ctxlen:-1])  # lm-eval's parse_logprobs
        assert loglikelihood == pytest.approx(float(sum(ref[i - 1, ids[i]] for i in range(ctxlen, len(ids)))),
                                              abs=TOL * len(ids))
    assert out["usage"]["completion_tokens"] == 2


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(server, client, dense):
    text = "Memory is a river"
    out = client.completions.create(model=NAME, prompt=text, max_tokens=0, echo=True, logprobs=2)
    choice = out.choices[0]
    ids = dense.tokenizer(text)["input_ids"]
    assert choice.text == text and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == len(ids) and out.usage.completion_tokens == 0
    assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs[1:])
    plain = client.completions.create(model=NAME, prompt=text, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(text) and plain.choices[0].logprobs is None


def test_completion_logprobs_stream_like_the_whole_response(server, client):
    body = dict(model=NAME, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=3)
    whole = client.completions.create(**body).choices[0]
    tokens, values = [], []
    for chunk in client.completions.create(**body, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
    assert tokens == whole.logprobs.tokens and values == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)
    assert len(whole.logprobs.tokens) == 6 and all(len(t) >= 3 for t in whole.logprobs.top_logprobs)


def test_chat_logprobs_and_top_logprobs(server, client):
    messages = [{"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy
        assert item.bytes == list(item.token.encode("utf-8"))
    streamed = []
    for chunk in client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                                logprobs=True, top_logprobs=2, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.content
    assert [c.token for c in streamed] == [c.token for c in content]
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_n_choices_are_seeded_ordered_and_summed(server, client):
    body = dict(model=NAME, prompt=["Three colours:", "Dear diary,"], max_tokens=5, temperature=1.0, seed=99, n=3,
                extra_body={"ignore_eos": True})
    first, second = client.completions.create(**body), client.completions.create(**body)
    assert [c.index for c in first.choices] == list(range(6))
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in second.choices]                      # reproducible
    assert len(set(texts[:3])) == 3 and len(set(texts[3:])) == 3           # distinct
    assert first.usage.completion_tokens == 6 * 5
    alone = client.completions.create(model=NAME, prompt="Three colours:", max_tokens=5, temperature=1.0, seed=99,
                                      extra_body={"ignore_eos": True})
    assert alone.choices[0].text == texts[0]                               # child 0 keeps the request's seed
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=1.0, seed=5, n=2)
    assert [c.index for c in chat.choices] == [0, 1]


def test_n_streams_every_choice(server, client):
    body = dict(model=NAME, prompt="Hello there", max_tokens=6, temperature=1.0, seed=3, n=2)
    whole = [c.text for c in client.completions.create(**body).choices]
    pieces = {0: "", 1: ""}
    for chunk in client.completions.create(**body, stream=True):
        for choice in chunk.choices:
            pieces[choice.index] += choice.text
    assert [pieces[0], pieces[1]] == whole


def test_best_of_keeps_the_most_likely_and_counts_every_sequence(server, client):
    body = dict(model=NAME, prompt="A short poem about the sea:", max_tokens=4, temperature=1.2, seed=8,
                extra_body={"ignore_eos": True})
    every = client.completions.create(**body, n=4, logprobs=0)
    scores = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best = client.completions.create(**body, n=1, best_of=4)
    assert len(best.choices) == 1 and best.choices[0].text == every.choices[scores.index(max(scores))].text
    assert best.usage.completion_tokens == 4 * 4
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**body, n=1, best_of=2, stream=True)
    assert info.value.body["param"] == "best_of"


def test_presence_and_frequency_penalties_reach_the_sampler(server, client, checkpoint):
    """Greedy with strong negative penalties (repeats favoured; the random model never repeats on its own):
    the same tokens as the in-process LLM with the same SamplingParams, and not those without them."""
    from trtllm_diffkv.llmapi.llm import LLM
    from trtllm_diffkv.runtime.sampling import SamplingParams

    prompt = "def add(a, b):"
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, presence_penalty=-2.0,
                                    frequency_penalty=-1.5, logprobs=0)
    with LLM(str(checkpoint), device="cpu", kv_memory_bytes=32 << 20, max_batch_size=2) as llm:
        penalized = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=-2.0,
                                                        frequency_penalty=-1.5))
        plain = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))
    assert got.choices[0].text == penalized.outputs[0].text
    assert penalized.outputs[0].token_ids != plain.outputs[0].token_ids
    assert len(set(penalized.outputs[0].token_ids)) < len(penalized.outputs[0].token_ids)  # repeats
