"""LLM API (trtllm_diffkv.llmapi.llm) on tiny models on the CPU: outputs against the reference generators,
streaming, asyncio, threads, abort, per-request failures, shutdown."""
import asyncio
import threading
import time

import pytest
import torch

from conftest import peaked_tiny_llama, tiny_llama
from tiny_checkpoint import write_tiny_text_checkpoint
from trtllm_diffkv.config import DiffKVConfig, get_preset
from trtllm_diffkv.generation.reference import ReferenceGenerator
from trtllm_diffkv.llmapi.llm import LLM
from trtllm_diffkv.llmapi.outputs import IncrementalDetokenizer
from trtllm_diffkv.generation.static_batch import PagedGenerator
from trtllm_diffkv.runtime.sampling import SamplingParams

GREEDY = SamplingParams.greedy_params


def _prompts(vocab: int, lengths=(1, 17, 70, 130)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _free(llm) -> bool:
    stats = llm.stats()
    return stats["free_pages"] == stats["pool_pages"] and stats["running"] == 0 and stats["waiting"] == 0


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama()
    with LLM.from_model(model, None, model.config, "default", kv_memory_bytes=16 << 20, max_batch_size=8) as llm:
        yield model, llm


@pytest.fixture(scope="module")
def text_llm(tmp_path_factory):
    folder = write_tiny_text_checkpoint(tmp_path_factory.mktemp("tiny_text"))
    with LLM(str(folder), "default", device="cpu", kv_memory_bytes=32 << 20) as llm:
        yield llm


@pytest.mark.parametrize("preset", ["diffkv", "fp16"])
def test_generate_batch_equals_alone_and_the_reference_generators(preset):
    """In-flight batched greedy outputs = each prompt alone = ReferenceGenerator = PagedGenerator (peaked
    attention, prompts past the 64-token recent window, so the tiered preset really tiers tokens)."""
    model = peaked_tiny_llama()
    kv = get_preset(preset)
    prompts = _prompts(model.config.vocab_size)
    reference = [ReferenceGenerator(model, None, model.config, kv).generate_ids(p, 12) for p in prompts]
    paged = PagedGenerator(model, None, model.config, kv).generate_batch(prompts, 12)
    with LLM.from_model(model, None, model.config, kv, kv_memory_bytes=16 << 20) as llm:
        batch = llm.generate(prompts, GREEDY(12))
        alone = [llm.generate(p, GREEDY(12)) for p in prompts]
        assert _free(llm)
    assert [o.outputs[0].token_ids for o in batch] == [r.token_ids for r in reference]
    assert [o.outputs[0].token_ids for o in alone] == [r.token_ids for r in reference]
    assert [r.token_ids for r in paged] == [r.token_ids for r in reference]
    for out, ref in zip(batch, reference):
        assert out.finished and out.error is None and out.outputs[0].finish_reason == "length"
        assert out.prompt_token_ids == prompts[out.request_id - batch[0].request_id]
        # the pool holds the reference cache's tokens: same accounted bytes and tier fractions
        assert out.metrics["kv_cache_bytes"] == ref.kv_cache_bytes
        assert out.metrics["high_fraction"] == ref.high_fraction
    if preset == "diffkv":
        assert min(r.high_fraction for r in reference[2:]) < 1.0  # tiers really changed


def test_single_prompt_gives_one_output_and_a_list_gives_a_list(tiny):
    model, llm = tiny
    one = llm.generate([5, 6, 7], GREEDY(3))
    assert one.outputs[0].length == 3
    assert [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7]], GREEDY(3))] == [one.outputs[0].token_ids]
    assert llm.generate([], GREEDY(3)) == []
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate([[1, 2]], [GREEDY(1), GREEDY(1)])
    # a list of numbers is one prompt even when one is not an id: one output naming it, not a "batch" of
    # prompts 5, True and 7 each refused as "a prompt is a str or a list of token ids, got int"
    for bad, named in (([5, True, 7], "True"), ([5, 6, 7.0], "7.0"), ([torch.tensor(5).item(), 6.5], "6.5")):
        out = llm.generate(bad, GREEDY(3))
        assert not isinstance(out, list), bad
        assert out.error == f"token id {named} is not an integer" and out.outputs[0].finish_reason == "error"
    assert _free(llm)


