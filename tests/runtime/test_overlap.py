"""The overlap scheduler (``Executor(disable_overlap_scheduler=False)``) on the CPU, against the same executor
reading every step before it returns (the default on the CPU).

With the overlap a decode step is launched before the previous one is read; its input ids are the previous
step's sampled tokens on the device. Outputs must be the unoverlapped run's token for token (greedy, and seeded
sampling, whose draws depend only on the seed and the logits), every page must come back, and after every step
the pool must agree with the running requests (``check_pool``). The CPU gains no time from it; what is checked
here is the bookkeeping (lengths, pages, stops, aborts, failures) the GPU run relies on.
"""
import random

import pytest

from test_executor import (CFG, FP16, CharTokenizer, _greedy, _prompts, arrivals_params, check_pool, drive, make,
                           model, solo)  # noqa: F401 (fixture)
from trtllm_diffkv.engine_config import EngineConfig
from trtllm_diffkv.runtime.executor import Executor
from trtllm_diffkv.runtime.resource_manager import DiffKVResourceManager
from trtllm_diffkv.runtime.sampling import SamplingParams

OVERLAP = dict(disable_overlap_scheduler=False)


@pytest.fixture(autouse=True)
def free_bound(monkeypatch):
    """After every step of ``drive`` (and here): besides ``check_pool``, the scheduler's free-page bound, which
    the plan trusts instead of reading the count, is at most the true count (on the CPU a launched step has
    taken its pages already)."""
    import test_executor

    base = test_executor.check_pool

    def check(ex):
        base(ex)
        assert ex.scheduler.free_estimate <= ex.rm.free_pages()

    monkeypatch.setattr(test_executor, "check_pool", check)
    globals()["check_pool"] = check
    yield
    globals()["check_pool"] = base


def _same_results(got, want, fields=("kv_cache_bytes", "high_fraction", "low_fraction", "pruned_fraction")):
    assert got.keys() == want.keys()
    for key, (streamed, update) in got.items():
        assert streamed == want[key][0], key
        assert update.finish_reason == want[key][1].finish_reason and update.result.token_ids == streamed, key
        if update.finish_reason == "length":  # a request reaching max_tokens never runs the speculative step
            for field in fields:
                assert getattr(update.result, field) == getattr(want[key][1].result, field), (key, field)


@pytest.mark.parametrize("kv_config, max_batch_size", [(CFG, 8), (CFG, 2), (FP16, 3)])
def test_overlapped_steps_equal_unoverlapped_ones(model, kv_config, max_batch_size):
    prompts = _prompts((20, 7, 33, 1, 12))
    arrivals = {0: [(0, prompts[0], _greedy(10)), (1, prompts[1], _greedy(6))], 2: [(2, prompts[2], _greedy(9))],
                3: [(3, prompts[3], _greedy(8))], 7: [(4, prompts[4], _greedy(5))]}
    want = drive(make(model, kv_config, max_batch_size=max_batch_size), arrivals)
    ex = make(model, kv_config, max_batch_size=max_batch_size, **OVERLAP)
    got = drive(ex, arrivals)
    _same_results(got, want)
    stats = ex.stats()
    assert stats["overlapped_steps"] > 0 and stats["output_tokens"] == 10 + 6 + 9 + 8 + 5
    assert make(model, kv_config).stats()["overlapped_steps"] == 0


def test_a_request_arriving_during_the_overlap_is_admitted_at_once(model):
    """A waiting request that fits ends the overlap for a step: the next call prefills it (its first token), it
    does not wait for the running request's end."""
    long, late = _prompts((10, 8), seed=3)
    ex = make(model, **OVERLAP)
    first = ex.add_request(long, _greedy(30))
    updates = []
    for _ in range(4):
        updates += ex.step()
    assert ex.stats()["overlapped_steps"] > 0 and ex._inflight is not None
    second = ex.add_request(late, _greedy(3))
    now = ex.step()
    assert [len(u.new_token_ids) for u in now if u.request_id == second] == [1]  # its prefill sampled a token
    updates += now
    while ex.has_unfinished():
        updates += ex.step()
        check_pool(ex)
    tokens = {rid: [t for u in updates if u.request_id == rid for t in u.new_token_ids] for rid in (first, second)}
    assert tokens[second] == solo(model, CFG, late, _greedy(3))[0]
    assert tokens[first] == solo(model, CFG, long, _greedy(30))[0]
    assert ex.requests == {} and ex.cache.manager.free_pages() == ex.cache.manager.num_pages


