"""Chunked prefill in the executor (CPU, tiny peaked model, torch path; one run on the Triton interpreter).

References: the same request prefilled in one step (``enable_chunked_prefill=False``), whose outputs
``test_executor.py`` checks against the reference generator. Chunked outputs must give the same greedy
tokens, the same tier fractions and bytes, and logits within :data:`LOGIT_ATOL` (fp32 model: the chunks'
attention runs on other shapes than the one-step prefill, so hidden states differ by ~1e-6; a
quantized preset can round such a key or value to the neighbouring code, which moves a logit by up to
~2e-2; the fp16 preset stays within 1e-3). The pages and staging a half-prefilled prompt holds count in
admission and come back on abort and preemption (``drive`` checks the page manager after every step).
"""
import pytest
import torch

from conftest import peaked_tiny_llama, poison_prompt_staging, random_llama
from test_executor import CFG, _greedy, _prompts, drive, make
from trtllm_diffkv.config import DiffKVConfig, TierConfig, get_preset
from trtllm_diffkv.runtime.sampling import SamplingParams

K8V8 = DiffKVConfig(name="k8v8", high=TierConfig(8, 8), low=TierConfig(8, 8), alpha_low=0.0, alpha_high=0.0)
LOGIT_ATOL = {"fp16": 1e-3, "k8v4": 5e-2, "diffkv": 5e-2, "k8v8": 5e-2}
PROMPT = _prompts((100,), seed=3)[0]  # > S = 64: the score window is a part of the prompt


@pytest.fixture(scope="module")
def model():
    return peaked_tiny_llama()


def preset(name):
    return K8V8 if name == "k8v8" else get_preset(name)


def run(model, kv_config, prompt, max_tokens, chunk=None, ex=None, **kw):
    """Greedy ``prompt`` alone: ``chunk`` tokens per step (``None``: one-step prefill). Returns (request, logits
    ``[max_tokens, vocab]`` the sampler saw)."""
    if ex is None:
        ex = make(model, kv_config, max_batch_size=1, max_num_tokens=chunk or 128,
                  enable_chunked_prefill=chunk is not None, **kw)
    seen = []
    sample = ex.sampler.sample

    def recording(logits, ids, histories):
        seen.append(logits.clone())
        return sample(logits, ids, histories)

    ex.sampler.sample = recording
    rid = ex.add_request(prompt, _greedy(max_tokens))
    request = ex.run_until_done()[rid]
    ex.sampler.sample = sample
    assert ex.cache.manager.free_pages() == ex.cache.manager.num_pages and ex.cache.staging == {}
    return request, torch.cat(seen)


_unchunked = {}


def unchunked(model, name):
    if name not in _unchunked:
        _unchunked[name] = run(model, preset(name), PROMPT, 6)
    return _unchunked[name]


@pytest.mark.parametrize("name,chunk", [("diffkv", 1), ("diffkv", 63), ("diffkv", 64), ("diffkv", 90),
                                        ("fp16", 1), ("fp16", 64), ("fp16", 90), ("k8v4", 63), ("k8v4", 90),
                                        ("k8v8", 64)])
def test_chunked_prefill_equals_the_one_step_prefill(model, name, chunk):
    """Chunks of 1, of the window (64), of window - 1 and a final chunk shorter than the window (100 = 90 + 10:
    the scoring queries 36..99 span two chunks)."""
    want, want_logits = unchunked(model, name)
    got, logits = run(model, preset(name), PROMPT, 6, chunk)
    assert got.output_token_ids == want.output_token_ids
    assert bool(torch.isfinite(logits).all())
    torch.testing.assert_close(logits, want_logits, atol=LOGIT_ATOL[name], rtol=0)
    for field in ("kv_cache_bytes", "high_fraction", "low_fraction", "pruned_fraction", "pool_pages"):
        assert getattr(got.result, field) == getattr(want.result, field), field


@pytest.mark.parametrize("name", ["k8v4", "k8v8"])
def test_chunked_prefill_with_an_8_bit_cache_gives_no_nan(model, name, monkeypatch):
    """Public report: "chunked prefill with an 8-bit KV cache produced NaN". Here the pool already served a
    request (stale pages) and every staging row is NaN until a chunk writes it: no output may see either."""
    poison_prompt_staging(monkeypatch)
    ex = make(model, preset(name), max_batch_size=1, max_num_tokens=30)
    run(model, None, _prompts((70,), seed=9)[0], 3, ex=ex)  # leaves stale bytes in the pages
    got, logits = run(model, None, PROMPT, 6, ex=ex)
    want, want_logits = unchunked(model, name)
    assert bool(torch.isfinite(logits).all()) and got.output_token_ids == want.output_token_ids
    torch.testing.assert_close(logits, want_logits, atol=LOGIT_ATOL[name], rtol=0)