def test_bad_requests_fail_alone_and_free_everything(tiny):
    model, llm = tiny
    good = [[3, 4, 5, 6], [9] * 20]
    expected = [ReferenceGenerator(model, None, model.config, get_preset("default")).generate_ids(p, 5).token_ids
                for p in good]
    batch = [good[0], [], [model.config.vocab_size], [1] * 4095, "text but no tokenizer", good[1], [1, 2]]
    params = [GREEDY(5)] * 6 + [SamplingParams(max_tokens=5, temperature=-1.0)]
    outs = llm.generate(batch, params)
    assert [o.outputs[0].token_ids for o in (outs[0], outs[5])] == expected
    errors = [o.error for o in outs]
    assert errors[0] is None and errors[5] is None
    for i, words in [(1, "empty prompt"), (2, "outside the model's vocabulary"), (3, "exceeds"),
                     (4, "no tokenizer"), (6, "temperature")]:
        assert words in errors[i] and outs[i].outputs[0].finish_reason == "error" and outs[i].finished
    assert _free(llm)


def test_whitespace_is_a_prompt_and_only_the_empty_string_is_empty(text_llm):
    """Issue 44: whitespace-only prompts were refused as "empty"; OpenAI and vLLM take them (they are tokens).
    ``""`` is still refused (no token at all)."""
    outs = text_llm.generate([" ", "\n\t ", ""], GREEDY(3))
    for prompt, out in zip((" ", "\n\t "), outs):
        assert out.error is None and out.prompt_token_ids == text_llm.tokenizer(prompt)["input_ids"]
        assert len(out.outputs[0].token_ids) >= 1
    assert "empty prompt" in outs[2].error and outs[2].outputs[0].finish_reason == "error"
    assert _free(text_llm)


def test_a_text_that_is_not_unicode_fails_alone_with_its_position(text_llm):
    """A lone surrogate (``"\\ud800"``: what ``os.fsdecode`` or a JSON ``\\ud800`` escape hands over) cannot be
    tokenized; the request fails alone with an error naming the character, not the tokenizer's TypeError."""
    outs = text_llm.generate(["a\ud800b", "ab"], GREEDY(2))
    assert outs[0].error == "prompt is not valid Unicode text: surrogates not allowed at character 1 ('\\ud800')"
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].prompt_token_ids == []
    assert outs[1].error is None and outs[1].outputs[0].length == 2
    assert _free(text_llm)


def test_stream_deltas_concatenate_to_the_final_text_and_ids(text_llm, monkeypatch):
    tokenizer = text_llm.tokenizer
    step = text_llm.executor.step
    monkeypatch.setattr(text_llm.executor, "step", lambda: (time.sleep(0.01), step())[1])  # let the reader keep up
    for params in (SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=24, seed=11)):
        outs = list(text_llm.generate_stream("Tell me a story about", params))
        final = outs[-1]
        assert final.finished and not any(o.finished for o in outs[:-1]) and len(outs) >= 2
        done = final.outputs[0]
        assert "".join(o.outputs[0].text_diff for o in outs) == done.text
        assert [t for o in outs for t in o.outputs[0].token_ids_diff] == done.token_ids
        for before, after in zip(outs, outs[1:]):  # cumulative
            assert after.outputs[0].text.startswith(before.outputs[0].text)
        text_ids = done.token_ids[:-1] if done.stop_reason is not None else done.token_ids
        assert done.text == tokenizer.decode(text_ids, skip_special_tokens=True)
        # and the same request without streaming gives the same tokens (greedy, or the same seed)
        assert text_llm.generate("Tell me a story about", params).outputs[0].token_ids == done.token_ids


def test_incremental_detokenizer_never_shows_a_split_character(text_llm):
    tokenizer = text_llm.tokenizer
    text = "naïve café: 日本語のテキスト 🙂👍🏽 done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # the test really splits characters
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([t]) for t in ids]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == text and detok.finish() == text


def test_stop_string_cuts_the_text_and_streams_consistently(text_llm):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    full = text_llm.generate("Once upon a time", params).outputs[0]
    words = full.text.split()
    assert len(words) >= 4
    stop = words[len(words) // 2][:3]
    outs = list(text_llm.generate_stream("Once upon a time", params.with_changes(stop=[stop, "zzzz-never"])))
    done = outs[-1].outputs[0]
    assert done.finish_reason == "stop" and done.stop_reason == stop
    assert done.text == full.text[:full.text.index(stop)]
    assert "".join(o.outputs[0].text_diff for o in outs) == done.text
    assert full.token_ids[:len(done.token_ids)] == done.token_ids


def test_chat_template_wraps_the_prompt(text_llm):
    tokenizer = text_llm.tokenizer
    out = text_llm.generate("Hi there", GREEDY(2), chat_template=True)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                         add_generation_prompt=True)
    assert out.prompt_token_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert out.prompt == "Hi there"
    raw = text_llm.generate("Hi there", GREEDY(2))
    assert raw.prompt_token_ids == tokenizer("Hi there")["input_ids"]


