"""The OpenAI server's choice and usage rules for several sequences, in process (issue 43).

A scripted stand-in LLM answers each sequence (one ``generate_async`` call per prompt and child) with the
ids, cumulative log-probability, log-probability entries and executor metrics the test chose, so the
expected response is worked out here from those numbers and OpenAI's rules, independently of the server:

* ``best_of > n`` over several prompts: each prompt's ``n`` most likely sequences, best first, indices
  ``prompt * n + j`` without gaps; ``usage.prompt_tokens`` counts each prompt once (OpenAI, vLLM) and
  ``completion_tokens`` every sequence run, the dropped ones too;
* a sampled (not greedy) chat choice's ``top_logprobs``: the ``k`` most likely tokens in rank order, whatever
  the rank of the sampled token (the sampled token comes first in the LLM's entries);
* DiffKV's usage numbers over several sequences: tier fractions weighted by each sequence's FP16 KV bytes,
  ``kv_memory_fraction`` = KV bytes / FP16 KV bytes of all of them, pool bytes summed;
* the streamed usage (``stream_options.include_usage``) equals the unstreamed one; ``echo`` with
  ``max_tokens`` 0 counts no completion token.
"""
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")  # the server extra

from test_openai_app_rules import CharTokenizer  # noqa: E402 - one id per character, chr back
from trtllm_diffkv.llmapi.outputs import CompletionOutput  # noqa: E402
from trtllm_diffkv.runtime.sampling import Logprob  # noqa: E402

MAX_SEQ_LEN = 64


class Handle:
    """A request handle that gives ``outputs`` one by one (the last one finished)."""

    def __init__(self, outputs):
        self.outputs, self.finished = list(outputs), False

    async def __anext__(self):
        output = self.outputs.pop(0)
        self.finished = not self.outputs
        return output

    def abort(self):
        pass


class ScriptedLLM:
    """``answer(call index, prompt ids, params) -> (CompletionOutput, metrics dict or None)`` per sequence; a
    streamed sequence comes in two pieces (the first half of its ids, then the rest). ``calls``: (ids, params)."""

    tokenizer, max_seq_len = CharTokenizer(), MAX_SEQ_LEN

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def generate_async(self, prompt, params, streaming=False):
        ids = [ord(c) for c in prompt] if isinstance(prompt, str) else list(prompt)
        completion, metrics = self.answer(len(self.calls), ids, params)
        self.calls.append((ids, params))
        final = SimpleNamespace(error=None, prompt_token_ids=ids, finished=True, outputs=[completion],
                                metrics=metrics)
        if not streaming:
            return Handle([final])
        half = len(completion.token_ids) // 2
        head = CompletionOutput(text=completion.text[:half], token_ids=completion.token_ids[:half],
                                text_diff=completion.text[:half], token_ids_diff=completion.token_ids[:half])
        tail = CompletionOutput(**{**completion.__dict__, "text_diff": completion.text[half:],
                                   "token_ids_diff": completion.token_ids[half:]})
        return Handle([SimpleNamespace(error=None, prompt_token_ids=ids, finished=False, outputs=[head],
                                       metrics=None),
                       SimpleNamespace(error=None, prompt_token_ids=ids, finished=True, outputs=[tail],
                                       metrics=metrics)])


def _client(answer):
    from fastapi.testclient import TestClient

    from trtllm_diffkv.serve.openai_server import create_app

    llm = ScriptedLLM(answer)
    return TestClient(create_app(llm, "tiny"), raise_server_exceptions=False), llm


def _completion(ids, cumulative=None, finish_reason="length", logprobs=None):
    text = "".join(chr(i) for i in ids)
    return CompletionOutput(text=text, token_ids=list(ids), text_diff=text, token_ids_diff=list(ids),
                            finish_reason=finish_reason, cumulative_logprob=cumulative, logprobs=logprobs)


def _counts(usage):
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


@pytest.mark.parametrize("n,best_of", [(1, 4), (2, 3)])
def test_best_of_over_several_prompts_indexes_choices_without_gaps_and_counts_each_prompt_once(n, best_of):
    """Three prompts of 2, 5 and 9 characters; sequence ``i`` of a prompt has ``3 + i`` tokens and the cumulative
    log-probability ``SCORES[i]``, so the chosen ones and their order are known here."""
    scores = [-3.0, -0.5, -2.0, -1.0]  # best first: sequence 1, then 3, then 2, then 0
    prompts = ["ab", "hello", "123456789"]

    def answer(call, ids, params):
        i = call % best_of
        return _completion([65 + call] * (3 + i), cumulative=scores[i]), None

    http, llm = _client(answer)
    out = http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 8, "n": n, "best_of": best_of,
                                              "temperature": 1.0, "seed": 3})
    assert out.status_code == 200, out.text
    body = out.json()
    assert len(llm.calls) == len(prompts) * best_of
    chosen = sorted(range(best_of), key=lambda i: -scores[i])[:n]
    want = [(p * n + j, chr(65 + p * best_of + i) * (3 + i)) for p in range(len(prompts)) for j, i in enumerate(chosen)]
    assert [(c["index"], c["text"]) for c in body["choices"]] == want
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = len(prompts) * sum(3 + i for i in range(best_of))  # the dropped sequences count too
    assert _counts(body["usage"]) == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                      "total_tokens": prompt_tokens + completion_tokens}