def test_stop_ids_and_strings_drop_the_speculative_token(model):
    """A request that stops on an id or a string in the step being read also ran the step launched before the
    read: that token never reaches the caller, and its pages come back."""
    prompt = _prompts((11,), seed=10)[0]
    base = solo(model, CFG, prompt, _greedy(12))[0]
    k = next(i for i in range(2, 12) if base[i] not in base[:i])
    text = CharTokenizer().decode(base)
    stop = text[k - 1:k + 1]
    arrivals = {0: [("id", prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[base[k]])),
                    ("str", prompt, SamplingParams(max_tokens=12, temperature=0, stop=stop)),
                    ("len", prompt, _greedy(12))]}
    want = drive(make(model, tokenizer=CharTokenizer()), arrivals)
    ex = make(model, tokenizer=CharTokenizer(), **OVERLAP)
    got = drive(ex, arrivals)
    _same_results(got, want)
    assert got["id"][0] == base[:k + 1] and got["id"][1].result.text == want["id"][1].result.text == text[:k]
    assert got["str"][1].stop_reason == stop and got["str"][1].result.text == want["str"][1].result.text
    assert ex.stats()["overlapped_steps"] > 0


NUM_PAGES = 130


def test_random_traffic_with_aborts_and_preemption(model):
    """Seeded sampling, random lengths and aborts, a small pool (preemptions): every request streamed the
    unoverlapped run's tokens (FP16, whose outputs do not depend on the batch nor on a re-prefill after a
    preemption; DiffKV's re-prefill compacts differently); pages agree after every step and all come back."""
    rng = random.Random(0)
    lengths = [rng.choice([4, 8, 13, 26, 1, 17, 29]) for _ in range(20)]
    arrivals, aborts = {}, {}
    for key, n in enumerate(lengths):
        params = SamplingParams(max_tokens=rng.randint(1, 10), temperature=rng.choice([0.0, 0.8]),
                                top_k=rng.choice([0, 5]), seed=rng.randint(0, 99))
        arrivals.setdefault(rng.randint(0, 20), []).append((key, _prompts((n,), seed=key)[0], params))
        if rng.random() < 0.2:
            aborts.setdefault(rng.randint(0, 25), []).append(key)
    aborts = {s: [k for k in keys if any(k == a[0] for t in range(s + 1) for a in arrivals.get(t, []))]
              for s, keys in aborts.items()}
    want = drive(make(model, FP16, num_pages=NUM_PAGES, max_batch_size=6), arrivals)  # no aborts: every token
    ex = make(model, FP16, num_pages=NUM_PAGES, max_batch_size=6, **OVERLAP)
    got = drive(ex, arrivals, aborts)
    stats = ex.stats()
    assert stats["preemptions"] > 0 and stats["overlapped_steps"] > 0
    reasons = [u.finish_reason for _, u in got.values()]
    assert set(reasons) <= {"length", "abort"} and "abort" in reasons
    for key, (streamed, update) in got.items():
        assert update.result.token_ids == streamed
        full = want[key][0]
        assert streamed == full if update.finish_reason == "length" else streamed == full[:len(streamed)], key


def test_abort_of_a_request_in_flight_returns_its_pages_at_once(model):
    a, b = _prompts((9, 14), seed=4)
    ex = make(model, **OVERLAP)
    ids = [ex.add_request(p, _greedy(12)) for p in (a, b)]
    streamed = {i: [] for i in ids}
    for _ in range(5):
        for u in ex.step():
            streamed[u.request_id] += u.new_token_ids
    assert ex._inflight is not None and len(ex._inflight.sampled) == 2
    ex.abort(ids[0])
    check_pool(ex)  # its slot and pages are free now, its step still in flight
    finals = {}
    while ex.has_unfinished():
        for u in ex.step():
            assert u.request_id not in finals
            streamed[u.request_id] += u.new_token_ids
            if u.finished:
                finals[u.request_id] = u
        check_pool(ex)
    assert finals[ids[0]].finish_reason == "abort" and finals[ids[1]].finish_reason == "length"
    assert streamed[ids[1]] == solo(model, CFG, b, _greedy(12))[0]
    assert streamed[ids[0]] == solo(model, CFG, a, _greedy(12))[0][:len(streamed[ids[0]])]
    assert ex.cache.manager.free_pages() == ex.cache.manager.num_pages