def test_seeded_sampling_does_not_depend_on_the_chunking(model):
    """A prompt's non-final chunks sample nothing: its seeded draws are those of the one-step prefill."""
    params = SamplingParams(max_tokens=6, temperature=0.9, top_k=20, seed=77)
    got = {}
    for chunk in (None, 30):
        ex = make(model, CFG, max_batch_size=1, max_num_tokens=chunk or 128, enable_chunked_prefill=chunk is not None)
        rid = ex.add_request(PROMPT, params)
        got[chunk] = ex.run_until_done()[rid].output_token_ids
    assert got[30] == got[None] and len(set(got[None])) > 1


def test_decodes_run_in_every_step_while_a_long_prompt_is_chunked(model):
    """Decodes first, then prompt chunks in what is left of ``max_num_tokens``; nobody's tokens change."""
    kv, short = get_preset("diffkv"), _prompts((10,), seed=4)[0]
    ex = make(model, kv, max_batch_size=2, max_num_tokens=16)
    tokens_per_step, prepare = [], ex.rm.prepare_resources

    def recording(batch, **kw):
        tokens_per_step.append((batch.num_tokens, len(batch.generation_requests), len(batch.context_requests)))
        return prepare(batch, **kw)

    ex.rm.prepare_resources = recording
    got = drive(ex, {0: [("short", short, _greedy(12))], 2: [("long", PROMPT, _greedy(4))]})
    assert got["short"][0] == run(model, kv, short, 12)[0].output_token_ids
    assert got["long"][0] == unchunked(model, "diffkv")[0].output_token_ids[:4]
    assert all(n <= 16 for n, _, _ in tokens_per_step)
    # steps 2..8: the short request decodes while the long prompt comes in chunks of 15 (100 = 6 x 15 + 10)
    assert tokens_per_step[2:9] == [(16, 1, 1)] * 6 + [(11, 1, 1)]


def test_a_half_prefilled_prompt_holds_its_reserve_in_admission(model):
    """From its first chunk a prompt holds its whole reserve (all tokens counted high) and its staging: a prompt
    that needs those pages is not admitted beside its final chunk, only once it ended."""
    probe = make(model, CFG)
    reserve_a, reserve_b = probe.rm.prefill_pages_needed(60), probe.rm.prefill_pages_needed(20)
    ex = make(model, CFG, num_pages=reserve_a + reserve_b - 1, max_num_tokens=16)
    a = ex.add_request(_prompts((60,), seed=5)[0], _greedy(1))  # ends at its final chunk
    b = ex.add_request(_prompts((20,), seed=6)[0], _greedy(2))
    ex.step()
    for _ in range(3):  # chunks 2..4 of a (60 = 3 x 16 + 12); the last leaves 4 tokens of the step for b
        stats = ex.stats()
        assert stats["used_pages"] == reserve_a and stats["staging_bytes"] == ex.rm.staging_bytes_needed(60)
        assert [r.request_id for r in ex.running] == [a] and [r.request_id for r in ex.waiting] == [b]
        ex.step()
    assert a not in ex.requests and ex.stats()["staging_bytes"] == 0 and ex.stats()["used_pages"] == 0
    assert [r.request_id for r in ex.waiting] == [b]
    ex.step()
    assert [r.request_id for r in ex.running] == [b]
    ex.run_until_done()
    assert ex.cache.manager.free_pages() == ex.cache.manager.num_pages


