"""Per-step DiffKV decisions for every row of the decode requests, in one batched pass (paper section 4.2).

The step that writes position ``pos`` of a request decides first, from the
scores accumulated through the previous step (the authors' order, ``DiffKV.md``
"Where the authors' code and the paper text differ"; :mod:`trtllm_diffkv.policy`):

* candidate = the token at position ``cand = pos - max(W, 1)`` (found in the
  high tier through the position segment); importance = score /
  :func:`~trtllm_diffkv.policy.query_counts` (``seq_len = pos``); tier by
  ``alpha / N`` with ``N = pos``;
* candidate HIGH: victim = least important HIGH token at positions <= cand
  (candidate included; ties -> lowest position), re-tiered;
  candidate LOW: victim = least important LOW token at positions <= cand, the
  candidate included, re-tiered but never promoted; candidate PRUNED: no victim.

What this module returns is where things go, tiers kept dense (no holes): the
new token takes the high slot the step frees (the victim's, or the departing
candidate's) or is appended; a token that moves to the low tier is appended
there or takes a pruned low victim's slot. Per row, ``(high_delta,
low_delta)`` in {0, +1}:

=====================================  ==========  ======================  =====================
case                                   deltas      moved high -> low       new token's high slot
=====================================  ==========  ======================  =====================
no candidate yet / fp16 preset         (+1, 0)     -                       append (index h)
cand HIGH, victim stays                (+1, 0)     -                       append (index h)
cand HIGH, victim demoted              (0, +1)     victim -> low index l   victim's slot
cand HIGH, victim pruned               (0, 0)      -                       victim's slot
cand LOW, victim stays (or is cand)    (0, +1)     cand -> low index l     candidate's slot
cand LOW, low victim pruned            (0, 0)      cand -> victim's slot   candidate's slot
cand PRUNED                            (0, 0)      -                       candidate's slot
=====================================  ==========  ======================  =====================

Rows of a sliding-window layer (window ``W``; :mod:`trtllm_diffkv.policy`, any preset) take no
decision from scores: their high tier holds exactly the window, the prompt's last ``min(n, W)`` tokens
written at indices ``0..`` in position order (``prefill.py``), and each step's new token replaces the
token at ``pos - W``, which no later query reaches. By induction token ``t`` sits at high index
``(t - max(n - W, 0)) mod W``, so the step writing ``pos`` puts its token at ``(pos - max(n - W, 0))
mod W``: appended (``(+1, 0)``) while ``pos < W``, in the departing token's slot (``(0, 0)``) after;
nothing moves to the low tier (:func:`slide_windows`). Why a formula and not the scan that finds a full layer's
candidate by position: the fp16 preset's pages carry no position segment (its bytes are FP16's), and
every preset must keep exactly the window; the formula is O(1) per row, needs no metadata and is the same
for every preset and on both paths (the Triton kernel skips the scan of these rows). The tests check the kept positions against the
window itself (``tests/paged/test_sliding_window.py``), not against this formula.

:func:`decide` is the reference and the torch path; the Triton path computes
the same actions bit for bit in one launch
(:func:`trtllm_diffkv.kernels.decision_kernel.decide_rows`,
``tests/kernels/test_decision_kernel.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory import KVCachePool
from ..policy import TIER_HIGH, TIER_LOW, TIER_PRUNED, tier_of, tier_thresholds
from .gather import gather_tier


@dataclass
class StepActions:
    """What one decode step does to each row (all tensors ``[m]``, on the rows' device).

    Attributes:
        high_delta, low_delta: int32 in {0, 1}: the page manager's ``append_decode`` input.
        new_index: int64 high-tier index the new token is written to.
        move_from: int64 high-tier index of the token moving to the low tier, -1 if none.
        move_to: int64 low-tier index it goes to, -1 if none.
    """

    high_delta: torch.Tensor
    low_delta: torch.Tensor
    new_index: torch.Tensor
    move_from: torch.Tensor
    move_to: torch.Tensor


def counts_for(positions: torch.Tensor, prompt_len: torch.Tensor, pos: torch.Tensor, window: int) -> torch.Tensor:
    """fp32 queries that scored each token by the decision of the step writing ``pos`` (:func:`policy.query_counts`)."""
    p = positions.long()
    pl, n = prompt_len.long()[:, None], pos.long()[:, None]
    from_prompt = torch.where(p < pl, torch.minimum(pl - p, torch.full_like(p, window)), torch.zeros_like(p))
    from_decode = (n - torch.maximum(p, pl)).clamp(min=0)
    return (from_prompt + from_decode).float()


def _argmin_importance(importance: torch.Tensor, positions: torch.Tensor, eligible: torch.Tensor):
    """Per row: index of the eligible column of least importance, ties to the lowest position; and that importance."""
    inf = torch.full_like(importance, float("inf"))
    masked = torch.where(eligible, importance, inf)
    best = masked.amin(1)
    tie = eligible & (masked == best[:, None])
    big = torch.full_like(positions, torch.iinfo(torch.int32).max)
    index = torch.where(tie, positions, big).argmin(1)
    return index, best


def decide(pool: KVCachePool, page_table: torch.Tensor, tier_tokens: torch.Tensor, rows: torch.Tensor,
           pos: torch.Tensor, prompt_len: torch.Tensor, *, alpha_high: float, alpha_low: float,
           recent_window_tokens: int, prompt_score_window_tokens: int, max_pos: int) -> StepActions:
    """Decisions of one decode step for ``m`` rows (paper section 4.2; module docstring).

    Args:
        pool, page_table, tier_tokens: the pages and the manager's ``page_table``
            int32 ``[rows, R]`` and ``tokens`` int32 ``[rows, 2]`` before the step.
        rows: int64 ``[m]`` table rows.
        pos: int64 ``[m]`` position the step writes (tokens stored before it).
        prompt_len: int64 ``[m]`` prompt length of each row's request.
        max_pos: host bound on ``pos`` (sizes the gathers; no device read).

    Returns:
        :class:`StepActions`.
    """
    fmt = pool.page_format
    m = rows.numel()
    dev = rows.device
    cand = pos - max(recent_window_tokens, 1)
    has_cand = cand >= 0
    h_count = tier_tokens[rows, 0].long()
    l_count = tier_tokens[rows, 1].long()
    wh = -(-max(max_pos, 1) // fmt.high_tokens_per_page) * fmt.high_tokens_per_page
    wl = -(-max(max_pos, 1) // fmt.low_tokens_per_page) * fmt.low_tokens_per_page
    high = gather_tier(pool, page_table, tier_tokens, rows, "high", wh)
    low = gather_tier(pool, page_table, tier_tokens, rows, "low", wl)
    n = pos.clamp(min=1)
    thr_h, thr_l = tier_thresholds(alpha_high, n)[:, None], tier_thresholds(alpha_low, n)[:, None]
    imp_h = high.scores / counts_for(high.positions, prompt_len, pos, prompt_score_window_tokens).clamp(min=1)
    imp_l = low.scores / counts_for(low.positions, prompt_len, pos, prompt_score_window_tokens).clamp(min=1)

    is_cand = high.valid & (high.positions.long() == cand[:, None])
    ic = is_cand.to(torch.int8).argmax(1)
    found = has_cand & is_cand.any(1)
    imp_c = imp_h.gather(1, ic[:, None])
    c_tier = tier_of(imp_c, thr_h, thr_l)[:, 0]

    # candidate HIGH: least important high token at positions <= cand
    elig_h = high.valid & (high.positions.long() <= cand[:, None])
    iv_h, imp_vh = _argmin_importance(imp_h, high.positions, elig_h)
    vh_tier = tier_of(imp_vh[:, None], thr_h, thr_l)[:, 0]
    # candidate LOW: least important of the low tokens and the candidate (ties: the low token, lower position)
    iv_l, imp_vl = _argmin_importance(imp_l, low.positions, low.valid)
    victim_is_cand = imp_c[:, 0] < imp_vl  # inf when the low tier is empty
    imp_v = torch.where(victim_is_cand, imp_c[:, 0], imp_vl)
    vl_tier = tier_of(imp_v[:, None], thr_h, thr_l)[:, 0]
    vl_pruned = vl_tier == TIER_PRUNED  # never for the candidate itself (it classified LOW)

    one, zero, neg = torch.ones(m, dtype=torch.long, device=dev), torch.zeros(m, dtype=torch.long, device=dev), \
        torch.full((m,), -1, dtype=torch.long, device=dev)
    c_high, c_low = found & (c_tier == TIER_HIGH), found & (c_tier == TIER_LOW)  # PRUNED: new token in its slot
    v_stays, v_demoted = vh_tier == TIER_HIGH, vh_tier == TIER_LOW

    dh = torch.where(~found | (c_high & v_stays), one, zero)
    dl = torch.where((c_high & v_demoted) | (c_low & ~vl_pruned), one, zero)
    new_index = torch.where(~found | (c_high & v_stays), h_count, torch.where(c_high, iv_h, ic))
    move_from = torch.where(c_high & v_demoted, iv_h, torch.where(c_low, ic, neg))
    move_to = torch.where((c_high & v_demoted) | (c_low & ~vl_pruned), l_count, torch.where(c_low, iv_l, neg))
    return StepActions(dh.to(torch.int32), dl.to(torch.int32), new_index, move_from, move_to)


def slide_windows(act: StepActions, rows: torch.Tensor, tier_tokens: torch.Tensor, pos: torch.Tensor,
                  prompt_len: torch.Tensor, row_windows: torch.Tensor) -> StepActions:
    """``act`` with the rows of sliding-window layers replaced by the window's actions (module docstring).

    Args:
        act: the step's actions from :func:`decide` or :func:`append_only`.
        rows: int64 ``[m]`` table rows; tier_tokens: the manager's ``tokens`` before the step.
        pos: int64 ``[m]`` the position each row's step writes; prompt_len: int64 ``[m]`` its prompt's tokens.
        row_windows: int ``[m]`` each row's layer window, 0 for a full-attention layer (left as ``act`` has it).

    Returns:
        :class:`StepActions`: sliding rows ``(+1, 0)`` appended while ``pos < W``, else ``(0, 0)`` at high index
        ``(pos - max(prompt_len - W, 0)) mod W``; no move.
    """
    sliding = row_windows > 0
    w = row_windows.long().clamp(min=1)
    append = pos < w
    ring = (pos - (prompt_len.long() - w).clamp(min=0)) % w
    neg = torch.full_like(act.move_from, -1)
    return StepActions(torch.where(sliding, append.to(torch.int32), act.high_delta),
                       torch.where(sliding, torch.zeros_like(act.low_delta), act.low_delta),
                       torch.where(sliding, torch.where(append, tier_tokens[rows, 0].long(), ring), act.new_index),
                       torch.where(sliding, neg, act.move_from), torch.where(sliding, neg, act.move_to))


def append_only(rows: torch.Tensor, tier_tokens: torch.Tensor) -> StepActions:
    """Actions of a step that keeps every token (fp16 preset): the new token appended to the high tier."""
    m, dev = rows.numel(), rows.device
    neg = torch.full((m,), -1, dtype=torch.long, device=dev)
    return StepActions(torch.ones(m, dtype=torch.int32, device=dev), torch.zeros(m, dtype=torch.int32, device=dev),
                       tier_tokens[rows, 0].long(), neg, neg.clone())
