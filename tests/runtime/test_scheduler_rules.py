"""The scheduler's documented rules, one by one, on a host-only pool (runtime/scheduler.py's docstring).

The end-to-end executor tests only see final outputs and preemption counts; these check *which*
request is preempted (the most recently admitted: ``running[-1]``), *when* the free-page estimate
is re-read (only when it refuses after a release), and the queue order after a refused plan.
The pool is :class:`CountingPool`: a page count per request, ``free = pool - held`` read exactly,
every read of the true free count counted (on the GPU it is a device read).
"""
import pytest

from trtllm_diffkv.runtime.request import Request, RequestState
from trtllm_diffkv.runtime.scheduler import Scheduler
from trtllm_diffkv.runtime.sampling import SamplingParams


class CountingPool:
    """The resource-manager calls the scheduler makes, over ``num_pages`` pages.

    A decode step of ``n`` requests may take ``decode_pages_per_request * n`` pages; a prefill of
    ``t`` tokens reserves ``t`` pages. ``held`` maps a request id to its pages (set by the test).
    """

    def __init__(self, num_pages, decode_pages_per_request=1):
        self.num_pages, self.per_request = num_pages, decode_pages_per_request
        self.held, self.free_reads, self.released = {}, 0, []

    def get_max_resource_count(self):
        return self.num_pages

    def decode_pages_needed(self, num_requests):
        return self.per_request * num_requests

    def prefill_pages_needed(self, num_tokens):
        return num_tokens

    def free_pages(self):
        self.free_reads += 1
        return self.num_pages - sum(self.held.values())

    def free_resources(self, request):
        self.released.append(request.request_id)
        self.held.pop(request.request_id, None)
        request.slot = None


def _request(rid, prompt_len, generated=0):
    r = Request(request_id=rid, prompt_token_ids=list(range(prompt_len)), sampling_params=SamplingParams())
    r.prefill_token_ids = list(r.prompt_token_ids)
    r.output_token_ids = list(range(100, 100 + generated))
    return r


def _running(scheduler, pool, held):
    """Put requests with ``held`` = {id: (pages, prompt_len, generated)} in ``running``, in this order."""
    for slot, (rid, (pages, prompt_len, generated)) in enumerate(held.items()):
        r = _request(rid, prompt_len, generated)
        r.state, r.slot, pool.held[rid] = RequestState.RUNNING, slot, pages
        scheduler.running.append(r)
    scheduler.observe_free(pool.num_pages - sum(pool.held.values()))
    pool.free_reads = 0


def test_the_most_recently_admitted_request_is_preempted():
    pool = CountingPool(num_pages=20)
    s = Scheduler(pool, max_batch_size=8, max_num_tokens=64)
    # 18 pages held, 2 free: a decode step of 3 requests needs 3, of 2 needs 2 -> exactly one preemption
    _running(s, pool, {"old": (6, 5, 2), "mid": (6, 5, 3), "new": (6, 4, 1)})
    s.add(_request("queued", 3))
    batch, rejected = s.schedule()
    assert rejected == [] and s.preemptions == 1
    assert pool.released == ["new"]                                     # running[-1], not running[0]
    assert [r.request_id for r in batch.generation_requests] == ["old", "mid"]
    assert [r.request_id for r in s.running] == ["old", "mid"] and batch.context_requests == []
    assert [r.request_id for r in s.waiting] == ["new", "queued"]       # back at the FRONT of the queue
    victim = s.waiting[0]
    assert victim.state is RequestState.WAITING and victim.slot is None and victim.num_preemptions == 1
    assert victim.prefill_token_ids == [0, 1, 2, 3, 100]                 # prompt + generated: recomputation


def test_preemption_goes_newest_first_until_the_step_fits():
    pool = CountingPool(num_pages=20, decode_pages_per_request=3)
    s = Scheduler(pool, max_batch_size=8, max_num_tokens=64)
    # 17 held, 3 free: 4 requests need 12; 3 need 9 > 3 + 4; 2 need 6 <= 3 + 4 + 4 -> two preempted
    _running(s, pool, {"a": (5, 2, 0), "b": (4, 2, 0), "c": (4, 2, 0), "d": (4, 2, 0)})
    batch, _ = s.schedule()
    assert pool.released == ["d", "c"] and s.preemptions == 2
    assert [r.request_id for r in s.waiting] == ["c", "d"]               # the earlier-admitted one first
    assert [r.request_id for r in batch.generation_requests] == ["a", "b"]


def test_the_estimate_is_reread_once_after_a_release_and_only_when_it_refuses():
    pool = CountingPool(num_pages=20)
    s = Scheduler(pool, max_batch_size=8, max_num_tokens=64)
    _running(s, pool, {"a": (12, 4, 1), "b": (6, 4, 1)})                  # 2 free, estimate 2
    s.add(_request("w", 8))                                                # needs 8 + decode reserve 2 = 10
    batch, _ = s.schedule()                                                # nothing released: no re-read
    assert batch.context_requests == [] and pool.free_reads == 0 and s.free_estimate == 2
    s.remove(s.running[0])                                                 # "a" finishes: 12 pages back
    assert pool.free_reads == 0 and s.free_estimate == 2                   # a release alone reads nothing
    batch, _ = s.schedule()                                                # the estimate refuses -> one read
    assert [r.request_id for r in batch.context_requests] == ["w"]         # admitted in this very step
    assert pool.free_reads == 1 and s.free_estimate == 14
    s.add(_request("x", 1))                                                # 1 + decode reserve 2 <= 14: no read
    s.observe_free(pool.free_pages())
    pool.free_reads = 0
    batch, _ = s.schedule()
    assert [r.request_id for r in batch.context_requests] == ["x"] and pool.free_reads == 0


