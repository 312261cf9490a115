"""The in-flight batching executor on tiny models (CPU; torch ops path, one test on the Triton interpreter).

Outputs are checked against independent runs: each request alone in its own executor, the
reference generator (:class:`ReferenceGenerator`, the exact oracle cache) and the static-batch
:class:`PagedGenerator`. Pages are checked after every step against the page manager's own
tables (pages held per row + free ring entries = pool; ``check_invariants``; the cache's active
slots = the running requests' slots), and idle executors must be back at the initial free count.
"""
import inspect
import random
import threading

import pytest
import torch

from conftest import peaked_tiny_llama, random_llama, tiny_llama
from trtllm_diffkv.config import DiffKVConfig, get_preset
from trtllm_diffkv.engine_config import EngineConfig
from trtllm_diffkv.generation.reference import ReferenceGenerator
from trtllm_diffkv.generation.static_batch import PagedGenerator
from trtllm_diffkv.runtime.executor import Executor
from trtllm_diffkv.runtime.resource_manager import DiffKVResourceManager
from trtllm_diffkv.runtime.sampling import SamplingParams

# Small windows so tiers change within a few steps (demotions, pruning) on the peaked model.
CFG = DiffKVConfig(recent_window_tokens=4, prompt_score_window_tokens=8, alpha_high=1.0, alpha_low=0.3)
FP16 = get_preset("fp16")
TPP = 4  # high tokens per page: pages fill within a few tokens


@pytest.fixture(scope="module")
def model():
    return peaked_tiny_llama()


