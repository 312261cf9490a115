"""CPU page manager: exact page ids, atomic out-of-pages, page conservation (edge cases 8 and 9)."""
import pytest
import torch

from trtllm_diffkv.config import DiffKVConfig, TierConfig
from trtllm_diffkv.memory import CpuPageManager, PageFormat, PageStatus, SlotState
from support.page_manager import Lockstep, duplicate_slot_calls, random_calls, simulate_serving

FMT = PageFormat.for_config(DiffKVConfig(), 128)  # 32 high / 52 low tokens per page
L, H = 1, 2


def manager(num_pages=20, max_slots=3, max_seq_len_tokens=100, layers=L, heads=H):
    return CpuPageManager(FMT, num_pages, max_slots, layers, heads, max_seq_len_tokens)


def per_head(*values):
    return torch.tensor(values).reshape(-1, L, H)


def test_geometry():
    m = manager()
    assert m.max_pages_per_row == 5  # ceil(100 / 32) + 1
    assert m.reserve_pages_needed([64, 1]) == 2 * (3 + 2)
    assert m.worst_case_decode_pages(3) == 12
    assert m.free_pages() == 20


def test_prompt_reserve_commit_exact_ids():
    m = manager()
    m.reserve_prompt([2], [64])  # 64 tokens: 2 + 1 pages per head
    assert m.read_status() == (PageStatus.OK, 14)
    snap = m.snapshot()
    assert snap.page_table[2, 0].tolist() == [[0, 1, 2, -1, -1], [3, 4, 5, -1, -1]]
    assert snap.slot_state.tolist() == [0, 0, SlotState.RESERVED]
    # head 0: 40 high (2 pages) + 20 low (1 page); head 1: 10 high (1) + 0 low
    m.commit_prompt([2], per_head(40, 10), per_head(20, 0))
    assert m.read_status() == (PageStatus.OK, 16)
    snap = m.snapshot()
    # head 0: high [0, 1] stay left, reserved position 2 shifts to the right end
    # head 1: high [3] stays, 4 and 5 return to the ring
    assert snap.page_table[2, 0].tolist() == [[0, 1, -1, -1, 2], [3, -1, -1, -1, -1]]
    assert snap.pages[2, 0].tolist() == [[2, 1], [1, 0]]
    assert snap.tokens[2, 0].tolist() == [[40, 20], [10, 0]]
    assert snap.free_page_ids().tolist() == list(range(6, 20)) + [4, 5]
    m.check_invariants()


def test_decode_takes_a_page_only_when_a_tier_fills():
    m = manager()
    m.reserve_prompt([0], [64])
    m.commit_prompt([0], per_head(32, 31), per_head(52, 0))  # both high tiers exactly full
    m.read_status()
    assert m.snapshot().page_table[0, 0].tolist() == [[0, -1, -1, -1, 2], [3, -1, -1, -1, -1]]
    # head 0: +1 high (new page 6... ring front), +1 low (new low page); head 1: +1 high fits (31 -> 32)
    m.append_decode([0], per_head(1, 1), per_head(1, 0))
    assert m.read_status().status == PageStatus.OK
    snap = m.snapshot()
    front = snap.ring[6:8].tolist()
    assert front == [6, 7]
    assert snap.page_table[0, 0].tolist() == [[0, 6, -1, 7, 2], [3, -1, -1, -1, -1]]
    assert snap.tokens[0, 0].tolist() == [[33, 53], [32, 0]]
    # shrinking frees nothing; growing back within capacity takes nothing
    m.append_decode([0], per_head(0, -1), per_head(-1, 0))
    m.append_decode([0], per_head(0, 1), per_head(1, 0))
    assert m.read_status() == (PageStatus.OK, 20 - 5)
    assert snap.page_table.tolist() == m.snapshot().page_table.tolist()
    m.check_invariants()


def test_release_returns_high_then_low_pages_in_token_order():
    m = manager()
    m.reserve_prompt([1], [100])
    m.commit_prompt([1], per_head(33, 100), per_head(60, 0))
    m.read_status()
    table = m.snapshot().page_table[1, 0]
    m.release([1])
    assert m.read_status() == (PageStatus.OK, 20)
    returned = m.snapshot().free_page_ids()[-8:].tolist()
    high0, low0, high1 = table[0, :2].tolist(), table[0, [4, 3]].tolist(), table[1, :4].tolist()
    assert -1 not in high0 + low0 + high1 and table[1, 4] == -1
    assert returned == high0 + low0 + high1
    assert m.snapshot().page_table.eq(-1).all()
    m.check_invariants()


