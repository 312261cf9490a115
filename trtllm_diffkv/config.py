"""DiffKV configuration: precision tiers, thresholds and windows.

One frozen, validated :class:`DiffKVConfig` describes every knob of the DiffKV
policy (paper section 4; ``shared/reference/DiffKV.md``, "Policy details"):

* two precision tiers, each a :class:`TierConfig` (key bits, value bits and
  quantization groups per head): high precision (K8V4 by default) and low
  precision (K4V2);
* ``alpha_high`` / ``alpha_low``: a token whose importance exceeds
  ``alpha_high / N`` stays high precision, one in ``[alpha_low/N, alpha_high/N]``
  goes to the low tier, the rest are pruned (N: the sequence length in the
  generation phase, the prompt length in the prompt phase);
* ``recent_window_tokens``: the newest tokens are always kept at high precision;
* ``prompt_score_window_tokens``: only the last queries of the prompt score the
  prompt tokens, as the authors' implementation does.

Every invalid value raises ``ValueError`` naming the field and its allowed
range. Model-dependent checks (head_dim, GQA ratio) live in
:meth:`DiffKVConfig.validate_for_model`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

SUPPORTED_BITS = (2, 4, 8, 16)
"""Bit widths a tier may use; 16 means "stored unquantized" (no compression)."""

SUPPORTED_GROUPS = (1, 2, 4)
"""Quantization groups per head (the head dimension split into equal groups)."""

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
"""Head dimensions the packed formats and page layouts are defined for."""


def _check_choice(name: str, value, allowed) -> None:
    if isinstance(value, bool) or type(value) not in {type(a) for a in allowed} or value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed values: {list(allowed)}")


def _check_range(name: str, value, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not lo <= value <= hi:
        raise ValueError(f"{name}={value!r} is out of range; allowed range: [{lo}, {hi}]")


def default_groups(bits: int) -> int:
    """Quantization groups per head the authors use for a bit width.

    8-bit -> 1 group, 4-bit -> 2 groups, 2-bit -> 4 groups (their long-reasoning
    settings, ``DiffKV.md`` "Quantization"); 16-bit (unquantized) -> 1.
    """
    return {16: 1, 8: 1, 4: 2, 2: 4}[bits]


@dataclass(frozen=True)
class TierConfig:
    """Storage format of one precision tier.

    Attributes:
        key_bits: bits per key element (2, 4, 8; 16 = unquantized).
        value_bits: bits per value element (2, 4, 8; 16 = unquantized).
        key_groups: quantization groups per head for keys (1, 2 or 4); ``None``
            takes :func:`default_groups` of ``key_bits``.
        value_groups: the same for values.

    Raises:
        ValueError: a field outside its allowed set, naming the field.
    """

    key_bits: int
    value_bits: int
    key_groups: int | None = None
    value_groups: int | None = None

    def __post_init__(self) -> None:
        _check_choice("key_bits", self.key_bits, SUPPORTED_BITS)
        _check_choice("value_bits", self.value_bits, SUPPORTED_BITS)
        if self.key_groups is None:
            object.__setattr__(self, "key_groups", default_groups(self.key_bits))
        if self.value_groups is None:
            object.__setattr__(self, "value_groups", default_groups(self.value_bits))
        _check_choice("key_groups", self.key_groups, SUPPORTED_GROUPS)
        _check_choice("value_groups", self.value_groups, SUPPORTED_GROUPS)

    @property
    def name(self) -> str:
        """Short name such as ``"K8V4"``."""
        return f"K{self.key_bits}V{self.value_bits}"

    @property
    def quantized(self) -> bool:
        """Whether either keys or values are stored below 16 bits."""
        return self.key_bits < 16 or self.value_bits < 16

    def token_bytes(self, head_dim: int) -> int:
        """Bytes one token of one KV head takes in this tier's packed format.

        Key codes + value codes (``head_dim * bits / 8`` each) plus, for every
        quantized side, one 16-bit scale and one 16-bit zero per group. The
        per-token score (fp32) and position (int32) are not included: see
        :data:`TOKEN_METADATA_BYTES`.
        """
        total = 0
        for bits, groups in ((self.key_bits, self.key_groups), (self.value_bits, self.value_groups)):
            total += head_dim * bits // 8
            if bits < 16:
                total += 4 * groups
        return total

    def validate_for_head_dim(self, head_dim: int) -> None:
        """Refuse a (bits, groups, head_dim) combination that cannot pack densely.

        Raises:
            ValueError: ``head_dim`` not in :data:`SUPPORTED_HEAD_DIMS`, or a
                group whose codes do not fill whole bytes.
        """
        _check_choice("head_dim", head_dim, SUPPORTED_HEAD_DIMS)
        for side, bits, groups in (("key", self.key_bits, self.key_groups), ("value", self.value_bits, self.value_groups)):
            if head_dim % groups or (head_dim // groups * bits) % 8:
                raise ValueError(
                    f"{side}_groups={groups} with {side}_bits={bits} does not pack head_dim={head_dim} into whole bytes"
                )


TOKEN_METADATA_BYTES = 8
"""Per-token, per-KV-head bookkeeping DiffKV stores beside the codes: the
accumulated attention score (fp32) and the token position (int32)
(``DiffKV.md``, "Memory manager": the six page segments)."""

HIGH_K8V4 = TierConfig(8, 4)
LOW_K4V2 = TierConfig(4, 2)
FP16_TIER = TierConfig(16, 16)


@dataclass(frozen=True)
class DiffKVConfig:
    """Frozen, validated DiffKV policy configuration.

    Attributes:
        high: format of the high-precision tier (default K8V4).
        low: format of the low-precision tier (default K4V2).
        alpha_high: high-precision threshold multiplier, in [0, 1000].
        alpha_low: pruning threshold multiplier, in [0, alpha_high].
        recent_window_tokens: newest tokens always kept at high precision, in
            [0, 65536] (paper: W = 64).
        prompt_score_window_tokens: how many of the last prompt queries score
            the prompt tokens, in [1, 65536] (authors' implementation: 64).
        prompt_threshold_base: what N is in the prompt phase's ``alpha / N``:
            ``"prompt_len"`` (default, every preset: ``alpha / prompt_len``, as
            the authors' released kernels do and on which the paper's
            thresholds were calibrated) or ``"position"`` (the paper text's
            ``alpha / i``: token ``p`` against ``alpha / (p + 1)``; kept as an
            option). On SmolLM2-135M, ``"position"`` sends early prompt tokens
            to the low tier and breaks greedy agreement on half the
            calibration prompts (docs/CALIBRATION.md).
        center_keys: quantize keys after subtracting a per-(request, layer,
            KV head) channel offset (the prompt keys' per-channel mean, fp16).
            Not in the paper: softmax is invariant to adding one vector to
            every key of a head, so attention is unchanged, while constant
            key channel outliers (Qwen-family k_proj biases, edge case 3) no
            longer inflate every token's quantization step.
        compress: ``False`` turns all compression off (the ``fp16`` preset):
            every token is kept, unquantized, and thresholds are ignored.
        name: preset name, for reports only.

    Raises:
        ValueError: any field out of range, naming the field and the range.
    """

    high: TierConfig = HIGH_K8V4
    low: TierConfig = LOW_K4V2
    alpha_high: float = 1.0
    alpha_low: float = 0.02
    recent_window_tokens: int = 64
    prompt_score_window_tokens: int = 64
    prompt_threshold_base: str = "prompt_len"
    center_keys: bool = True
    compress: bool = True
    name: str = "custom"

    def __post_init__(self) -> None:
        if not isinstance(self.high, TierConfig):
            raise ValueError(f"high must be a TierConfig, got {type(self.high).__name__}")
        if not isinstance(self.low, TierConfig):
            raise ValueError(f"low must be a TierConfig, got {type(self.low).__name__}")
        _check_range("alpha_high", self.alpha_high, 0.0, 1000.0)
        _check_range("alpha_low", self.alpha_low, 0.0, self.alpha_high)
        for name in ("center_keys", "compress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        for name in ("recent_window_tokens", "prompt_score_window_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r} must be an integer")
        _check_range("recent_window_tokens", self.recent_window_tokens, 0, 65536)
        _check_range("prompt_score_window_tokens", self.prompt_score_window_tokens, 1, 65536)
        _check_choice("prompt_threshold_base", self.prompt_threshold_base, ("position", "prompt_len"))
        if self.compress and (self.high.key_bits < self.low.key_bits or self.high.value_bits < self.low.value_bits):
            raise ValueError(
                f"high tier {self.high.name} must have at least the bits of low tier {self.low.name}"
            )

    def replace(self, **changes) -> "DiffKVConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def validate_for_model(self, head_dim: int, num_heads: int, num_kv_heads: int) -> None:
        """Refuse a model this configuration cannot run, at configuration time.

        Raises:
            ValueError: unsupported head_dim for a quantized tier, or
                ``num_heads`` not a positive multiple of ``num_kv_heads``.
        """
        if num_kv_heads <= 0 or num_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}"
            )
        if self.compress:
            self.high.validate_for_head_dim(head_dim)
            self.low.validate_for_head_dim(head_dim)

    def token_bytes(self, tier: str, head_dim: int) -> int:
        """Bytes per token per KV head in ``tier`` ("high" or "low"), metadata included.

        Without compression every token is FP16 keys and values, whatever the tiers say.
        """
        if not self.compress:
            return FP16_TIER.token_bytes(head_dim)
        fmt = {"high": self.high, "low": self.low}[tier]
        return fmt.token_bytes(head_dim) + TOKEN_METADATA_BYTES


def _preset(name: str, **kw) -> DiffKVConfig:
    return DiffKVConfig(name=name, **kw)


PRESETS: dict[str, DiffKVConfig] = {
    # Paper's calibrated thresholds (DiffKV.md "Policy details"): (alpha_low, alpha_high).
    "llama3-8b": _preset("llama3-8b", alpha_low=0.02, alpha_high=1.0),
    "llama3-70b": _preset("llama3-70b", alpha_low=0.0, alpha_high=1.0),
    # Qwen2.5-7B: low tier off (alpha_low == alpha_high), prune only.
    "qwen2.5-7b": _preset("qwen2.5-7b", alpha_low=0.04, alpha_high=0.04),
    "qwen2.5-32b": _preset("qwen2.5-32b", alpha_low=0.0, alpha_high=3.0),
    "qwq-32b": _preset("qwq-32b", alpha_low=0.0, alpha_high=3.0),
    # Quantization only: every token high precision (K8V4), nothing pruned.
    "k8v4": _preset("k8v4", low=HIGH_K8V4, alpha_low=0.0, alpha_high=0.0),
    # No compression at all: the reference for accuracy and memory.
    "fp16": _preset("fp16", high=FP16_TIER, low=FP16_TIER, alpha_low=0.0, alpha_high=0.0, compress=False),
}
# Calibrated on the default model (SmolLM2-135M-Instruct) with examples/calibrate_thresholds.py over
# HumanEval problems 100-123 (docs/CALIBRATION.md): pruning at any alpha_low > 0 broke greedy agreement.
PRESETS["smollm2-135m"] = _preset("smollm2-135m", alpha_low=0.0, alpha_high=1.0)
PRESETS["default"] = PRESETS["smollm2-135m"].replace(name="default")


def get_preset(name: str) -> DiffKVConfig:
    """Look up a named preset (see :data:`PRESETS`).

    Raises:
        ValueError: unknown name, listing the known ones.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown kv-config preset {name!r}; known presets: {sorted(PRESETS)}") from None