def _prompts(lengths, seed=1, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _greedy(n):
    return SamplingParams.greedy_params(n)


def budget_for_pages(model, kv_config, num_pages, max_batch_size=8, max_seq_len=128):
    """The byte budget that holds exactly ``num_pages`` pages once the bookkeeping is paid."""
    probe = DiffKVResourceManager(model.config, kv_config, EngineConfig(
        kv_memory_bytes=1 << 26, max_batch_size=max_batch_size, max_seq_len=max_seq_len, max_num_tokens=max_seq_len,
        high_tokens_per_page=TPP, use_triton=False))
    fixed = probe.bookkeeping_bytes - 4 * probe.cache.manager.num_pages  # one int32 ring entry per page
    return fixed + num_pages * (probe.cache.page_format.page_size_bytes + 4)


def make(model, kv_config=CFG, num_pages=2000, max_batch_size=8, max_seq_len=128, **kw):
    executor_kw = {k: kw.pop(k) for k in ("tokenizer", "stop_token_ids", "parallel") if k in kw}
    ex = Executor(model, model.config, kv_config, EngineConfig(
        max_batch_size=max_batch_size, max_seq_len=max_seq_len,
        kv_memory_bytes=budget_for_pages(model, kv_config, num_pages, max_batch_size, max_seq_len),
        high_tokens_per_page=TPP, use_triton=kw.pop("use_triton", False), **kw), **executor_kw)
    assert ex.rm.get_max_resource_count() == num_pages
    return ex


def check_pool(ex):
    """After a step: page manager invariants; pages held by rows + free = pool; slots of running requests only."""
    manager = ex.cache.manager
    manager.check_invariants()
    assert int(manager.pages.sum()) + manager.free_pages() == manager.num_pages
    assert sorted(ex.cache.active_slots) == sorted(r.slot for r in ex.running)
    assert all(r.slot is None for r in ex.waiting)


def drive(ex, arrivals, aborts=None, max_steps=500):
    """Run ``ex`` until idle. ``arrivals``: {step: [(key, prompt, params)]} added before that step;
    ``aborts``: {step: [key]} aborted before that step. Returns {key: (streamed ids, final update)}."""
    aborts = aborts or {}
    ids, streamed, final = {}, {}, {}
    last = max(list(arrivals) + list(aborts) + [0])
    for step in range(max_steps):
        for key, prompt, params in arrivals.get(step, []):
            ids[key] = ex.add_request(prompt, params)
            streamed[key] = []
        for key in aborts.get(step, []):
            ex.abort(ids[key])
        keys = {v: k for k, v in ids.items()}
        for update in ex.step():
            key = keys[update.request_id]
            assert key not in final, f"update after the end for {key}"
            streamed[key] += update.new_token_ids
            if update.finished:
                final[key] = update
        check_pool(ex)
        if step >= last and not ex.has_unfinished():
            break
    else:
        raise AssertionError("executor did not finish")
    assert ex.cache.manager.free_pages() == ex.cache.manager.num_pages  # idle: every page back
    return {key: (streamed[key], final[key]) for key in ids}


def solo(model, kv_config, prompt, params, **kw):
    """The request alone in a fresh executor."""
    return drive(make(model, kv_config, **kw), {0: [(0, prompt, params)]})[0]


def test_staggered_batch_equals_each_request_alone_and_the_reference(model):
    prompts = _prompts((20, 7, 33, 1, 12))
    arrivals = {0: [(0, prompts[0], _greedy(10)), (1, prompts[1], _greedy(6))], 2: [(2, prompts[2], _greedy(9))],
                3: [(3, prompts[3], _greedy(8))], 7: [(4, prompts[4], _greedy(5))]}
    ex = make(model)
    got = drive(ex, arrivals)
    reference = ReferenceGenerator(model, None, model.config, CFG)
    static = PagedGenerator(model, None, model.config, CFG, high_tokens_per_page=TPP).generate_batch(prompts, 10)
    for key, (streamed, update) in got.items():
        n = arrivals_params(arrivals)[key].max_tokens
        want = reference.generate_ids(prompts[key], n)
        alone = solo(model, CFG, prompts[key], _greedy(n))[1].result
        assert update.finish_reason == "length" and update.result.token_ids == streamed
        assert streamed == want.token_ids == alone.token_ids == static[key].token_ids[:n]
        assert update.result.kv_cache_bytes == want.kv_cache_bytes == alone.kv_cache_bytes
        assert update.result.high_fraction == want.high_fraction and update.result.pruned_fraction == want.pruned_fraction
        assert update.result.pool_used_bytes >= update.result.kv_cache_bytes
    assert sum(u.result.low_fraction + u.result.pruned_fraction for _, u in got.values()) > 0  # tiers changed
    stats = ex.stats()
    assert stats["running"] == stats["waiting"] == stats["used_pages"] == 0
    assert stats["output_tokens"] == 10 + 6 + 9 + 8 + 5 and 1 < stats["mean_batch_size"] <= 5


def arrivals_params(arrivals):
    return {key: params for items in arrivals.values() for key, _, params in items}


def test_abort_at_every_stage_returns_every_page(model):
    prompts = _prompts((9, 14, 21, 6), seed=2)
    # 2: aborted while waiting; 1: right after its prefill; 3 (admitted in place of 1): mid decode; 0 finishes
    ex = make(model, max_batch_size=2)
    ids = {k: ex.add_request(p, _greedy(12)) for k, p in enumerate(prompts)}
    free0 = ex.cache.manager.free_pages()
    ex.abort(ids[2])  # waiting (queued third)
    updates = ex.step()  # prefill of 0 and 1
    assert [u.finish_reason for u in updates if u.request_id == ids[2]] == ["abort"]
    assert ex.cache.manager.free_pages() < free0
    ex.abort(ids[1])  # right after prefill: its pages come back at once
    check_pool(ex)
    assert [r.request_id for r in ex.running] == [ids[0]]
    rest = []
    for _ in range(4):
        rest += ex.step()
        check_pool(ex)
    assert ids[3] in [r.request_id for r in ex.running] and ex.requests[ids[3]].output_token_ids
    ex.abort(ids[3])  # admitted in place of 1: mid decode
    check_pool(ex)
    while ex.has_unfinished():
        rest += ex.step()
        check_pool(ex)
    assert ex.cache.manager.free_pages() == free0
    finals = {u.request_id: u for u in rest if u.finished}
    assert finals[ids[1]].finish_reason == finals[ids[3]].finish_reason == "abort"
    assert finals[ids[0]].finish_reason == "length"
    assert finals[ids[0]].result.token_ids == solo(model, CFG, prompts[0], _greedy(12))[0]
    ex.abort(ids[0])  # finished: ignored
    ex.abort("never-added")
    assert ex.step() == []


def test_preemption_fp16_keeps_outputs_equal_to_solo_runs(model):
    prompts = _prompts((10, 13, 11, 9), seed=3)
    arrivals = {0: [(k, p, _greedy(14)) for k, p in enumerate(prompts)]}
    ex = make(model, FP16, num_pages=90)
    got = drive(ex, arrivals)
    assert ex.stats()["preemptions"] > 0
    for key, (streamed, update) in got.items():
        assert update.finish_reason == "length", update.error
        assert streamed == update.result.token_ids == solo(model, FP16, prompts[key], _greedy(14))[0]
        assert update.result.kv_memory_fraction == 1.0 and update.result.high_fraction is None


def test_fp16_decode_worst_case_is_one_page_per_row(model):
    """A policy that never moves a token to the low tier (``fp16``) needs at most one page per row a decode step,
    so a pool with one such step of headroom over the run's peak never preempts (two pages per row, the
    compressing presets' bound, would preempt there)."""
    prompts = _prompts((10, 13, 11, 9), seed=3)
    roomy = make(model, FP16)
    rows = roomy.cache.rows_per_slot
    assert roomy.rm.decode_pages_needed(3) == 3 * rows
    assert make(model, CFG).rm.decode_pages_needed(3) == 2 * 3 * rows
    for p in prompts:
        roomy.add_request(p, _greedy(14))
    peak = 0
    while roomy.has_unfinished():
        roomy.step()
        peak = max(peak, roomy.cache.manager.num_pages - roomy.cache.manager.free_pages())
    ex = make(model, FP16, num_pages=peak + rows * len(prompts))
    got = drive(ex, {0: [(k, p, _greedy(14)) for k, p in enumerate(prompts)]})
    assert ex.stats()["preemptions"] == 0
    for key, (streamed, update) in got.items():
        assert streamed == update.result.token_ids == solo(model, FP16, prompts[key], _greedy(14))[0]


def test_a_custom_uncompressed_config_is_the_fp16_preset(model):
    """``DiffKVConfig(compress=False)`` with the default (quantized) tiers stores FP16 like the ``fp16`` preset: same
    page size, same tokens, full memory fraction (it used to lay pages out as K8V4 and report 1.0)."""
    custom = DiffKVConfig(compress=False)  # high K8V4 / low K4V2 by default
    prompt = _prompts((11,), seed=5)[0]
    ex = make(model, custom)
    assert ex.cache.page_format.page_size_bytes == make(model, FP16).cache.page_format.page_size_bytes
    streamed, update = drive(ex, {0: [(0, prompt, _greedy(12))]})[0]
    assert streamed == solo(model, FP16, prompt, _greedy(12))[0]
    assert update.result.kv_memory_fraction == 1.0


def preemption_storm(ex, prompts, params):
    """Run ``prompts`` together in ``ex`` until idle, checking the pool after every step and that a
    preempted request's next prefill is its prompt + every token streamed. Returns ``(keys, streamed,
    before, finals)``: request ids, streamed ids per id, the ids streamed before each preempted request's
    first preemption, the final updates."""
    keys = [ex.add_request(p, params) for p in prompts]
    streamed = {k: [] for k in keys}
    before = {}  # tokens streamed before a request's first preemption
    finals = {}
    while ex.has_unfinished():
        for update in ex.step():
            streamed[update.request_id] += update.new_token_ids
            if update.finished:
                finals[update.request_id] = update
        for request in ex.waiting:
            if request.num_preemptions == 1 and request.request_id not in before:
                before[request.request_id] = list(streamed[request.request_id])
                assert request.prefill_token_ids == request.prompt_token_ids + streamed[request.request_id]
        check_pool(ex)
    return keys, streamed, before, finals


def test_preemption_diffkv_loses_and_duplicates_no_token(model):
    prompts = _prompts((10, 13, 11, 9), seed=4)
    keys, streamed, before, finals = preemption_storm(make(model, CFG, num_pages=90), prompts, _greedy(14))
    assert before, "no preemption happened"
    for key, prompt in zip(keys, prompts):
        update = finals[key]
        assert update.finish_reason == "length" and len(streamed[key]) == 14
        assert update.result.token_ids == streamed[key] and update.result.generated_tokens == 14
        if key in before:
            n = len(before[key])
            assert streamed[key][:n] == solo(model, CFG, prompt, _greedy(14))[0][:n]


def test_tiny_prompts_edge_case_8(model):
    """0/1/16/17-token prompts in one batch: the empty one fails alone and allocates nothing."""
    prompts = _prompts((0, 1, 16, 17), seed=5)
    ex = make(model)
    empty = ex.add_request([], _greedy(4))
    updates = ex.step()
    assert [(u.finish_reason, u.error) for u in updates] == [("error", "ValueError: empty prompt: at least one "
                                                                         "token is needed")]
    assert ex.stats()["steps"] == 0 and ex.cache.manager.free_pages() == 2000  # nothing ran, nothing taken
    assert updates[0].request_id == empty and updates[0].result.finish_reason == "error"
    got = drive(ex, {0: [(k, p, _greedy(6)) for k, p in enumerate(prompts)]})
    assert got[0][1].finish_reason == "error" and got[0][0] == []
    for key in (1, 2, 3):
        assert got[key][0] == solo(model, CFG, prompts[key], _greedy(6))[0]


def test_bad_requests_fail_alone(model):
    prompts = _prompts((8, 8), seed=6)
    good = _greedy(5)
    bad = {
        "temperature": (prompts[1], SamplingParams(temperature=-1.0)),
        "top_p": (prompts[1], SamplingParams(top_p=1.5)),
        "max_tokens": (prompts[1], SamplingParams(max_tokens=0)),
        "repetition_penalty": (prompts[1], SamplingParams(repetition_penalty=0.0)),
        "stop": (prompts[1], SamplingParams(stop=["x"])),  # stop strings need a tokenizer
        "not SamplingParams": (prompts[1], {"max_tokens": 3}),
        "vocabulary": (prompts[1][:4] + [512], good),
        "not an integer": (prompts[1][:4] + [1.5], good),
        "max_seq_len": (prompts[1], _greedy(125)),  # 8 + 125 > 128
    }
    arrivals = {0: [("good", prompts[0], good)] + [(k, p, s) for k, (p, s) in bad.items()]}
    got = drive(make(model), arrivals)
    for key in bad:
        update = got[key][1]
        assert update.finish_reason == "error" and key.split()[-1] in update.error, (key, update.error)
        assert got[key][0] == []
    assert got["good"][0] == solo(model, CFG, prompts[0], good)[0]


def test_max_seq_len_is_inclusive(model):
    """prompt + max_tokens == max_seq_len fits (every position < max_seq_len is used); one more is refused."""
    prompt = _prompts((8,), seed=9)[0]
    got = drive(make(model, max_seq_len=32), {0: [("fits", prompt, _greedy(24)), ("over", prompt, _greedy(25))]})
    assert got["fits"][1].finish_reason == "length", got["fits"][1].error
    assert got["fits"][0] == solo(model, CFG, prompt, _greedy(24))[0] and len(got["fits"][0]) == 24
    assert got["over"][1].finish_reason == "error" and "exceeds max_seq_len 32" in got["over"][1].error


def test_request_larger_than_the_pool_fails_alone(model):
    """A prompt whose prefill reserve exceeds the whole pool, and one that would outgrow it alone while decoding."""
    ex = make(model, FP16, num_pages=60)
    rows = ex.cache.rows_per_slot
    long_prompt, short = _prompts((40, 6), seed=7)  # 40 tokens reserve (10 + 1) pages per row > 60 / 6
    grows = _prompts((30,), seed=8)[0]  # prefill fits (8 pages/row); 30 + 20 tokens need 13 pages/row > 10
    got = drive(ex, {0: [("long", long_prompt, _greedy(3)), ("short", short, _greedy(4))],
                     1: [("grows", grows, _greedy(20))]})
    assert got["long"][1].finish_reason == "error" and "whole pool has 60" in got["long"][1].error
    assert got["long"][0] == [] and ex.rm.prefill_pages_needed(40) == rows * 11
    # without tiers its growth is known: refused at admission, before any token (it used to stream, then fail)
    assert got["grows"][1].finish_reason == "error" and "by its last decode step" in got["grows"][1].error
    assert got["grows"][0] == []
    assert got["short"][0] == solo(model, FP16, short, _greedy(4))[0]


def test_non_finite_keys_fail_their_request_alone():
    """A token whose embedding is NaN gives NaN keys/values: that request fails (cache error flags), not the batch."""
    model = tiny_llama()
    poison = 7
    with torch.no_grad():
        model.model.embed_tokens.weight[poison] = float("nan")
    clean = [p for p in _prompts((9, 12, 30), seed=9) if poison not in p][:2]
    alone = [solo(model, CFG, p, _greedy(6))[0] for p in clean]
    assert all(poison not in a for a in alone)
    got = drive(make(model), {0: [(0, clean[0], _greedy(6)), ("bad", clean[1][:5] + [poison], _greedy(6))],
                              1: [(1, clean[1], _greedy(6))]})
    assert got["bad"][1].finish_reason == "error" and "NaN/Inf" in got["bad"][1].error
    assert got[0][0] == alone[0] and got[1][0] == alone[1]


def _refuse_once(ex, exc, when):
    """Make ``ex``'s cache refuse the first step whose batch satisfies ``when(batch)`` by raising ``exc`` from
    ``prepare_resources`` (nothing changed, as the cache's plan guarantees); returns the list of refused batches'
    request ids."""
    prepare, refused = ex.rm.prepare_resources, []

    def refusing(batch, **kw):
        if not refused and when(batch):
            refused.append(sorted(r.request_id for r in batch.all_requests))
            raise exc
        return prepare(batch, **kw)

    ex.rm.prepare_resources = refusing
    return refused


def test_a_step_the_cache_refuses_fails_its_requests_and_the_executor_goes_on(model):
    """The error path of a failed plan: the cache refuses a step with an error that is not about pages (nothing
    changed). That step's requests (a decoding one and the new prompt) fail with the error, once; a request that
    arrives later runs to its solo tokens; every page comes back (``drive`` checks the pool after every step)."""
    first, late, other = _prompts((10, 7, 12), seed=31)
    ex = make(model)
    refused = _refuse_once(ex, ValueError("simulated: the plan was refused"),
                           lambda batch: any(r.prompt_token_ids == late for r in batch.context_requests))
    got = drive(ex, {0: [("first", first, _greedy(8))], 2: [("late", late, _greedy(4))], 5: [("other", other, _greedy(5))]})
    assert len(refused) == 1 and len(refused[0]) == 2  # the decoding request and the new prompt
    for key in ("first", "late"):
        assert got[key][1].finish_reason == "error" and "simulated: the plan was refused" in got[key][1].error, key
    assert len(got["first"][0]) == 2 and got["late"][0] == []  # first's prefill and one decode ran before
    assert got["other"][1].finish_reason == "length"
    assert got["other"][0] == solo(model, CFG, other, _greedy(5))[0]


def test_a_step_refused_for_pages_is_retried_and_loses_nothing(model):
    """A stale free-page bound: the cache refuses a step for pages (``OutOfPagesError``, nothing changed). Its new
    prompts go back to the queue front, the step is planned again next time, and every request gives its solo
    tokens (no request fails, none is duplicated)."""
    from trtllm_diffkv.paged.cache import OutOfPagesError

    prompts = _prompts((10, 7, 12), seed=32)
    ex = make(model)
    refused = _refuse_once(ex, OutOfPagesError("simulated: a stale bound"),
                           lambda batch: len(batch.context_requests) == 2 and batch.generation_requests)
    got = drive(ex, {0: [(0, prompts[0], _greedy(6))], 2: [(1, prompts[1], _greedy(5)), (2, prompts[2], _greedy(4))]})
    assert len(refused) == 1 and len(refused[0]) == 3
    for key, n in ((0, 6), (1, 5), (2, 4)):
        assert got[key][1].finish_reason == "length" and got[key][0] == solo(model, CFG, prompts[key], _greedy(n))[0]


class CharTokenizer:
    """Token id i decodes to letter ``chr(97 + i % 26)``; id 0 is the EOS (a special token, skipped)."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids if not (skip_special_tokens and i == 0))


def test_stop_ids_and_stop_strings(model):
    prompt = _prompts((11,), seed=10)[0]
    base = solo(model, CFG, prompt, _greedy(12))[0]
    k = next(i for i in range(2, 12) if base[i] not in base[:i])  # a token first seen at position k
    ex = make(model, tokenizer=CharTokenizer())
    text = CharTokenizer().decode(base)
    stop = text[k - 1:k + 1]  # spans tokens k-1 and k
    first = text.find(stop)
    got = drive(ex, {0: [("id", prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[base[k]])),
                         ("str", prompt, SamplingParams(max_tokens=12, temperature=0, stop=stop)),
                         ("len", prompt, _greedy(12))]})
    result = got["id"][1].result
    assert got["id"][0] == base[:k + 1] and result.finish_reason == "stop" and result.stop_token_id == base[k]
    assert result.text == text[:k]
    string = got["str"][1].result
    assert string.finish_reason == "stop" and string.stop_token_id is None and string.text == text[:first]
    assert got["str"][1].stop_reason == stop and got["id"][1].stop_reason == base[k]
    assert got["str"][0] == base[:len(got["str"][0])] and first + len(stop) <= len(got["str"][0]) <= k + 1
    assert got["len"][1].result.finish_reason == "length" and got["len"][1].result.text == text


def test_random_traffic_edge_case_9(model):
    """Many random requests (lengths around page capacities), random sampling, random aborts; small pool."""
    rng = random.Random(0)
    ex = make(model, CFG, num_pages=130, max_batch_size=6)
    fmt = ex.cache.page_format
    caps = [fmt.high_tokens_per_page, fmt.low_tokens_per_page]
    lengths = [rng.choice([c * m for c in caps for m in (1, 2, 3)] + list(range(1, 30))) for _ in range(24)]
    arrivals, aborts = {}, {}
    for key, n in enumerate(lengths):
        params = SamplingParams(max_tokens=rng.randint(1, 10), temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([0, 5]),
                                seed=rng.randint(0, 99))
        arrivals.setdefault(rng.randint(0, 20), []).append((key, _prompts((n,), seed=key)[0], params))
        if rng.random() < 0.2:
            aborts.setdefault(rng.randint(0, 25), []).append(key)
    aborts = {s: [k for k in keys if any(k == a[0] for t in range(s + 1) for a in arrivals.get(t, []))]
              for s, keys in aborts.items()}
    got = drive(ex, arrivals, aborts)
    assert ex.stats()["preemptions"] > 0
    reasons = [u.finish_reason for _, u in got.values()]
    assert set(reasons) <= {"length", "abort"} and "abort" in reasons
    for key, (streamed, update) in got.items():
        assert update.result.token_ids == streamed
        params = arrivals_params(arrivals)[key]
        assert len(streamed) == params.max_tokens if update.finish_reason == "length" else len(streamed) < params.max_tokens


def test_seeded_sampling_is_independent_of_the_batch(model):
    prompt, other = _prompts((9, 15), seed=11)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=1234)
    alone = solo(model, CFG, prompt, params)[0]
    got = drive(make(model), {0: [("other", other, SamplingParams(max_tokens=8, temperature=1.0))],
                              1: [("seeded", prompt, params)]})
    assert got["seeded"][0] == alone


def test_requests_added_and_aborted_from_another_thread(model):
    """A serving thread steps; the caller's thread adds and aborts (one lock): aborted pages come back."""
    ex = make(model)
    prompts = _prompts((9, 12, 15, 8), seed=15)
    finals, stop = {}, threading.Event()

    def serve():
        while not stop.is_set() or ex.has_unfinished():
            for update in ex.step():
                if update.finished:
                    finals[update.request_id] = update

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        ids = [ex.add_request(p, _greedy(100 if k % 2 else 12)) for k, p in enumerate(prompts)]
        ex.abort(ids[1])
        ex.abort(ids[3])
    finally:
        stop.set()
        thread.join(120)
    assert not thread.is_alive()
    assert [finals[i].finish_reason for i in ids] == ["length", "abort", "length", "abort"]
    assert finals[ids[0]].result.token_ids == solo(model, CFG, prompts[0], _greedy(12))[0]
    check_pool(ex)
    assert ex.cache.manager.free_pages() == 2000


def test_stats_report_pool_fraction_and_bookkeeping(model):
    prompts = _prompts((24, 17), seed=12)
    ex = make(model)
    reads, read = [], ex._start_read
    ex._start_read = lambda values: reads.append(values.numel()) or read(values)  # the step's device-to-host read
    ex.cache.step_errors = None  # the error flags must come with that one read, not from a separate one
    for p in prompts:
        ex.add_request(p, _greedy(6))
    for _ in range(3):
        ex.step()
    assert reads == [2 + ex.max_batch_size + 2] * 3  # tokens + per-slot error flags + ring counters
    stats = ex.stats()
    cache = ex.cache
    tokens = sum(len(p) + 3 - 1 for p in prompts)  # 3 tokens generated, the last one not yet stored
    fp16_bytes = tokens * cache.num_layers * cache.num_kv_heads * 2 * cache.head_dim * 2
    held = int(cache.manager.pages.sum())
    meta = 2 * cache.rows_per_slot * cache.row_meta.format.row_bytes
    assert stats["used_pages"] == held and stats["free_pages"] == 2000 - held
    assert stats["used_bytes"] == held * cache.page_format.page_size_bytes + meta
    assert stats["kv_memory_fraction"] == pytest.approx(stats["used_bytes"] / fp16_bytes)
    assert stats["running"] == 2 and stats["waiting"] == 0 and stats["mean_batch_size"] == 2
    assert 0 < stats["bookkeeping_fraction"] < 1 and stats["output_tokens_per_s"] > 0


def test_triton_interpreter_path_matches_torch_path():
    """The executor on the Triton kernels (interpreter): same greedy tokens as the torch path, pages back."""
    pytest.importorskip("triton")
    from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4

    patch_interpreter_for_numpy_2_4()
    model = random_llama(0, vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, max_position_embeddings=256)
    prompts = _prompts((7, 5), seed=13, vocab=128)
    arrivals = {0: [(0, prompts[0], _greedy(3))], 1: [(1, prompts[1], _greedy(3))]}
    want = drive(make(model, CFG, num_pages=200, max_seq_len=32), arrivals)
    got = drive(make(model, CFG, num_pages=200, max_seq_len=32, use_triton=True), arrivals)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}


