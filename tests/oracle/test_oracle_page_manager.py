"""``CpuPageManager`` against the loop-by-loop model in ``tests/oracle/pages.py``: exact page ids, ring
order, page table, counts and status after every call of random workloads (page-capacity multiples,
tiers filling at different rates, out-of-pages and row-full refusals, releases in every state)."""
import random

import pytest
import torch

from oracle.pages import ACTIVE, FREE, RESERVED, PageManagerModel
from trtllm_diffkv.config import DiffKVConfig, TierConfig
from trtllm_diffkv.memory import CpuPageManager, PageFormat

FORMATS = [
    PageFormat.for_config(DiffKVConfig(), 128),  # 32 high / 52 low tokens per page
    PageFormat.for_config(DiffKVConfig(), 64, high_tokens_per_page=8),  # 8 / 12: many page boundaries
    PageFormat.for_config(DiffKVConfig(low=TierConfig(4, 2, 1, 1)), 128),  # the authors' 32 / 60
]
SLOTS, LAYERS, HEADS, MAX_SEQ = 4, 2, 2, 160


def assert_same(manager: CpuPageManager, model: PageManagerModel) -> None:
    snap = manager.snapshot()
    assert snap.free_page_ids().tolist() == model.free_ids(), "free ids or their ring order"
    assert snap.page_table.reshape(-1, model.width).tolist() == model.table, "page table"
    assert snap.pages.reshape(-1, 2).tolist() == model.pages, "pages per tier"
    assert snap.tokens.reshape(-1, 2).tolist() == model.tokens, "tokens per tier"
    assert snap.slot_state.tolist() == model.state, "slot states"


def per_head(values, n):
    return torch.tensor(values, dtype=torch.int64).reshape(n, LAYERS, HEADS)


def random_step(rng: random.Random, manager, model, fmt) -> tuple[str, int]:
    """One random valid call on both; returns (call, status bits)."""
    rows = LAYERS * HEADS
    by_state = {s: [i for i in range(SLOTS) if model.state[i] == s] for s in (FREE, RESERVED, ACTIVE)}
    op = rng.choice(["reserve", "commit", "decode", "decode", "decode", "release"])
    if op == "reserve" and by_state[FREE]:
        slots = rng.sample(by_state[FREE], rng.randint(1, len(by_state[FREE])))
        caps = [fmt.high_tokens_per_page, fmt.low_tokens_per_page]
        prompts = [rng.choice([rng.randint(1, MAX_SEQ + 20), rng.choice(caps) * rng.randint(1, 3) + rng.choice([-1, 0, 1])])
                   for _ in slots]
        manager.reserve_prompt(slots, prompts)
        model.reserve_prompt(slots, prompts)
        model.prompts = getattr(model, "prompts", {}) | dict(zip(slots, prompts))
    elif op == "commit" and by_state[RESERVED]:
        slots = rng.sample(by_state[RESERVED], rng.randint(1, len(by_state[RESERVED])))
        high, low = [], []
        for slot in slots:
            n = model.prompts[slot]
            hs = [rng.randint(0, n) for _ in range(rows)]
            high.append(hs)
            low.append([rng.randint(0, n - h) for h in hs])
        manager.commit_prompt(slots, per_head(high, len(slots)), per_head(low, len(slots)))
        model.commit_prompt(slots, high, low)
    elif op == "decode" and by_state[ACTIVE]:
        slots = rng.sample(by_state[ACTIVE], rng.randint(1, len(by_state[ACTIVE])))
        dh, dl = [], []
        for slot in slots:
            tokens = [model.tokens[row] for row in model.rows_of(slot)]
            dh.append([rng.choice([1, 1, 0, -1]) if t[0] > 0 else rng.choice([0, 1]) for t in tokens])
            dl.append([rng.choice([1, 1, 0, -1]) if t[1] > 0 else rng.choice([0, 1]) for t in tokens])
        for _ in range(rng.randint(1, 12)):  # a burst of steps, so tiers fill up and cross page boundaries
            manager.append_decode(slots, per_head(dh, len(slots)), per_head(dl, len(slots)))
            model.append_decode(slots, dh, dl)
            if any(model.tokens[row][k] == 0 for slot in slots for row in model.rows_of(slot) for k in (0, 1)):
                break
    elif op == "release":
        slots = rng.sample(range(SLOTS), rng.randint(1, 2))
        manager.release(slots)
        model.release(slots)
    status = tuple(manager.read_status())
    assert status == model.read_status(), op
    return op, status[0]


@pytest.mark.parametrize("fmt_index", range(len(FORMATS)))
@pytest.mark.parametrize("num_pages", [30, 120])
def test_cpu_page_manager_equals_the_loop_model(fmt_index, num_pages):
    fmt = FORMATS[fmt_index]
    manager = CpuPageManager(fmt, num_pages, SLOTS, LAYERS, HEADS, MAX_SEQ)
    model = PageManagerModel(fmt.high_tokens_per_page, fmt.low_tokens_per_page, num_pages, SLOTS, LAYERS, HEADS,
                             MAX_SEQ)
    assert manager.max_pages_per_row == model.width
    rng = random.Random(fmt_index * 1000 + num_pages)
    seen = set()
    for _ in range(400):
        seen.add(random_step(rng, manager, model, fmt))
        assert_same(manager, model)
    manager.release(list(range(SLOTS)))
    model.release(list(range(SLOTS)))
    assert_same(manager, model)
    assert model.free() == num_pages and model.start > num_pages  # the ring wrapped at least once
    assert {("reserve", 0), ("commit", 0), ("decode", 0), ("release", 0)} <= seen, seen
    assert any(op == "reserve" and status & 2 for op, status in seen), "no ROW_FULL refusal"
    if num_pages == 30:
        assert ("decode", 1) in seen and ("reserve", 1) in seen, seen
