"""Loop-based DiffKV tier rules: the independent oracle of ``trtllm_diffkv.policy``.

Rules (authors' released code, ``DiffKV.md`` "Policy details" and "Where the
authors' code and the paper text differ"):

Prompt phase (prompt of ``prompt_len`` tokens, S = ``min(prompt_score_window_tokens,
prompt_len)`` scoring queries, W = ``recent_window_tokens``):
    importance[t] = score_sum[t] / min(prompt_len - t, S)
    HIGH if importance > alpha_high / L, LOW if >= alpha_low / L, else PRUNED,
    with L = prompt_len (``"prompt_len"``) or t + 1 (``"position"``);
    the last W prompt tokens are HIGH whatever their importance.

Decode step writing position ``pos`` (the sequence holds ``pos`` tokens):
    candidate cand = pos - max(W, 1) (no decision when negative); N = pos;
    count(t) = min(prompt_len - t, S) for a prompt token, plus the
    pos - max(t, prompt_len) decode queries that already saw t;
    importance = score / count (fp32, as the cache stores scores);
    candidate HIGH -> victim = least important HIGH token at positions <= cand
    (candidate included, ties -> lowest position), re-classified;
    candidate LOW -> the candidate becomes LOW, victim = least important LOW
    token at positions <= cand, re-classified but never promoted;
    candidate PRUNED -> pruned, no victim.

Tier codes are the storage format the whole system shares; they are restated
here (and pinned against the library's in a test) rather than imported.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PRUNED, HIGH, LOW = 0, 1, 2
"""Tier codes (int8 in the cache)."""

AMBIGUITY_RTOL = 1e-6
"""A comparison closer than this (relative; about 8 fp32 ulps) depends on rounding: the oracle refuses to judge it."""


class AmbiguousDecision(Exception):
    """An importance lies within :data:`AMBIGUITY_RTOL` of a threshold or of another victim candidate."""


def importance_f32(score: float, count: int) -> float:
    """``score / count`` rounded as fp32 division rounds it (the cache keeps fp32 scores)."""
    return float(np.float32(score) / np.float32(count))


def _check_margin(value: float, threshold: float) -> None:
    if value != threshold and abs(value - threshold) <= AMBIGUITY_RTOL * abs(threshold):
        raise AmbiguousDecision(f"importance {value!r} within {AMBIGUITY_RTOL} of threshold {threshold!r}")


def classify(importance: float, alpha_high: float, alpha_low: float, n: float) -> int:
    """HIGH if ``importance > alpha_high / n``; LOW if ``>= alpha_low / n``; else PRUNED.

    Raises:
        AmbiguousDecision: ``importance`` within rounding distance of a threshold.
    """
    high_thr, low_thr = alpha_high / n, alpha_low / n
    _check_margin(importance, high_thr)
    _check_margin(importance, low_thr)
    if importance > high_thr:
        return HIGH
    if importance >= low_thr:
        return LOW
    return PRUNED


def prompt_query_count(t: int, prompt_len: int, prompt_score_window_tokens: int) -> int:
    """How many of the last ``S`` prompt queries (positions ``>= t``) scored prompt token ``t``."""
    first_scoring = prompt_len - min(prompt_score_window_tokens, prompt_len)
    return sum(1 for query in range(first_scoring, prompt_len) if query >= t)


def decode_query_count(t: int, pos: int, prompt_len: int, prompt_score_window_tokens: int) -> int:
    """Queries that have added to token ``t``'s score before the step writing ``pos``.

    The prompt's scoring queries (for a prompt token), then every decode query
    at positions ``prompt_len .. pos - 1`` that is at or after ``t``.
    """
    count = prompt_query_count(t, prompt_len, prompt_score_window_tokens) if t < prompt_len else 0
    for query in range(prompt_len, pos):
        if query >= t:
            count += 1
    return count


def prompt_tiers(score_sums: list[float], alpha_high: float, alpha_low: float, recent_window_tokens: int,
                 prompt_score_window_tokens: int, threshold_base: str = "prompt_len",
                 score_pool_tokens: int = 1) -> list[int]:
    """Tiers of one KV head's prompt tokens.

    Args:
        score_sums: ``prompt_len`` floats, the stored score of each prompt token.
        threshold_base: ``"prompt_len"`` (L = prompt_len) or ``"position"`` (L = t + 1).
        score_pool_tokens: token ``t`` is tiered by the largest importance of tokens
            ``t - w // 2 .. t + w // 2`` (those that exist), ``w`` this width.

    Returns:
        ``prompt_len`` tier codes.

    Raises:
        AmbiguousDecision: a token on a threshold within rounding.
    """
    prompt_len = len(score_sums)
    tiers = []
    for t in range(prompt_len):
        if t >= prompt_len - recent_window_tokens:
            tiers.append(HIGH)
            continue
        half = score_pool_tokens // 2
        importance = max(importance_f32(score_sums[u], prompt_query_count(u, prompt_len, prompt_score_window_tokens))
                         for u in range(max(t - half, 0), min(t + half, prompt_len - 1) + 1))
        length = prompt_len if threshold_base == "prompt_len" else t + 1
        tiers.append(classify(importance, alpha_high, alpha_low, length))
    return tiers


@dataclass
class DecodeOutcome:
    """One head's decision at one decode step.

    Attributes:
        tiers: tier codes of positions ``0 .. pos - 1`` after the decision.
        candidate: position of the token leaving the window, or -1 (no decision).
        candidate_tier: its new tier (-1 when no decision).
        victim: position of the re-checked token, or -1.
        victim_before, victim_tier: its tier before and after.
    """

    tiers: list[int]
    candidate: int = -1
    candidate_tier: int = -1
    victim: int = -1
    victim_before: int = -1
    victim_tier: int = -1

    @property
    def kind(self) -> str:
        """A label for coverage counting, e.g. ``"cand=LOW victim LOW->PRUNED"``."""
        names = {HIGH: "HIGH", LOW: "LOW", PRUNED: "PRUNED"}
        if self.candidate < 0:
            return "no decision"
        label = f"cand={names[self.candidate_tier]}"
        if self.victim >= 0:
            label += f" victim {names[self.victim_before]}->{names[self.victim_tier]}"
            label += " (self)" if self.victim == self.candidate else ""
        return label


def decode_candidate(pos: int, recent_window_tokens: int) -> int:
    """The token leaving the recent window at the step writing ``pos``: ``pos - W`` (negative: none).

    ``W = 0`` counts as ``W = 1`` (the lead's documented choice: the new token
    has not been scored yet, so the newest tokenable one is ``pos - 1``).
    """
    return pos - max(recent_window_tokens, 1)


def decide(tiers: list[int], importance: list[float], cand: int, n: float, alpha_high: float,
           alpha_low: float) -> DecodeOutcome:
    """Tier the candidate and re-check a victim, given every token's importance.

    Args:
        tiers: tier codes of positions ``0 .. len - 1`` (at least ``cand + 1``).
        importance: the same length, importance of each token (only ``0 .. cand`` are read).
        cand: the candidate's position.
        n: the N of ``alpha / N``.

    Returns:
        :class:`DecodeOutcome` (``tiers`` a new list).

    Raises:
        AmbiguousDecision: a comparison decided by rounding alone.
    """
    after = list(tiers)
    cand_tier = classify(importance[cand], alpha_high, alpha_low, n)
    after[cand] = cand_tier
    outcome = DecodeOutcome(after, cand, cand_tier)
    if cand_tier == PRUNED:
        return outcome
    victim, best = -1, None
    for t in range(cand + 1):
        if after[t] != cand_tier:
            continue
        value = importance[t]
        if best is not None and value != best and abs(value - best) <= AMBIGUITY_RTOL * abs(best):
            raise AmbiguousDecision(f"victim candidates {victim} and {t} within rounding")
        if best is None or value < best:  # strict: ties keep the lowest position
            victim, best = t, value
    new_tier = classify(best, alpha_high, alpha_low, n)
    if cand_tier == LOW and new_tier == HIGH:
        new_tier = LOW  # a low victim is never promoted
    outcome.victim, outcome.victim_before, outcome.victim_tier = victim, cand_tier, new_tier
    after[victim] = new_tier
    return outcome


def decode_decision(tiers: list[int], scores: list[float], pos: int, prompt_len: int, recent_window_tokens: int,
                    prompt_score_window_tokens: int, alpha_high: float, alpha_low: float) -> DecodeOutcome:
    """The decision of the decode step writing ``pos``, for one KV head.

    Args:
        tiers: ``pos`` tier codes before the step (the window's tokens HIGH).
        scores: ``pos`` accumulated scores before the step (fp32 values).
        pos: position of the token this step writes (``pos >= prompt_len``).

    Returns:
        :class:`DecodeOutcome`; N = ``pos``.

    Raises:
        AmbiguousDecision: a comparison decided by rounding alone.
    """
    cand = decode_candidate(pos, recent_window_tokens)
    if cand < 0:
        return DecodeOutcome(list(tiers))
    importance = [importance_f32(scores[t], decode_query_count(t, pos, prompt_len, prompt_score_window_tokens))
                  for t in range(cand + 1)]
    return decide(tiers, importance, cand, pos, alpha_high, alpha_low)
