"""The generators, the in-flight executor and the LLM API on a model with sliding-window layers (Gemma 3), against
transformers' greedy continuations; pages conserved after finish and abort.

Model: the tiny random Gemma 3 of ``tests/tiny_gemma.py`` (window 8; layers sliding / full / sliding / full). Prompts
of 29 (3.6 windows), 5 (decode crosses the window) and 17 tokens; 12 greedy tokens. The executor prefills in chunks
of at most 16 tokens (the staging path with the window mask) while other requests decode. Logprobs against
transformers' log-softmax at the same positions: within 1e-3 (the fp16 preset's pages round K/V to fp16).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_gemma import (check_greedy, check_window_coverage, check_window_rows, hf_greedy,  # noqa: E402
                        save_tiny_gemma3, setup)
from trtllm_diffkv.config import get_preset  # noqa: E402
from trtllm_diffkv.engine_config import EngineConfig  # noqa: E402
from trtllm_diffkv.generation.reference import ReferenceGenerator  # noqa: E402
from trtllm_diffkv.generation.static_batch import PagedGenerator  # noqa: E402
from trtllm_diffkv.runtime.executor import Executor  # noqa: E402
from trtllm_diffkv.runtime.sampling import SamplingParams  # noqa: E402

STEPS = 12
PROMPT_LENS = (29, 5, 17)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_gemma3")
    return (folder,) + setup(folder, PROMPT_LENS, STEPS)


def test_reference_and_static_batch_generators_equal_transformers(gemma):
    _, _, model, config, prompts, refs = gemma
    fp16 = get_preset("fp16")
    reference = ReferenceGenerator(model, None, config, fp16)
    assert reference.kv_config.sliding_windows(4) == (8, None, 8, None)  # the model's windows joined the policy
    for i, p in enumerate(prompts):
        got = reference.generate_ids(p, STEPS)
        assert got.error is None and got.token_ids == refs[i][0], i
    batch = PagedGenerator(model, None, config, fp16, high_tokens_per_page=4).generate_batch(prompts, STEPS)
    for i, got in enumerate(batch):
        assert got.error is None and got.token_ids == refs[i][0], i


def _executor(model, config, preset, **kw):
    return Executor(model, config, get_preset(preset),
                    EngineConfig(max_batch_size=4, max_seq_len=64, max_num_tokens=16,
                                 kv_memory_bytes=kw.pop("kv_memory_bytes", 8 << 20), high_tokens_per_page=4,
                                 use_triton=False, **kw))


def _run(ex, arrivals, aborts=None, max_steps=200, window_rows=None):
    """Drive ``ex`` until idle: ``arrivals`` {step: [(key, prompt, params)]}, ``aborts`` {step: [key]}; after every
    step the pool's pages are conserved and the sliding layers' rows hold their window
    (:func:`tiny_gemma.check_window_rows`; the rows checked are appended to ``window_rows`` when given). Returns
    {key: (tokens, final update, streamed logprobs)}."""
    aborts, ids, tokens, final, logprobs = aborts or {}, {}, {}, {}, {}
    manager = ex.cache.manager
    for step in range(max_steps):
        for key, prompt, params in arrivals.get(step, []):
            ids[key] = ex.add_request(prompt, params)
            tokens[key], logprobs[key] = [], []
        for key in aborts.get(step, []):
            ex.abort(ids[key])
        keys = {v: k for k, v in ids.items()}
        for update in ex.step():
            tokens[keys[update.request_id]] += update.new_token_ids
            logprobs[keys[update.request_id]] += update.logprobs or []
            if update.finished:
                final[keys[update.request_id]] = update
        manager.check_invariants()
        assert int(manager.pages.sum()) + manager.free_pages() == manager.num_pages
        checked = check_window_rows(ex.cache)
        if window_rows is not None:
            window_rows += checked
        if step >= max(list(arrivals) + list(aborts)) and not ex.has_unfinished():
            break
    assert manager.free_pages() == manager.num_pages, "pages leaked"
    return {key: (tokens[key], final[key], logprobs[key]) for key in ids}


def test_executor_chunked_prefill_and_batching_equal_transformers(gemma):
    """fp16: the 29- and 17-token prompts prefill in chunks (16-token steps) beside decoding requests; greedy tokens
    and their logprobs equal transformers'."""
    _, hf, model, config, prompts, refs = gemma
    ex = _executor(model, config, "fp16")
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=2)
    got = _run(ex, {0: [(1, prompts[1], params)], 1: [(0, prompts[0], params)], 3: [(2, prompts[2], params)]})
    for i, (tokens, update, logprobs) in got.items():
        want_tokens, want_logits = refs[i]
        assert update.finish_reason == "length" and tokens == want_tokens, i
        logp = torch.log_softmax(want_logits[len(prompts[i]) - 1:], -1)
        assert len(logprobs) == STEPS
        for step, entry in enumerate(logprobs):
            assert len(entry) >= 2
            for token, lp in entry.items():
                assert abs(lp.logprob - float(logp[step, token])) < 1e-3, (i, step, token)


