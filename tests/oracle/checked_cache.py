"""A backend that checks every step of a ``DiffKVReferenceCache`` against the independent oracles.

:class:`CheckedCache` stands in for the cache as the model's attention backend
(or is driven directly with random q/k/v). Each ``forward`` snapshots the
layer's state, lets the cache run, then checks, by induction over the steps:

prefill (step 0)
    output = dense float64 causal attention over the original K/V; key
    offsets = the fp16 mean of the prompt keys; stored scores = the score sums
    of :func:`oracle.attention.prompt_score_sums`; tiers = :func:`oracle.rules.prompt_tiers`;
    every kept token within the error bounds of its tier's key and value format.
decode
    tiers = :func:`oracle.rules.decode_decision` on the state before the step;
    the new token is high precision, a demoted token re-quantized at the low
    tier from its stored high values, every other kept token bit-identical;
    output = dense float64 attention over the kept stored tokens; scores grow
    by the group-max probability of each kept token.

For the uncompressed (``compress=False``) preset: every token kept, stored
exactly, output = dense attention over the original K/V. For uniform
quantization (``compress`` with ``alpha_high == 0``: ``k8v4``, ``k8v8``): every
token kept in the high format, no scores kept, no per-token score and position
bytes (:func:`tiered`).
:meth:`CheckedCache.expected_stats` rebuilds the memory accounting from the
oracle's own tier counts.
"""
from __future__ import annotations

import collections

import torch

from tests.oracle import attention, rules
from tests.oracle.quant import check_quantized


def format_token_bytes(key_bits: int, value_bits: int, key_groups: int, value_groups: int, head_dim: int) -> int:
    """Bytes of one token of one KV head: codes plus an fp16 scale and zero per quantized group."""
    total = 0
    for bits, groups in ((key_bits, key_groups), (value_bits, value_groups)):
        total += head_dim * bits // 8
        if bits < 16:
            total += 2 * 2 * groups
    return total


def tiered(cfg) -> bool:
    """Whether tokens are tiered by attention: a compressing configuration with ``alpha_high > 0``. With
    ``alpha_high == 0`` every token stays high for good, so a uniform cache keeps no scores (the rule written
    here independently of ``DiffKVConfig.tiered``)."""
    return bool(cfg.compress) and cfg.alpha_high > 0