def test_a_sampled_chat_choice_lists_the_k_most_likely_tokens_in_rank_order():
    """A sampled token of rank 4 (three tokens more likely): its entry holds it first, then the alternatives of
    ranks 1, 2, 3. ``top_logprobs: 3`` must list ranks 1, 2, 3 in that order (not the sampled token first, nor
    drop the third alternative); ``logprob`` is the sampled token's own."""
    ranked = [(ord("a"), -0.4), (ord("b"), -1.1), (ord("c"), -1.9), (ord("d"), -2.3)]  # ranks 1..4
    sampled, sampled_lp = ranked[3]
    entry = {sampled: Logprob(sampled_lp, 4)}
    entry.update({t: Logprob(lp, r + 1) for r, (t, lp) in enumerate(ranked[:3])})
    greedy_entry = {t: Logprob(lp, r + 1) for r, (t, lp) in enumerate(ranked[:3])}

    def answer(call, ids, params):
        assert params.logprobs == 3 and not params.greedy
        return _completion([sampled, ranked[0][0]], cumulative=sampled_lp + ranked[0][1],
                           logprobs=[entry, greedy_entry]), None

    http, _ = _client(answer)
    out = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                   "temperature": 1.2, "logprobs": True, "top_logprobs": 3})
    assert out.status_code == 200, out.text
    content = out.json()["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [("d", -2.3), ("a", -0.4)]
    for item in content:
        assert [(t["token"], t["logprob"]) for t in item["top_logprobs"]] == [("a", -0.4), ("b", -1.1), ("c", -1.9)]


def _metrics(fp16, kv, high, low, pruned, pool):
    return dict(fp16_kv_cache_bytes=fp16, kv_cache_bytes=kv, high_fraction=high, low_fraction=low,
                pruned_fraction=pruned, pool_used_bytes=pool)


METRICS = [_metrics(1000, 400, 0.5, 0.3, 0.2, 4096), _metrics(3000, 900, 0.1, 0.6, 0.3, 8192)]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_usage_weights_the_tier_fractions_of_several_sequences_by_their_fp16_bytes(route):
    """Two sequences of 1000 and 3000 FP16 KV bytes: the request's high fraction is (0.5 x 1000 + 0.1 x 3000) / 4000
    = 0.2 (their plain mean, 0.3, would let a short sequence weigh as much as a long one)."""
    def answer(call, ids, params):
        return _completion([70 + call] * 3), METRICS[call]

    http, _ = _client(answer)
    body = {"max_tokens": 3, "n": 2, "temperature": 1.0}
    body.update({"prompt": "abc"} if route == "completions" else {"messages": [{"role": "user", "content": "x"}]})
    out = http.post("/v1/completions" if route == "completions" else "/v1/chat/completions", json=body)
    assert out.status_code == 200, out.text
    usage = out.json()["usage"]
    total = sum(m["fp16_kv_cache_bytes"] for m in METRICS)
    for name in ("high_fraction", "low_fraction", "pruned_fraction"):
        want = sum(m[name] * m["fp16_kv_cache_bytes"] for m in METRICS) / total
        assert usage[name] == pytest.approx(want, abs=1e-12), name
    assert usage["high_fraction"] == pytest.approx(0.2)
    assert usage["kv_memory_fraction"] == pytest.approx(1300 / 4000)
    assert usage["kv_pool_bytes"] == 4096 + 8192
    assert usage["completion_tokens"] == 6


def test_usage_numbers_are_null_when_a_sequence_reported_none():
    """One sequence without tier numbers (the ``fp16`` preset reports none): the request's are ``null``, not an
    average of the other sequence's."""
    reported = [METRICS[0], {**METRICS[1], "high_fraction": None, "low_fraction": None, "pruned_fraction": None}]

    def answer(call, ids, params):
        return _completion([70] * 2), reported[call]

    http, _ = _client(answer)
    usage = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "n": 2}).json()["usage"]
    assert usage["high_fraction"] is None and usage["low_fraction"] is None and usage["pruned_fraction"] is None
    assert usage["kv_memory_fraction"] == pytest.approx(1300 / 4000)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_streamed_usage_equals_the_unstreamed_usage(route):
    """``stream_options.include_usage`` with n = 2: the final usage chunk counts the prompt once and both
    sequences' tokens, with the same DiffKV numbers as the unstreamed response."""
    def answer(call, ids, params):
        return _completion([70 + call % 2] * (4 + call % 2)), METRICS[call % 2]

    http, _ = _client(answer)
    body = {"max_tokens": 5, "n": 2, "temperature": 1.0}
    body.update({"prompt": "abcdefg"} if route == "completions" else {"messages": [{"role": "user", "content": "x"}]})
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    whole = http.post(path, json=body).json()["usage"]
    with http.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = json.loads(events[-2])
    assert streamed["choices"] == [] and streamed["usage"] == whole
    prompt_tokens = len("abcdefg") if route == "completions" else len("<user>x<assistant>")  # once, not per sequence
    assert _counts(whole) == {"prompt_tokens": prompt_tokens, "completion_tokens": 4 + 5,
                              "total_tokens": prompt_tokens + 9}


def test_echo_with_max_tokens_zero_counts_no_completion_token():
    """lm-eval's request shape: ``echo`` with ``max_tokens`` 0 runs one token per prompt and drops it; the text is
    the prompt alone, ``completion_tokens`` 0 and ``prompt_tokens`` each prompt's length."""
    def answer(call, ids, params):
        assert params.max_tokens == 1
        return _completion([90]), None

    http, _ = _client(answer)
    prompts = ["abc", "hello"]
    out = http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 0, "echo": True}).json()
    assert [c["text"] for c in out["choices"]] == prompts
    assert _counts(out["usage"]) == {"prompt_tokens": 8, "completion_tokens": 0, "total_tokens": 8}
