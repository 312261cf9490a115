"""Admission by free pages and preemption by recomputation: the executor's scheduler (host bookkeeping only).

:class:`Scheduler` holds the waiting queue (FIFO) and the running requests (in admission
order) and decides each step's :class:`~.resource_manager.ScheduledBatch` from the page
manager's sizing rules, read through :class:`~.resource_manager.DiffKVResourceManager`:

* decode: every running request decodes one token; the step may take up to
  ``decode_pages_needed(n)`` pages (one per tier per (layer, KV head) row; one per row for a
  policy that keeps every token high, e.g. ``fp16``). When that
  exceeds the free pages, the most recently admitted request is preempted by recomputation:
  its pages are freed and it goes back to the FRONT of the queue with prompt + generated
  tokens as its next prefill (vLLM's ``RECOMPUTE`` mode; nothing lost or duplicated). A
  request that does not fit even alone cannot run at all: it is rejected.
* chunked prefill (``enable_chunked_prefill``, TensorRT-LLM's and vLLM's order): the step's
  ``max_num_tokens`` go first to the running decodes (one token each), then to the prompts
  already half-prefilled (admission order; they hold their pages and staging), then to new
  prompts. A prompt longer than a step can carry beside the running decodes gets a chunk of what
  is left and continues in the next steps; it samples its first token after its final chunk. A
  prompt that one step could carry whole but that does not fit in what is left waits for the next
  step instead (on the H200 a step with a chunk cost ~2.7x a step with the whole prompt,
  docs/PERFORMANCE.md "Chunked prefill steps"). A half-prefilled prompt holds
  a slot and its whole prompt's reserve from its first chunk, counts among ``running`` (it is
  preempted like any other, newest first), and decodes nothing until it ends.
* admission: unless a request was preempted in this step, waiting requests join in FIFO
  order while their prefill reserve (``reserve_pages_needed`` of the whole prompt) plus the decode
  worst case fits in the free pages, within ``max_batch_size`` slots and the step's
  ``max_num_tokens``; a prompt that would be chunked also needs its staging bytes free
  (``staging_bytes_needed``, under the cache's own rule ``staging_fits``: an exact fill fits; else
  it waits, or without chunking until one step can take it whole). The queue head blocks the
  others (no overtaking). A head that cannot fit in an empty pool is rejected.

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
        max_num_tokens: most tokens in a step (prefill chunks + one per decode request).
        enable_chunked_prefill: split a prompt that does not fit in a step's remaining tokens over steps
            (module docstring); ``False``: a prompt waits until one step can take it whole.

    Attributes:
        waiting: queued requests (FIFO; preempted ones go to the front).
        running: requests with tokens in the cache, in admission order.
        free_estimate: a lower bound on the free pages (see the module docstring).
        preemptions: requests preempted so far.
    """

    def __init__(self, rm: DiffKVResourceManager, max_batch_size: int, max_num_tokens: int,
                 enable_chunked_prefill: bool = True) -> None:
        self.rm, self.max_batch_size, self.max_num_tokens = rm, max_batch_size, max_num_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
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

    def observe_free(self, free_pages: int, *, keep_stale: bool = False) -> None:
        """The true free page count (read after a step, or after a refused plan), or a lower bound on it.

        ``keep_stale``: pages may have come back since the count was taken (a step read one
        :meth:`Executor.step` after its launch, releases in between): a refusal still re-reads it."""
        self.free_estimate, self._stale = free_pages, self._stale and keep_stale

    def reserve(self, pages: int) -> None:
        """A step launched and not read yet may take ``pages`` (its decode worst case): the bound drops by them."""
        self.free_estimate -= pages

    def runs_unchanged(self, num_decodes: int, *, shrinking: bool, in_flight_pages: int = 0) -> bool:
        """Whether :meth:`schedule` would now run only the running requests' decodes, judged on the host alone
        (no free-count read): nothing half-prefilled, ``decode_pages_needed(num_decodes)`` within
        :attr:`free_estimate` (no preemption), and no waiting request that could be admitted (the batch full,
        or the queue head's prefill reserve plus the decode worst case beyond the bound plus ``in_flight_pages``
        while no pages came back:
        the step not read yet may take fewer pages than its worst case). The executor's overlap launches the next
        step before reading the last one only then.

        Args:
            num_decodes: requests the next step decodes.
            shrinking: a running request ends in the step not read yet (its pages come back: a waiting
                request may then fit, so the answer is ``False`` when one waits).
            in_flight_pages: the worst case of the step not read yet, reserved in :attr:`free_estimate`.
        """
        if any(r.prefill_in_progress for r in self.running):
            return False
        need = self.rm.decode_pages_needed(num_decodes)
        if need > self.free_estimate:
            return False
        if not self.waiting or (len(self.running) >= self.max_batch_size and not shrinking):
            return True
        if shrinking or self._stale:
            return False
        head = need + self.rm.prefill_pages_needed(len(self.waiting[0].prefill_token_ids))
        return head > self.free_estimate + in_flight_pages

    def schedule(self) -> tuple[ScheduledBatch, list[tuple[Request, Exception]]]:
        """The next step's batch, and the requests that can never fit (already removed; the caller fails them).

        Running requests past their prefill become the batch's generation requests (after any
        preemption); half-prefilled ones and admitted ones its context requests, each with its
        ``prefill_chunk_tokens``; admitted ones are marked ``RUNNING`` and appended to :attr:`running`.
        """
        rejected, preempted = [], False
        while True:
            decoding = [r for r in self.running if not r.prefill_in_progress]
            if not decoding or self._fits(self.rm.decode_pages_needed(len(decoding))):
                break
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
        batch = ScheduledBatch(generation_requests=[r for r in self.running if not r.prefill_in_progress])
        budget = self.max_num_tokens - len(batch.generation_requests)
        for request in self.running:  # half-prefilled prompts continue first (their pages are already held)
            if request.prefill_in_progress and budget > 0:
                request.prefill_chunk_tokens = min(budget, len(request.prefill_token_ids) - request.num_cached_tokens)
                batch.context_requests.append(request)
                budget -= request.prefill_chunk_tokens
        continuing = len(batch.context_requests)
        if not preempted:
            self._admit(batch, rejected, budget)
        self.running.extend(batch.context_requests[continuing:])
        return batch, rejected

    def unschedule(self, batch: ScheduledBatch) -> None:
        """Put a batch's newly admitted context requests back at the queue front (its plan was refused; nothing
        changed); half-prefilled ones stay running."""
        for request in reversed(batch.context_requests):
            request.prefill_chunk_tokens = 0
            if request.prefill_in_progress:
                continue
            self.running.remove(request)
            request.state = RequestState.WAITING
            self.waiting.appendleft(request)

    def _admit(self, batch: ScheduledBatch, rejected: list, budget: int) -> None:
        reserve = self.rm.decode_pages_needed(len(batch.generation_requests))
        admitted, staging = 0, 0  # staging bytes of the prompts chunked from this step on
        while self.waiting and len(self.running) + admitted < self.max_batch_size and budget > 0:
            request = self.waiting[0]
            n = len(request.prefill_token_ids)
            chunk = min(budget, n)
            if chunk < n:
                if not self.enable_chunked_prefill:
                    return  # waits until one step can take it whole
                if n <= self.max_num_tokens - len(batch.generation_requests):
                    return  # the next step can take it whole: a chunk step costs more (docs/PERFORMANCE.md)
                staging += self.rm.staging_bytes_needed(n)
                if not self.rm.staging_fits(staging):  # the cache's plan applies the same rule
                    return  # waits for staging room (or, if it fits one step, for a step that takes it whole)
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
            request.prefill_chunk_tokens = chunk
            batch.context_requests.append(request)
            budget, reserve, admitted = budget - chunk, need, admitted + 1

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
        request.prefill_chunk_tokens = 0
        request.prefill_token_ids = request.prompt_token_ids + request.output_token_ids
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.preemptions += 1
