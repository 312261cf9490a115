"""Rotary position embedding (RoPE) and its scalings, as transformers computes them.

Layout: rotate-half (HF weight layout, not Meta's interleaved one); angles in
fp32, cos/sin cast to the model dtype afterwards.

``rope_scaling`` types (:data:`SUPPORTED_ROPE_TYPES`), each from the source
that defines it:

* ``"default"``: ``theta ** (-2i / head_dim)``.
* ``"linear"``: every frequency divided by ``factor``.
* ``"llama3"``: low frequencies divided by ``factor``, the middle band
  interpolated (Llama 3.1; transformers ``_compute_llama3_parameters``).
* ``"yarn"``: YaRN (arXiv:2309.00071; transformers
  ``_compute_yarn_parameters``, ``truncate`` default true): frequencies blended
  between interpolated and original along a ramp between the correction
  dimensions of ``beta_fast`` and ``beta_slow``, and cos/sin multiplied by
  ``attention_factor`` (default ``0.1 ln(factor) + 1``, or the
  ``mscale``/``mscale_all_dim`` ratio).
* ``"freq_factors"``: frequency ``i`` divided by ``freq_factors[i]`` (how a
  GGUF's ``rope_freqs.weight`` tensor scales RoPE; llama.cpp).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")
"""RoPE variants :func:`rope_inv_freq` computes."""

_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
              "mscale_all_dim", "truncate")


def normalize_rope_scaling(scaling: Mapping | None, max_position_embeddings: int, head_dim: int) -> dict | None:
    """Validate and canonicalize ``rope_scaling``; ``None`` for plain RoPE.

    Accepts ``rope_type`` or the legacy ``type`` key. ``llama3`` and ``yarn``
    default ``original_max_position_embeddings`` to ``max_position_embeddings``
    (as transformers does); ``yarn`` without ``factor`` uses
    ``max_position_embeddings / original_max_position_embeddings``.

    Raises:
        ValueError: an unsupported type (naming it and the supported list), a
            missing key, ``freq_factors`` not ``head_dim // 2`` positive
            finite numbers.
    """
    if not scaling:
        return None
    scaling = dict(scaling)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return None
    if rope_type == "freq_factors":
        return {"rope_type": rope_type, "freq_factors": _freq_factors(scaling.get("freq_factors"), head_dim)}
    if rope_type in ("llama3", "yarn"):
        scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
    if rope_type == "yarn":
        if scaling.get("factor") is None:
            scaling["factor"] = max_position_embeddings / scaling["original_max_position_embeddings"]
        return {"rope_type": rope_type, **{k: scaling[k] for k in _YARN_KEYS if scaling.get(k) is not None}}
    if "factor" not in scaling:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs 'factor'")
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_ROPE_KEYS if k not in scaling]
        if missing:
            raise ValueError(f"rope_scaling of type 'llama3' is missing {missing}")
    return {"rope_type": rope_type, **scaling}


def _freq_factors(factors: Any, head_dim: int) -> list[float]:
    if not isinstance(factors, (list, tuple)):
        raise ValueError("rope_scaling of type 'freq_factors' needs a list 'freq_factors'")
    factors = [float(f) for f in factors]
    if len(factors) != head_dim // 2 or not all(math.isfinite(f) and f > 0 for f in factors):
        raise ValueError(f"rope_scaling freq_factors must be {head_dim // 2} positive finite numbers "
                         f"(head_dim // 2); got {len(factors)}")
    return factors


def rope_inv_freq(config, device: torch.device | str | None = None) -> torch.Tensor:
    """RoPE inverse frequencies, ``[head_dim // 2]`` fp32, scaled per ``config.rope_type``.

    Args:
        config: a :class:`~trtllm_diffkv.model.llama.ModelConfig` (``head_dim``,
            ``rope_theta``, ``rope_scaling``, ``rope_type``).
        device: where the result goes.
    """
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponent)
    s = config.rope_scaling
    if config.rope_type == "linear":
        return inv_freq / s["factor"]
    if config.rope_type == "freq_factors":
        return inv_freq / torch.tensor(s["freq_factors"], dtype=torch.float32, device=device)
    if config.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, s, dim, config.rope_theta)
    if config.rope_type == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_context = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _yarn_inv_freq(inv_freq: torch.Tensor, s: Mapping, dim: int, base: float) -> torch.Tensor:
    """YaRN frequency blend (transformers ``_compute_yarn_parameters``)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast", 32)), correction_dim(s.get("beta_slow", 1))
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency (fast rotations), 0: interpolate
    return inv_freq / s["factor"] * (1 - extrapolation) + inv_freq * extrapolation


def rope_attention_factor(config) -> float:
    """Factor on cos and sin (YaRN's attention scaling); 1.0 for every other type."""
    if config.rope_type != "yarn":
        return 1.0
    s = config.rope_scaling
    if "attention_factor" in s:
        return float(s["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(s["factor"], s["mscale"]) / mscale(s["factor"], s["mscale_all_dim"])
    return mscale(s["factor"])


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given absolute positions.

    Holds ``inv_freq`` (``[head_dim // 2]`` fp32, a non-persistent buffer) and
    ``attention_factor`` (a float multiplying cos and sin; 1 except for YaRN).
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.attention_factor = rope_attention_factor(config)
        # Computed on CPU, then moved to the default device: on the meta device
        # the math would pull in torch's slow decomposition machinery.
        default_device = torch.empty(0).device
        self.register_buffer("inv_freq", rope_inv_freq(config, "cpu").to(default_device), persistent=False)

    def reset_inv_freq(self, device: torch.device | str) -> None:
        """Recompute ``inv_freq`` on ``device`` (after building on the meta device)."""
        self.inv_freq = rope_inv_freq(self.config, device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[num_tokens]`` int64 -> (cos, sin), each ``[num_tokens, head_dim]`` in ``dtype``.

        Angles are computed in fp32, then cast (as transformers does).
        """
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor != 1.0:
            return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]`` by (cos, sin) ``[num_tokens, head_dim]``."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]