def test_fp16_request_that_can_never_finish_is_refused_before_any_token(model):
    """Without tiers the end is known: a request whose last decode step can never be planned, even alone, fails at
    admission (it used to be admitted, stream tokens, then fail); one that just fits runs to its end."""
    ex = make(model, FP16, num_pages=60)
    rows = ex.cache.rows_per_slot  # 3 layers x 2 KV heads = 6 rows; TPP = 4 tokens per page
    fits = 4 * (60 - ex.rm.decode_pages_needed(1)) // rows  # tokens held before the last step when it still fits
    got = drive(ex, {0: [("ok", _prompts((fits - 8,))[0], _greedy(9)),
                         ("never", _prompts((fits - 8,), seed=2)[0], _greedy(9 + 2 * TPP))]})
    assert got["ok"][1].finish_reason == "length" and len(got["ok"][0]) == 9
    assert got["never"][1].finish_reason == "error" and got["never"][0] == []
    assert "by its last decode step" in got["never"][1].error
    check_pool(ex)
    assert ex.cache.manager.free_pages() == 60


def test_unhashable_request_id_is_a_value_error(model):
    ex = make(model, FP16, num_pages=60)
    with pytest.raises(ValueError, match="hashable"):
        ex.add_request([1, 2, 3], _greedy(2), request_id=["a"])
    assert not ex.has_unfinished()


