"""Workloads that drive page managers in lockstep: shared by the CPU, interpreter and GPU tests.

* :class:`Lockstep` applies every call to several managers (the first is the
  oracle, usually :class:`~.page_manager.CpuPageManager`), reads each one's
  status, and checks that statuses and whole snapshots agree and that every
  invariant holds (:meth:`~.page_manager.PageTableSnapshot.check`).
* :func:`simulate_serving` is a small scheduler: requests with random prompt
  and output lengths (exact multiples of every page capacity among them) are
  admitted against the free count read once per step, prefilled (reserve, then
  commit a random high/low split), decoded with DiffKV's per-step count changes
  and finished, or aborted before prefill, after prefill or mid decode
  (``shared/cases/edge-cases.md`` case 9). Greedy admission makes decode run
  out of pages at times; the scheduler then preempts, as the paper's does.
* :func:`random_calls` fires random valid calls, including ones that run out
  of pages or overflow a row.
* :func:`duplicate_slot_calls` lists a slot twice in every kind of call and
  checks that each is refused without any change.

All randomness comes from one seeded ``random.Random``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from trtllm_diffkv.memory.page_manager import PageManager, PageStatus, SlotState, StepStatus


class Lockstep:
    """Run the same calls on several managers and compare them after every call.

    Args:
        managers: same geometry; ``managers[0]`` is the reference.
        compare_every: compare full snapshots every this many calls (1: always);
            statuses and free counts are compared after every call.
        check: check the reference's invariants whenever snapshots are compared.

    Raises (from :meth:`call`):
        AssertionError: statuses, snapshots or invariants disagree.
    """

    def __init__(self, managers: list[PageManager], compare_every: int = 1, check: bool = True) -> None:
        self.managers = managers
        self.reference = managers[0]
        self.compare_every = compare_every
        self.check = check
        self.calls = 0
        self.status_counts: dict[str, int] = {}

    def call(self, name: str, *args) -> StepStatus:
        """Apply ``reference.<name>(*args)`` to every manager; return the reference's status."""
        for manager in self.managers:
            getattr(manager, name)(*(a.to(manager.device) if isinstance(a, torch.Tensor) else a for a in args))
        statuses = [manager.read_status() for manager in self.managers]
        assert all(s == statuses[0] for s in statuses), f"call {self.calls} {name}: statuses differ {statuses}"
        key = f"{name}:{statuses[0].status.name}"
        self.status_counts[key] = self.status_counts.get(key, 0) + 1
        self.calls += 1
        if self.calls % self.compare_every == 0:
            self.compare()
        return statuses[0]

    def compare(self) -> None:
        reference = self.reference.snapshot()
        for manager in self.managers[1:]:
            diff = reference.diff(manager.snapshot())
            assert not diff, f"after call {self.calls}: {type(manager).__name__} differs in {diff}"
        if self.check:
            reference.check(self.reference.page_format)


@dataclass(eq=False)
class _Request:
    prompt_tokens: int
    output_tokens: int
    abort_stage: str | None
    abort_at_token: int = 0
    slot: int = -1
    generated: int = 0
    tokens: torch.Tensor | None = None  # int64 [L, H, 2] high/low tokens per head


@dataclass
class ServingReport:
    """What :func:`simulate_serving` did."""

    steps: int = 0
    finished: int = 0
    aborted: dict[str, int] = field(default_factory=dict)
    preempted: int = 0
    out_of_pages: int = 0
    max_pages_in_use: int = 0