@pytest.mark.parametrize("limit_prompts,admitted_at", [(1, 3), (2, 2)])
def test_a_chunked_prompt_is_admitted_only_when_its_staging_fits(model, limit_prompts, admitted_at):
    """``chunk_staging_bytes`` for one prompt (62 tokens: a re-prefill of prompt + max_tokens - 1 must fit it): the
    second waits for the first's final chunk; for two, it starts beside that final chunk."""
    probe = make(model, CFG)
    limit = limit_prompts * probe.rm.staging_bytes_needed(62)
    ex = make(model, CFG, max_num_tokens=40, chunk_staging_bytes=limit)
    first, second = _prompts((60, 60), seed=7)
    ex.add_request(first, _greedy(3))
    late = ex.add_request(second, _greedy(3))
    admitted = None
    for step in range(1, 4):
        ex.step()  # step 1: 40 of the first; step 2: its final 20 + (if the staging allows) 20 of the second
        assert ex.stats()["staging_bytes"] <= limit
        if admitted is None and any(r.request_id == late for r in ex.running):
            admitted = step
    assert admitted == admitted_at
    out = ex.run_until_done()
    assert out[late].output_token_ids == run(model, CFG, second, 3)[0].output_token_ids


def _steps_with_tokens(ex, keys: dict, max_steps: int = 40) -> dict:
    """Step ``ex`` until idle (at most ``max_steps``: a stalled executor fails the test instead of hanging).
    ``keys``: {request id: name}. Returns {name: [step indices that gave it a token]} and the final updates
    under ``"final"``."""
    got, final = {name: [] for name in keys.values()}, {}
    for step in range(max_steps):
        for update in ex.step():
            if update.new_token_ids:
                got[keys[update.request_id]].append(step)
            if update.finished:
                final[keys[update.request_id]] = update
        if not ex.has_unfinished():
            break
    else:
        raise AssertionError(f"still unfinished after {max_steps} steps: waiting "
                             f"{[keys[r.request_id] for r in ex.waiting]}, running {[keys[r.request_id] for r in ex.running]}")
    return {**got, "final": final}


@pytest.mark.parametrize("spare_bytes", [0, -1])
def test_a_prompt_whose_staging_exactly_fills_the_limit_runs_beside_the_decodes(model, spare_bytes):
    """Issue 43: ``chunk_staging_bytes`` equal to one prompt's staging (max_tokens 1: a re-prefill is the prompt
    itself) admits that prompt, chunks it while a short request decodes a token every step, and completes it with
    the one-step prefill's token; the scheduler, the cache's plan and the request check share one rule
    (``staging_fits``). A limit one byte smaller refuses the prompt alone, naming the field; the short request
    never misses a step. (With the cache refusing what the scheduler admitted, the step was retried forever and
    the short request's decodes stalled.)"""
    long, short = _prompts((60, 8), seed=12)
    probe = make(model, CFG)
    limit = probe.rm.staging_bytes_needed(60) + spare_bytes
    ex = make(model, CFG, max_batch_size=2, max_num_tokens=16, chunk_staging_bytes=limit)
    keys = {ex.add_request(short, _greedy(10)): "short"}
    ex.step()  # the short prompt's prefill: it decodes from the next step on
    keys[ex.add_request(long, _greedy(1))] = "long"
    held = []
    prepare = ex.rm.prepare_resources

    def recording(batch, **kw):
        out = prepare(batch, **kw)
        held.append(ex.cache.staging_bytes_used())
        return out

    ex.rm.prepare_resources = recording
    got = _steps_with_tokens(ex, keys)
    final = got["final"]
    assert got["short"] == list(range(len(got["short"]))) and len(got["short"]) == 9  # a token at every step
    assert final["short"].result.token_ids == run(model, CFG, short, 10)[0].output_token_ids
    if spare_bytes == 0:
        assert final["long"].finish_reason == "length"
        assert final["long"].result.token_ids == unchunked_tokens(model, long, 1)
        assert max(held) == limit  # the staging really filled the limit to the byte
    else:
        assert final["long"].finish_reason == "error" and f"chunk_staging_bytes={limit}" in final["long"].error
        assert max(held) == 0
    assert ex.cache.staging == {} and ex.cache.manager.free_pages() == ex.cache.manager.num_pages


def unchunked_tokens(model, prompt, max_tokens):
    return run(model, CFG, prompt, max_tokens)[0].output_token_ids