def test_a_failing_overlapped_step_fails_its_requests_and_the_executor_goes_on(model):
    ex = make(model, **OVERLAP)
    forward, calls = ex._forward, []

    def failing(batch, graphs=None, input_ids=None):
        if input_ids is not None:
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("planted")
        return forward(batch, graphs, input_ids)

    ex._forward = failing
    a, b = _prompts((9, 14), seed=5)
    got = drive(ex, {0: [("a", a, _greedy(10))], 1: [("b", b, _greedy(10))]})
    assert {u.finish_reason for _, u in got.values()} == {"error"} and all("planted" in u.error for _, u in got.values())
    for key, prompt in (("a", a), ("b", b)):
        assert got[key][0] == solo(model, CFG, prompt, _greedy(10))[0][:len(got[key][0])]
    later = drive(ex, {0: [("c", a, _greedy(6))]})  # the executor still serves
    assert later["c"][0] == solo(model, CFG, a, _greedy(6))[0]


def test_history_reading_draws_and_logprobs_are_not_overlapped(model):
    """A repetition or presence penalty reads the tokens so far on the host, logprobs need a second copy: a step
    with such a request is read before the next one is planned (same outputs, no overlapped step)."""
    a, b = _prompts((9, 14), seed=6)
    for params in (SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3),
                   SamplingParams(max_tokens=8, temperature=0, presence_penalty=0.5),
                   SamplingParams(max_tokens=8, temperature=0, logprobs=2)):
        arrivals = {0: [("x", a, params), ("plain", b, _greedy(8))]}
        want = drive(make(model), arrivals)
        ex = make(model, **OVERLAP)
        got = drive(ex, arrivals)
        _same_results(got, want)
        assert ex.stats()["overlapped_steps"] == 0
        if params.logprobs is not None:
            assert got["x"][1].logprobs is not None and got["x"][1].logprobs == want["x"][1].logprobs


def test_the_option_is_checked(model):
    with pytest.raises(ValueError, match="disable_overlap_scheduler"):
        make(model, disable_overlap_scheduler="no")

    class TwoRanks:  # a multi-process hook: reads each step's status on every rank before the next
        def resource_manager(self, *args, **kwargs):
            return DiffKVResourceManager(*args, **kwargs)

        def step_status(self, status, num_requests):
            return status

    with pytest.raises(ValueError, match="tensor-parallel"):
        Executor(model, model.config, CFG, EngineConfig(max_batch_size=2, max_seq_len=64, kv_memory_bytes=1 << 24,
                                                        use_triton=False, disable_overlap_scheduler=False),
                 parallel=TwoRanks())
    assert not Executor(model, model.config, CFG, EngineConfig(max_batch_size=2, max_seq_len=64, kv_memory_bytes=1 << 24,
                                                               use_triton=False), parallel=TwoRanks()).overlap_steps
    assert not make(model).overlap_steps and make(model, **OVERLAP).overlap_steps


def _failing_at(ex, request_id, position):
    """``ex._forward`` raising for the decode step of ``request_id`` at cache length ``position``."""
    forward = ex._forward

    def failing(batch, graphs=None, input_ids=None):
        if any(r.request_id == request_id and r.num_cached_tokens == position for r in batch.generation_requests):
            raise RuntimeError("planted")
        return forward(batch, graphs, input_ids)

    ex._forward = failing