def _length(rng: random.Random, capacities: list[int], low: int, high: int) -> int:
    """A length in [low, high]; half the time an exact multiple of a page capacity (or one off)."""
    if rng.random() < 0.5:
        cap = rng.choice(capacities)
        value = cap * rng.randint(1, max(1, high // cap)) + rng.choice((0, 0, -1, 1))
        return min(max(value, low), high)
    return rng.randint(low, high)


def _split(rng: random.Random, prompt: int, num_layers: int, num_heads: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random per-head (high, low) token counts with high >= min(prompt, window), high + low <= prompt."""
    gen = torch.Generator().manual_seed(rng.getrandbits(31))
    keep_window = min(prompt, window)
    rest = prompt - keep_window
    high_extra = (torch.rand(num_layers, num_heads, generator=gen) * (rest + 1)).long().clamp(max=rest)
    low = (torch.rand(num_layers, num_heads, generator=gen) * (rest - high_extra + 1)).long()
    low = torch.minimum(low, rest - high_extra)
    return keep_window + high_extra, low


def _decode_deltas(rng: random.Random, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DiffKV per-step changes for tokens ``[n, L, H, 2]``: new token high; one token may leave high."""
    gen = torch.Generator().manual_seed(rng.getrandbits(31))
    shape = tokens.shape[:-1]
    r = torch.rand(shape, generator=gen)
    # 0: candidate stays high (+1 high); 1: candidate demoted (0 high, +1 low);
    # 2: candidate pruned (0 high); 3: low token pruned as well (+1 high, -1 low)
    case = (r * 4).long()
    dh = torch.where((case == 0) | (case == 3), 1, 0)
    dl = torch.where(case == 1, 1, torch.where(case == 3, -1, 0))
    dl = torch.where(tokens[..., 1] + dl < 0, 0, dl)
    return dh.to(torch.int8), dl.to(torch.int8)


def simulate_serving(
    driver: Lockstep,
    seed: int,
    num_requests: int = 200,
    max_prompt_tokens: int = 300,
    max_output_tokens: int = 120,
    abort_rate: float = 0.3,
    window_tokens: int = 16,
    greedy_rate: float = 0.3,
) -> ServingReport:
    """Serve ``num_requests`` random requests to completion through ``driver`` (edge case 9).

    Every call goes through ``driver`` (status and invariants checked after
    each). Admission: a request is admitted when a slot is free and the pages
    its reservation needs fit in the free count read at the end of the last
    step, less the worst-case decode need of the running requests (the
    watermark); with probability ``greedy_rate`` a step ignores the watermark,
    so decode can run out of pages, and then the newest running request is
    preempted (released and queued again, its progress lost).

    Raises:
        AssertionError: any disagreement or broken invariant, or a pool that
            is not full once every request is done.
    """
    rng = random.Random(seed)
    manager = driver.reference
    fmt = manager.page_format
    caps = [fmt.high_tokens_per_page, fmt.low_tokens_per_page]
    max_total = manager.max_seq_len_tokens
    pending = []
    for _ in range(num_requests):
        prompt = _length(rng, caps, 1, min(max_prompt_tokens, max_total - 1))
        output = _length(rng, caps, 1, min(max_output_tokens, max_total - prompt))
        stage = rng.choice(("before_prefill", "after_prefill", "mid_decode")) if rng.random() < abort_rate else None
        pending.append(_Request(prompt, output, stage, abort_at_token=rng.randint(1, output)))
    free_slots = list(range(manager.max_slots))
    running: list[_Request] = []
    report = ServingReport()
    free_pages = manager.free_pages()
    while pending or running:
        report.steps += 1
        # 1. admit against the free count of the last step (host arithmetic only)
        greedy = rng.random() < greedy_rate
        budget = free_pages - (0 if greedy else manager.worst_case_decode_pages(len(running)))
        admitted = []
        while pending and free_slots:
            need = manager.reserve_pages_needed([pending[0].prompt_tokens])
            if need > budget:
                break
            budget -= need
            request = pending.pop(0)
            request.slot = free_slots.pop(0)
            admitted.append(request)
        if admitted:
            slots = torch.tensor([r.slot for r in admitted])
            status = driver.call("reserve_prompt", slots, torch.tensor([r.prompt_tokens for r in admitted]))
            assert status.status == PageStatus.OK, f"admission within the free count failed: {status}"
            for request in [r for r in admitted if r.abort_stage == "before_prefill"]:
                _finish(driver, request, free_slots, report, "before_prefill")
            admitted = [r for r in admitted if r.abort_stage != "before_prefill"]
        # 2. prefill: commit the policy's split
        if admitted:
            splits = [_split(rng, r.prompt_tokens, manager.num_layers, manager.num_kv_heads, window_tokens) for r in admitted]
            driver.call("commit_prompt", torch.tensor([r.slot for r in admitted]),
                        torch.stack([s[0] for s in splits]), torch.stack([s[1] for s in splits]))
            for request, (high, low) in zip(admitted, splits):
                request.tokens = torch.stack([high, low], -1)
            for request in [r for r in admitted if r.abort_stage == "after_prefill"]:
                _finish(driver, request, free_slots, report, "after_prefill")
            running += [r for r in admitted if r.abort_stage != "after_prefill"]
        # 3. decode one token for every running request
        decoding = [r for r in running if r not in admitted]
        if decoding:
            tokens = torch.stack([r.tokens for r in decoding])
            dh, dl = _decode_deltas(rng, tokens)
            status = driver.call("append_decode", torch.tensor([r.slot for r in decoding]), dh, dl)
            if status.status & PageStatus.OUT_OF_PAGES:
                report.out_of_pages += 1
                victim = decoding[-1]  # the newest running request
                running.remove(victim)
                driver.call("release", torch.tensor([victim.slot]))
                free_slots.append(victim.slot)
                victim.generated, victim.slot, victim.tokens = 0, -1, None
                pending.insert(0, victim)
                report.preempted += 1
            else:
                assert status.status == PageStatus.OK, status
                for request, a, b in zip(decoding, dh, dl):
                    request.tokens = request.tokens + torch.stack([a, b], -1).long()
                    request.generated += 1
        # 4. finish and abort mid decode
        for request in list(running):
            if request.abort_stage == "mid_decode" and request.generated >= request.abort_at_token:
                running.remove(request)
                _finish(driver, request, free_slots, report, "mid_decode")
            elif request.generated >= request.output_tokens:
                running.remove(request)
                _finish(driver, request, free_slots, report, None)
        free_pages = manager.free_pages()  # the executor's one read per step
        report.max_pages_in_use = max(report.max_pages_in_use, manager.num_pages - free_pages)
    driver.compare()
    assert manager.free_pages() == manager.num_pages, "pool not full when idle"
    assert bool((manager.snapshot().slot_state == SlotState.FREE).all())
    return report


def _finish(driver: Lockstep, request: _Request, free_slots: list[int], report: ServingReport, stage: str | None) -> None:
    driver.call("release", torch.tensor([request.slot]))
    free_slots.append(request.slot)
    if stage is None:
        report.finished += 1
    else:
        report.aborted[stage] = report.aborted.get(stage, 0) + 1


def random_calls(driver: Lockstep, seed: int, num_calls: int, max_batch: int = 4) -> None:
    """``num_calls`` random valid calls (any slot state, deltas in {-1, 0, 1}, prompts up to past the row limit)."""
    rng = random.Random(seed)
    manager = driver.reference
    caps = [manager.high_tokens_per_page, manager.low_tokens_per_page]
    limit = manager.max_seq_len_tokens
    layers, heads = manager.num_layers, manager.num_kv_heads
    for _ in range(num_calls):
        snap = manager.snapshot()
        state = snap.slot_state
        by_state = {s: torch.nonzero(state == s).flatten().tolist() for s in SlotState}
        op = rng.choice(("reserve", "reserve", "commit", "decode", "decode", "decode", "release"))
        gen = torch.Generator().manual_seed(rng.getrandbits(31))
        if op == "reserve" and by_state[SlotState.FREE]:
            slots = rng.sample(by_state[SlotState.FREE], rng.randint(1, min(max_batch, len(by_state[SlotState.FREE]))))
            prompts = [_length(rng, caps, 1, limit + 40) for _ in slots]
            driver.call("reserve_prompt", torch.tensor(slots), torch.tensor(prompts))
        elif op == "commit" and by_state[SlotState.RESERVED]:
            slots = rng.sample(by_state[SlotState.RESERVED], rng.randint(1, min(max_batch, len(by_state[SlotState.RESERVED]))))
            reserved = snap.pages[slots, ..., 0].long()  # [n, L, H]
            budget = (reserved - 1) * manager.page_format.min_tokens_per_page
            high = (torch.rand(len(slots), layers, heads, generator=gen) * (budget + 1)).long()
            low = (torch.rand(len(slots), layers, heads, generator=gen) * (budget - high + 1)).long()
            driver.call("commit_prompt", torch.tensor(slots), high, low)
        elif op == "decode" and by_state[SlotState.ACTIVE]:
            slots = rng.sample(by_state[SlotState.ACTIVE], rng.randint(1, min(max_batch, len(by_state[SlotState.ACTIVE]))))
            tokens = snap.tokens[slots].long()
            d = torch.randint(-1, 2, (2, len(slots), layers, heads), generator=gen)
            d[0] = torch.where(tokens[..., 0] + d[0] < 0, 0, d[0])
            d[1] = torch.where(tokens[..., 1] + d[1] < 0, 0, d[1])
            d[0] = torch.where(torch.rand(d[0].shape, generator=gen) < 0.5, 1, d[0])  # grow more often than shrink
            driver.call("append_decode", torch.tensor(slots), d[0].to(torch.int8), d[1].to(torch.int8))
        elif op == "release":
            count = rng.randint(1, max_batch)
            driver.call("release", torch.tensor(rng.sample(range(manager.max_slots), min(count, manager.max_slots))))


def long_row_calls(driver: Lockstep, seed: int, rounds: int = 3) -> None:
    """Prompts up to ``max_seq_len_tokens`` with splits from all-high to all-low, then decode and release.

    Exercises rows longer than one kernel chunk and the commit's right shift of
    low pages by 0, 1, a few and many positions (overlapping source and
    destination). Needs ``max_slots >= 4`` and a pool of at least
    ``4 * rows_per_slot * max_pages_per_row`` pages.
    """
    rng = random.Random(seed)
    manager = driver.reference
    limit, p_min = manager.max_seq_len_tokens, manager.page_format.min_tokens_per_page
    shape = (manager.num_layers, manager.num_kv_heads)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        prompts = [limit, max(1, limit - p_min), max(1, limit - 3 * p_min), rng.randint(1, limit)]
        slots = torch.tensor([0, 1, 2, 3])
        driver.call("reserve_prompt", slots, torch.tensor(prompts))
        high, low = [], []
        for n in prompts:
            frac = torch.rand(shape, generator=gen)
            mode = torch.randint(0, 3, shape, generator=gen)  # all low, all high, random split
            h = torch.where(mode == 0, 0, torch.where(mode == 1, n, (frac * n).long()))
            high.append(h)
            low.append(torch.where(mode == 1, 0, n - h))
        driver.call("commit_prompt", slots, torch.stack(high), torch.stack(low))
        for _ in range(rng.randint(1, 5)):
            deltas = torch.randint(0, 2, (2, 4, *shape), generator=gen).to(torch.int8)
            driver.call("append_decode", slots, deltas[0], deltas[1])
        driver.call("release", slots)


def duplicate_slot_calls(manager: PageManager) -> int:
    """Every mutating call with a slot listed twice (copies adjacent and apart) is refused and changes nothing.

    A manager that checks on the host (:class:`~.page_manager.CpuPageManager`,
    ``validate=True``) must raise ``ValueError`` ("distinct"); one that checks
    on the device must set status ``INVALID``. Afterwards the same calls
    without the copies succeed and the pool comes back whole, so nothing a
    refused call touched (such as a device-side claim counter) lingers. Needs
    a fresh manager with ``max_slots >= 6``, room for 4 prompts of 40 tokens
    and rows of 4 pages. Returns the number of refused calls.

    Raises:
        AssertionError: a call was not refused, or it changed the state.
    """
    m, dev = manager, manager.device
    assert m.max_slots >= 6 and m.free_pages() == m.num_pages

    def ids(*values):
        return torch.tensor(values, device=dev)

    def heads(n: int, value: int):
        return torch.full((n, m.num_layers, m.num_kv_heads), value, device=dev)

    full_page = m.high_tokens_per_page
    m.reserve_prompt(ids(0, 1, 2, 3), ids(40, 40, 40, 40))
    m.commit_prompt(ids(0, 1), heads(2, full_page), heads(2, 0))  # a high page exactly full: +1 takes a page
    assert m.read_status().status == PageStatus.OK  # slots 0, 1 active; 2, 3 reserved; 4, 5 free
    calls = [
        ("reserve_prompt", ids(4, 5, 4), ids(5, 5, 5)),
        ("reserve_prompt", ids(5, 5), ids(5, 5)),
        ("commit_prompt", ids(2, 3, 2), heads(3, 1), heads(3, 1)),
        ("append_decode", ids(0, 1, 0), heads(3, 1), heads(3, 1)),
        ("append_decode", ids(1, 1), heads(2, 0), heads(2, 0)),
        ("release", ids(0, 1, 2, 3, 4, 0)),
        ("release", ids(2, 2)),
        ("release", ids(5, 5)),
    ]
    for name, *args in calls:
        before = m.snapshot()
        label = f"{name}{tuple(args[0].tolist())}"
        if m._validate_values:
            try:
                getattr(m, name)(*args)
            except ValueError as exc:
                assert "distinct" in str(exc), f"{label}: {exc}"
            else:
                raise AssertionError(f"{label} did not raise")
        else:
            getattr(m, name)(*args)
            status = m.read_status()
            assert status == (PageStatus.INVALID, before.free_pages), f"{label}: {status}"
        diff = before.diff(m.snapshot())
        assert not diff, f"{label} changed {diff}"
    m.append_decode(ids(0, 1), heads(2, 1), heads(2, 1))
    m.commit_prompt(ids(2, 3), heads(2, 1), heads(2, 1))
    m.release(ids(5, 1, 2, 3, 4, 0))
    status = m.read_status()
    assert status == (PageStatus.OK, m.num_pages), f"valid calls after the refused ones: {status}"
    m.check_invariants()
    return len(calls)