def test_llm_api_equals_transformers(gemma):
    from trtllm_diffkv import LLM

    folder, _, _, _, prompts, refs = gemma
    with LLM(str(folder), kv_config="fp16", device="cpu", max_batch_size=4, max_num_tokens=16,
             kv_memory_bytes=8 << 20) as llm:
        assert llm.kv_config.sliding_windows(4) == (8, None, 8, None)
        outs = llm.generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0.0))
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == refs[i][0], i


@pytest.mark.parametrize("preset", ["diffkv", "k8v4"])
def test_pages_conserved_after_finish_and_abort(gemma, preset):
    """DiffKV presets on the sliding-window model: a request aborted mid-prefill (between its chunks), one aborted
    mid-decode, the others finish; every page comes back. The first token of each finished request comes from a
    prefill over full-precision K/V (chunked for the 29-token prompt): transformers' first greedy token."""
    _, _, model, config, prompts, refs = gemma
    ex = _executor(model, config, preset)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0)
    long_prompt = prompts[0] + prompts[2]  # 46 tokens: three chunks
    window_rows = []
    got = _run(ex, {0: [(0, prompts[0], params), (1, prompts[1], params), (3, long_prompt, params)],
                    1: [(2, prompts[2], params)]}, aborts={2: [3], 6: [2]}, window_rows=window_rows)
    check_window_coverage(window_rows, ex.cache, 2 * (STEPS - 1) * 2)  # 2 finished requests, 2 sliding layers
    assert got[3][1].finish_reason == got[2][1].finish_reason == "abort"
    assert got[0][1].finish_reason == got[1][1].finish_reason == "length"
    assert got[0][0][0] == refs[0][0][0] and got[1][0][0] == refs[1][0][0]
    result = got[0][1].result  # FP16 bytes count the sliding layers' windows only (the last token is not stored)
    n = len(prompts[0]) + STEPS - 1
    assert result.fp16_kv_cache_bytes == config.num_kv_heads * (2 * n + 2 * 8) * 2 * config.head_dim * 2
    assert result.kv_cache_bytes < result.fp16_kv_cache_bytes


GPU_SHAPE_PROMPT_LENS = (61, 5, 23, 130)
GPU_SHAPE_STEPS = 24
LOGPROB_TOL = 2e-3
"""fp16 pages round K/V: greedy logprobs measured within 1.2e-3 of transformers' (fp32) on these prompts, top-2
margins within 2e-3; the tiny model's own top-2 margins go down to 2.4e-3 here (:func:`tiny_gemma.check_greedy`)."""


def test_executor_at_the_gpu_tests_shape_equals_transformers(tmp_path):
    """The CPU twin of ``test_sliding_window_gpu.py``'s executor test (same model seed, prompts and engine limits;
    torch kernels, no CUDA graphs; decodes and prompts split, overlap on): the 130-token prompt prefills in 64-token
    chunks across window boundaries beside decoding requests, the 5-token one decodes across the window, and it
    picks token 1 (the config's EOS id, not a stop token without a tokenizer) at step 5, which transformers'
    ``generate(min_new_tokens=...)`` would have masked. Greedy tokens: :func:`tiny_gemma.check_greedy`; logprobs of a
    second run within ``LOGPROB_TOL`` up to the first difference."""
    hf = save_tiny_gemma3(tmp_path, seed=0)
    from trtllm_diffkv.model import load_model

    model, _, config = load_model(tmp_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in GPU_SHAPE_PROMPT_LENS]
    refs = [hf_greedy(hf, p, GPU_SHAPE_STEPS) for p in prompts]
    assert 1 in refs[1][0]  # the EOS id is a greedy token of the short prompt
    engine = EngineConfig(max_batch_size=8, max_seq_len=256, max_num_tokens=64, kv_memory_bytes=64 << 20,
                          use_triton=False, split_mixed_steps=True, disable_overlap_scheduler=False)
    for logprobs in (None, 2):  # None: decode-only steps overlap; 2: every step read before the next
        ex = Executor(model, config, get_preset("fp16"), engine)
        params = SamplingParams(max_tokens=GPU_SHAPE_STEPS, temperature=0.0, logprobs=logprobs)
        window_rows = []
        got = _run(ex, {0: [(i, p, params) for i, p in enumerate(prompts)]}, window_rows=window_rows)
        if logprobs is None:
            assert ex.stats()["overlapped_steps"] > 0
        # as the GPU test: the 130-token prompt half-prefilled (slot 3, 35 tokens staged after step 1: no rows)
        check_window_coverage(window_rows, ex.cache, len(prompts) * (GPU_SHAPE_STEPS - 1) * 2)
        for i, (tokens, update, entries) in got.items():
            want_tokens, want_logits = refs[i]
            agree = check_greedy(tokens, want_tokens, want_logits, len(prompts[i]), LOGPROB_TOL, f"prompt {i}")
            logp = torch.log_softmax(want_logits[len(prompts[i]) - 1:], -1)
            for step, entry in enumerate(entries[:agree]):
                for token, lp in entry.items():
                    assert abs(lp.logprob - float(logp[step, token])) < LOGPROB_TOL, (i, step, token)