def test_asyncio_concurrent_requests_match_the_sync_results(tiny):
    model, llm = tiny
    prompts = _prompts(model.config.vocab_size, (3, 9, 30, 5))
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY(8))]

    async def stream(p):
        outs = [out async for out in llm.generate_async(p, GREEDY(8), streaming=True)]
        final = outs[-1]
        assert final.finished and [t for o in outs for t in o.outputs[0].token_ids_diff] == final.outputs[0].token_ids
        return final.outputs[0].token_ids

    async def main():
        streamed = await asyncio.gather(*(stream(p) for p in prompts))
        awaited = await asyncio.gather(*(llm.generate_async(p, GREEDY(8)) for p in prompts))
        results = await asyncio.gather(*(llm.generate_async(p, GREEDY(8)).aresult() for p in prompts))
        return streamed, [o.outputs[0].token_ids for o in awaited], [o.outputs[0].token_ids for o in results]

    streamed, awaited, results = asyncio.run(main())
    assert streamed == awaited == results == expected


def test_many_threads_share_one_llm(tiny):
    model, llm = tiny
    prompts = _prompts(model.config.vocab_size, (2, 11, 23, 40, 6, 8))
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY(6))]
    got = [None] * len(prompts)

    def worker(i):
        got[i] = llm.generate(prompts[i], GREEDY(6)).outputs[0].token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == expected


def test_abort_mid_stream_frees_the_pages(tiny):
    model, llm = tiny
    request = llm.generate_async([4] * 40, GREEDY(500), streaming=True)
    first = next(request)
    assert not first.finished and first.outputs[0].length >= 1
    assert llm.stats()["used_pages"] > 0
    request.abort()
    final = request.result(timeout=60)
    assert final.finished and final.outputs[0].finish_reason == "cancelled" and final.outputs[0].length < 500
    assert _free(llm)
    # leaving a generate_stream loop early aborts its request too
    for out in llm.generate_stream([5] * 10, GREEDY(500)):
        break
    assert _wait_for(lambda: _free(llm))
    assert llm.stats()["requests_cancelled"] >= 2


def test_an_exception_in_a_step_fails_the_running_requests_and_the_loop_goes_on(tiny, monkeypatch):
    model, llm = tiny
    real_step, calls = llm.executor.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:  # the requests are running by then
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(llm.executor, "step", failing_step)
    outs = llm.generate([[1, 2, 3], [4, 5, 6, 7]], GREEDY(20))
    assert all(o.outputs[0].finish_reason == "error" and "injected failure" in o.error for o in outs)
    assert _free(llm) and llm.stats()["step_errors"] == 1
    again = llm.generate([1, 2, 3], GREEDY(4))
    assert again.error is None and again.outputs[0].length == 4


def test_shutdown_cancels_what_is_left_frees_pages_and_joins_the_thread():
    model = tiny_llama()
    llm = LLM.from_model(model, None, model.config, "default", kv_memory_bytes=16 << 20)
    request = llm.generate_async([7] * 30, GREEDY(2000), streaming=True)
    next(request)
    llm.shutdown()
    final = request.result(timeout=60)
    assert final.outputs[0].finish_reason == "cancelled" and "shut down" in final.error
    assert not llm._thread.is_alive()
    assert llm._thread not in threading.enumerate()
    stats = llm.stats()
    assert stats["free_pages"] == stats["pool_pages"] and stats["running"] == 0
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate_async([1], GREEDY(1))
    llm.shutdown()  # idempotent


def _wait_for(condition, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_submission_racing_shutdown_is_answered_not_lost(tmp_path):
    """A request still being tokenized when shutdown() runs gets a final output (it hung before)."""
    folder = write_tiny_text_checkpoint(tmp_path / "tiny")
    llm = LLM(str(folder), "default", device="cpu", kv_memory_bytes=8 << 20)
    prompt_ids = llm._prompt_ids
    llm._prompt_ids = lambda *a, **k: (time.sleep(0.3), prompt_ids(*a, **k))[1]  # a long prompt on a busy CPU
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("req", llm.generate_async("hello there",
                                                                                      SamplingParams(max_tokens=4))))
    thread.start()
    time.sleep(0.05)
    llm.shutdown()
    thread.join()
    out = box["req"].result(timeout=10)
    assert out.finished and out.outputs[0].finish_reason == "cancelled" and "shut down" in out.error
    assert not llm._thread.is_alive()


def test_result_timeout_bounds_the_whole_wait(text_llm):
    """result(timeout) is a total bound, not a per-token one (it returned after every token before)."""
    req = text_llm.generate_async("hello", SamplingParams(max_tokens=400, ignore_eos=True))
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        req.result(timeout=0.3)
    assert time.monotonic() - start < 2.0
    req.abort()
    req.result(timeout=60)


