"""Admission by free pages and preemption by recomputation: the executor's scheduler (host bookkeeping only).

:class:`Scheduler` holds the waiting queue (FIFO) and the running requests (in admission
order) and decides each step's :class:`~.resource_manager.ScheduledBatch` from the page
manager's sizing rules, read through :class:`~.resource_manager.DiffKVResourceManager`:

* decode: every running request decodes one token; the step may take up to
  ``worst_case_decode_pages(n)`` pages (one per tier per (layer, KV head) row). When that
  exceeds the free pages, the most recently admitted request is preempted by recomputation:
  its pages are freed and it goes back to the FRONT of the queue with prompt + generated
  tokens as its next prefill (vLLM's ``RECOMPUTE`` mode; nothing lost or duplicated). A
  request that does not fit even alone cannot run at all: it is rejected.
* admission: unless a request was preempted in this step, waiting requests join in FIFO
  order while their prefill reserve (``reserve_pages_needed``) plus the decode worst case fits
  in the free pages, within ``max_batch_size`` and ``max_num_tokens``; the queue head blocks
  the others (no overtaking). A head that cannot fit in an empty pool is rejected.

Free pages: :attr:`Scheduler.free_estimate` is the true count read with the last step's status
(:meth:`observe_free`), a lower bound since then (releases only add pages); it is re-read once
(:meth:`DiffKVResourceManager.free_pages`, a device read on the GPU) only when it refuses.
"""
from __future__ import annotations

from collections import deque

from ..paged.cache import OutOfPagesError
from .request import Request, RequestState
from .resource_manager import DiffKVResourceManager, ScheduledBatch


class Scheduler:
    """FIFO admission by free pages, preemption by recomputation (module docstring).

    Args:
        rm: the resource manager (pages, slots).
        max_batch_size: most requests in a step.
        max_num_tokens: most tokens in a step (prefill tokens + one per decode request).

    Attributes:
        waiting: queued requests (FIFO; preempted ones go to the front).
        running: requests with tokens in the cache, in admission order.
        free_estimate: a lower bound on the free pages (see the module docstring).
        preemptions: requests preempted so far.
    """

    def __init__(self, rm: DiffKVResourceManager, max_batch_size: int, max_num_tokens: int) -> None:
        self.rm, self.max_batch_size, self.max_num_tokens = rm, max_batch_size, max_num_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_estimate, self._stale = rm.get_max_resource_count(), False
        self.preemptions = 0

    def add(self, request: Request) -> None:
        """Queue a new request at the back."""
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and give back every page it holds (finish, failure, abort)."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        if request.slot is not None:
            self.rm.free_resources(request)
            self._stale = True

    def observe_free(self, free_pages: int) -> None:
        """The true free page count (read after a step, or after a refused plan)."""
        self.free_estimate, self._stale = free_pages, False

    def schedule(self) -> tuple[ScheduledBatch, list[tuple[Request, Exception]]]:
        """The next step's batch, and the requests that can never fit (already removed; the caller fails them).

        Running requests become the batch's generation requests (after any preemption);
        admitted ones its context requests, marked ``RUNNING`` and appended to :attr:`running`.
        """
        rejected, preempted = [], False
        while self.running and not self._fits(self.rm.decode_pages_needed(len(self.running))):
            victim = self.running[-1]
            if len(self.running) > 1:
                self._preempt(victim)
                preempted = True
                continue
            total, held = self.rm.get_max_resource_count(), self.rm.get_max_resource_count() - self.free_estimate
            rejected.append((victim, OutOfPagesError(
                f"the request needs more pages than the whole pool: it holds {held} pages after "
                f"{victim.num_cached_tokens} tokens and a decode step may take {self.rm.decode_pages_needed(1)} "
                f"more; the pool has {total}")))
            self.remove(victim)
        batch = ScheduledBatch(generation_requests=list(self.running))
        if not preempted:
            self._admit(batch, rejected)
        self.running.extend(batch.context_requests)
        return batch, rejected

    def unschedule(self, batch: ScheduledBatch) -> None:
        """Put a batch's context requests back at the queue front (its plan was refused; nothing changed)."""
        for request in reversed(batch.context_requests):
            self.running.remove(request)
            request.state = RequestState.WAITING
            self.waiting.appendleft(request)

    def _admit(self, batch: ScheduledBatch, rejected: list) -> None:
        tokens, reserve = batch.num_tokens, self.rm.decode_pages_needed(len(batch.generation_requests))
        while self.waiting and batch.batch_size < self.max_batch_size:
            request = self.waiting[0]
            n = len(request.prefill_token_ids)
            if tokens + n > self.max_num_tokens:
                return
            need = reserve + self.rm.prefill_pages_needed(n)
            if not self._fits(need):
                if self.running or batch.context_requests:
                    return  # FIFO: the head waits for pages, nobody overtakes it
                rejected.append((request, OutOfPagesError(
                    f"the request needs {need} pages to prefill {n} tokens; the whole pool has "
                    f"{self.rm.get_max_resource_count()}")))
                self.waiting.popleft()
                continue
            self.waiting.popleft()
            request.state = RequestState.RUNNING
            batch.context_requests.append(request)
            tokens, reserve = tokens + n, need

    def _fits(self, pages: int) -> bool:
        """Whether ``pages`` are free: the lower bound, re-read once when it refuses after releases."""
        if pages <= self.free_estimate:
            return True
        if self._stale:
            self.observe_free(self.rm.free_pages())
        return pages <= self.free_estimate

    def _preempt(self, request: Request) -> None:
        """Preemption by recomputation: every page back, to the queue front with prompt + generated tokens."""
        self.remove(request)
        request.state = RequestState.WAITING
        request.prefill_token_ids = request.prompt_token_ids + request.output_token_ids
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.preemptions += 1
