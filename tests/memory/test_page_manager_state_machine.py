"""Hypothesis state machine over the CPU page manager: 10^5 random operations.

Rules: prompt reservation with random lengths (exact multiples of every page
capacity among them, and prompts past the row limit), commits with random
per-head splits, decode appends with random per-head changes, finishes and
aborts in every state (reserved, committed, mid decode), calls that run out
of pages, and invalid calls. After every operation: the manager's counts
equal an independent model, its status equals the model's prediction,
free + owned = total, no page is owned twice, the ring and the table agree,
tables only grow during decode, and the pool is full whenever no slot is in
use (edge case 9).

``DIFFKV_PAGE_FUZZ_OPS`` sets the number of operations (default 100000).
"""
import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test  # noqa: E402

from trtllm_diffkv.config import DiffKVConfig, PRESETS, TierConfig  # noqa: E402
from trtllm_diffkv.memory import CpuPageManager, PageFormat, PageStatus, SlotState  # noqa: E402

TARGET_OPS = int(os.environ.get("DIFFKV_PAGE_FUZZ_OPS", "100000"))
STEPS_PER_EXAMPLE = 200  # rules per example; a decode rule runs 1-60 steps
OPS_PER_EXAMPLE = 250  # page-manager calls per example, about (measured: ~290)

FORMATS = [
    PageFormat.for_config(DiffKVConfig(), 128),  # 32 high / 52 low tokens per page
    PageFormat.for_config(DiffKVConfig(low=TierConfig(4, 2, 1, 1)), 128),  # authors' 32 / 60
    PageFormat.for_config(DiffKVConfig(), 64, high_tokens_per_page=8),  # tiny pages: many page boundaries
    PageFormat.for_config(PRESETS["fp16"], 80, high_tokens_per_page=16),  # one tier size for both
]
MAX_SLOTS, NUM_LAYERS, NUM_HEADS, MAX_SEQ_TOKENS = 5, 2, 2, 200
OPS = {"count": 0}