def test_bad_stop_value_fails_its_request_without_raising(text_llm):
    outs = text_llm.generate(["hello", "world"], [SamplingParams(max_tokens=2, stop=123), SamplingParams(max_tokens=2)])
    assert outs[0].error and "stop must be" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 2


def test_a_1d_tensor_or_array_is_one_prompt(text_llm):
    import numpy as np

    ids = text_llm.tokenizer("hello there")["input_ids"]
    greedy = SamplingParams(max_tokens=3, temperature=0)
    want = text_llm.generate(ids, greedy).outputs[0].token_ids
    for prompt in (torch.tensor(ids), np.array(ids)):
        out = text_llm.generate(prompt, greedy)  # one RequestOutput, not one failing request per id
        assert out.error is None and out.outputs[0].token_ids == want


@pytest.mark.parametrize("bad", [0, -5, 2.5, True])
def test_bad_max_seq_len_is_refused_not_read_as_the_model_limit(bad):
    model = tiny_llama()
    with pytest.raises(ValueError, match="max_seq_len"):
        LLM.from_model(model, None, model.config, "default", kv_memory_bytes=4 << 20, max_seq_len=bad)


def test_vllm_stop_token_ids_min_tokens_and_include_stop_str_end_to_end(tmp_path):
    """Issue 44: vLLM's ``stop_token_ids``, ``min_tokens`` and ``include_stop_str_in_output`` through the LLM and
    its executor (the server and the Triton model pass them on). References: the plain greedy run (where a stop
    id cuts it) and, for ``min_tokens``, each step's plain log-probabilities teacher-forced from the prompt
    plus the tokens before (fp16 preset: no compression): a token within ``min_tokens`` is the most likely
    non-stop token (vLLM's MinTokensLogitsProcessor), and the request does not stop before."""
    folder = write_tiny_text_checkpoint(tmp_path / "tiny")
    with LLM(str(folder), "fp16", device="cpu", kv_memory_bytes=16 << 20) as llm:
        prompt = llm.tokenizer("Once upon a time")["input_ids"]
        decode = llm.tokenizer.decode
        plain = llm.generate(prompt, GREEDY(12)).outputs[0]
        stop_id = plain.token_ids[2]
        first = plain.token_ids.index(stop_id)
        for include in (False, True):
            out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id],
                                                      include_stop_str_in_output=include)).outputs[0]
            assert out.token_ids == plain.token_ids[:first + 1]
            assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
            assert out.text == decode(plain.token_ids[:first + 1 if include else first], skip_special_tokens=True)
        min_tokens = first + 4
        masked = {stop_id} | llm.stop_token_ids                   # the model's end ids too, even with ignore_eos
        out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id],
                                                  min_tokens=min_tokens, ignore_eos=True)).outputs[0]
        assert len(out.token_ids) > min_tokens and not masked & set(out.token_ids[:min_tokens])
        for k, token in enumerate(out.token_ids[:min_tokens + 1]):
            entry = llm.generate(prompt + out.token_ids[:k], SamplingParams(max_tokens=1, temperature=0.0, logprobs=8,
                                                                            ignore_eos=True)).outputs[0].logprobs[0]
            allowed = {t: lp.logprob for t, lp in entry.items() if k >= min_tokens or t not in masked}
            assert entry[token].logprob == pytest.approx(max(allowed.values()), abs=1e-3), (k, token)
        assert out.finish_reason == ("stop" if out.token_ids[-1] == stop_id else "length")
        assert _free(llm)



def test_one_llm_checks_its_kv_config_against_the_model_once(tmp_path, monkeypatch):
    """Issue 40: ``LLM(model)`` ran ``validate_for_model`` 4 times (loader, executor, resource manager, cache)."""
    folder = write_tiny_text_checkpoint(tmp_path / "tiny")
    calls, real = [], DiffKVConfig.validate_for_model

    def spy(self, head_dim, num_heads, num_kv_heads, num_layers=None):
        calls.append((head_dim, num_heads, num_kv_heads))
        return real(self, head_dim, num_heads, num_kv_heads, num_layers)

    monkeypatch.setattr(DiffKVConfig, "validate_for_model", spy)
    with LLM(str(folder), "default", device="cpu", kv_memory_bytes=8 << 20, max_batch_size=2) as llm:
        assert calls == [(64, 2, 1)]  # tiny_checkpoint.TINY_TEXT_CONFIG: head_dim 64, 2 query / 1 KV heads
        assert llm.executor.engine_config.max_batch_size == 2
        assert llm.generate([5, 6, 7], GREEDY(2)).error is None
    assert len(calls) == 1
    model = tiny_llama()
    with LLM.from_model(model, None, model.config, "default", kv_memory_bytes=4 << 20) as llm:  # not loaded here
        assert calls[1:] == [(model.config.head_dim, model.config.num_heads, model.config.num_kv_heads)]
