"""Page manager API and its CPU implementation (the oracle and the CPU path).

DiffKV memory manager (paper section 5; ``DiffKV.md``, "Memory manager"). The
allocator deals only in integer page ids and knows no policy; it keeps:

* the **circular free page list** ``ring``: int32 ``[num_pages]`` holding every
  free page id at ``ring[(ring_start + i) % num_pages]`` for
  ``0 <= i < ring_end - ring_start``. ``ring_start`` (allocate) and ``ring_end``
  (reclaim) are monotonically increasing int64 counters, so ``free = end -
  start`` tells full (``num_pages``) and empty (0) apart without a flag.
* the **bidirectional page table** ``page_table``: int32 ``[rows,
  max_pages_per_row]``, one row per (request slot, layer, KV head), ``row =
  (slot * num_layers + layer) * num_kv_heads + head``. High-tier pages grow from
  the left (position ``j`` holds the ``j``-th high page), low-tier pages from the
  right (position ``max_pages_per_row - 1 - j`` holds the ``j``-th low page);
  unused positions hold -1.
* ``pages``: int32 ``[rows, 2]`` pages held per tier (high, low), and
  ``tokens``: int32 ``[rows, 2]`` tokens stored per tier;
* ``slot_state``: int32 ``[max_slots]``, a :class:`SlotState`.

Workflows (each call is atomic: it either fully happens or changes nothing):

* prompt: :meth:`PageManager.reserve_prompt` before prefill reserves, per
  row, :meth:`~.page_format.PageFormat.prompt_reserve_pages` pages (all tokens high
  precision, plus one); :meth:`PageManager.commit_prompt` after the policy has
  split the prompt into ``h`` high and ``l`` low tokens per head keeps
  ``ceil(h/P_high)`` pages on the left, moves ``ceil(l/P_low)`` pages to the
  right end and returns the surplus to the ring.
* decode: :meth:`PageManager.append_decode` takes each head's change of high
  and low token counts (-1, 0 or +1 per tier); a head takes one page for a
  tier whose last page is full. Counts may shrink (pruning) but no page
  returns before the request ends (paper).
* finish / abort: :meth:`PageManager.release` returns every page of the slots
  at once, whatever state they are in.
* out of pages: a call whose total need exceeds the free count changes nothing
  and raises :attr:`PageStatus.OUT_OF_PAGES` in the status word that
  :meth:`PageManager.read_status` returns (so does :attr:`PageStatus.ROW_FULL`
  when a row would outgrow ``max_pages_per_row``).

Canonical order (what makes the GPU implementation bit-identical to this one):
the calls visit rows item by item, ``item = slot_index * rows_per_slot +
layer * num_kv_heads + head`` with ``slot_index`` the position in ``slots``;
within an item high pages come before low pages, each in token order. Pages
are taken from the ring front and appended at its back in that order.

Errors: a wrong shape, dtype or value of an argument (a slot out of range or
listed twice, a slot in the wrong state, a count below zero, a delta outside
{-1, 0, 1}, a split needing more pages than were reserved) raises
``ValueError`` naming the argument and the first offending slot, layer and
head, before anything changes. The GPU implementation checks values on the
device instead (status :attr:`PageStatus.INVALID`) unless built with
``validate=True``.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from .page_format import MAX_PAGES, PageFormat
from ..validators import positive_int


class PageStatus(enum.IntFlag):
    """Bits of the status word; several can be set at once. 0 is success."""

    OK = 0
    OUT_OF_PAGES = 1
    """The call needed more pages than were free; nothing changed. Preempt or wait."""
    ROW_FULL = 2
    """A row would need more than ``max_pages_per_row`` pages (request longer than ``max_seq_len_tokens``); nothing changed."""
    INVALID = 4
    """GPU only (``validate=False``): an argument value was invalid; nothing changed."""


class SlotState(enum.IntEnum):
    """Lifecycle of a request slot."""

    FREE = 0
    RESERVED = 1  # prompt pages reserved, tiers not yet committed
    ACTIVE = 2  # committed; decoding


class StepStatus(NamedTuple):
    """Result of :meth:`PageManager.read_status`: status bits since the last read, and free pages now."""

    status: PageStatus
    free_pages: int


@dataclass
class PageTableSnapshot:
    """Host copy of a manager's whole state, for tests, checks and restores.

    Attributes:
        ring: int32 ``[num_pages]`` raw ring array (free ids between start and end).
        ring_start, ring_end: int64 counters; ``free = ring_end - ring_start``.
        page_table: int32 ``[max_slots, num_layers, num_kv_heads, max_pages_per_row]``.
        pages: int32 ``[max_slots, num_layers, num_kv_heads, 2]`` pages per tier (high, low).
        tokens: int32 ``[max_slots, num_layers, num_kv_heads, 2]`` tokens per tier.
        slot_state: int32 ``[max_slots]`` :class:`SlotState` values.
        status: pending status bits (not yet read).
    """

    ring: torch.Tensor
    ring_start: int
    ring_end: int
    page_table: torch.Tensor
    pages: torch.Tensor
    tokens: torch.Tensor
    slot_state: torch.Tensor
    status: int

    @property
    def num_pages(self) -> int:
        return self.ring.numel()

    @property
    def free_pages(self) -> int:
        return self.ring_end - self.ring_start

    def free_page_ids(self) -> torch.Tensor:
        """int64 ``[free_pages]``: the free ids in ring order (next allocated first)."""
        idx = (self.ring_start + torch.arange(self.free_pages, dtype=torch.int64)) % self.num_pages
        return self.ring.to(torch.int64)[idx]

    def diff(self, other: "PageTableSnapshot") -> list[str]:
        """Names of the fields that differ from ``other`` (empty when identical)."""
        names = ("ring", "ring_start", "ring_end", "page_table", "pages", "tokens", "slot_state", "status")
        out = []
        for name in names:
            a, b = getattr(self, name), getattr(other, name)
            same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            if not same:
                out.append(name)
        return out

    def check(self, page_format: PageFormat) -> None:
        """Check every invariant of the manager; raise ``AssertionError`` naming the first broken one.

        Invariants: ``0 <= free <= num_pages``; the free ids and the ids in the
        table are together a permutation of ``0..num_pages-1`` (free + owned =
        total, no page owned twice or both free and owned); every row holds page
        ids exactly at ``[0, pages_high)`` and ``[R - pages_low, R)`` and -1
        elsewhere; tokens fit in the pages held; free slots hold nothing and
        reserved ones hold only the reservation.
        """
        num_pages, free = self.num_pages, self.free_pages
        assert 0 <= free <= num_pages, f"free pages {free} outside [0, {num_pages}]"
        table = self.page_table.reshape(-1, self.page_table.shape[-1])
        owned = table[table >= 0].to(torch.int64)
        assert free + owned.numel() == num_pages, f"free {free} + owned {owned.numel()} != total {num_pages}"
        seen = torch.bincount(torch.cat([self.free_page_ids(), owned]), minlength=num_pages)
        assert seen.numel() == num_pages and bool((seen == 1).all()), (
            f"page ids not a permutation: ids {torch.nonzero(seen != 1).flatten()[:8].tolist()} seen != once"
        )
        pages = self.pages.reshape(-1, 2).to(torch.int64)
        tokens = self.tokens.reshape(-1, 2).to(torch.int64)
        width = table.shape[1]
        pos = torch.arange(width)
        expect = (pos < pages[:, :1]) | (pos >= width - pages[:, 1:])
        assert bool((pages >= 0).all()) and bool((pages.sum(1) <= width).all()), "page counts out of range"
        assert torch.equal(table >= 0, expect), "page table rows disagree with their page counts"
        assert bool((tokens >= 0).all()), "negative token count"
        capacity = pages * torch.tensor([page_format.high_tokens_per_page, page_format.low_tokens_per_page])
        assert bool((tokens <= capacity).all()), "a row stores more tokens than its pages hold"
        state = self.slot_state.to(torch.int64).repeat_interleave(pages.shape[0] // self.slot_state.numel())
        assert bool(((state >= 0) & (state <= 2)).all()), "unknown slot state"
        assert bool((pages[state == SlotState.FREE] == 0).all()), "a free slot holds pages"
        reserved = state == SlotState.RESERVED
        assert bool((pages[reserved, 1] == 0).all() & (tokens[reserved] == 0).all()), (
            "a reserved row holds low pages or tokens")
        if bool((self.slot_state == SlotState.FREE).all()):
            assert free == num_pages, f"idle pool holds {free} free pages of {num_pages}"


def _as_index(name: str, value, device: torch.device) -> torch.Tensor:
    tensor = torch.as_tensor(value, device=device)
    if tensor.numel() == 0 and not isinstance(value, torch.Tensor):
        tensor = tensor.to(torch.int64)  # an empty list
    if tensor.dtype == torch.bool or tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        raise ValueError(f"{name} must hold integers, got dtype {tensor.dtype}")
    return tensor


class PageManager(abc.ABC):
    """Common API of the page managers (CPU: :class:`CpuPageManager`, GPU: ``TritonPageManager``).

    Args:
        page_format: the pool's :class:`~.page_format.PageFormat`.
        num_pages: pages in the pool, ``1 <= num_pages <= 2**31 - 1``
            (:meth:`PageFormat.pages_in_budget`).
        max_slots: request slots (rows of the page table / batch capacity).
        num_layers, num_kv_heads: model shape; ``rows_per_slot = num_layers * num_kv_heads``.
        max_seq_len_tokens: longest request; sets ``max_pages_per_row =
            ceil(max_seq_len_tokens / min_tokens_per_page) + 1`` (the +1: a split
            into high and low tokens can take one page more than all-high).

    Every mutating call takes ``slots``: integer ``[n]`` distinct slot ids in
    ``[0, max_slots)``, and per-head tensors shaped ``[n, num_layers,
    num_kv_heads]``. Calls return nothing; their outcome accumulates in the
    status word read by :meth:`read_status`.

    Raises:
        ValueError: a non-positive size, or too many pages for int32 ids.
    """

    def __init__(
        self,
        page_format: PageFormat,
        num_pages: int,
        max_slots: int,
        num_layers: int,
        num_kv_heads: int,
        max_seq_len_tokens: int,
    ) -> None:
        for name, value in (("num_pages", num_pages), ("max_slots", max_slots), ("num_layers", num_layers),
                            ("num_kv_heads", num_kv_heads), ("max_seq_len_tokens", max_seq_len_tokens)):
            positive_int(name, value)
        if num_pages > MAX_PAGES:
            raise ValueError(f"num_pages={num_pages} exceeds {MAX_PAGES} (page ids are int32)")
        self.page_format = page_format
        self.num_pages = num_pages
        self.max_slots = max_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.max_seq_len_tokens = max_seq_len_tokens
        self.rows_per_slot = num_layers * num_kv_heads
        self.max_pages_per_row = -(-max_seq_len_tokens // page_format.min_tokens_per_page) + 1
        self.high_tokens_per_page = page_format.high_tokens_per_page
        self.low_tokens_per_page = page_format.low_tokens_per_page

    # ----------------------------------------------------------- host-side sizing
    def reserve_pages_needed(self, prompt_tokens: Sequence[int]) -> int:
        """Pages :meth:`reserve_prompt` takes for prompts of these lengths (host arithmetic, no device access)."""
        return self.rows_per_slot * sum(self.page_format.prompt_reserve_pages(int(n)) for n in prompt_tokens)

    def worst_case_decode_pages(self, num_requests: int, low_tier_grows: bool = True) -> int:
        """Most pages one :meth:`append_decode` of ``num_requests`` requests can take: one per tier per row, or
        one per row when ``low_tier_grows`` is false (every ``low_delta`` 0: a policy that keeps every token
        high, ``decisions.append_only``)."""
        return (2 if low_tier_grows else 1) * self.rows_per_slot * num_requests

    @property
    def bookkeeping_bytes(self) -> int:
        """Bytes of the ring, page table and per-row counters (outside the KV pool)."""
        rows = self.max_slots * self.rows_per_slot
        return 4 * (self.num_pages + rows * (self.max_pages_per_row + 4) + self.max_slots)

    # ----------------------------------------------------------- public API
    def reserve_prompt(self, slots, prompt_tokens) -> None:
        """Reserve pages for new prompts, all tokens counted high precision (before prefill).

        Args:
            slots: integer ``[n]`` slot ids, each :attr:`SlotState.FREE`.
            prompt_tokens: integer ``[n]`` prompt lengths, each >= 1.

        Each row of each slot gets :meth:`PageFormat.prompt_reserve_pages` pages at the left
        of its table row; the slots become :attr:`SlotState.RESERVED`. Needs
        :meth:`reserve_pages_needed` free pages, else nothing changes
        (``OUT_OF_PAGES``; ``ROW_FULL`` for a prompt beyond ``max_seq_len_tokens``).
        """
        slots = self._slots_arg(slots)
        prompt = self._per_request_arg("prompt_tokens", prompt_tokens, slots.numel())
        if self._validate_values:
            self._check_slot_values(slots)
            state, _, _ = self._host_state(slots)
            self._check_state(slots, state, SlotState.FREE, "reserve_prompt")
            host = prompt.cpu()
            bad = torch.nonzero(host < 1).flatten()
            if bad.numel():
                i = int(bad[0])
                raise ValueError(f"prompt_tokens[{i}]={int(host[i])} for slot {int(slots[i])} must be >= 1")
        if slots.numel():
            self._reserve(slots, prompt)

    def commit_prompt(self, slots, high_tokens, low_tokens) -> None:
        """Fit reserved rows to the policy's split: keep high pages, move low pages right, reclaim surplus.

        Args:
            slots: integer ``[n]`` slot ids, each :attr:`SlotState.RESERVED`.
            high_tokens: integer ``[n, num_layers, num_kv_heads]`` high-tier tokens per head.
            low_tokens: integer ``[n, num_layers, num_kv_heads]`` low-tier tokens per head.

        Row keeps ``ceil(h / P_high)`` pages at positions ``[0, kh)``; the last
        ``ceil(l / P_low)`` reserved pages move to the right end (a constant shift
        of ``R - reserved``, order kept: reserved position ``C-1-j`` becomes low
        page ``j``); reserved positions ``[kh, C - kl)`` return to the ring.
        Cannot run out of pages. Slots become :attr:`SlotState.ACTIVE`.

        Raises:
            ValueError: a count below zero, or a split needing more pages than
                reserved (impossible when ``h + l <= prompt_tokens``).
        """
        slots = self._slots_arg(slots)
        high = self._per_head_arg("high_tokens", high_tokens, slots.numel())
        low = self._per_head_arg("low_tokens", low_tokens, slots.numel())
        if self._validate_values:
            self._check_slot_values(slots)
            state, pages, _ = self._host_state(slots)
            self._check_state(slots, state, SlotState.RESERVED, "commit_prompt")
            h, l = high.cpu().to(torch.int64).flatten(), low.cpu().to(torch.int64).flatten()
            self._check_rows(slots, (h < 0) | (l < 0), "high_tokens and low_tokens must be >= 0")
            need = -(-h // self.high_tokens_per_page) - (-l // self.low_tokens_per_page)
            self._check_rows(slots, need > pages[:, 0].to(torch.int64), "the split needs more pages than were reserved")
        if slots.numel():
            self._commit(slots, high, low)

    def append_decode(self, slots, high_delta, low_delta) -> None:
        """Apply one decode step's token-count changes; a head takes a page when a tier's last page is full.

        Args:
            slots: integer ``[n]`` slot ids, each :attr:`SlotState.ACTIVE`.
            high_delta: integer ``[n, num_layers, num_kv_heads]`` in {-1, 0, 1}:
                change of each head's high-tier token count (new token +1,
                demotion or pruning -1).
            low_delta: the same for the low tier.

        A row takes one high page when ``h + dh > pages_high * P_high`` (at
        position ``pages_high``) and one low page when ``l + dl > pages_low *
        P_low`` (at position ``R - 1 - pages_low``); shrinking frees nothing.
        Needs at most :meth:`worst_case_decode_pages`; if fewer are free nothing
        changes (``OUT_OF_PAGES``).

        Raises:
            ValueError: delta outside {-1, 0, 1} or a count going below zero.
        """
        slots = self._slots_arg(slots)
        dh = self._per_head_arg("high_delta", high_delta, slots.numel(), allow_bool=True)
        dl = self._per_head_arg("low_delta", low_delta, slots.numel(), allow_bool=True)
        if self._validate_values:
            self._check_slot_values(slots)
            state, _, tokens = self._host_state(slots)
            self._check_state(slots, state, SlotState.ACTIVE, "append_decode")
            a, b = dh.cpu().to(torch.int64).flatten(), dl.cpu().to(torch.int64).flatten()
            self._check_rows(slots, (a.abs() > 1) | (b.abs() > 1), "high_delta and low_delta must be in {-1, 0, 1}")
            self._check_rows(slots, (tokens[:, 0] + a < 0) | (tokens[:, 1] + b < 0), "a token count would go below zero")
        if slots.numel():
            self._decode(slots, dh, dl)

    def release(self, slots) -> None:
        """Finish or abort requests: every page of the slots returns to the ring at once.

        Args:
            slots: integer ``[n]`` slot ids in any state (a free slot is a no-op).

        Pages return high first then low, each in token order; rows reset to
        -1, counts to 0, slots to :attr:`SlotState.FREE`. Never fails.
        """
        slots = self._slots_arg(slots)
        if self._validate_values:
            self._check_slot_values(slots)
        if slots.numel():
            self._release(slots)

    @abc.abstractmethod
    def read_status(self) -> StepStatus:
        """Status bits of the calls since the last read, and the free page count; clears the bits.

        On the GPU this is the one small device-to-host read per step.
        """

    def free_pages(self) -> int:
        """Free pages now (a device read on the GPU; the status bits stay)."""
        start, end, _ = self.snapshot_counters()
        return end - start

    @abc.abstractmethod
    def snapshot_counters(self) -> tuple[int, int, int]:
        """``(ring_start, ring_end, status)`` as host ints."""

    @abc.abstractmethod
    def snapshot(self) -> PageTableSnapshot:
        """Host copy of the whole state."""

    @abc.abstractmethod
    def load_snapshot(self, snapshot: PageTableSnapshot) -> None:
        """Replace the whole state with ``snapshot`` (same geometry)."""

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any invariant is broken (see :meth:`PageTableSnapshot.check`)."""
        self.snapshot().check(self.page_format)

    # ----------------------------------------------------------- implementation hooks
    _validate_values = True
    device = torch.device("cpu")

    @abc.abstractmethod
    def _host_state(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host copies: slot_state of ``slots`` ``[n]``, pages ``[n*G, 2]`` and tokens ``[n*G, 2]`` of their rows."""

    @abc.abstractmethod
    def _reserve(self, slots: torch.Tensor, prompt: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def _commit(self, slots: torch.Tensor, high: torch.Tensor, low: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def _decode(self, slots: torch.Tensor, dh: torch.Tensor, dl: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def _release(self, slots: torch.Tensor) -> None: ...

    # ----------------------------------------------------------- argument checks
    def _slots_arg(self, slots) -> torch.Tensor:
        tensor = _as_index("slots", slots, self.device)
        if tensor.dim() != 1:
            raise ValueError(f"slots must be 1-D [n], got shape {tuple(tensor.shape)}")
        return tensor

    def _per_request_arg(self, name: str, value, n: int) -> torch.Tensor:
        tensor = _as_index(name, value, self.device)
        if tuple(tensor.shape) != (n,):
            raise ValueError(f"{name} must have shape [{n}], got {tuple(tensor.shape)}")
        return tensor

    def _per_head_arg(self, name: str, value, n: int, allow_bool: bool = False) -> torch.Tensor:
        tensor = torch.as_tensor(value, device=self.device)
        if allow_bool and tensor.dtype == torch.bool:
            tensor = tensor.to(torch.int8)
        tensor = _as_index(name, tensor, self.device)
        shape = (n, self.num_layers, self.num_kv_heads)
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} must have shape [n, num_layers, num_kv_heads] = {list(shape)}, got {list(tensor.shape)}")
        return tensor.contiguous()

    def _check_slot_values(self, slots: torch.Tensor) -> None:
        host = slots.cpu().to(torch.int64)
        bad = torch.nonzero((host < 0) | (host >= self.max_slots)).flatten()
        if bad.numel():
            raise ValueError(f"slots[{int(bad[0])}]={int(host[bad[0]])} is outside [0, {self.max_slots})")
        if torch.unique(host).numel() != host.numel():
            raise ValueError(f"slots must be distinct, got {host.tolist()}")

    def _check_state(self, slots: torch.Tensor, state: torch.Tensor, allowed: SlotState, call: str) -> None:
        bad = torch.nonzero(state != allowed).flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"{call}: slot {int(slots[i])} is {SlotState(int(state[i])).name}, must be {allowed.name}"
            )

    def _check_rows(self, slots: torch.Tensor, bad_rows: torch.Tensor, message: str) -> None:
        bad = torch.nonzero(bad_rows).flatten()
        if bad.numel():
            item = int(bad[0])
            slot = int(slots[item // self.rows_per_slot])
            layer, head = divmod(item % self.rows_per_slot, self.num_kv_heads)
            raise ValueError(f"{message}: slot {slot}, layer {layer}, KV head {head}")

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        """int64 ``[n * rows_per_slot]`` table rows of ``slots`` in canonical item order."""
        g = self.rows_per_slot
        return (slots.to(torch.int64)[:, None] * g + torch.arange(g, device=slots.device)).reshape(-1)


class CpuPageManager(PageManager):
    """The page manager on host tensors: the oracle for the GPU one and the CPU product path.

    Same API and results as ``TritonPageManager``. Vectorized torch over all
    rows of a call (no Python loop over requests, layers or heads); state is
    kept in CPU int32 tensors as described in the module docstring.
    """

    def __init__(self, page_format, num_pages, max_slots, num_layers, num_kv_heads, max_seq_len_tokens) -> None:
        super().__init__(page_format, num_pages, max_slots, num_layers, num_kv_heads, max_seq_len_tokens)
        rows = max_slots * self.rows_per_slot
        self.ring = torch.arange(num_pages, dtype=torch.int32)
        self.ring_start, self.ring_end, self.status = 0, num_pages, 0
        self.page_table = torch.full((rows, self.max_pages_per_row), -1, dtype=torch.int32)
        self.pages = torch.zeros(rows, 2, dtype=torch.int32)
        self.tokens = torch.zeros(rows, 2, dtype=torch.int32)
        self.slot_state = torch.zeros(max_slots, dtype=torch.int32)
        self._pos = torch.arange(self.max_pages_per_row)

    # ----------------------------------------------------------- ring
    def _take(self, count: int) -> torch.Tensor:
        """Allocate ``count`` ids from the ring front (int32 ``[count]``)."""
        idx = (self.ring_start + torch.arange(count)) % self.num_pages
        self.ring_start += count
        return self.ring[idx]

    def _give(self, ids: torch.Tensor) -> None:
        """Append ``ids`` at the ring back."""
        idx = (self.ring_end + torch.arange(ids.numel())) % self.num_pages
        self.ring[idx] = ids.to(torch.int32)
        self.ring_end += ids.numel()

    def _refuse(self, status: PageStatus) -> bool:
        self.status |= int(status)
        return status != PageStatus.OK

    # ----------------------------------------------------------- operations
    def _reserve(self, slots, prompt) -> None:
        p_min = self.page_format.min_tokens_per_page
        per_row = (prompt.to(torch.int64) + p_min - 1) // p_min + 1  # PageFormat.prompt_reserve_pages
        counts = per_row.repeat_interleave(self.rows_per_slot)
        total = int(counts.sum())
        status = PageStatus.ROW_FULL if bool((per_row > self.max_pages_per_row).any()) else PageStatus.OK
        if self._refuse(status | (PageStatus.OUT_OF_PAGES if total > self.free_pages() else 0)):
            return
        rows = self._rows(slots)
        tile = torch.full((rows.numel(), self.max_pages_per_row), -1, dtype=torch.int32)
        tile[self._pos < counts[:, None]] = self._take(total)  # row-major = canonical order
        self.page_table[rows] = tile
        self.pages[rows] = torch.stack([counts, torch.zeros_like(counts)], 1).to(torch.int32)
        self.tokens[rows] = 0
        self.slot_state[slots.to(torch.int64)] = SlotState.RESERVED

    def _commit(self, slots, high, low) -> None:
        rows = self._rows(slots)
        h, l = high.to(torch.int64).flatten(), low.to(torch.int64).flatten()
        kh = (h + self.high_tokens_per_page - 1) // self.high_tokens_per_page
        kl = (l + self.low_tokens_per_page - 1) // self.low_tokens_per_page
        reserved = self.pages[rows, 0].to(torch.int64)
        tile, pos, width = self.page_table[rows], self._pos, self.max_pages_per_row
        self._give(tile[(pos >= kh[:, None]) & (pos < (reserved - kl)[:, None])])
        moved = torch.gather(tile, 1, (pos + (reserved - width)[:, None]).clamp(min=0))
        tile = torch.where(pos < kh[:, None], tile, torch.where(pos >= (width - kl)[:, None], moved, -1))
        self.page_table[rows] = tile
        self.pages[rows] = torch.stack([kh, kl], 1).to(torch.int32)
        self.tokens[rows] = torch.stack([h, l], 1).to(torch.int32)
        self.slot_state[slots.to(torch.int64)] = SlotState.ACTIVE

    def _decode(self, slots, dh, dl) -> None:
        rows = self._rows(slots)
        pages, tokens = self.pages[rows].to(torch.int64), self.tokens[rows].to(torch.int64)
        new_tokens = tokens + torch.stack([dh.flatten(), dl.flatten()], 1).to(torch.int64)
        capacity = pages * torch.tensor([self.high_tokens_per_page, self.low_tokens_per_page])
        need = (new_tokens > capacity).to(torch.int64)  # [k, 2]: one page per tier at most
        total = int(need.sum())
        status = PageStatus.ROW_FULL if bool(((pages + need).sum(1) > self.max_pages_per_row).any()) else PageStatus.OK
        if self._refuse(status | (PageStatus.OUT_OF_PAGES if total > self.free_pages() else 0)):
            return
        ids = self._take(total)
        offset = (torch.cumsum(need.flatten(), 0) - need.flatten()).reshape(-1, 2)  # exclusive, high before low
        hi, lo = need[:, 0].bool(), need[:, 1].bool()
        self.page_table[rows[hi], pages[hi, 0]] = ids[offset[hi, 0]]
        self.page_table[rows[lo], self.max_pages_per_row - 1 - pages[lo, 1]] = ids[offset[lo, 1]]
        self.pages[rows] = (pages + need).to(torch.int32)
        self.tokens[rows] = new_tokens.to(torch.int32)

    def _release(self, slots) -> None:
        rows = self._rows(slots)
        tile, pos, width = self.page_table[rows], self._pos, self.max_pages_per_row
        nh, nl = self.pages[rows, 0].to(torch.int64)[:, None], self.pages[rows, 1].to(torch.int64)[:, None]
        order = torch.where(pos < nh, pos, width - 1 - (pos - nh))  # high pages, then low pages in token order
        self._give(torch.gather(tile, 1, order)[pos < nh + nl])
        self.page_table[rows] = -1
        self.pages[rows] = 0
        self.tokens[rows] = 0
        self.slot_state[slots.to(torch.int64)] = SlotState.FREE

    # ----------------------------------------------------------- state access
    def _host_state(self, slots):
        slots = slots.to(torch.int64)
        rows = self._rows(slots)
        return self.slot_state[slots], self.pages[rows], self.tokens[rows]

    def read_status(self) -> StepStatus:
        status, self.status = self.status, 0
        return StepStatus(PageStatus(status), self.ring_end - self.ring_start)

    def snapshot_counters(self) -> tuple[int, int, int]:
        return self.ring_start, self.ring_end, self.status

    def snapshot(self) -> PageTableSnapshot:
        shape = (self.max_slots, self.num_layers, self.num_kv_heads)
        return PageTableSnapshot(
            ring=self.ring.clone(),
            ring_start=self.ring_start,
            ring_end=self.ring_end,
            page_table=self.page_table.reshape(*shape, -1).clone(),
            pages=self.pages.reshape(*shape, 2).clone(),
            tokens=self.tokens.reshape(*shape, 2).clone(),
            slot_state=self.slot_state.clone(),
            status=self.status,
        )

    def load_snapshot(self, snapshot: PageTableSnapshot) -> None:
        self.ring.copy_(snapshot.ring)
        self.ring_start, self.ring_end, self.status = snapshot.ring_start, snapshot.ring_end, snapshot.status
        self.page_table.copy_(snapshot.page_table.reshape(self.page_table.shape))
        self.pages.copy_(snapshot.pages.reshape(-1, 2))
        self.tokens.copy_(snapshot.tokens.reshape(-1, 2))
        self.slot_state.copy_(snapshot.slot_state)
