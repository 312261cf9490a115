"""A loop-by-loop model of the page manager: the independent oracle of ``CpuPageManager``.

Rules (``trtllm_diffkv/memory/page_manager.py`` module docstring; ``DiffKV.md``
"Memory manager"), written with Python lists and ints, one row at a time:

* ring: ``num_pages`` slots, free ids at ``ring[(start + i) % num_pages]``;
  allocation takes from the front (``start``), reclamation appends at the back (``end``);
* row ``(slot * num_layers + layer) * num_kv_heads + head``; high page ``j`` at
  column ``j``, low page ``j`` at column ``R - 1 - j``;
* rows are visited slot by slot (in the call's order), layer by layer, head by
  head; within a row high pages before low ones, each in token order;
* a call that needs more pages than are free, or would give a row more than
  ``R`` pages, changes nothing and sets its status bit.
"""
from __future__ import annotations

OUT_OF_PAGES, ROW_FULL = 1, 2
FREE, RESERVED, ACTIVE = 0, 1, 2


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PageManagerModel:
    """Plain-Python page manager with the API of ``CpuPageManager`` (valid calls only).

    Args:
        high_tokens_per_page, low_tokens_per_page: tokens per page of each tier.
        num_pages, max_slots, num_layers, num_kv_heads, max_seq_len_tokens: as the manager's.
    """

    def __init__(self, high_tokens_per_page, low_tokens_per_page, num_pages, max_slots, num_layers, num_kv_heads,
                 max_seq_len_tokens):
        self.p_high, self.p_low = high_tokens_per_page, low_tokens_per_page
        self.p_min = min(high_tokens_per_page, low_tokens_per_page)
        self.num_pages, self.num_layers, self.num_kv_heads = num_pages, num_layers, num_kv_heads
        self.width = ceil_div(max_seq_len_tokens, self.p_min) + 1
        self.ring = list(range(num_pages))
        self.start, self.end, self.status = 0, num_pages, 0
        rows = max_slots * num_layers * num_kv_heads
        self.table = [[-1] * self.width for _ in range(rows)]
        self.pages = [[0, 0] for _ in range(rows)]
        self.tokens = [[0, 0] for _ in range(rows)]
        self.state = [FREE] * max_slots

    # ------------------------------------------------------------------ ring
    def free(self) -> int:
        return self.end - self.start

    def free_ids(self) -> list[int]:
        """Free ids, next allocated first."""
        return [self.ring[(self.start + i) % self.num_pages] for i in range(self.free())]

    def take(self) -> int:
        page = self.ring[self.start % self.num_pages]
        self.start += 1
        return page

    def give(self, page: int) -> None:
        self.ring[self.end % self.num_pages] = page
        self.end += 1

    def rows_of(self, slot: int) -> list[int]:
        per_slot = self.num_layers * self.num_kv_heads
        return [slot * per_slot + i for i in range(per_slot)]

    def read_status(self) -> tuple[int, int]:
        status, self.status = self.status, 0
        return status, self.free()

    # ------------------------------------------------------------- workflows
    def reserve_prompt(self, slots: list[int], prompt_tokens: list[int]) -> None:
        per_row = [ceil_div(n, self.p_min) + 1 for n in prompt_tokens]
        need = sum(count * len(self.rows_of(slot)) for slot, count in zip(slots, per_row))
        refused = (ROW_FULL if any(count > self.width for count in per_row) else 0) | (
            OUT_OF_PAGES if need > self.free() else 0)
        if refused:
            self.status |= refused
            return
        for slot, count in zip(slots, per_row):
            for row in self.rows_of(slot):
                self.table[row] = [self.take() if col < count else -1 for col in range(self.width)]
                self.pages[row], self.tokens[row] = [count, 0], [0, 0]
            self.state[slot] = RESERVED

    def commit_prompt(self, slots: list[int], high: list[list[int]], low: list[list[int]]) -> None:
        """``high[i][r]``, ``low[i][r]``: tokens of row ``r`` (layer-major) of ``slots[i]``."""
        for i, slot in enumerate(slots):
            for r, row in enumerate(self.rows_of(slot)):
                h, l = high[i][r], low[i][r]
                kh, kl, reserved = ceil_div(h, self.p_high), ceil_div(l, self.p_low), self.pages[row][0]
                old = self.table[row]
                for col in range(kh, reserved - kl):
                    self.give(old[col])
                new = [-1] * self.width
                for col in range(kh):
                    new[col] = old[col]
                for j in range(kl):  # reserved column C-1-j becomes low page j
                    new[self.width - 1 - j] = old[reserved - 1 - j]
                self.table[row], self.pages[row], self.tokens[row] = new, [kh, kl], [h, l]
            self.state[slot] = ACTIVE

    def append_decode(self, slots: list[int], high_delta: list[list[int]], low_delta: list[list[int]]) -> None:
        plan = []
        for i, slot in enumerate(slots):
            for r, row in enumerate(self.rows_of(slot)):
                h = self.tokens[row][0] + high_delta[i][r]
                l = self.tokens[row][1] + low_delta[i][r]
                need_h = int(h > self.pages[row][0] * self.p_high)
                need_l = int(l > self.pages[row][1] * self.p_low)
                plan.append((row, h, l, need_h, need_l))
        need = sum(p[3] + p[4] for p in plan)
        refused = (ROW_FULL if any(self.pages[row][0] + self.pages[row][1] + nh + nl > self.width
                                   for row, _, _, nh, nl in plan) else 0) | (OUT_OF_PAGES if need > self.free() else 0)
        if refused:
            self.status |= refused
            return
        for row, h, l, need_h, need_l in plan:
            if need_h:
                self.table[row][self.pages[row][0]] = self.take()
                self.pages[row][0] += 1
            if need_l:
                self.table[row][self.width - 1 - self.pages[row][1]] = self.take()
                self.pages[row][1] += 1
            self.tokens[row] = [h, l]

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            for row in self.rows_of(slot):
                ph, pl = self.pages[row]
                for col in range(ph):
                    self.give(self.table[row][col])
                for j in range(pl):
                    self.give(self.table[row][self.width - 1 - j])
                self.table[row] = [-1] * self.width
                self.pages[row], self.tokens[row] = [0, 0], [0, 0]
            self.state[slot] = FREE