def test_out_of_pages_is_atomic_and_reported():
    m = manager(num_pages=9)
    m.reserve_prompt([0], [64])  # 6 pages
    m.read_status()
    before = m.snapshot()
    m.reserve_prompt([1, 2], [1, 1])  # 2 x 2 x 2 = 8 > 3 free
    assert m.read_status() == (PageStatus.OUT_OF_PAGES, 3)
    assert not before.diff(m.snapshot())
    m.commit_prompt([0], per_head(32, 32), per_head(52, 52))  # keeps 4 pages
    m.reserve_prompt([1], [1])  # 4 pages: fits exactly in the 5 free
    m.append_decode([0], per_head(1, 1), per_head(1, 1))  # needs 4, 1 free
    status = m.read_status()
    assert status == (PageStatus.OUT_OF_PAGES, 1)
    m.release([1])
    m.append_decode([0], per_head(1, 1), per_head(1, 1))
    assert m.read_status() == (PageStatus.OK, 1)
    m.check_invariants()


def test_row_full_when_a_request_outgrows_max_seq_len():
    m = manager(num_pages=50, max_seq_len_tokens=64)  # 3 pages per row
    m.reserve_prompt([0], [65])  # 4 pages per row
    assert m.read_status() == (PageStatus.ROW_FULL, 50)
    m.reserve_prompt([0], [64])
    m.commit_prompt([0], per_head(64, 64), per_head(0, 0))  # 2 high pages per row
    m.append_decode([0], per_head(0, 0), per_head(1, 1))  # + 1 low page: 3, fits
    assert m.read_status() == (PageStatus.OK, 44)
    before = m.snapshot()
    m.append_decode([0], per_head(1, 0), per_head(0, 0))  # a fourth page in row 0: refused
    assert m.read_status() == (PageStatus.ROW_FULL, 44)
    assert not before.diff(m.snapshot())


def test_ring_wraps_around_many_times():
    m = manager(num_pages=7, max_slots=2, max_seq_len_tokens=64)
    for i in range(100):
        m.reserve_prompt([i % 2], [1 + i % 20])
        m.commit_prompt([i % 2], per_head(1, 0), per_head(0, 1))
        m.release([i % 2])
        assert m.read_status() == (PageStatus.OK, 7)
    snap = m.snapshot()
    assert snap.ring_start > 100 and snap.free_pages == 7
    snap.check(FMT)


def test_zero_token_prompt_fails_alone_and_allocates_nothing():
    """Edge case 8: the 0-token request is refused with a clear error; the others proceed."""
    m = manager(num_pages=40, max_slots=4)
    before = m.snapshot()
    with pytest.raises(ValueError, match=r"prompt_tokens\[0\]=0 for slot 0 must be >= 1"):
        m.reserve_prompt([0, 1, 2, 3], [0, 1, 16, 17])
    assert not before.diff(m.snapshot())
    m.reserve_prompt([1, 2, 3], [1, 16, 17])
    m.commit_prompt([1, 2, 3], torch.tensor([1, 16, 17]).reshape(3, 1, 1).expand(3, L, H), torch.zeros(3, L, H, dtype=torch.int64))
    assert m.read_status().status == PageStatus.OK
    assert m.snapshot().pages[1:, 0, :, 0].tolist() == [[1, 1]] * 3
    m.check_invariants()