def test_a_stale_estimate_is_not_reread_twice():
    pool = CountingPool(num_pages=20)
    s = Scheduler(pool, max_batch_size=8, max_num_tokens=64)
    _running(s, pool, {"a": (10, 4, 1), "b": (9, 4, 1)})                  # 1 free
    s.remove(s.running[1])                                                 # 9 back: 10 free, estimate still 1
    s.add(_request("big", 15))                                             # 15 + 1 > 10 even after the read
    s.add(_request("small", 1))
    batch, _ = s.schedule()
    assert batch.context_requests == [] and pool.free_reads == 1 and s.free_estimate == 10
    assert [r.request_id for r in s.waiting] == ["big", "small"]           # FIFO: the head blocks the rest
    s.schedule()
    assert pool.free_reads == 1                                            # fresh now: refusals read nothing


@pytest.mark.parametrize("num_new", [2, 3])
def test_unschedule_restores_the_queue_order_of_a_refused_plan(num_new):
    pool = CountingPool(num_pages=200)
    s = Scheduler(pool, max_batch_size=8, max_num_tokens=64)
    _running(s, pool, {"r0": (4, 3, 1)})
    names = [f"n{i}" for i in range(num_new)]
    for name in names + ["late"]:
        s.add(_request(name, 2))
    s.max_batch_size = 1 + num_new                                         # "late" stays queued
    batch, _ = s.schedule()
    assert [r.request_id for r in batch.context_requests] == names
    s.unschedule(batch)                                                    # prepare_resources refused the plan
    assert [r.request_id for r in s.waiting] == names + ["late"]           # as before: FIFO order kept
    assert [r.request_id for r in s.running] == ["r0"]
    assert all(r.state is RequestState.WAITING for r in s.waiting)
    again, _ = s.schedule()
    assert [r.request_id for r in again.context_requests] == names



def test_a_prompt_one_step_can_hold_waits_for_it_instead_of_being_chunked():
    """With chunked prefill, a prompt that fits a step beside the running decodes but not in what earlier prompts
    left waits for the next step (whole); one longer than a step is still chunked at once."""
    pool = CountingPool(num_pages=1000)
    pool.staging_bytes_needed = lambda n: 0
    pool.staging_fits = lambda new_bytes: True
    s = Scheduler(pool, max_batch_size=8, max_num_tokens=16)
    _running(s, pool, {"dec": (2, 3, 1)})                    # one decode: 15 tokens left per step
    for rid, n in (("a", 10), ("b", 10), ("long", 40)):
        s.add(_request(rid, n))
    batch, _ = s.schedule()
    assert [(r.request_id, r.prefill_chunk_tokens) for r in batch.context_requests] == [("a", 10)]
    assert [r.request_id for r in s.waiting] == ["b", "long"]  # b (10 <= 15) is not cut into 5 + 5
    for r in batch.context_requests:                          # a's prefill ran: it decodes from now on
        r.num_cached_tokens = r.prefill_chunk_tokens
    batch, _ = s.schedule()
    assert [(r.request_id, r.prefill_chunk_tokens) for r in batch.context_requests] == [("b", 10), ("long", 4)]


@pytest.mark.parametrize("seed", range(6))
def test_a_waiting_head_waits_only_behind_work_and_every_prompt_runs(seed):
    """No starvation from the whole-prompt wait: under random traffic (prompts of 1 .. 3 steps' tokens arriving
    while others decode), a queue head is left waiting with free pages and slots only in a step whose budget went
    to work ahead of it (half-prefilled prompts, prompts admitted before it); FIFO, so no later prompt runs first;
    and every request ends. A rule that ignored the decodes (``n <= max_num_tokens``) idles such a head in steps
    of decodes alone for as long as they run."""
    import random

    rng = random.Random(seed)
    M = rng.choice([8, 16, 33])
    pool = CountingPool(num_pages=10 ** 6)
    pool.staging_bytes_needed = lambda n: 0
    pool.staging_fits = lambda new_bytes: True
    s = Scheduler(pool, max_batch_size=4, max_num_tokens=M)
    out_len, order, started, next_id = {}, [], [], 0
    for step in range(3000):
        if step < 60 and rng.random() < 0.5:
            n = rng.choice([1, M // 2, M - 3, M - 1, M, M + 1, 3 * M, rng.randint(1, 3 * M)])
            r = _request(next_id, max(1, n))
            out_len[next_id], next_id = rng.randint(1, 40), next_id + 1
            order.append(r.request_id)
            s.add(r)
        if step >= 60 and not s.waiting and not s.running:
            break
        head = s.waiting[0] if s.waiting else None
        batch, rejected = s.schedule()
        assert rejected == []
        new = [r for r in batch.context_requests if r.num_cached_tokens == 0]
        started += [r.request_id for r in new]
        if head is not None and head not in new and len(s.running) < s.max_batch_size:
            assert batch.context_requests, f"step {step}: head {head.request_id} waits in a step with no prefill"
        for r in batch.context_requests:
            r.num_cached_tokens += r.prefill_chunk_tokens
            r.slot, pool.held[r.request_id] = 0, 1
        for r in batch.generation_requests + [r for r in new if not r.prefill_in_progress]:
            r.output_token_ids.append(1)
            r.num_cached_tokens += r in batch.generation_requests
            if len(r.output_token_ids) >= out_len[r.request_id]:
                s.remove(r)
    assert not s.waiting and not s.running and started == order  # all ran, in arrival order