def _ceil(a, b):
    return -(-a // b)


class PageManagerMachine(RuleBasedStateMachine):
    """Model: per slot a state, per row pages and tokens of each tier (int64 [S, L, H])."""

    @initialize(fmt_index=st.integers(0, len(FORMATS) - 1), num_pages=st.sampled_from([12, 40, 90, 400]))
    def setup(self, fmt_index, num_pages):
        self.fmt = FORMATS[fmt_index]
        self.p_high, self.p_low, self.p_min = self.fmt.high_tokens_per_page, self.fmt.low_tokens_per_page, self.fmt.min_tokens_per_page
        self.m = CpuPageManager(self.fmt, num_pages, MAX_SLOTS, NUM_LAYERS, NUM_HEADS, MAX_SEQ_TOKENS)
        self.num_pages = num_pages
        self.width = self.m.max_pages_per_row
        shape = (MAX_SLOTS, NUM_LAYERS, NUM_HEADS)
        self.state = [SlotState.FREE] * MAX_SLOTS
        self.pages = torch.zeros(*shape, 2, dtype=torch.int64)
        self.tokens = torch.zeros(*shape, 2, dtype=torch.int64)
        self.gen = torch.Generator()

    # ------------------------------------------------------------ helpers
    def slots_in(self, rng, state, max_size=3):
        pool = [s for s in range(MAX_SLOTS) if self.state[s] == state]
        return rng.sample(pool, rng.randint(1, min(max_size, len(pool))))

    def free_model(self):
        return self.num_pages - int(self.pages.sum())

    def expect(self, oop, row_full):
        status = self.m.read_status()
        expected = (PageStatus.OUT_OF_PAGES if oop else PageStatus.OK) | (PageStatus.ROW_FULL if row_full else PageStatus.OK)
        assert status.status == expected, (status, expected)
        self.reported_free = status.free_pages
        OPS["count"] += 1
        return expected == PageStatus.OK

    def length(self, rng, high):
        """A prompt length in [1, high]; half the time a page capacity multiple or one off."""
        if rng.random() < 0.5:
            return rng.randint(1, high)
        edge = [k * p + d for p in (self.p_high, self.p_low) for k in (1, 2, 3, 5) for d in (-1, 0, 1)]
        return rng.choice([e for e in edge if 1 <= e <= high])

    # ------------------------------------------------------------ rules
    @precondition(lambda self: SlotState.FREE in self.state)
    @rule(rng=st.randoms(use_true_random=False))
    def reserve(self, rng):
        slots = self.slots_in(rng, SlotState.FREE)
        prompts = [self.length(rng, MAX_SEQ_TOKENS + 40) for _ in slots]
        reserve = [_ceil(n, self.p_min) + 1 for n in prompts]
        self.m.reserve_prompt(torch.tensor(slots), torch.tensor(prompts))
        need = sum(reserve) * NUM_LAYERS * NUM_HEADS
        assert need == self.m.reserve_pages_needed(prompts)
        if self.expect(need > self.free_model(), max(reserve) > self.width):
            for s, c in zip(slots, reserve):
                self.state[s] = SlotState.RESERVED
                self.pages[s, ..., 0] = c

    @precondition(lambda self: SlotState.RESERVED in self.state)
    @rule(rng=st.randoms(use_true_random=False))
    def commit(self, rng):
        slots = self.slots_in(rng, SlotState.RESERVED)
        self.gen.manual_seed(rng.getrandbits(32))
        reserved = self.pages[slots, ..., 0]
        budget = (reserved - 1) * self.p_min  # any h + l within it fits the reservation
        high = (torch.rand(reserved.shape, generator=self.gen) * (budget + 1)).long()
        if rng.random() < 0.5:  # exact page multiples
            high = high // self.p_high * self.p_high
        low = (torch.rand(reserved.shape, generator=self.gen) * (budget - high + 1)).long()
        before = self.m.snapshot().page_table[slots]
        self.m.commit_prompt(torch.tensor(slots), high, low)
        assert self.expect(False, False)
        kh, kl = _ceil(high, self.p_high), _ceil(low, self.p_low)
        after = self.m.snapshot().page_table[slots]
        pos = torch.arange(self.width)
        keep = pos < kh[..., None]
        assert torch.equal(after[keep], before[keep]), "commit moved high pages"
        for s in slots:
            self.state[s] = SlotState.ACTIVE
        self.pages[slots] = torch.stack([kh, kl], -1)
        self.tokens[slots] = torch.stack([high, low], -1)

    @precondition(lambda self: SlotState.ACTIVE in self.state)
    @rule(rng=st.randoms(use_true_random=False))
    def decode(self, rng):
        """1-60 decode steps; per head and tier -1, 0 or +1, growing with a random bias."""
        slots = self.slots_in(rng, SlotState.ACTIVE, max_size=MAX_SLOTS)
        self.gen.manual_seed(rng.getrandbits(32))
        grow = rng.random()
        for _ in range(rng.randint(1, 60)):
            tokens = self.tokens[slots]
            d = torch.randint(-1, 2, tokens.shape, generator=self.gen)
            d = torch.where(torch.rand(tokens.shape, generator=self.gen) < grow, 1, d)
            d = torch.where(tokens + d < 0, 0, d)
            before = self.m.snapshot().page_table[slots]
            self.m.append_decode(torch.tensor(slots), d[..., 0].to(torch.int8), d[..., 1].to(torch.int8))
            new = tokens + d
            need = (new > self.pages[slots] * torch.tensor([self.p_high, self.p_low])).long()
            full = bool(((self.pages[slots] + need).sum(-1) > self.width).any())
            after = self.m.snapshot().page_table[slots]
            assert torch.equal(after[before >= 0], before[before >= 0]), "decode changed an owned page"
            if not self.expect(int(need.sum()) > self.free_model(), full):
                assert torch.equal(after, before)
                return
            self.pages[slots] += need
            self.tokens[slots] = new

    @rule(rng=st.randoms(use_true_random=False))
    def release(self, rng):
        """Finish or abort: slots in any state, free ones included."""
        slots = rng.sample(range(MAX_SLOTS), rng.randint(1, 3))
        self.m.release(torch.tensor(slots))
        assert self.expect(False, False)
        for s in slots:
            self.state[s] = SlotState.FREE
        self.pages[slots] = 0
        self.tokens[slots] = 0

    @rule(rng=st.randoms(use_true_random=False))
    def invalid_call(self, rng):
        """A call with a bad argument raises ValueError and changes nothing."""
        before = self.m.snapshot()
        z = torch.zeros(1, NUM_LAYERS, NUM_HEADS, dtype=torch.int64)
        busy = [s for s in range(MAX_SLOTS) if self.state[s] != SlotState.FREE]
        not_reserved = [s for s in range(MAX_SLOTS) if self.state[s] != SlotState.RESERVED]
        not_active = [s for s in range(MAX_SLOTS) if self.state[s] != SlotState.ACTIVE]
        reserved = [s for s in range(MAX_SLOTS) if self.state[s] == SlotState.RESERVED]
        active = [s for s in range(MAX_SLOTS) if self.state[s] == SlotState.ACTIVE]
        calls = [
            lambda: self.m.reserve_prompt([MAX_SLOTS], [5]),
            lambda: self.m.reserve_prompt([-1], [5]),
            lambda: self.m.release([0, 0]),
            lambda: self.m.reserve_prompt([0], [5, 6]),
            lambda: self.m.append_decode([0], z[:, :1], z[:, :1]),
            lambda: self.m.commit_prompt([0], z.float(), z.float()),
        ]
        if SlotState.FREE in self.state:
            free = self.state.index(SlotState.FREE)
            calls.append(lambda: self.m.reserve_prompt([free], [0]))
        if busy:
            calls.append(lambda: self.m.reserve_prompt([busy[0]], [5]))
        if not_reserved:
            calls.append(lambda: self.m.commit_prompt([not_reserved[0]], z, z))
        if not_active:
            calls.append(lambda: self.m.append_decode([not_active[0]], z, z))
        if reserved:
            r = reserved[0]
            too_many = (self.pages[r, ..., 0] * self.p_high + 1)[None]
            calls.append(lambda: self.m.commit_prompt([r], too_many, z))
            calls.append(lambda: self.m.commit_prompt([r], z - 1, z))
        if active:
            a = active[0]
            calls.append(lambda: self.m.append_decode([a], z + 2, z))
            empty_low = self.tokens[a, ..., 1] == 0
            if bool(empty_low.any()):
                calls.append(lambda: self.m.append_decode([a], z, torch.where(empty_low, -1, 0)[None]))
        call = rng.choice(calls)
        with pytest.raises(ValueError):
            call()
        OPS["count"] += 1
        diff = before.diff(self.m.snapshot())
        assert not diff, f"invalid call changed {diff}"

    # ------------------------------------------------------------ invariants
    @invariant()
    def manager_matches_model(self):
        snap = self.m.snapshot()
        snap.check(self.fmt)  # conservation, uniqueness, ring/table agreement, idle => full
        assert torch.equal(snap.pages.long(), self.pages)
        assert torch.equal(snap.tokens.long(), self.tokens)
        assert snap.slot_state.tolist() == [int(s) for s in self.state]
        assert snap.free_pages == self.free_model()
        assert getattr(self, "reported_free", snap.free_pages) == snap.free_pages
        if all(s == SlotState.FREE for s in self.state):
            assert snap.free_pages == self.num_pages


def _run(examples: int, derandomize: bool) -> None:
    run_state_machine_as_test(
        PageManagerMachine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=STEPS_PER_EXAMPLE,
            deadline=None,
            database=None,
            derandomize=derandomize,
            suppress_health_check=list(HealthCheck),
        ),
    )


def test_page_manager_state_machine_1e5_operations():
    OPS["count"] = 0
    _run(max(1, TARGET_OPS // OPS_PER_EXAMPLE), derandomize=True)  # reproducible
    while OPS["count"] < TARGET_OPS:  # top up (another Hypothesis version may draw shorter runs)
        _run(max(1, (TARGET_OPS - OPS["count"]) // OPS_PER_EXAMPLE + 1), derandomize=False)
    print(f"{OPS['count']} page-manager operations")
