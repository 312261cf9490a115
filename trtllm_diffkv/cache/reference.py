"""Reference DiffKV KV cache for one request (exact, slow, not paged).

Storage is indexed by token position: every layer keeps, per KV head, the
dequantized key and value of every kept token at its current tier, the tier
code of every position (high, low or pruned) and the accumulated attention
score. Pruned positions are masked out of attention and cost no bytes in the
memory accounting, which counts exactly what the packed formats
(:mod:`trtllm_diffkv.quant`) plus the per-token score and position take.
The paged, memory-saving layout is :mod:`trtllm_diffkv.memory`; this class is
the oracle its kernels are compared with.

Step protocol (the :class:`~trtllm_diffkv.model.attention_api.AttentionBackend`
contract, one request): the first ``forward`` of each layer is the prefill
(all prompt tokens), each later one a single decode token.

Prefill (paper section 4.2): causal attention over the full-precision prompt
keys and values, then the last ``prompt_score_window_tokens`` queries score
the prompt tokens (per query head summed over the queries, then max over the
KV head's query heads) and every token is stored at its tier.

Decode, the authors' order (``DiffKV.md``, "Where the authors' code and the
paper text differ"): first the decision from the scores through the previous
step: the token leaving the recent window is tiered against ``alpha / N`` and a
victim re-checked (:func:`trtllm_diffkv.policy.decode_step`); then the new
token is written at high precision; then attention reads every kept token and
its probabilities (max over each KV head's query heads) are added to the
scores.

Sliding-window layers (``config.layers``, :meth:`DiffKVConfig.for_model`; every
preset, ``fp16`` included): the prefill attends within the window and keeps the
last ``W`` prompt tokens, pruning the older ones; each decode step prunes the
token at ``pos - W`` before writing ``pos`` (:mod:`trtllm_diffkv.policy`), so
attention reads exactly the window.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import policy
from ..config import DiffKVConfig, TierConfig
from ..model.attention_api import causal_attention
from ..policy import TIER_HIGH, TIER_LOW, TIER_PRUNED
from ..quant import FP16_MAX, check_finite, fake_quantize


@dataclass(frozen=True)
class CacheStats:
    """Memory and tier statistics of a cache, summed over layers and KV heads.

    Attributes:
        seq_len_tokens: tokens processed (prompt + generated so far).
        high_tokens, low_tokens, pruned_tokens: (layer, KV head, token)
            triples in each tier; the recent window counts as high. A
            sliding-window layer counts only the tokens it can still attend
            (:func:`~trtllm_diffkv.policy.reachable_tokens`): those that left its
            window are in no tier.
        kv_cache_bytes: bytes the packed cache takes (codes, fp16 scale/zero,
            fp32 score and int32 position per kept token; no metadata for the
            uncompressed ``fp16`` preset).
        fp16_kv_cache_bytes: an FP16 cache of the same reachable tokens: 2
            bytes x head_dim x 2 (K and V) per token per KV head per layer (an
            FP16 cache, too, holds only the window of a sliding layer).
    """

    seq_len_tokens: int
    high_tokens: int
    low_tokens: int
    pruned_tokens: int
    kv_cache_bytes: int
    fp16_kv_cache_bytes: int

    @property
    def total_tokens(self) -> int:
        return self.high_tokens + self.low_tokens + self.pruned_tokens

    @property
    def kv_memory_fraction(self) -> float:
        """KV memory as a fraction of FP16 (paper: 0.19-0.37)."""
        return self.kv_cache_bytes / self.fp16_kv_cache_bytes if self.fp16_kv_cache_bytes else 0.0

    def fraction(self, tier: str) -> float:
        """Fraction of tokens in ``tier`` ("high", "low", "pruned")."""
        count = {"high": self.high_tokens, "low": self.low_tokens, "pruned": self.pruned_tokens}[tier]
        return count / self.total_tokens if self.total_tokens else 0.0


class DiffKVReferenceCache:
    """Exact DiffKV cache of one request, usable as the model's attention backend.

    Args:
        config: the DiffKV policy; ``config.compress == False`` keeps every
            token unquantized (the ``fp16`` preset).
        num_layers, num_heads, num_kv_heads, head_dim: model shape.
        max_seq_len_tokens: capacity (prompt + new tokens).
        device: where tensors live.

    Raises:
        ValueError: configuration the model cannot run (see
            :meth:`DiffKVConfig.validate_for_model`), a prompt longer than the
            capacity, or a non-finite key/value (naming layer and KV head).
    """

    def __init__(self, config: DiffKVConfig, num_layers: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, max_seq_len_tokens: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        config.validate_for_model(head_dim, num_heads, num_kv_heads, num_layers)
        self.config = config
        self.sliding_windows = config.sliding_windows(num_layers)  # read by the model (attention_api)
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = num_layers, num_heads, num_kv_heads, head_dim
        self.max_seq_len_tokens = max_seq_len_tokens
        store_dtype = torch.float32 if config.compress else dtype
        shape = (num_layers, num_kv_heads, max_seq_len_tokens, head_dim)
        self.keys = torch.zeros(shape, dtype=store_dtype, device=device)
        self.values = torch.zeros(shape, dtype=store_dtype, device=device)
        self.tiers = torch.full(shape[:3], TIER_PRUNED, dtype=torch.int8, device=device)
        self.scores = torch.zeros(shape[:3], dtype=torch.float32, device=device)
        # Per-(layer, KV head) key channel offset subtracted before quantization (config.center_keys).
        self.key_offsets = torch.zeros((num_layers, num_kv_heads, head_dim), dtype=torch.float32, device=device)
        self.prompt_len = 0
        self.seq_len = 0  # tokens fully processed by every layer
        self._layer_seq_len = [0] * num_layers

    # ----------------------------------------------------------------- storage
    def _quantized_keys(self, layer_idx: int, k: torch.Tensor, tier: TierConfig, first_token: int = 0) -> torch.Tensor:
        """Reconstructed keys ``[num_kv_heads, n, head_dim]`` fp32 after quantization at ``tier``.

        Keys are quantized relative to the layer's per-head channel offset,
        which is added back (``config.center_keys``).

        The caller has refused non-finite keys (``check_finite``, once per step).

        Raises:
            ValueError: a key whose distance from the offset is beyond fp16's
                range (the quantizer's zero point is fp16), naming layer, KV
                head, token and the key's own value.
        """
        offset = self.key_offsets[layer_idx][:, None, :]
        centered = k.float() - offset
        if centered.numel() and float(centered.abs().amax()) > FP16_MAX:
            head, token, channel = (int(i) for i in (centered.abs() > FP16_MAX).nonzero()[0])
            raise ValueError(
                f"cannot quantize key: value {float(k[head, token, channel])} at layer {layer_idx}, KV head {head}, "
                f"token {first_token + token}, channel {channel} is {float(centered[head, token, channel])} from the "
                f"head's key offset {float(offset[head, 0, channel])}, beyond the fp16 range of the stored zero point")
        q = fake_quantize(centered, tier.key_bits, tier.key_groups, check=False)
        return q + offset

    def _quantized_values(self, layer_idx: int, v: torch.Tensor, tier: TierConfig) -> torch.Tensor:
        """Reconstructed values at ``tier``; the caller has refused non-finite values (``check_finite``)."""
        return fake_quantize(v, tier.value_bits, tier.value_groups, check=False)

    def _store_tiered(self, layer_idx: int, n: int, k: torch.Tensor, v: torch.Tensor, tiers: torch.Tensor) -> None:
        """Store positions ``0..n-1`` with per-(head, token) tiers ``int8 [num_kv_heads, n]``."""
        high, low = self.config.high, self.config.low
        is_high = (tiers == TIER_HIGH)[..., None]
        keep = (tiers != TIER_PRUNED)[..., None]
        keys = torch.where(is_high, self._quantized_keys(layer_idx, k, high), self._quantized_keys(layer_idx, k, low))
        values = torch.where(is_high, self._quantized_values(layer_idx, v, high), self._quantized_values(layer_idx, v, low))
        self.keys[layer_idx, :, :n] = keys * keep
        self.values[layer_idx, :, :n] = values * keep
        self.tiers[layer_idx, :, :n] = tiers

    def _low_rows(self, layer_idx: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored rows of tokens ``pos[i]`` of KV head ``i % num_kv_heads`` (``int64 [m]``) re-quantized at
        the low format: ``(keys, values)`` ``float32 [m, head_dim]``. Quantization is per row, so each row is
        what quantizing it alone gives."""
        heads = torch.arange(pos.shape[0], device=pos.device) % self.num_kv_heads
        low = self.config.low
        offset = self.key_offsets[layer_idx, heads]
        k = self.keys[layer_idx, heads, pos] - offset
        k_low = fake_quantize(k[:, None], low.key_bits, low.key_groups, check=False)[:, 0] + offset
        v_low = fake_quantize(self.values[layer_idx, heads, pos][:, None], low.value_bits, low.value_groups,
                              check=False)[:, 0]
        return k_low, v_low

    def _retier(self, layer_idx: int, pos: torch.Tensor, new_tier: torch.Tensor, k_low: torch.Tensor,
                v_low: torch.Tensor, only_changed: bool) -> None:
        """Move token ``pos[h]`` of every KV head ``h`` to ``new_tier[h]`` (``int64 [num_kv_heads]``,
        ``int8 [num_kv_heads]``): to low, store ``k_low[h]`` / ``v_low[h]`` (:meth:`_low_rows`); to pruned,
        zero the row; to high, nothing (tokens are never promoted). With ``only_changed`` a token at
        ``new_tier`` already keeps its row. Selected on the device, no host sync."""
        heads = torch.arange(self.num_kv_heads, device=pos.device)
        old_tier = self.tiers[layer_idx, heads, pos]
        k = self.keys[layer_idx, heads, pos]
        v = self.values[layer_idx, heads, pos]
        to_low, to_pruned = new_tier == TIER_LOW, new_tier == TIER_PRUNED
        if only_changed:
            to_low, to_pruned = to_low & (old_tier != TIER_LOW), to_pruned & (old_tier != TIER_PRUNED)
        to_low, to_pruned = to_low[:, None], to_pruned[:, None]
        zero = torch.zeros_like(k)
        self.keys[layer_idx, heads, pos] = torch.where(to_pruned, zero, torch.where(to_low, k_low, k))
        self.values[layer_idx, heads, pos] = torch.where(to_pruned, zero, torch.where(to_low, v_low, v))
        self.tiers[layer_idx, heads, pos] = torch.where((to_low | to_pruned)[:, 0], new_tier, old_tier)

    # --------------------------------------------------------------- attention
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention backend entry point; shapes as in ``AttentionBackend.forward``."""
        start, n = self._check_step(layer_idx, q)
        if start == 0:
            out = self._prefill(layer_idx, q, k, v)
        elif n == 1:
            out = self._decode(layer_idx, q, k, v)
        else:
            raise ValueError("the reference cache takes the whole prompt at once, then one token per step")
        self._advance(layer_idx, start + n)
        return out

    def store_prompt(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The prefill step of :meth:`forward` without its attention output: everything is stored and
        tiered exactly as :meth:`forward` does, for a caller that runs one prefill for several caches
        (the prefill attends over the full-precision prompt whatever the configuration, so one cache's
        output serves all; ``trtllm_diffkv.evaluation.quality``).

        Raises:
            ValueError: as :meth:`forward`, or a layer that has had its prefill already.
        """
        start, n = self._check_step(layer_idx, q)
        if start != 0:
            raise ValueError(f"layer {layer_idx} has had its prefill; store_prompt takes only the prompt")
        self._store_prompt(layer_idx, q, k, v)
        self._advance(layer_idx, n)

    def _check_step(self, layer_idx: int, q: torch.Tensor) -> tuple[int, int]:
        start = self._layer_seq_len[layer_idx]
        n = q.shape[0]
        if start + n > self.max_seq_len_tokens:
            raise ValueError(f"sequence of {start + n} tokens exceeds the cache capacity {self.max_seq_len_tokens}")
        return start, n

    def _advance(self, layer_idx: int, length: int) -> None:
        self._layer_seq_len[layer_idx] = length
        if layer_idx == self.num_layers - 1:
            self.seq_len = length

    def _prefill(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._store_prompt(layer_idx, q, k, v)
        return causal_attention(q, k, v, sliding_window_tokens=self.sliding_windows[layer_idx])

    def _store_prompt(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Score, tier and store the prompt of one layer; returns its ``(keys, values)`` ``[num_kv_heads, n,
        head_dim]`` as given."""
        n = q.shape[0]
        if n == 0:
            raise ValueError("empty prompt: at least one token is needed")
        cfg = self.config
        group = self.num_heads // self.num_kv_heads
        kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [num_kv_heads, n, head_dim]
        check_finite(kh, "key", layer_idx)
        check_finite(vh, "value", layer_idx)
        self.prompt_len = n
        window = self.sliding_windows[layer_idx]
        if not cfg.tiered:  # fp16 and uniform quantization: every token high (but those out of a layer's window)
            untiered = torch.full((self.num_kv_heads, n), TIER_HIGH, dtype=torch.int8, device=kh.device) \
                if window is None else policy.sliding_window_prompt_tiers(self.num_kv_heads, n, window, kh.device)
        if not cfg.compress:
            keep = (untiered != TIER_PRUNED)[..., None]
            self.keys[layer_idx, :, :n] = (kh * keep).to(self.keys.dtype)
            self.values[layer_idx, :, :n] = (vh * keep).to(self.values.dtype)
            self.tiers[layer_idx, :, :n] = untiered
            return kh, vh
        qh = q.transpose(0, 1)
        if cfg.center_keys:
            self.key_offsets[layer_idx] = kh.float().mean(1).to(torch.float16).float()
        if not cfg.tiered:  # uniform quantization: the high tier's format, no scores
            self._store_tiered(layer_idx, n, kh, vh, untiered)
            return kh, vh
        num_scoring = min(cfg.prompt_score_window_tokens, n)
        probs = _causal_probs(qh[:, n - num_scoring:].float(), kh.float(), group, n - num_scoring, window)
        scores = policy.prompt_score_sums(probs, self.num_kv_heads)
        self.scores[layer_idx, :, :n] = scores
        tiers = policy.prompt_tiers(scores, cfg.alpha_high, cfg.alpha_low, cfg.recent_window_tokens,
                                    cfg.prompt_score_window_tokens, cfg.prompt_threshold_base, cfg.score_pool_tokens,
                                    sliding_window_tokens=window)
        self._store_tiered(layer_idx, n, kh, vh, tiers)
        return kh, vh

    def _decode(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        pos = self._layer_seq_len[layer_idx]
        seq_len = pos + 1
        kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [num_kv_heads, 1, head_dim]
        check_finite(kh, "key", layer_idx, first_token=pos)  # refused before anything changes
        check_finite(vh, "value", layer_idx, first_token=pos)
        if self.sliding_windows[layer_idx] is not None:
            self._slide(layer_idx, pos)  # the token leaving the window: no later query reaches it
        elif cfg.tiered:
            self._compact(layer_idx, pos)  # decide from the scores through the previous step
        if cfg.compress:
            self.keys[layer_idx, :, pos] = self._quantized_keys(layer_idx, kh, cfg.high, first_token=pos)[:, 0]
            self.values[layer_idx, :, pos] = self._quantized_values(layer_idx, vh, cfg.high)[:, 0]
        else:
            self.keys[layer_idx, :, pos] = kh[:, 0].to(self.keys.dtype)
            self.values[layer_idx, :, pos] = vh[:, 0].to(self.values.dtype)
        self.tiers[layer_idx, :, pos] = TIER_HIGH
        keys, values = self.keys[layer_idx, :, :seq_len], self.values[layer_idx, :, :seq_len]
        kept = self.tiers[layer_idx, :, :seq_len] != TIER_PRUNED
        out, probs = attend_kept(q[0], keys, values, kept)
        if cfg.tiered:
            # Pruned tokens are masked out of the softmax: their probability is exactly 0.
            self.scores[layer_idx, :, :seq_len] += policy.merge_query_heads(probs, self.num_kv_heads)
        return out[None].to(q.dtype)

    def _slide(self, layer_idx: int, pos: int) -> None:
        """Prune the token leaving a sliding-window layer's window before position ``pos`` is written (every
        preset; :func:`policy.sliding_window_decision`)."""
        cand = policy.decode_candidate_pos(pos, self.sliding_windows[layer_idx])
        if cand < 0:
            return
        decision = policy.sliding_window_decision(self.num_kv_heads, self.scores.device)
        cand_pos = torch.full((self.num_kv_heads,), cand, dtype=torch.long, device=self.scores.device)
        unused = self.keys.new_zeros(self.num_kv_heads, self.head_dim)  # no row goes to the low tier
        self._retier(layer_idx, cand_pos, decision.candidate_tier, unused, unused, only_changed=False)

    def _compact(self, layer_idx: int, pos: int) -> None:
        """Tier the token leaving the recent window and re-check a victim, before position ``pos`` is written.

        Uses the scores accumulated through the previous step: importance =
        score / :func:`policy.query_counts` with ``seq_len = pos``, thresholds
        ``alpha / pos``.
        """
        cfg = self.config
        cand = policy.decode_candidate_pos(pos, cfg.recent_window_tokens)
        if cand < 0:
            return  # everything still fits in the recent window
        positions = torch.arange(cand + 1, device=self.scores.device)
        counts = policy.query_counts(positions, self.prompt_len, pos, cfg.prompt_score_window_tokens)
        importance = self.scores[layer_idx, :, :cand + 1] / counts
        decision = policy.decode_step(self.tiers[layer_idx, :, :cand + 1], importance, pos,
                                      cfg.alpha_high, cfg.alpha_low)
        # The candidate moves first, then the victim (it can be the candidate itself). Both low rows come from
        # the storage before the candidate's move, in one quantization: a victim re-quantized to low is a token
        # the candidate's move left as it was (a candidate moved to low and picked as the victim is low already
        # and stays, or is pruned), and a high decision moves nothing (nothing is promoted).
        cand_pos = torch.full((self.num_kv_heads,), cand, dtype=torch.long, device=self.scores.device)
        victim_pos = decision.victim_pos.clamp(min=0)
        k_low, v_low = self._low_rows(layer_idx, torch.cat([cand_pos, victim_pos]))
        h = self.num_kv_heads
        self._retier(layer_idx, cand_pos, decision.candidate_tier, k_low[:h], v_low[:h], only_changed=False)
        victim_tier = torch.where(decision.victim_pos >= 0, decision.victim_tier, TIER_HIGH).to(torch.int8)
        self._retier(layer_idx, victim_pos, victim_tier, k_low[h:], v_low[h:], only_changed=True)

    # ------------------------------------------------------------------ report
    def stats(self) -> CacheStats:
        """Tier counts and packed bytes over all layers and KV heads, at ``seq_len`` (a sliding-window layer's
        tokens that left its window counted nowhere: :class:`CacheStats`)."""
        n = self.seq_len
        tiers = self.tiers[:, :, :n]
        high = int((tiers == TIER_HIGH).sum())
        low = int((tiers == TIER_LOW).sum())
        total = self.num_kv_heads * sum(policy.reachable_tokens(n, w) for w in self.sliding_windows)
        pruned = total - high - low
        fp16_bytes = total * 2 * self.head_dim * 2
        if self.config.compress:
            used = high * self.config.token_bytes("high", self.head_dim) + low * self.config.token_bytes("low", self.head_dim)
            if self.config.center_keys and n:  # one fp16 offset vector per (layer, KV head)
                used += self.num_layers * self.num_kv_heads * self.head_dim * 2
        else:
            used = fp16_bytes
        return CacheStats(n, high, low, pruned, used, fp16_bytes)


def _causal_probs(q: torch.Tensor, k: torch.Tensor, group: int, first_query_pos: int,
                  sliding_window_tokens: int | None = None) -> torch.Tensor:
    """Softmax probabilities of queries ``[num_heads, m, head_dim]`` at positions
    ``first_query_pos..`` over keys ``[num_kv_heads, n, head_dim]``, causal (within the sliding window when one
    is given, :func:`policy.window_attention_mask`), fp32.

    Returns ``[num_heads, m, n]`` with exact zeros where masked.
    """
    n = k.shape[1]
    logits = q @ k.repeat_interleave(group, 0).transpose(1, 2) / math.sqrt(q.shape[-1])
    qpos = torch.arange(first_query_pos, first_query_pos + q.shape[1], device=q.device)
    attend = policy.window_attention_mask(qpos, torch.arange(n, device=q.device), sliding_window_tokens)
    return torch.softmax(logits.masked_fill(~attend, float("-inf")), dim=-1)


def attend_kept(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense fp32 decode attention over each KV head's kept tokens (the reference for kernels).

    Args:
        q: ``[num_heads, head_dim]`` one query per head.
        keys, values: ``[num_kv_heads, seq_len, head_dim]`` (dequantized).
        kept: ``bool [num_kv_heads, seq_len]``; masked tokens never enter the
            softmax. A head must keep at least one token.

    Returns:
        ``(out [num_heads, head_dim] fp32, probs [num_heads, seq_len] fp32)``.
    """
    num_heads, head_dim = q.shape
    group = num_heads // keys.shape[0]
    qg = q.float().reshape(keys.shape[0], group, head_dim)
    logits = torch.einsum("hgd,hnd->hgn", qg, keys.float()) / math.sqrt(head_dim)
    logits = logits.masked_fill(~kept[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("hgn,hnd->hgd", probs, values.float())
    return out.reshape(num_heads, head_dim), probs.reshape(num_heads, -1)