@pytest.mark.parametrize("call, match", [
    (lambda m: m.reserve_prompt([3], [5]), r"slots\[0\]=3 is outside \[0, 3\)"),
    (lambda m: m.reserve_prompt([1, 1], [5, 5]), "distinct"),
    (lambda m: m.reserve_prompt([[1]], [5]), "1-D"),
    (lambda m: m.reserve_prompt([1], [5.0]), "integers"),
    (lambda m: m.reserve_prompt([0], [5]), "slot 0 is ACTIVE, must be FREE"),
    (lambda m: m.commit_prompt([0], per_head(1, 1), per_head(1, 1)), "slot 0 is ACTIVE, must be RESERVED"),
    (lambda m: m.commit_prompt([1], per_head(1, 1), per_head(1, 1)), "slot 1 is FREE, must be RESERVED"),
    (lambda m: m.commit_prompt([2], per_head(0, 100), per_head(0, 0)), "more pages than were reserved: slot 2, layer 0, KV head 1"),
    (lambda m: m.commit_prompt([2], per_head(-1, 0), per_head(0, 0)), ">= 0: slot 2, layer 0, KV head 0"),
    (lambda m: m.commit_prompt([2], torch.zeros(1, 2, 2, dtype=torch.int64), torch.zeros(1, 2, 2, dtype=torch.int64)), r"\[n, num_layers, num_kv_heads\]"),
    (lambda m: m.append_decode([0], per_head(2, 0), per_head(0, 0)), r"\{-1, 0, 1\}: slot 0, layer 0, KV head 0"),
    (lambda m: m.append_decode([0], per_head(0, 0), per_head(0, -1)), "below zero: slot 0, layer 0, KV head 1"),
    (lambda m: m.append_decode([2], per_head(0, 0), per_head(0, 0)), "slot 2 is RESERVED, must be ACTIVE"),
    (lambda m: m.release([0, -1]), r"slots\[1\]=-1"),
])
def test_invalid_calls_raise_value_error_and_change_nothing(call, match):
    m = manager()
    m.reserve_prompt([0, 2], [40, 40])
    m.commit_prompt([0], per_head(5, 5), per_head(5, 0))
    m.read_status()
    before = m.snapshot()
    with pytest.raises(ValueError, match=match):
        call(m)
    assert not before.diff(m.snapshot())


def test_duplicate_slots_raise_in_every_call_and_change_nothing():
    assert duplicate_slot_calls(manager(num_pages=60, max_slots=6)) == 8
    m = manager(num_pages=40)
    m.reserve_prompt([2], [5])
    m.read_status()
    before = m.snapshot()
    with pytest.raises(ValueError, match="distinct"):
        m.release([2, 2])
    assert not before.diff(m.snapshot())
    m.release([2])
    assert m.read_status() == (PageStatus.OK, 40)


def test_constructor_rejects_bad_sizes():
    for kwargs in (dict(num_pages=0), dict(max_slots=-1), dict(num_pages=2**31), dict(layers=True)):
        with pytest.raises(ValueError):
            manager(**kwargs)


def test_empty_calls_and_index_dtypes():
    m = manager()
    m.reserve_prompt(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))
    m.release([])
    m.reserve_prompt(torch.tensor([1], dtype=torch.int32), torch.tensor([33], dtype=torch.int32))
    m.commit_prompt(torch.tensor([1], dtype=torch.int32), per_head(33, 0).int(), per_head(0, 1).short())
    m.append_decode([1], per_head(True, False), per_head(False, True))
    assert m.read_status().status == PageStatus.OK
    assert m.snapshot().tokens[1, 0].tolist() == [[34, 0], [0, 2]]


def test_serving_200_requests_conserves_pages():
    """Edge case 9: random prompt/output lengths (page multiples included), aborts at every stage."""
    m = CpuPageManager(FMT, 150, 12, 2, 3, 480)
    driver = Lockstep([m])
    report = simulate_serving(driver, seed=0, num_requests=200)
    assert report.finished + sum(report.aborted.values()) == 200
    assert set(report.aborted) == {"before_prefill", "after_prefill", "mid_decode"}
    assert report.out_of_pages > 0 and report.preempted == report.out_of_pages
    assert report.max_pages_in_use > 100
    assert m.free_pages() == 150


@pytest.mark.parametrize("fmt", [FMT, PageFormat.for_config(DiffKVConfig(low=TierConfig(4, 2, 1, 1)), 64, 8)])
def test_random_calls_keep_every_invariant(fmt):
    m = CpuPageManager(fmt, 60, 6, 2, 2, 150)
    driver = Lockstep([m])
    random_calls(driver, seed=5, num_calls=1500)
    seen = " ".join(driver.status_counts)
    assert "reserve_prompt:OUT_OF_PAGES" in seen and "ROW_FULL" in seen and "append_decode:OK" in seen
    m.release(list(range(6)))
    assert m.free_pages() == 60