class CheckedCache:
    """Wraps ``cache``; every ``forward`` is checked (raises ``AssertionError`` on the first mismatch).

    Args:
        cache: a fresh ``DiffKVReferenceCache``.
        atol: absolute tolerance of attention outputs (fp32 cache vs float64 oracle).

    Attributes:
        outcomes: ``Counter`` of prompt tiers and decode decision kinds seen.
        ambiguous: decisions the oracle refused to judge (rounding ties); skipped.
        ambiguities: what each of them was.
        tiers: per layer, ``[num_kv_heads]`` lists of the oracle's tier codes.
    """

    def __init__(self, cache, atol: float = 2e-5):
        self.cache = cache
        self.config = cache.config
        self.atol = atol
        self.outcomes: collections.Counter = collections.Counter()
        self.ambiguous = 0
        self.ambiguities: list[str] = []
        self.prompt_len = 0
        self.tiers: dict[int, list[list[int]]] = {}
        self.layer_len = [0] * cache.num_layers

    # ------------------------------------------------------------------ entry
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``AttentionBackend.forward``: run the cache, check the step, return the cache's output."""
        c, start = self.cache, self.layer_len[layer_idx]
        before = tuple(t[layer_idx, :, :start].clone() for t in (c.tiers, c.scores, c.keys, c.values))
        out = c.forward(layer_idx, q, k, v)
        if start == 0:
            self._check_prefill(layer_idx, q, k, v, out)
        else:
            self._check_decode(layer_idx, start, q, k, v, out, before)
        self.layer_len[layer_idx] = start + q.shape[0]
        return out

    # ---------------------------------------------------------------- helpers
    def _offset(self, layer_idx: int) -> torch.Tensor:
        """float64 ``[num_kv_heads, head_dim]`` key offset of the layer (zeros without centering)."""
        offsets = getattr(self.cache, "key_offsets", None)
        if offsets is None or not self.config.center_keys:
            return torch.zeros(self.cache.num_kv_heads, self.cache.head_dim, dtype=torch.float64)
        return offsets[layer_idx].double().cpu()

    def _check_rows(self, layer_idx, head, positions, k_src, v_src, k_stored, v_stored, tier, what):
        """Bounds of rows ``positions`` of one head against their sources, at ``tier``'s format."""
        if not positions:
            return
        fmt = self.config.high if tier == rules.HIGH else self.config.low
        off = self._offset(layer_idx)[head].expand(len(positions), -1)
        name = f"layer {layer_idx} head {head} {what}"
        check_quantized(k_src - off, k_stored - off, fmt.key_bits, fmt.key_groups, f"{name} keys", offset=off)
        check_quantized(v_src, v_stored, fmt.value_bits, fmt.value_groups, f"{name} values")

    def _assert_close(self, got, expected, what):
        got = got.double().cpu()
        err = (got - expected).abs()
        tol = self.atol + 1e-4 * expected.abs()
        assert bool((err <= tol).all()), f"{what}: max error {float(err.max()):.3g} (atol {self.atol})"

    # ---------------------------------------------------------------- prefill
    def _check_prefill(self, layer_idx, q, k, v, out):
        c, cfg = self.cache, self.config
        n = q.shape[0]
        self.prompt_len = n
        self._assert_close(out, attention.causal_attention(q, k, v), f"prefill output, layer {layer_idx}")
        tiers = c.tiers[layer_idx, :, :n].cpu()
        keys, values = c.keys[layer_idx, :, :n].cpu(), c.values[layer_idx, :, :n].cpu()
        kh, vh = k.transpose(0, 1).double().cpu(), v.transpose(0, 1).double().cpu()
        if not cfg.compress:
            assert bool((tiers == rules.HIGH).all()), "fp16 preset: every prompt token stays"
            assert torch.equal(keys, kh.to(keys.dtype)) and torch.equal(values, vh.to(values.dtype)), (
                "fp16 preset: stored K/V must equal the originals")
            self.tiers[layer_idx] = [[rules.HIGH] * n for _ in range(c.num_kv_heads)]
            self.outcomes["prompt HIGH"] += n * c.num_kv_heads
            return
        if cfg.center_keys:
            expected = kh.mean(1).half().double()
            ulp = (expected.abs().clamp_min(2.0**-14) * 2.0**-10)
            assert bool(((self._offset(layer_idx) - expected).abs() <= ulp).all()), "key offset != fp16 prompt-key mean"
        if not tiered(cfg):
            assert bool((tiers == rules.HIGH).all()), "uniform quantization: every prompt token high"
            self.tiers[layer_idx] = [[rules.HIGH] * n for _ in range(c.num_kv_heads)]
            self.outcomes["prompt HIGH"] += n * c.num_kv_heads
            for head in range(c.num_kv_heads):
                self._check_rows(layer_idx, head, list(range(n)), kh[head], vh[head], keys[head], values[head],
                                 rules.HIGH, "prompt tokens (uniform)")
            return
        sums = attention.prompt_score_sums(q, k, cfg.prompt_score_window_tokens)
        stored = c.scores[layer_idx, :, :n].double().cpu()
        err = (stored - sums).abs()
        assert bool((err <= 1e-6 + 1e-4 * sums).all()), (
            f"prompt score sums, layer {layer_idx}: max error {float(err.max()):.3g}")
        self.tiers[layer_idx] = []
        for head in range(c.num_kv_heads):
            try:
                expected_tiers = rules.prompt_tiers(stored[head].tolist(), cfg.alpha_high, cfg.alpha_low,
                                                    cfg.recent_window_tokens, cfg.prompt_score_window_tokens,
                                                    cfg.prompt_threshold_base, cfg.score_pool_tokens)
            except rules.AmbiguousDecision as exc:
                self.ambiguous += 1
                self.ambiguities.append(f"layer {layer_idx} head {head}: {exc}")
                expected_tiers = tiers[head].tolist()
            assert tiers[head].tolist() == expected_tiers, (
                f"prompt tiers, layer {layer_idx} head {head}:\n got {tiers[head].tolist()}\nwant {expected_tiers}")
            self.tiers[layer_idx].append(expected_tiers)
            for tier, name in ((rules.HIGH, "HIGH"), (rules.LOW, "LOW"), (rules.PRUNED, "PRUNED")):
                rows = [t for t in range(n) if expected_tiers[t] == tier]
                self.outcomes[f"prompt {name}"] += len(rows)
                if tier != rules.PRUNED:
                    self._check_rows(layer_idx, head, rows, kh[head, rows], vh[head, rows], keys[head, rows],
                                     values[head, rows], tier, f"prompt {name} tokens")

    # ----------------------------------------------------------------- decode
    def _check_decode(self, layer_idx, pos, q, k, v, out, before):
        c, cfg = self.cache, self.config
        tiers_b, scores_b, keys_b, values_b = (t.cpu() for t in before)
        tiers_a = c.tiers[layer_idx, :, :pos + 1].cpu()
        keys_a, values_a = c.keys[layer_idx, :, :pos + 1].cpu(), c.values[layer_idx, :, :pos + 1].cpu()
        k_new, v_new = k[0].double().cpu(), v[0].double().cpu()  # [num_kv_heads, head_dim]
        expected_tiers = self.tiers[layer_idx]
        for head in range(c.num_kv_heads):
            if tiered(cfg):
                try:
                    outcome = rules.decode_decision(tiers_b[head].tolist(), scores_b[head].tolist(), pos,
                                                    self.prompt_len, cfg.recent_window_tokens,
                                                    cfg.prompt_score_window_tokens, cfg.alpha_high, cfg.alpha_low)
                    self.outcomes[outcome.kind] += 1
                    want = outcome.tiers + [rules.HIGH]
                except rules.AmbiguousDecision as exc:
                    self.ambiguous += 1
                    self.ambiguities.append(f"layer {layer_idx} head {head} pos {pos}: {exc}")
                    want = tiers_a[head].tolist()
            else:
                want = [rules.HIGH] * (pos + 1)
            got = tiers_a[head].tolist()
            assert got == want, (f"decode tiers, layer {layer_idx} head {head} pos {pos}: positions "
                                 f"{[t for t in range(pos + 1) if got[t] != want[t]]} got "
                                 f"{[got[t] for t in range(pos + 1) if got[t] != want[t]]} want "
                                 f"{[want[t] for t in range(pos + 1) if got[t] != want[t]]}")
            expected_tiers[head] = want
            # storage: untouched kept tokens bit-identical, demoted ones re-quantized, the new one high
            same = [t for t in range(pos) if want[t] != rules.PRUNED and want[t] == int(tiers_b[head, t])]
            assert torch.equal(keys_a[head, same], keys_b[head, same]), f"layer {layer_idx} head {head}: kept keys changed"
            assert torch.equal(values_a[head, same], values_b[head, same]), f"layer {layer_idx} head {head}: kept values changed"
            demoted = [t for t in range(pos) if want[t] == rules.LOW and int(tiers_b[head, t]) == rules.HIGH]
            self._check_rows(layer_idx, head, demoted, keys_b[head, demoted].double(), values_b[head, demoted].double(),
                             keys_a[head, demoted], values_a[head, demoted], rules.LOW, "demoted tokens")
            if cfg.compress:
                self._check_rows(layer_idx, head, [pos], k_new[head:head + 1], v_new[head:head + 1],
                                 keys_a[head, pos:pos + 1], values_a[head, pos:pos + 1], rules.HIGH, "new token")
            else:
                assert torch.equal(keys_a[head, pos], k_new[head].to(keys_a.dtype)), "fp16 preset: new key changed"
                assert torch.equal(values_a[head, pos], v_new[head].to(values_a.dtype)), "fp16 preset: new value changed"
        kept = torch.tensor(expected_tiers) != rules.PRUNED
        expected_out, probs = attention.decode_attention(q[0], keys_a, values_a, kept)
        self._assert_close(out[0], expected_out, f"decode output, layer {layer_idx}, pos {pos}")
        if not tiered(cfg):
            return
        grown = torch.cat([scores_b.double(), torch.zeros(c.num_kv_heads, 1, dtype=torch.float64)], 1)
        grown += attention.group_max(probs, c.num_kv_heads)
        got = c.scores[layer_idx, :, :pos + 1].double().cpu()
        err = ((got - grown).abs() * kept)
        assert bool((err <= 2e-6 + 1e-5 * grown.abs()).all()), (
            f"decode scores, layer {layer_idx}, pos {pos}: max error {float(err.max()):.3g}")

    # ------------------------------------------------------------------ stats
    def expected_stats(self) -> dict:
        """The memory accounting rebuilt from the oracle's tiers (keys as in ``CacheStats``)."""
        c, cfg = self.cache, self.config
        seq_len = min(self.layer_len)
        counts = collections.Counter()
        for layer in range(c.num_layers):
            for head_tiers in self.tiers[layer]:
                counts.update(head_tiers[:seq_len])
        d = c.head_dim
        fp16_bytes = (c.num_layers * c.num_kv_heads * seq_len) * d * 2 * 2
        if cfg.compress:
            meta = 8 if tiered(cfg) else 0  # fp32 score + int32 position a token, only where tokens are tiered
            high = format_token_bytes(cfg.high.key_bits, cfg.high.value_bits, cfg.high.key_groups,
                                      cfg.high.value_groups, d) + meta
            low = format_token_bytes(cfg.low.key_bits, cfg.low.value_bits, cfg.low.key_groups,
                                     cfg.low.value_groups, d) + meta
            used = counts[rules.HIGH] * high + counts[rules.LOW] * low
            if cfg.center_keys and seq_len:
                used += c.num_layers * c.num_kv_heads * d * 2
        else:
            used = (counts[rules.HIGH] + counts[rules.LOW]) * d * 2 * 2
        return dict(seq_len_tokens=seq_len, high_tokens=counts[rules.HIGH], low_tokens=counts[rules.LOW],
                    pruned_tokens=counts[rules.PRUNED], kv_cache_bytes=used, fp16_kv_cache_bytes=fp16_bytes)

    def assert_stats(self) -> None:
        """Assert that ``cache.stats()`` equals :meth:`expected_stats` field by field."""
        stats, expected = self.cache.stats(), self.expected_stats()
        assert {name: getattr(stats, name) for name in expected} == expected
        if expected["fp16_kv_cache_bytes"]:
            assert stats.kv_memory_fraction == expected["kv_cache_bytes"] / expected["fp16_kv_cache_bytes"]