def test_the_executor_takes_one_engine_config():
    """Issue 40: the sizes and backends travel as one EngineConfig, not as a long parameter list."""
    params = [name for name in inspect.signature(Executor.__init__).parameters if name != "self"]
    assert params[:4] == ["model", "model_config", "kv_config", "engine_config"] and len(params) <= 8


def _count_kv_checks(monkeypatch) -> list:
    calls, real = [], DiffKVConfig.validate_for_model

    def spy(self, head_dim, num_heads, num_kv_heads, num_layers=None):
        calls.append((head_dim, num_heads, num_kv_heads))
        return real(self, head_dim, num_heads, num_kv_heads, num_layers)

    monkeypatch.setattr(DiffKVConfig, "validate_for_model", spy)
    return calls


def test_an_executor_checks_its_kv_config_once_and_still_refuses_a_bad_one(model, monkeypatch):
    calls, mc = _count_kv_checks(monkeypatch), model.config
    engine = EngineConfig(max_batch_size=2, max_seq_len=64, kv_memory_bytes=1 << 22, use_triton=False)
    Executor(model, mc, CFG, engine)  # the executor, its resource manager and its cache
    assert calls == [(mc.head_dim, mc.num_heads, mc.num_kv_heads)]
    wrong = DiffKVConfig(calibrated_for=(mc.num_heads, mc.num_kv_heads, 2 * mc.head_dim))
    with pytest.raises(ValueError, match=f"calibrated for head_dim={2 * mc.head_dim}; this model has head_dim="):
        Executor(model, mc, wrong, engine)