@pytest.mark.parametrize("spare_bytes,admitted_at", [(0, 1), (-1, 2)])
def test_a_second_chunked_prompt_that_exactly_fills_what_is_left_starts_beside_the_first(model, spare_bytes,
                                                                                          admitted_at):
    """Two 60-token prompts, 40 tokens a step, ``chunk_staging_bytes`` = both stagings (+0 / -1 byte): the second
    starts beside the first's final chunk when the two fill the limit exactly, one step later when one byte is
    missing; both complete with their one-step prefill's tokens."""
    probe = make(model, CFG)
    one = probe.rm.staging_bytes_needed(60)
    ex = make(model, CFG, max_num_tokens=40, chunk_staging_bytes=2 * one + spare_bytes)
    first, second = _prompts((60, 60), seed=13)
    keys = {ex.add_request(first, _greedy(1)): "first", ex.add_request(second, _greedy(2)): "second"}
    late = next(rid for rid, name in keys.items() if name == "second")
    admitted = None
    for step in range(3):
        ex.step()
        assert ex.stats()["staging_bytes"] <= 2 * one + spare_bytes
        if admitted is None and any(r.request_id == late for r in ex.running):
            admitted = step
    assert admitted == admitted_at
    out = ex.run_until_done()
    assert out[late].output_token_ids == unchunked_tokens(model, second, 2)


def test_abort_in_the_middle_of_a_chunked_prompt_frees_every_page_and_its_staging(model):
    short, long = _prompts((8, 90), seed=8)
    ex = make(model, CFG, max_num_tokens=10)
    got = drive(ex, {0: [("short", short, _greedy(10)), ("long", long, _greedy(5))]}, aborts={4: ["long"]})
    assert got["long"][1].finish_reason == "abort" and got["long"][0] == []
    assert ex.cache.staging == {} and ex.stats()["staging_bytes"] == 0  # drive: every page back, checked each step
    assert got["short"][0] == run(model, CFG, short, 10)[0].output_token_ids


def test_preempting_a_half_prefilled_prompt_frees_it_and_it_restarts(model):
    """A decoding request grows until its decode step no longer fits: the newest request, a prompt still in its
    chunks, is preempted (pages and staging back) and later prefilled again from its first token."""
    fp16 = get_preset("fp16")
    probe = make(model, fp16)
    decode_pages = probe.rm.decode_pages_needed(1)
    ex = make(model, fp16, num_pages=probe.rm.prefill_pages_needed(60) + 2 * decode_pages + 6, max_batch_size=2,
              max_num_tokens=4)
    preempted, preempt = [], ex.scheduler._preempt

    def recording(request):
        preempted.append((request.request_id, request.num_cached_tokens, len(request.prefill_token_ids)))
        preempt(request)

    ex.scheduler._preempt = recording
    grower, prompt = _prompts((4, 60), seed=10)
    got = drive(ex, {0: [("grower", grower, _greedy(40))], 1: [("chunked", prompt, _greedy(3))]})
    assert preempted and all(0 < cached < total for _, cached, total in preempted)  # mid-prompt each time
    assert got["chunked"][0] == run(model, fp16, prompt, 3)[0].output_token_ids
    assert got["grower"][0] == run(model, fp16, grower, 40)[0].output_token_ids
    assert ex.cache.staging == {}


def test_without_chunked_prefill_a_prompt_must_fit_one_step(model):
    ex = make(model, CFG, max_num_tokens=32, enable_chunked_prefill=False)
    rid = ex.add_request(_prompts((40,), seed=11)[0], _greedy(2))
    update = [u for u in ex.step() if u.request_id == rid][0]
    assert update.finish_reason == "error" and "max_num_tokens=32" in update.error and "enable_chunked_prefill" in update.error
    with pytest.raises(ValueError, match="max_num_tokens=4 must be >= max_batch_size=8"):
        make(model, CFG, max_num_tokens=4)
    with pytest.raises(ValueError, match="enable_chunked_prefill='no' must be True or False"):
        make(model, CFG, enable_chunked_prefill="no")
    tiny = make(model, CFG, max_num_tokens=16, chunk_staging_bytes=100)
    rid = tiny.add_request(_prompts((40,), seed=11)[0], _greedy(2))
    update = [u for u in tiny.step() if u.request_id == rid][0]
    assert update.finish_reason == "error" and "chunk_staging_bytes=100" in update.error


def test_chunked_prefill_on_the_triton_interpreter():
    """The executor on the Triton kernels (interpreter, small shapes): chunks of 4 of a 10-token prompt (S = 8: the
    final chunk of 2 leaves scoring queries in earlier chunks) give the one-step prefill's tokens."""
    model = random_llama(0, vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, max_position_embeddings=256)
    prompt = _prompts((10,), seed=12, vocab=128)[0]
    kw = dict(num_pages=200, max_seq_len=32, max_batch_size=1, use_triton=True)
    want = run(model, CFG, prompt, 2, ex=make(model, CFG, max_num_tokens=16, enable_chunked_prefill=False, **kw))
    got = run(model, CFG, prompt, 2, ex=make(model, CFG, max_num_tokens=4, **kw))
    assert got[0].output_token_ids == want[0].output_token_ids
    torch.testing.assert_close(got[1], want[1], atol=5e-2, rtol=0)


