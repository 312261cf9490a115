"""The unified page format: one frozen spec every kernel and size calculation reads.

DiffKV stores the KV cache in *unified pages* (paper section 5; ``DiffKV.md``,
"Memory manager"): every page of a pool has the same byte size, and one page
holds tokens of exactly one (request, layer, KV head) at one precision tier.
A page is six segments, each starting on an ``alignment_bytes`` boundary so a
warp reads it with full, coalesced sectors::

    [key codes | key scale/zero | value codes | value scale/zero | score fp32 | position int32]

* key / value codes: ``tokens x head_dim x bits / 8`` bytes of packed codes
  (16 bits: plain fp16). The order of codes inside the segment belongs to the
  kernels that write and read them (``cache/``, ``kernels/``).
* key / value scale/zero: ``[tokens, groups, 2]`` fp16 (scale, zero) per
  quantization group; empty for a 16-bit side.
* score: ``[tokens]`` fp32 accumulated attention score; position: ``[tokens]``
  int32 token position. Both are present when the configuration tiers tokens
  (``DiffKVConfig.tiered``), as :func:`DiffKVConfig.token_bytes` counts.

Because the tiers differ in bytes per token, they differ in tokens per page:
:attr:`TierLayout.tokens_per_page` is the largest token count whose aligned
segments fit in the page.

How the page size is chosen
---------------------------
The page is sized for the high tier: ``high_tokens_per_page`` (default 32, the
authors' choice) tokens of the high tier, segments aligned, rounded up to
128 bytes so every page starts on a cache line. The low tier then takes as many
tokens as fit. For head_dim 128 and the default tiers this gives 6784-byte
pages, 32 tokens at K8V4 (0 bytes of slack) and 52 at K4V2 with 2/4
quantization groups (128 bytes = 1.9 % of slack). With the authors' 1-group
K4V2 the same rule gives their 60 tokens, and their 24 at K8V8 and 13 at FP16
(see the tests). Per (request, layer, KV head) the expected tail waste is about
half a page per tier in use (the last, partly filled page); 32 high tokens is a
trade between that tail (smaller pages) and page-table size / contiguous
attention loads (larger pages). ``waste_bytes`` reports the per-page slack of a
tier; :meth:`PageFormat.describe` prints the whole layout.

How many pages fit
------------------
``pages_in_budget(memory_bytes) = memory_bytes // page_size_bytes``: 100 GiB of
6784-byte pages is 15,827,562 pages. Page ids are int32, so a pool holds at
most ``2**31 - 1`` pages (about 13.2 TiB of 6784-byte pages). The page table and
free list are separate and small (:class:`~.page_manager.PageManager`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import SUPPORTED_HEAD_DIMS, TOKEN_METADATA_BYTES, DiffKVConfig, TierConfig
from ..validators import is_int, positive_int

PAGE_BASE_ALIGNMENT_BYTES = 128
"""Pages start on 128-byte (cache-line) boundaries: the page size is a multiple of this."""

MAX_PAGES = 2**31 - 1
"""Page ids are int32."""

SEGMENT_NAMES = ("key_codes", "key_meta", "value_codes", "value_meta", "score", "position")
"""The six segments of a page, in page order."""

TIERS = ("high", "low")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Segment:
    """One segment of a page: byte offset from the page start and byte size (padded to alignment)."""

    offset_bytes: int
    size_bytes: int


@dataclass(frozen=True)
class TierLayout:
    """Where each segment of one tier lies inside a page.

    Attributes:
        tier: the storage format (bits and groups) of this tier.
        tokens_per_page: tokens of one (request, layer, KV head) a page holds.
        token_bytes: bytes one token takes, unaligned, metadata included.
        key_codes, key_meta, value_codes, value_meta, score, position: the six
            segments, in page order (see the module docstring for their dtypes).
        used_bytes: end of the last segment (<= the page size).
    """

    tier: TierConfig
    tokens_per_page: int
    token_bytes: int
    key_codes: Segment
    key_meta: Segment
    value_codes: Segment
    value_meta: Segment
    score: Segment
    position: Segment

    @property
    def used_bytes(self) -> int:
        return self.position.offset_bytes + self.position.size_bytes

    def segment(self, name: str) -> Segment:
        """The segment called ``name`` (one of :data:`SEGMENT_NAMES`)."""
        if name not in SEGMENT_NAMES:
            raise ValueError(f"unknown page segment {name!r}; segments: {list(SEGMENT_NAMES)}")
        return getattr(self, name)

    def waste_bytes(self, page_size_bytes: int) -> int:
        """Bytes of a full page not holding token data (alignment padding and the tail)."""
        return page_size_bytes - self.tokens_per_page * self.token_bytes


def _segment_sizes(tier: TierConfig, head_dim: int, tokens: int, with_token_metadata: bool) -> list[int]:
    sizes = []
    for bits, groups in ((tier.key_bits, tier.key_groups), (tier.value_bits, tier.value_groups)):
        sizes.append(tokens * head_dim * bits // 8)
        sizes.append(tokens * groups * 4 if bits < 16 else 0)  # fp16 scale + fp16 zero per group
    meta = tokens * 4 if with_token_metadata else 0
    return sizes + [meta, meta]  # score fp32, position int32


def _layout(tier: TierConfig, head_dim: int, tokens: int, alignment_bytes: int, with_token_metadata: bool) -> TierLayout:
    offset, segments = 0, []
    for size in _segment_sizes(tier, head_dim, tokens, with_token_metadata):
        padded = _round_up(size, alignment_bytes)
        segments.append(Segment(offset, padded))
        offset += padded
    token_bytes = tier.token_bytes(head_dim) + (TOKEN_METADATA_BYTES if with_token_metadata else 0)
    return TierLayout(tier, tokens, token_bytes, *segments)


def _check_alignment(alignment_bytes: int) -> None:
    if not is_int(alignment_bytes) or alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
        raise ValueError(f"alignment_bytes={alignment_bytes!r} must be a positive power of two")


def tier_layout(
    tier: TierConfig,
    head_dim: int,
    page_size_bytes: int,
    alignment_bytes: int = 32,
    with_token_metadata: bool = True,
) -> TierLayout:
    """The layout holding the most tokens of ``tier`` that fits in ``page_size_bytes``.

    Args:
        tier: storage format of the tier.
        head_dim: one of :data:`~trtllm_diffkv.config.SUPPORTED_HEAD_DIMS`.
        page_size_bytes: size of every page of the pool.
        alignment_bytes: every segment starts on a multiple of this (32 = one
            DRAM sector; the paper uses 32/128).
        with_token_metadata: include the score and position segments.

    Raises:
        ValueError: unsupported head_dim / tier combination, or not even one
            token fits in the page.
    """
    tier.validate_for_head_dim(head_dim)
    _check_alignment(alignment_bytes)
    per_token = tier.token_bytes(head_dim) + (TOKEN_METADATA_BYTES if with_token_metadata else 0)
    tokens = page_size_bytes // per_token  # upper bound; alignment padding only lowers it
    while tokens > 0 and _layout(tier, head_dim, tokens, alignment_bytes, with_token_metadata).used_bytes > page_size_bytes:
        tokens -= 1
    if tokens == 0:
        raise ValueError(f"page_size_bytes={page_size_bytes} holds no token of tier {tier.name} at head_dim={head_dim}")
    return _layout(tier, head_dim, tokens, alignment_bytes, with_token_metadata)


@dataclass(frozen=True)
class PageFormat:
    """Frozen page spec of one pool: page size, tokens per tier, segment offsets.

    Build it with :meth:`for_config`; every kernel and size calculation reads
    this object rather than recomputing sizes.

    Attributes:
        head_dim: head dimension of the model (one of ``SUPPORTED_HEAD_DIMS``).
        page_size_bytes: bytes of every page (a multiple of 128).
        alignment_bytes: segment alignment inside a page.
        high: layout of the high-precision tier.
        low: layout of the low-precision tier.
    """

    head_dim: int
    page_size_bytes: int
    alignment_bytes: int
    high: TierLayout
    low: TierLayout

    @classmethod
    def for_config(
        cls,
        config: DiffKVConfig,
        head_dim: int,
        high_tokens_per_page: int = 32,
        alignment_bytes: int = 32,
    ) -> "PageFormat":
        """The page format for ``config`` at ``head_dim``.

        The page holds ``high_tokens_per_page`` high-tier tokens (aligned
        segments, rounded up to 128 bytes); the low tier takes what fits.

        Raises:
            ValueError: head_dim not in ``SUPPORTED_HEAD_DIMS``, a tier that
                cannot pack at this head_dim, ``high_tokens_per_page`` < 1, or a
                bad alignment.
        """
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim={head_dim} is not supported; allowed values: {list(SUPPORTED_HEAD_DIMS)}")
        positive_int("high_tokens_per_page", high_tokens_per_page)
        _check_alignment(alignment_bytes)
        meta = config.tiered
        config.high.validate_for_head_dim(head_dim)
        sized = _layout(config.high, head_dim, high_tokens_per_page, alignment_bytes, meta)
        page_size = _round_up(sized.used_bytes, max(PAGE_BASE_ALIGNMENT_BYTES, alignment_bytes))
        high = tier_layout(config.high, head_dim, page_size, alignment_bytes, meta)
        low = tier_layout(config.low, head_dim, page_size, alignment_bytes, meta)
        return cls(head_dim, page_size, alignment_bytes, high, low)

    def tier(self, name: str) -> TierLayout:
        """Layout of tier ``name`` ("high" or "low")."""
        if name not in TIERS:
            raise ValueError(f"unknown tier {name!r}; tiers: {list(TIERS)}")
        return getattr(self, name)

    @property
    def high_tokens_per_page(self) -> int:
        return self.high.tokens_per_page

    @property
    def low_tokens_per_page(self) -> int:
        return self.low.tokens_per_page

    @property
    def min_tokens_per_page(self) -> int:
        """Tokens per page of the denser-in-bytes tier (the high tier for every valid config)."""
        return min(self.high.tokens_per_page, self.low.tokens_per_page)

    def pages_for_tokens(self, tier: str, num_tokens: int) -> int:
        """Pages one (request, layer, KV head) needs for ``num_tokens`` tokens of ``tier``."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} must be >= 0")
        return -(-num_tokens // self.tier(tier).tokens_per_page)

    def prompt_reserve_pages(self, prompt_tokens: int) -> int:
        """Pages reserved per (layer, KV head) for a prompt before its tiers are known.

        ``ceil(prompt_tokens / min_tokens_per_page) + 1``: whatever split into
        ``h`` high and ``l`` low tokens (``h + l <= prompt_tokens``) the policy
        later picks, ``ceil(h / P_high) + ceil(l / P_low)`` never exceeds it (the
        paper's "allocate as if all tokens were high precision", plus the one
        page a split can add, e.g. 32 tokens = 1 high page, but 1 high + 31 low
        tokens = 2 pages).
        """
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens={prompt_tokens} must be >= 1")
        return -(-prompt_tokens // self.min_tokens_per_page) + 1

    def pages_in_budget(self, memory_bytes: int) -> int:
        """How many pages fit in ``memory_bytes`` (floor; capped at :data:`MAX_PAGES`).

        Raises:
            ValueError: negative budget.
        """
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes={memory_bytes} must be >= 0")
        return min(int(memory_bytes) // self.page_size_bytes, MAX_PAGES)

    def describe(self) -> str:
        """Human-readable table of the layout (for logs and docs)."""
        lines = [f"page {self.page_size_bytes} B, head_dim {self.head_dim}, segments aligned to {self.alignment_bytes} B"]
        for name in TIERS:
            lay = self.tier(name)
            segs = ", ".join(f"{s}@{lay.segment(s).offset_bytes}+{lay.segment(s).size_bytes}" for s in SEGMENT_NAMES)
            waste = lay.waste_bytes(self.page_size_bytes)
            lines.append(
                f"  {name} {lay.tier.name}: {lay.tokens_per_page} tokens x {lay.token_bytes} B, "
                f"waste {waste} B ({100 * waste / self.page_size_bytes:.1f}%); {segs}"
            )
        return "\n".join(lines)

