"""The paper's baselines as one-request KV caches with the reference cache's protocol.

Every class here is an :class:`~trtllm_diffkv.model.attention_api.AttentionBackend` for one
request, exactly like :class:`~trtllm_diffkv.cache.DiffKVReferenceCache`: the first
``forward`` of a layer is the prefill (causal attention over the full-precision prompt, as
every method's public code does), then one token per step. Storage is by token position
(dequantized keys and values, a ``kept`` mask); decode attention is the same dense fp32
:func:`~trtllm_diffkv.cache.reference.attend_kept`. ``stats()`` returns a
:class:`~trtllm_diffkv.cache.CacheStats` whose ``kv_cache_bytes`` counts what each method
really has to store (codes, fp16 scale/zero, fp16 rows, an fp32 score where the method keeps
one), so ``kv_memory_fraction`` compares with DiffKV's at equal memory.

Methods, their rules and the public code they follow (where ours differs, it says so):

* :class:`UniformQuantCache`: every token quantized per token, per KV head, asymmetric
  min/max (the int8 / int4 KV formats of LMDeploy's ``quant_policy`` 8 / 4 and vLLM).
  Departure: one scale/zero per (token, head), fp16; no fp8.
* :class:`KIVICache`: KIVI (Liu et al., ICML 2024, arXiv:2402.02750; github.com/jy-yuan/KIVI):
  keys quantized per channel over groups of ``group_tokens`` tokens, values per token over
  groups of ``value_group_channels`` channels, the newest tokens kept in full precision: keys
  in a residual of up to ``residual_tokens`` that is quantized as one block when full (the
  prompt: all but ``prompt_len % residual_tokens``), values in a sliding window of
  ``residual_tokens`` (the oldest one quantized each step). Quantization after the step's
  attention, as in their code. Departure: fake quantization through our packed quantizer
  (same min/max rule, fp16 scale/zero).
* :class:`SnapKVCache`: SnapKV (Li et al., NeurIPS 2024, arXiv:2404.14469;
  github.com/FasterDecoding/SnapKV ``snapkv_utils.py``): the last ``window_tokens`` prompt
  queries (observation window) score the earlier prompt tokens (softmax over the whole
  causal row, summed over the window's queries), scores smoothed by 1-D pooling
  (``avgpool``, kernel 5), the top ``budget - window`` per head kept plus the window; no
  eviction while decoding. Departure: GQA heads merge by the mean over a KV head's query
  heads (their code targets one score per attention head; later GQA ports pool queries the
  same way).
* :class:`H2OCache`: H2O (Zhang et al., NeurIPS 2023, arXiv:2306.14048;
  github.com/FMInference/H2O ``H2OKVCache_LayerWise``): accumulated attention (sum over
  every query that saw the token; GQA: summed over a KV head's query heads, their
  ``sum_group``) selects heavy hitters; budget = heavy + recent, half each; the prompt is cut
  to the budget after prefill; each decode step adds its probabilities, then evicts the
  lowest-score token outside the recent window. Departure: one fp32 score per kept token is
  counted as memory (the rule needs it).
* :class:`StreamingLLMCache`: StreamingLLM (Xiao et al., ICLR 2024, arXiv:2309.17453;
  github.com/mit-han-lab/streaming-llm ``StartRecentKVCache``): ``sink_tokens`` first tokens
  plus the most recent ones, budget fixed; the oldest non-sink token is evicted before a new
  one is written. Departure: keys keep their original RoPE positions (their ``pos_shift``
  re-rotation is for running past the trained length, which these prompts never do).

The eviction baselines store FP16 rows. Their budget is ``budget_fraction`` of the prompt
(at least the method's fixed part), fixed for the request as in their code.
"""
from __future__ import annotations

import math

import torch

from ..cache import CacheStats
from ..cache.reference import attend_kept
from ..config import TierConfig
from ..quant import check_finite, fake_quantize

FP16_ROW_BYTES_PER_DIM = 2
"""Bytes of one fp16 element."""

SCORE_BYTES = 4
"""Bytes of one fp32 accumulated score (H2O keeps one per kept token per KV head)."""