def _mixed_traffic(model, kv, split):
    """Requests arriving while others decode (whole prompts and a chunked one, greedy and seeded), every
    sampled logits row recorded per request; returns (drive's outputs, rows, steps planned with both kinds)."""
    ex = make(model, kv, max_batch_size=4, max_num_tokens=40, split_mixed_steps=split)
    rows, mixed, sample, prepare = {}, [], ex.sampler.sample, ex.rm.prepare_resources

    def recording(logits, ids, histories):
        for rid, row in zip(ids, logits):
            rows.setdefault(rid, []).append(row.clone())
        return sample(logits, ids, histories)

    def planned(batch, **kw):
        mixed.append(bool(batch.context_requests and batch.generation_requests))
        return prepare(batch, **kw)

    ex.sampler.sample, ex.rm.prepare_resources = recording, planned
    prompts = _prompts((12, 30, 100, 7), seed=11)
    seeded = SamplingParams(max_tokens=7, temperature=0.8, top_k=30, seed=5)
    got = drive(ex, {0: [("a", prompts[0], _greedy(12))], 2: [("b", prompts[1], seeded)],
                     3: [("c", prompts[2], _greedy(5))], 5: [("d", prompts[3], _greedy(6))]})
    return got, {key: torch.stack(rows[update.request_id]) for key, (_, update) in got.items()}, sum(mixed)


@pytest.mark.parametrize("name", ["diffkv", "fp16"])
def test_split_mixed_steps_equal_the_one_call_steps(model, name):
    """``split_mixed_steps`` (the default with CUDA graphs) runs a step's decodes, then its prompts, as two model
    calls: every request's tokens, logits, pages and tiers are those of the one-call step."""
    want, want_rows, want_mixed = _mixed_traffic(model, preset(name), False)
    got, got_rows, got_mixed = _mixed_traffic(model, preset(name), True)
    assert want_mixed > 0 and got_mixed == 0  # the traffic has mixed steps, and the split leaves none
    for key, (tokens, update) in want.items():
        assert got[key][0] == tokens and got[key][1].finish_reason == update.finish_reason, key
        torch.testing.assert_close(got_rows[key], want_rows[key], atol=LOGIT_ATOL[name], rtol=0)
        for field in ("kv_cache_bytes", "high_fraction", "low_fraction", "pruned_fraction", "pool_pages"):
            assert getattr(got[key][1].result, field) == getattr(update.result, field), (key, field)


def test_a_failing_prompt_call_of_a_split_step_fails_only_its_prompts(model):
    """The prompts' model call of a split step raises: those requests fail with the reason, the decodes of the
    same step go on to their tokens, and every page comes back."""
    ex = make(model, get_preset("diffkv"), max_batch_size=4, max_num_tokens=64, split_mixed_steps=True)
    forward = ex._forward

    def failing(batch, graphs=None, input_ids=None):
        if batch.context_requests and batch.context_requests[0].request_id == bad:
            raise RuntimeError("planted")
        return forward(batch, graphs, input_ids)

    ex._forward = failing
    short, other = _prompts((9, 20), seed=12)
    tokens, final = {}, {}
    good = ex.add_request(short, _greedy(8))
    bad = None
    for step in range(40):
        if step == 2:
            bad = ex.add_request(other, _greedy(4))
        for update in ex.step():
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finished:
                final[update.request_id] = update
        if step > 2 and not ex.has_unfinished():
            break
    assert final[good].finish_reason == "length"
    assert tokens[good] == run(model, get_preset("diffkv"), short, 8)[0].output_token_ids
    assert final[bad].finish_reason == "error" and "planted" in final[bad].error and tokens.get(bad, []) == []
    assert ex.cache.manager.free_pages() == ex.cache.manager.num_pages and ex.cache.staging == {}


def test_split_mixed_steps_is_checked(model):
    with pytest.raises(ValueError, match="split_mixed_steps"):
        make(model, get_preset("diffkv"), split_mixed_steps="yes")
