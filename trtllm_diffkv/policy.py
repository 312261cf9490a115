"""DiffKV token policy: scores in, tier decisions out. Pure functions.

Rules (paper section 4.2; ``DiffKV.md`` "Policy details"). Where the paper text
and the authors' released code differ, these follow the code, on which the
paper's thresholds were calibrated (README, "How the rules are implemented"):

* Importance of a token = mean attention probability it received from the
  queries that scored it.
* Prompt phase: only the last ``prompt_score_window_tokens`` (S) queries score.
  Per query head, the probabilities a token receives are summed over those
  queries; the KV head takes the max of the sums over its query heads
  (:func:`prompt_score_sums`). Token ``p`` (0-based) has importance
  ``sum / min(prompt_len - p, S)`` and is compared with ``alpha / prompt_len``
  (the code's rule; ``threshold_base="position"`` gives the paper text's
  ``alpha / (p + 1)``). The last ``recent_window_tokens`` prompt tokens stay high.
* Generation phase, the step that writes position ``pos``: the decision comes
  first, from the scores accumulated through the previous step: the token
  leaving the recent window (the candidate, position ``pos - W``) is compared
  with ``alpha / N``, ``N = pos`` (the tokens those scores cover), then the
  least important token of the tier it joined (the victim) is re-checked: it
  stays, is demoted (high -> low) or pruned (:func:`decode_step`). Then the new
  token is written at high precision, attention runs, and each KV head adds
  the max over its query heads of this step's probability to every kept
  token's score (:func:`merge_query_heads`). Each step changes a head's high
  and low token counts by 0 or +1 each.

* Sliding-window attention layers (``LayerSettings.sliding_window_tokens`` =
  ``W``, Gemma 3's local layers): the query at position ``i`` attends keys
  ``i - W < j <= i`` (:func:`window_attention_mask`), so a key is reachable by
  no later query once ``W`` newer tokens exist. Such a layer has a per-layer
  recent window of ``W`` tokens, kept high, and every token leaving it is
  pruned at the step that makes it unreachable, whatever its score and
  whatever the preset (``fp16`` and ``k8v4`` too): at prefill every prompt
  token older than ``prompt_len - W`` (:func:`prompt_tiers` with
  ``sliding_window_tokens``), in decode the token at ``pos - W`` at the step
  writing ``pos`` (:func:`sliding_window_decision`), before the step's
  attention, which then reads exactly the window. Each step still changes a
  head's high count by 0 or +1 (+1 only while ``pos < W``) and never its low
  count. Full-attention layers follow the rules above unchanged.

Tier codes are small integers shared by every layer of the system (cache,
page manager, kernels): :data:`TIER_PRUNED`, :data:`TIER_HIGH`, :data:`TIER_LOW`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

TIER_PRUNED = 0
TIER_HIGH = 1
TIER_LOW = 2


def merge_query_heads(probs: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Merge the query heads of each KV head by max (GQA/MHA rule, edge case 10).

    Args:
        probs: ``[num_heads, ...]`` attention probabilities, query head first;
            query head ``h`` belongs to KV head ``h // (num_heads // num_kv_heads)``.
        num_kv_heads: KV heads; must divide ``num_heads``.

    Returns:
        ``[num_kv_heads, ...]``, the max over each group's query heads.

    Raises:
        ValueError: ``num_heads`` not a multiple of ``num_kv_heads``.
    """
    num_heads = probs.shape[0]
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    return probs.reshape(num_kv_heads, num_heads // num_kv_heads, *probs.shape[1:]).amax(1)


def prompt_score_sums(last_query_probs: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Accumulated prompt scores from the last prompt queries (the authors' GQA merge).

    Per query head the probabilities each token receives are summed over the
    scoring queries; each KV head then takes the max of those sums over its
    query heads (``DiffKV.md``, "Where the authors' code and the paper text
    differ"). Taking the max per query first and summing after gives larger
    scores; that order is not used.

    Args:
        last_query_probs: ``float32 [num_heads, num_scoring_queries, prompt_len]``
            causal attention probabilities of the last ``num_scoring_queries``
            prompt queries (zeros where masked).
        num_kv_heads: KV heads.

    Returns:
        ``float32 [num_kv_heads, prompt_len]``: per KV head, the max over its
        query heads of the per-head sum over the scoring queries.

    Raises:
        ValueError: ``num_heads`` not a multiple of ``num_kv_heads``.
    """
    return merge_query_heads(last_query_probs.float().sum(1), num_kv_heads)


def query_counts(positions: torch.Tensor, prompt_len: int, seq_len: int, prompt_score_window_tokens: int) -> torch.Tensor:
    """How many queries have added to each token's score.

    A prompt token ``p`` was scored by the last ``min(prompt_len - p, S)``
    prompt queries (S = ``prompt_score_window_tokens``); every generation-phase
    query ``q`` (``prompt_len <= q < seq_len``) scores every token ``p <= q``.

    Args:
        positions: ``int64 [...]`` 0-based token positions, all ``< seq_len``.
        prompt_len: tokens in the prompt.
        seq_len: tokens whose queries have scored so far (prompt + generated).
            At the decision of the step that writes position ``pos`` this is
            ``pos``: the new token's query has not run yet.
        prompt_score_window_tokens: S.

    Returns:
        ``float32 [...]``, at least 1 for every valid position.
    """
    p = positions.long()
    from_prompt = torch.where(p < prompt_len, (prompt_len - p).clamp(max=prompt_score_window_tokens), 0)
    from_decode = (seq_len - torch.clamp(p, min=prompt_len)).clamp(min=0)
    return (from_prompt + from_decode).float()


def tier_thresholds(alpha: float, length: torch.Tensor | float) -> torch.Tensor:
    """The threshold ``alpha / N`` a token's importance is compared with (paper section 4.2), as fp32.

    The one home of the threshold rule: the reference cache, the paged cache's torch decisions and its
    prefill plan call it; the decision kernel (``kernels/decision_kernel.py``) computes the same in Triton,
    pinned bit-identical to the torch decisions by ``tests/kernels/test_decision_kernel.py``.

    Args:
        alpha: ``alpha_high`` or ``alpha_low``.
        length: the N of ``alpha / N``: a scalar, or a tensor (any dtype, any device).

    Returns:
        ``float32`` tensor of ``length``'s shape: the quotient in fp64, rounded once to fp32 (what comparing
        an fp32 importance with the Python float ``alpha / N`` does).
    """
    return (alpha / torch.as_tensor(length, dtype=torch.float64)).float()


def tier_of(importance: torch.Tensor, high_threshold: torch.Tensor, low_threshold: torch.Tensor) -> torch.Tensor:
    """Tier codes by threshold: ``> high_threshold`` high, ``>= low_threshold`` low, else pruned.

    Args:
        importance: ``float32 [...]`` mean attention received.
        high_threshold, low_threshold: ``float32`` tensors broadcastable to ``importance``
            (:func:`tier_thresholds`), or Python floats holding such an fp32 value.

    Returns:
        ``int8 [...]`` tier codes (:data:`TIER_HIGH`, :data:`TIER_LOW`, :data:`TIER_PRUNED`).
    """
    tier = torch.where(importance >= low_threshold, TIER_LOW, TIER_PRUNED)
    return torch.where(importance > high_threshold, TIER_HIGH, tier).to(torch.int8)


def classify(importance: torch.Tensor, alpha_high: float, alpha_low: float, length: torch.Tensor | float) -> torch.Tensor:
    """Tier of each token by threshold: > alpha_high/length high, >= alpha_low/length low, else pruned.

    Args:
        importance: ``float32 [...]`` mean attention received.
        length: the N of ``alpha / N``: a scalar, or a tensor broadcastable to ``importance``.

    Returns:
        ``int8 [...]`` tier codes.
    """
    if isinstance(length, (int, float)):  # Python floats: no host-to-device copy of a threshold per call
        return tier_of(importance, _scalar_threshold(alpha_high, float(length)),
                       _scalar_threshold(alpha_low, float(length)))
    device = importance.device
    return tier_of(importance, tier_thresholds(alpha_high, length).to(device),
                   tier_thresholds(alpha_low, length).to(device))


@functools.lru_cache(maxsize=4096)
def _scalar_threshold(alpha: float, length: float) -> float:
    """:func:`tier_thresholds` of a scalar as a Python float (an fp32 value, so comparing an fp32
    importance with it is comparing with the fp32 tensor), computed once per ``(alpha, length)``."""
    return float(tier_thresholds(alpha, length))


def pool_importance(importance: torch.Tensor, score_pool_tokens: int) -> torch.Tensor:
    """Max-pool importance over each token's neighbours (``DiffKVConfig.score_pool_tokens``).

    Token ``p`` takes the max over tokens ``p - r .. p + r`` (``r = score_pool_tokens // 2``,
    clipped at the sequence's ends), so the tokens of a span one query attends to sharply are
    tiered together. SnapKV (arXiv:2404.14469, section 4.2) pools its observation window's scores
    the same way (``max_pool1d``, stride 1, padding ``kernel // 2``) before selecting.

    Args:
        importance: ``float32 [num_kv_heads, num_tokens]`` of one sequence.
        score_pool_tokens: odd window width; 1 returns ``importance`` unchanged.

    Returns:
        ``float32 [num_kv_heads, num_tokens]``.
    """
    if score_pool_tokens <= 1 or importance.shape[-1] == 0:
        return importance
    return torch.nn.functional.max_pool1d(importance[:, None, :], score_pool_tokens, stride=1,
                                          padding=score_pool_tokens // 2)[:, 0, :]


def window_attention_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                          sliding_window_tokens: int | None) -> torch.Tensor:
    """Which keys each query attends: causal, and within the sliding window when one is given.

    The one home of the masking rule every torch attention path uses (transformers' ``causal_mask_function``
    and ``sliding_window_overlay``: ``kv_idx <= q_idx`` and ``kv_idx > q_idx - W``).

    Args:
        query_positions: int ``[m]`` absolute positions of the queries.
        key_positions: int ``[n]`` absolute positions of the keys.
        sliding_window_tokens: ``W`` or ``None`` (full causal attention).

    Returns:
        bool ``[m, n]``: ``True`` where query ``i`` attends key ``j``.
    """
    qp, kp = query_positions[:, None], key_positions[None, :]
    mask = kp <= qp
    if sliding_window_tokens is not None:
        mask &= kp > qp - sliding_window_tokens
    return mask


def reachable_tokens(seq_len: int, sliding_window_tokens: int | None) -> int:
    """Tokens of a sequence of ``seq_len`` that a layer's next query can attend, which is what every cache keeps
    of it at most: ``min(seq_len, W)`` for a sliding-window layer, ``seq_len`` for a full one. The memory figures
    count these for FP16 as for DiffKV (an FP16 engine holds only the window of a sliding layer too)."""
    return seq_len if sliding_window_tokens is None else min(seq_len, sliding_window_tokens)


def sliding_window_prompt_tiers(num_kv_heads: int, prompt_len: int, sliding_window_tokens: int,
                                device: torch.device | str = "cpu") -> torch.Tensor:
    """Prompt tiers of a sliding-window layer (module docstring): ``int8 [num_kv_heads, prompt_len]``, the last
    ``W`` tokens :data:`TIER_HIGH`, every older one :data:`TIER_PRUNED` (out of every later query's reach)."""
    tier = torch.full((num_kv_heads, prompt_len), TIER_PRUNED, dtype=torch.int8, device=device)
    tier[:, max(prompt_len - sliding_window_tokens, 0):] = TIER_HIGH
    return tier


def prompt_tiers(score_sums: torch.Tensor, alpha_high: float, alpha_low: float,
                 recent_window_tokens: int, prompt_score_window_tokens: int,
                 threshold_base: str = "prompt_len", score_pool_tokens: int = 1,
                 sliding_window_tokens: int | None = None) -> torch.Tensor:
    """Prompt-phase tiers (paper section 4.2, "prompt phase").

    Args:
        score_sums: ``float32 [num_kv_heads, prompt_len]`` from :func:`prompt_score_sums`.
        alpha_high, alpha_low: threshold multipliers.
        recent_window_tokens: the last W prompt tokens are always high.
        prompt_score_window_tokens: queries that scored (for the mean).
        threshold_base: ``"prompt_len"`` (default, the authors' code): every
            token is compared with ``alpha / prompt_len``; ``"position"``: token
            ``p`` with ``alpha / (p + 1)`` (the paper text's ``alpha / i``).
        score_pool_tokens: importance is max-pooled over this many neighbouring
            tokens before the comparison (:func:`pool_importance`; 1 = off).
        sliding_window_tokens: ``W`` of a sliding-window layer (module docstring): the
            last ``W`` tokens high, every older one pruned, the scores and thresholds
            unused; ``None`` (full attention): the rules above.

    Raises:
        ValueError: unknown ``threshold_base``.

    Returns:
        ``int8 [num_kv_heads, prompt_len]`` tier codes.
    """
    prompt_len = score_sums.shape[-1]
    if sliding_window_tokens is not None:
        return sliding_window_prompt_tiers(score_sums.shape[0], prompt_len, sliding_window_tokens, score_sums.device)
    positions = torch.arange(prompt_len, device=score_sums.device)
    counts = query_counts(positions, prompt_len, prompt_len, prompt_score_window_tokens)
    if threshold_base == "position":
        length = (positions + 1).float()
    elif threshold_base == "prompt_len":
        length = float(prompt_len)
    else:
        raise ValueError(f"threshold_base={threshold_base!r}; allowed: 'position', 'prompt_len'")
    tier = classify(pool_importance(score_sums / counts, score_pool_tokens), alpha_high, alpha_low, length)
    tier[:, max(prompt_len - recent_window_tokens, 0):] = TIER_HIGH
    return tier


@dataclass(frozen=True)
class DecodeDecision:
    """What one generation step does to one layer's tiers.

    Attributes:
        candidate_tier: ``int8 [num_kv_heads]`` new tier of the token leaving
            the recent window (at position ``candidate_pos``).
        victim_pos: ``int64 [num_kv_heads]`` position of the re-checked least
            important token of the tier the candidate joined; -1 when none.
        victim_tier: ``int8 [num_kv_heads]`` its new tier (unchanged = stays).
    """

    candidate_tier: torch.Tensor
    victim_pos: torch.Tensor
    victim_tier: torch.Tensor


def decode_candidate_pos(pos: int, recent_window_tokens: int) -> int:
    """Position of the token that leaves the recent window at the step writing ``pos``.

    After the step the window holds the newest ``W`` tokens ``pos - W + 1 ..
    pos``, so the candidate is ``pos - W``; negative means none yet. A new token
    is always written at high precision and can only be tiered once a query
    has scored it, so ``W = 0`` behaves as ``W = 1`` here (candidate
    ``pos - 1``; in the prompt phase ``W = 0`` forces nothing high).
    """
    return pos - max(recent_window_tokens, 1)


def sliding_window_decision(num_kv_heads: int, device: torch.device | str = "cpu") -> DecodeDecision:
    """The decision of a sliding-window layer at a step with a candidate (``decode_candidate_pos(pos, W) >= 0``,
    ``W`` the layer's window): the candidate, now out of every later query's reach, is pruned on every KV head,
    no victim is re-checked (module docstring)."""
    pruned = torch.full((num_kv_heads,), TIER_PRUNED, dtype=torch.int8, device=device)
    return DecodeDecision(pruned, torch.full((num_kv_heads,), -1, dtype=torch.long, device=device), pruned.clone())


def decode_step(tiers: torch.Tensor, importance: torch.Tensor, seq_len: int,
                alpha_high: float, alpha_low: float) -> DecodeDecision:
    """Generation-phase decision for the token leaving the recent window.

    Made at the start of the step that writes position ``pos``, before the new
    token is written, from the scores accumulated through the previous step
    (the authors' order).

    Args:
        tiers: ``int8 [num_kv_heads, candidate_pos + 1]`` current tiers of every
            token outside the recent window; the last column is the candidate
            (still marked high, as every window token is).
        importance: ``float32`` same shape, mean attention received so far
            (score / :func:`query_counts` with ``seq_len = pos``).
        seq_len: N of the thresholds ``alpha / N``: ``pos``, the number of
            tokens the scores were accumulated over.
        alpha_high, alpha_low: threshold multipliers.

    Returns:
        :class:`DecodeDecision`. Applying it changes the high and the low
        count of each head by at most one.
    """
    imp_c = importance[:, -1]
    cand = classify(imp_c, alpha_high, alpha_low, float(seq_len))
    after = tiers.clone()
    after[:, -1] = cand
    num_kv_heads = tiers.shape[0]
    victim_pos = torch.full((num_kv_heads,), -1, dtype=torch.long, device=tiers.device)
    victim_tier = torch.full((num_kv_heads,), TIER_PRUNED, dtype=torch.int8, device=tiers.device)
    for joined in (TIER_HIGH, TIER_LOW):  # both branches on every head (no host sync); `heads` selects
        heads = cand == joined
        masked = torch.where(after == joined, importance, torch.full_like(importance, float("inf")))
        pos = masked.argmin(-1)
        imp_v = importance.gather(-1, pos[:, None])[:, 0]
        new = classify(imp_v, alpha_high, alpha_low, float(seq_len))
        if joined == TIER_LOW:  # a low victim is never promoted
            new = torch.where(new == TIER_HIGH, torch.full_like(new, TIER_LOW), new)
        victim_pos = torch.where(heads, pos, victim_pos)
        victim_tier = torch.where(heads, new, victim_tier)
    return DecodeDecision(cand, victim_pos, victim_tier)