def test_a_failed_launch_fails_its_requests_after_the_step_in_flight_is_read(model):
    """Breaker finding: the launch of the next step failed before the in-flight step was read, and its requests
    were failed at once: A, which had sampled its stop id in the in-flight step, ended "error" instead of "stop",
    and B's good token of that step was never streamed. Now the in-flight step is read first."""
    pa, pb = _prompts((11, 11), seed=10)
    base = solo(model, CFG, pa, _greedy(12))[0]
    k = next(i for i in range(2, 12) if base[i] not in base[:i])
    params = {"A": SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[base[k]]), "B": _greedy(12)}
    runs = {}
    for overlap in (False, True):
        ex = make(model, disable_overlap_scheduler=not overlap)
        _failing_at(ex, "B", len(pb) + k)  # B's step after the one where A samples its stop id
        ex.add_request(pa, params["A"], request_id="A")
        ex.add_request(pb, params["B"], request_id="B")
        out, final = {"A": [], "B": []}, {}
        while ex.has_unfinished():
            for u in ex.step():
                out[u.request_id] += u.new_token_ids
                if u.finished:
                    final[u.request_id] = u.finish_reason
            check_pool(ex)
        runs[overlap] = out, final
        assert ex.cache.manager.free_pages() == ex.cache.manager.num_pages
    assert runs[True] == runs[False]
    assert runs[True][1] == {"A": "stop", "B": "error"} and runs[True][0]["A"] == base[:k + 1]
    assert len(runs[True][0]["B"]) == k + 1


def test_a_waiting_request_within_the_in_flight_worst_case_is_admitted_at_once(model):
    """Breaker finding: the overlap's admission test compared the queue head with the free bound less the
    in-flight step's worst case, so a head that fits the true count waited until a running request ended. Pool:
    B's prefill reserve + the decode worst case equals the free count exactly."""
    long_prompt, late = _prompts((8, 20), seed=3)
    firsts = {}
    for overlap in (False, True):
        ex = make(model, FP16, num_pages=66, max_batch_size=4, disable_overlap_scheduler=not overlap)
        ex.add_request(long_prompt, _greedy(30), request_id="A")
        step = 0
        while ex.has_unfinished() or step <= 4:
            if step == 4:
                ex.add_request(late, _greedy(3), request_id="B")
            for u in ex.step():
                if u.request_id == "B" and u.new_token_ids:
                    firsts.setdefault(overlap, step)
            check_pool(ex)
            step += 1
    assert firsts == {False: 4, True: 4}


def test_the_last_final_update_leaves_nothing_unfinished(model):
    """Breaker finding: an abort during the step that returns the last final update left the (now empty) step in
    flight, and ``has_unfinished()`` stayed true for one more empty step."""
    ex = make(model, **OVERLAP)
    rid = ex.add_request(_prompts((9,), seed=2)[0], _greedy(20))
    for _ in range(4):
        ex.step()
    assert ex._inflight is not None
    forward = ex._forward

    def aborting(*args, **kwargs):  # stands for ex.abort(rid) from another thread while the step runs
        ex.abort(rid)
        return forward(*args, **kwargs)

    ex._forward = aborting
    updates = ex.step()
    ex._forward = forward
    assert [u.finish_reason for u in updates if u.finished] == ["abort"]
    assert not ex.has_unfinished() and ex._inflight is None
    assert ex.cache.manager.free_pages() == ex.cache.manager.num_pages


def test_step_time_includes_the_settle_of_the_step_in_flight(model):
    """Breaker finding: an overlapped step's time stopped before the in-flight step was read and settled, so
    ``output_tokens_per_s`` over-counted; ``step_s`` now holds every call's whole time."""
    import time

    ex = make(model, **OVERLAP)
    slow = ex.rm.update_resources

    def slowed(*args, **kwargs):
        time.sleep(0.02)
        return slow(*args, **kwargs)

    ex.rm.update_resources = slowed
    ex.add_request(_prompts((9,), seed=2)[0], _greedy(12))
    t0 = time.perf_counter()
    while ex.has_unfinished():
        ex.step()
    wall = time.perf_counter() - t0
    stats = ex.stats()
    assert stats["overlapped_steps"] > 5
    assert stats["output_tokens_per_s"] <= 12 / (wall * 0.8)  # within the step() calls' own time
    assert ex._totals["step_s"] >= 12 * 0.02 * 0.9