def pool_scores(scores: torch.Tensor, kernel_tokens: int, pooling: str) -> torch.Tensor:
    """SnapKV's 1-D smoothing of per-token scores (stride 1, same length, zero padding).

    Args:
        scores: ``float32 [heads, tokens]``.
        kernel_tokens: odd window, e.g. 5; 1 = no pooling.
        pooling: ``"avgpool"`` (count includes the zero padding, as torch's default) or ``"maxpool"``.

    Raises:
        ValueError: even kernel or unknown pooling.
    """
    if kernel_tokens < 1 or kernel_tokens % 2 == 0:
        raise ValueError(f"kernel_tokens={kernel_tokens} must be odd and >= 1")
    pad = kernel_tokens // 2
    x = scores[:, None, :]
    if pooling == "avgpool":
        out = torch.nn.functional.avg_pool1d(x, kernel_tokens, stride=1, padding=pad)
    elif pooling == "maxpool":
        out = torch.nn.functional.max_pool1d(x, kernel_tokens, stride=1, padding=pad)
    else:
        raise ValueError(f"pooling={pooling!r}; allowed: 'avgpool', 'maxpool'")
    return out[:, 0, :]


def causal_probs_chunked(q: torch.Tensor, k: torch.Tensor, group: int, first_query_pos: int,
                         chunk_queries: int = 256):
    """Causal softmax rows of queries ``[num_heads, m, head_dim]`` (positions ``first_query_pos..``)
    over keys ``[num_kv_heads, n, head_dim]``, fp32, yielded in chunks ``(start, probs [num_heads, c, n])``
    so a long prompt never holds an ``m x n`` matrix per head at once."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    kf = k.float().repeat_interleave(group, 0).transpose(1, 2)
    n = k.shape[1]
    cols = torch.arange(n, device=q.device)[None, :]
    for start in range(0, q.shape[1], chunk_queries):
        qc = q[:, start:start + chunk_queries].float()
        logits = qc @ kf * scale
        rows = torch.arange(first_query_pos + start, first_query_pos + start + qc.shape[1], device=q.device)[:, None]
        yield start, torch.softmax(logits.masked_fill(cols > rows, float("-inf")), dim=-1)


class _TokenCache:
    """Shared storage and step protocol of the baseline caches (one request).

    Args:
        num_layers, num_heads, num_kv_heads, head_dim: model shape.
        max_seq_len_tokens: capacity (prompt + new tokens).
        device: where tensors live.

    Subclasses implement ``_store_prompt(layer_idx, qh, kh, vh)`` (``[heads, n, head_dim]``),
    optionally ``_before_write(layer_idx, pos)``, ``_store_token(layer_idx, pos, kh, vh)``,
    ``_after_attend(layer_idx, pos, probs [num_heads, pos + 1])`` and ``_kv_bytes()``.

    Raises:
        ValueError: ``num_heads`` not a multiple of ``num_kv_heads``, a prompt longer than the
            capacity, or a non-finite key/value (naming layer, KV head and token).
    """

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 max_seq_len_tokens: int, device: torch.device | str = "cpu"):
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = num_layers, num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.max_seq_len_tokens = max_seq_len_tokens
        shape = (num_layers, num_kv_heads, max_seq_len_tokens, head_dim)
        self.keys = torch.zeros(shape, dtype=torch.float32, device=device)
        self.values = torch.zeros(shape, dtype=torch.float32, device=device)
        self.kept = torch.zeros(shape[:3], dtype=torch.bool, device=device)
        self.prompt_len = 0
        self.seq_len = 0
        self._layer_seq_len = [0] * num_layers

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention backend entry point; shapes as in ``AttentionBackend.forward``."""
        start = self._layer_seq_len[layer_idx]
        n = q.shape[0]
        if start + n > self.max_seq_len_tokens:
            raise ValueError(f"sequence of {start + n} tokens exceeds the cache capacity {self.max_seq_len_tokens}")
        kh, vh = k.transpose(0, 1), v.transpose(0, 1)
        if start == 0:
            self._prefill_store(layer_idx, q, kh, vh)
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), kh.repeat_interleave(self.group, 0), vh.repeat_interleave(self.group, 0),
                is_causal=True).transpose(0, 1)
        elif n == 1:
            check_finite(kh, "key", layer_idx, first_token=start)
            check_finite(vh, "value", layer_idx, first_token=start)
            pos = start
            self._before_write(layer_idx, pos)
            self._store_token(layer_idx, pos, kh[:, 0].float(), vh[:, 0].float())
            self.kept[layer_idx, :, pos] = True
            o, probs = attend_kept(q[0], self.keys[layer_idx, :, :pos + 1], self.values[layer_idx, :, :pos + 1],
                                   self.kept[layer_idx, :, :pos + 1])
            self._after_attend(layer_idx, pos, probs)
            out = o[None].to(q.dtype)
        else:
            raise ValueError("the baseline caches take the whole prompt at once, then one token per step")
        self._layer_seq_len[layer_idx] = start + n
        if layer_idx == self.num_layers - 1:
            self.seq_len = start + n
        return out

    def store_prompt(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The prefill step of :meth:`forward` without its attention output (the prompt is stored and
        selected exactly as :meth:`forward` does), for a caller that runs one prefill for several caches.

        Raises:
            ValueError: as :meth:`forward`, or a layer that has had its prefill already.
        """
        n = q.shape[0]
        if self._layer_seq_len[layer_idx] != 0:
            raise ValueError(f"layer {layer_idx} has had its prefill; store_prompt takes only the prompt")
        if n > self.max_seq_len_tokens:
            raise ValueError(f"sequence of {n} tokens exceeds the cache capacity {self.max_seq_len_tokens}")
        self._prefill_store(layer_idx, q, k.transpose(0, 1), v.transpose(0, 1))
        self._layer_seq_len[layer_idx] = n
        if layer_idx == self.num_layers - 1:
            self.seq_len = n

    def _prefill_store(self, layer_idx: int, q: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> None:
        check_finite(kh, "key", layer_idx)
        check_finite(vh, "value", layer_idx)
        n = q.shape[0]
        if n == 0:
            raise ValueError("empty prompt: at least one token is needed")
        self.prompt_len = n
        self._store_prompt(layer_idx, q.transpose(0, 1), kh.float(), vh.float())

    # hooks ------------------------------------------------------------------
    def _store_prompt(self, layer_idx, qh, kh, vh) -> None:
        raise NotImplementedError

    def _before_write(self, layer_idx: int, pos: int) -> None:
        pass

    def _store_token(self, layer_idx: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys[layer_idx, :, pos] = k
        self.values[layer_idx, :, pos] = v

    def _after_attend(self, layer_idx: int, pos: int, probs: torch.Tensor) -> None:
        pass

    def _kv_bytes(self) -> int:
        raise NotImplementedError

    # report -----------------------------------------------------------------
    def kept_tokens(self) -> int:
        """(layer, KV head, token) triples kept, at ``seq_len``."""
        return int(self.kept[:, :, :self.seq_len].sum())

    def stats(self) -> CacheStats:
        """Kept/evicted counts (kept = ``high_tokens``) and the method's bytes, at ``seq_len``."""
        total = self.num_layers * self.num_kv_heads * self.seq_len
        kept = self.kept_tokens()
        return CacheStats(self.seq_len, kept, 0, total - kept, self._kv_bytes(),
                          total * 2 * self.head_dim * FP16_ROW_BYTES_PER_DIM)


class UniformQuantCache(_TokenCache):
    """Every token at one per-token format (uniform K8V8 / K4V4 ...), nothing evicted.

    Args:
        key_bits, value_bits: 2, 4 or 8.
        groups: quantization groups per head for keys and values (1: one scale/zero per
            (token, head), the LMDeploy/vLLM int8/int4 layout).
        (the rest as :class:`_TokenCache`)

    Bytes per token per KV head: :meth:`TierConfig.token_bytes` (codes + fp16 scale/zero).
    """

    def __init__(self, key_bits: int, value_bits: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, max_seq_len_tokens: int, device="cpu", groups: int = 1):
        super().__init__(num_layers, num_heads, num_kv_heads, head_dim, max_seq_len_tokens, device)
        self.tier = TierConfig(key_bits, value_bits, groups, groups)
        self.tier.validate_for_head_dim(head_dim)

    def _quant(self, layer_idx, k, v):
        t = self.tier
        return (fake_quantize(k, t.key_bits, t.key_groups, what="key", layer_idx=layer_idx),
                fake_quantize(v, t.value_bits, t.value_groups, what="value", layer_idx=layer_idx))

    def _store_prompt(self, layer_idx, qh, kh, vh) -> None:
        n = kh.shape[1]
        self.keys[layer_idx, :, :n], self.values[layer_idx, :, :n] = self._quant(layer_idx, kh, vh)
        self.kept[layer_idx, :, :n] = True

    def _store_token(self, layer_idx, pos, k, v) -> None:
        kq, vq = self._quant(layer_idx, k[:, None], v[:, None])
        self.keys[layer_idx, :, pos], self.values[layer_idx, :, pos] = kq[:, 0], vq[:, 0]

    def _kv_bytes(self) -> int:
        return self.kept_tokens() * self.tier.token_bytes(self.head_dim)


class KIVICache(_TokenCache):
    """KIVI: per-channel keys, per-token values, full-precision residual (rules in the module docstring).

    Args:
        bits: key and value bits (KIVI-2: 2; KIVI-4: 4).
        group_tokens: tokens per key quantization group (paper: 32); divides ``residual_tokens``.
        residual_tokens: newest tokens in full precision (paper: 128).
        value_group_channels: channels per value quantization group (paper: 32); divides head_dim.

    Raises:
        ValueError: groups that do not divide, or a bit width without a packed format.
    """

    def __init__(self, bits: int, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 max_seq_len_tokens: int, device="cpu", group_tokens: int = 32, residual_tokens: int = 128,
                 value_group_channels: int = 32):
        super().__init__(num_layers, num_heads, num_kv_heads, head_dim, max_seq_len_tokens, device)
        if residual_tokens % group_tokens or residual_tokens < group_tokens:
            raise ValueError(f"residual_tokens={residual_tokens} must be a positive multiple of "
                             f"group_tokens={group_tokens}")
        if head_dim % value_group_channels:
            raise ValueError(f"value_group_channels={value_group_channels} does not divide head_dim={head_dim}")
        self.bits, self.group_tokens, self.residual_tokens = bits, group_tokens, residual_tokens
        self.value_groups = head_dim // value_group_channels
        self.key_quantized_tokens = [0] * num_layers  # keys [0, this) are quantized per channel
        self.value_quantized_tokens = [0] * num_layers  # values [0, this) are quantized per token

    def _quantize_keys(self, layer_idx: int, start: int, end: int) -> None:
        """Per-channel quantization of keys ``[start, end)`` in groups of ``group_tokens`` tokens."""
        if end <= start:
            return
        g = self.group_tokens
        k = self.keys[layer_idx, :, start:end]  # [h, m, d], m a multiple of g
        h, m, d = k.shape
        blocks = k.reshape(h, m // g, g, d).permute(0, 1, 3, 2).reshape(h * (m // g), d, g)  # rows = channels
        q = fake_quantize(blocks, self.bits, 1, what="key", layer_idx=layer_idx)
        self.keys[layer_idx, :, start:end] = q.reshape(h, m // g, d, g).permute(0, 1, 3, 2).reshape(h, m, d)

    def _quantize_values(self, layer_idx: int, start: int, end: int) -> None:
        if end <= start:
            return
        v = self.values[layer_idx, :, start:end]
        self.values[layer_idx, :, start:end] = fake_quantize(v, self.bits, self.value_groups, what="value",
                                                             layer_idx=layer_idx)

    def _store_prompt(self, layer_idx, qh, kh, vh) -> None:
        n = kh.shape[1]
        self.keys[layer_idx, :, :n], self.values[layer_idx, :, :n] = kh, vh
        self.kept[layer_idx, :, :n] = True
        r = self.residual_tokens
        key_end = n - n % r if n >= r else 0
        self._quantize_keys(layer_idx, 0, key_end)
        self.key_quantized_tokens[layer_idx] = key_end
        value_end = max(n - r, 0)
        self._quantize_values(layer_idx, 0, value_end)
        self.value_quantized_tokens[layer_idx] = value_end

    def _after_attend(self, layer_idx, pos, probs) -> None:
        length = pos + 1
        key_start = self.key_quantized_tokens[layer_idx]
        if length - key_start == self.residual_tokens:  # the key residual is full: quantize it as one block
            self._quantize_keys(layer_idx, key_start, length)
            self.key_quantized_tokens[layer_idx] = length
        value_start = self.value_quantized_tokens[layer_idx]
        if length - value_start > self.residual_tokens:  # the oldest full-precision value leaves the window
            self._quantize_values(layer_idx, value_start, length - self.residual_tokens)
            self.value_quantized_tokens[layer_idx] = length - self.residual_tokens

    def kv_bytes_for(self, seq_len: int, key_quantized: int, value_quantized: int) -> int:
        """Bytes of one (layer, KV head) holding ``seq_len`` tokens, the first ``key_quantized`` keys and
        ``value_quantized`` values quantized: codes, fp16 scale + zero per (channel, token group) for keys
        and per (token, channel group) for values, 2 bytes per full-precision element."""
        d, b = self.head_dim, self.bits
        keys = key_quantized * d * b // 8 + (key_quantized // self.group_tokens) * d * 4
        keys += (seq_len - key_quantized) * d * FP16_ROW_BYTES_PER_DIM
        values = value_quantized * (d * b // 8 + self.value_groups * 4)
        values += (seq_len - value_quantized) * d * FP16_ROW_BYTES_PER_DIM
        return keys + values

    def _kv_bytes(self) -> int:
        return sum(self.num_kv_heads * self.kv_bytes_for(self.seq_len, kq, vq)
                   for kq, vq in zip(self.key_quantized_tokens, self.value_quantized_tokens))


def budget_tokens(prompt_len: int, budget_fraction: float, minimum_tokens: int) -> int:
    """Per-head token budget of an eviction method: ``round(fraction * prompt_len)``, at least
    ``minimum_tokens`` (the method's fixed part: window, sinks), at most the prompt.

    Raises:
        ValueError: a fraction outside (0, 1].
    """
    if not 0.0 < budget_fraction <= 1.0:
        raise ValueError(f"budget_fraction={budget_fraction!r} is out of range; allowed range: (0, 1]")
    return min(prompt_len, max(minimum_tokens, round(budget_fraction * prompt_len)))


class _EvictionCache(_TokenCache):
    """FP16 rows with a per-head keep mask and a budget fixed at the prompt."""

    score_bytes = 0

    def __init__(self, budget_fraction: float, num_layers, num_heads, num_kv_heads, head_dim,
                 max_seq_len_tokens, device="cpu"):
        super().__init__(num_layers, num_heads, num_kv_heads, head_dim, max_seq_len_tokens, device)
        budget_tokens(1, budget_fraction, 1)  # validates the fraction
        self.budget_fraction = budget_fraction
        self.budget = None

    def _keep_prompt(self, layer_idx: int, n: int, keep_idx: torch.Tensor | None, kh, vh) -> None:
        """Store the prompt rows; ``keep_idx int64 [num_kv_heads, budget]`` or ``None`` (keep all)."""
        self.keys[layer_idx, :, :n], self.values[layer_idx, :, :n] = kh.half().float(), vh.half().float()
        if keep_idx is None:
            self.kept[layer_idx, :, :n] = True
        else:
            self.kept[layer_idx, :, :n] = False
            self.kept[layer_idx].scatter_(1, keep_idx, True)

    def _store_token(self, layer_idx, pos, k, v) -> None:
        self.keys[layer_idx, :, pos], self.values[layer_idx, :, pos] = k.half().float(), v.half().float()

    def _kv_bytes(self) -> int:
        return self.kept_tokens() * (2 * self.head_dim * FP16_ROW_BYTES_PER_DIM + self.score_bytes)


class StreamingLLMCache(_EvictionCache):
    """StreamingLLM: ``sink_tokens`` attention sinks + the most recent tokens (rules in the module docstring)."""

    def __init__(self, budget_fraction: float, num_layers, num_heads, num_kv_heads, head_dim, max_seq_len_tokens,
                 device="cpu", sink_tokens: int = 4):
        super().__init__(budget_fraction, num_layers, num_heads, num_kv_heads, head_dim, max_seq_len_tokens, device)
        self.sink_tokens = sink_tokens

    def _store_prompt(self, layer_idx, qh, kh, vh) -> None:
        n = kh.shape[1]
        self.budget = budget_tokens(n, self.budget_fraction, self.sink_tokens + 1)
        keep = None
        if n > self.budget:
            recent = torch.arange(n - (self.budget - self.sink_tokens), n, device=kh.device)
            idx = torch.cat([torch.arange(self.sink_tokens, device=kh.device), recent])
            keep = idx[None].expand(self.num_kv_heads, -1)
        self._keep_prompt(layer_idx, n, keep, kh, vh)

    def _before_write(self, layer_idx, pos) -> None:
        kept = self.kept[layer_idx, :, :pos]
        if int(kept[0].sum()) < self.budget:  # every head keeps the same positions
            return
        kept_pos = kept[0].nonzero()[:, 0]
        self.kept[layer_idx, :, int(kept_pos[self.sink_tokens])] = False


class H2OCache(_EvictionCache):
    """H2O: heavy hitters by accumulated attention + a recent window (rules in the module docstring).

    Args:
        heavy_share: part of the budget for heavy hitters (their code: 0.5); the rest is recent.
    """

    score_bytes = SCORE_BYTES

    def __init__(self, budget_fraction: float, num_layers, num_heads, num_kv_heads, head_dim, max_seq_len_tokens,
                 device="cpu", heavy_share: float = 0.5):
        super().__init__(budget_fraction, num_layers, num_heads, num_kv_heads, head_dim, max_seq_len_tokens, device)
        self.heavy_share = heavy_share
        self.scores = torch.zeros(self.kept.shape, dtype=torch.float32, device=self.kept.device)
        self.recent_tokens = None

    def _merge(self, probs: torch.Tensor) -> torch.Tensor:
        """Sum a KV head's query heads (their ``sum_group``): ``[num_heads, n] -> [num_kv_heads, n]``."""
        return probs.reshape(self.num_kv_heads, self.group, -1).sum(1)

    def _store_prompt(self, layer_idx, qh, kh, vh) -> None:
        n = kh.shape[1]
        self.budget = budget_tokens(n, self.budget_fraction, 2)
        heavy = int(self.budget * self.heavy_share)
        self.recent_tokens = self.budget - heavy
        scores = torch.zeros((self.num_heads, n), dtype=torch.float32, device=kh.device)
        for _, probs in causal_probs_chunked(qh, kh, self.group, 0):
            scores += probs.sum(1)
        merged = self._merge(scores)
        self.scores[layer_idx, :, :n] = merged
        keep = None
        if n > self.budget:
            older = merged[:, :n - self.recent_tokens]
            top = older.topk(heavy, dim=-1).indices
            recent = torch.arange(n - self.recent_tokens, n, device=kh.device)[None].expand(self.num_kv_heads, -1)
            keep = torch.cat([top, recent], 1)
        self._keep_prompt(layer_idx, n, keep, kh, vh)
        self.scores[layer_idx, :, :n] *= self.kept[layer_idx, :, :n]

    def _after_attend(self, layer_idx, pos, probs) -> None:
        length = pos + 1
        self.scores[layer_idx, :, :length] += self._merge(probs)
        kept = self.kept[layer_idx, :, :length]
        if int(kept[0].sum()) <= self.budget:
            return
        older = length - self.recent_tokens
        masked = torch.where(kept[:, :older], self.scores[layer_idx, :, :older],
                             torch.full_like(self.scores[layer_idx, :, :older], float("inf")))
        victim = masked.argmin(-1)
        heads = torch.arange(self.num_kv_heads, device=victim.device)
        self.kept[layer_idx, heads, victim] = False
        self.scores[layer_idx, heads, victim] = 0.0


class SnapKVCache(_EvictionCache):
    """SnapKV: observation-window voting with pooling, prompt only (rules in the module docstring).

    Args:
        window_tokens: observation window (their default: 32).
        kernel_tokens: pooling kernel (their default: 5).
        pooling: ``"avgpool"`` (their default) or ``"maxpool"``.
    """

    def __init__(self, budget_fraction: float, num_layers, num_heads, num_kv_heads, head_dim, max_seq_len_tokens,
                 device="cpu", window_tokens: int = 32, kernel_tokens: int = 5, pooling: str = "avgpool"):
        super().__init__(budget_fraction, num_layers, num_heads, num_kv_heads, head_dim, max_seq_len_tokens, device)
        pool_scores(torch.zeros(1, 1), kernel_tokens, pooling)  # validates kernel and pooling
        self.window_tokens, self.kernel_tokens, self.pooling = window_tokens, kernel_tokens, pooling

    def _store_prompt(self, layer_idx, qh, kh, vh) -> None:
        n = kh.shape[1]
        self.budget = budget_tokens(n, self.budget_fraction, self.window_tokens + 1)
        keep = None
        if n > self.budget:
            w = self.window_tokens
            votes = torch.zeros((self.num_heads, n - w), dtype=torch.float32, device=kh.device)
            for _, probs in causal_probs_chunked(qh[:, n - w:], kh, self.group, n - w):
                votes += probs[:, :, :n - w].sum(1)
            merged = votes.reshape(self.num_kv_heads, self.group, -1).mean(1)
            pooled = pool_scores(merged, self.kernel_tokens, self.pooling)
            top = pooled.topk(self.budget - w, dim=-1).indices
            window = torch.arange(n - w, n, device=kh.device)[None].expand(self.num_kv_heads, -1)
            keep = torch.cat([top, window], 1)
        self._keep_prompt(layer_idx, n, keep, kh, vh)
