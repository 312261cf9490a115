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
  prompt tokens, as the authors' implementation does;
* low-tier key treatments beyond the paper: ``key_rotation`` (a randomized
  Hadamard transform per KV head, :mod:`trtllm_diffkv.model.rotation`; on in
  ``diffkv``, the tiered preset) and ``score_pool_tokens`` (SnapKV-style max-pooling of the
  prompt scores);
* ``layers``: per-layer settings (:class:`LayerSettings`), today the sliding
  window of a model's sliding-window attention layers (Gemma 3); filled from
  the model by :meth:`DiffKVConfig.for_model`.

A configuration can also come from a JSON file written by ``trtllm-diffkv
calibrate`` (:func:`load_kv_config_file`); :func:`resolve_kv_config` is the one
place that turns a preset name, a file path or a config into a config.

Every invalid value raises ``ValueError`` naming the field and its allowed
range. Model-dependent checks (head_dim, GQA ratio) live in
:meth:`DiffKVConfig.validate_for_model`.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

from .validators import is_int, is_number

SUPPORTED_BITS = (2, 4, 8, 16)
"""Bit widths a tier may use; 16 means "stored unquantized" (no compression)."""

SUPPORTED_GROUPS = (1, 2, 4)
"""Quantization groups per head (the head dimension split into equal groups)."""

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
"""Head dimensions the packed formats and page layouts are defined for."""

KEY_ROTATIONS = ("none", "hadamard")
"""``DiffKVConfig.key_rotation`` choices."""

ROTATION_HEAD_DIMS = SUPPORTED_HEAD_DIMS
"""Head dimensions ``key_rotation="hadamard"`` is defined for: every supported one (Sylvester's Hadamard
matrices for powers of two, Paley's construction for 80 and 96; :func:`~trtllm_diffkv.model.rotation.hadamard_matrix`)."""


def _check_choice(name: str, value, allowed) -> None:
    if isinstance(value, bool) or type(value) not in {type(a) for a in allowed} or value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed values: {list(allowed)}")


def _check_range(name: str, value, lo: float, hi: float) -> None:
    if not is_number(value) or not lo <= value <= hi:
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

MAX_SLIDING_WINDOW_TOKENS = 2**31 - 1
"""Largest ``LayerSettings.sliding_window_tokens`` (positions are int32 in the pages)."""


@dataclass(frozen=True)
class LayerSettings:
    """Settings of one decoder layer that differ from the model-wide ones (``DiffKVConfig.layers``).

    Attributes:
        sliding_window_tokens: ``None`` for a full-attention layer; ``W`` for a
            sliding-window attention layer, whose query at position ``i`` attends
            only the keys at positions ``i - W < j <= i`` (transformers'
            ``sliding_window_overlay``: ``W`` keys, the query's own included).
            The cache keeps exactly the tokens such a layer's future queries can
            attend, in every preset (``fp16`` and ``k8v4`` included, as real
            engines hold only the window): the policy treats it as a per-layer
            recent window of ``W`` tokens, kept at the high tier, every token
            leaving it pruned at the step that makes it unreachable (the prompt's
            tokens older than ``prompt_len - W`` at prefill; the token at ``pos -
            W`` at the step writing ``pos``; :mod:`trtllm_diffkv.policy`). DiffKV's
            thresholds and tiers apply to the full-attention layers only. In
            ``[1, MAX_SLIDING_WINDOW_TOKENS]``.

    Raises:
        ValueError: a value out of range, naming the field.
    """

    sliding_window_tokens: int | None = None

    def __post_init__(self) -> None:
        w = self.sliding_window_tokens
        if w is not None and not is_int(w):
            raise ValueError(f"sliding_window_tokens={w!r} must be an integer or None")
        if w is not None:
            _check_range("sliding_window_tokens", w, 1, MAX_SLIDING_WINDOW_TOKENS)


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
            every token is kept, unquantized, and thresholds are ignored; ``high``
            and ``low`` are then set to :data:`FP16_TIER` whatever was given, so
            that the page layout, the kernels and the byte accounting agree
            (quantization without tiers: ``compress=True`` with ``alpha_high=0``,
            the ``k8v4`` preset).
        key_rotation: ``"none"`` or ``"hadamard"``: keys (after RoPE) and
            queries are multiplied by a seeded randomized Hadamard matrix per
            (layer, KV head), values by the same matrix folded into
            ``v_proj`` with its inverse folded into ``o_proj``
            (:mod:`trtllm_diffkv.model.rotation`; QuaRot, arXiv:2404.00456).
            ``q . k`` and the attention output are unchanged, so are the tier
            scores; key outlier channels are spread over all channels before
            quantization. Not in the paper; on in the ``diffkv`` preset
            (docs/QUALITY.md "Choosing the default"). Needs head_dim in
            :data:`ROTATION_HEAD_DIMS` (every supported head_dim).
        rotation_seed: seed of the rotation's random signs, in [0, 2**31 - 1].
        score_pool_tokens: width of a max-pool over neighbouring prompt
            tokens' importance before the prompt-phase tier decision (SnapKV,
            arXiv:2404.14469, pools its observation window's scores the same
            way), odd, in [1, 63]; 1 = off (the paper). Stored scores stay the
            raw attention sums; only the prompt decision sees the pooled value.
        calibrated_for: ``(num_heads, num_kv_heads, head_dim)`` of the model a
            calibration file was written for, or ``None``;
            :meth:`validate_for_model` refuses any other model.
        layers: per-layer settings, one :class:`LayerSettings` per decoder layer,
            or ``()`` (the default, every preset): every layer full attention
            under the model-wide settings. A model with sliding-window layers
            fills it from its own config (:meth:`for_model`, which every engine
            calls); a list is stored as a tuple. :meth:`validate_for_model`
            refuses a length other than the model's layers.
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
    key_rotation: str = "none"
    rotation_seed: int = 0
    score_pool_tokens: int = 1
    calibrated_for: tuple[int, int, int] | None = None
    layers: tuple[LayerSettings, ...] = ()
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
        if not self.compress:  # one layout for "no compression": FP16 both tiers (pages, kernels, bytes)
            object.__setattr__(self, "high", FP16_TIER)
            object.__setattr__(self, "low", FP16_TIER)
        for name in ("recent_window_tokens", "prompt_score_window_tokens", "rotation_seed", "score_pool_tokens"):
            value = getattr(self, name)
            if not is_int(value):
                raise ValueError(f"{name}={value!r} must be an integer")
        _check_range("recent_window_tokens", self.recent_window_tokens, 0, 65536)
        _check_range("prompt_score_window_tokens", self.prompt_score_window_tokens, 1, 65536)
        _check_choice("prompt_threshold_base", self.prompt_threshold_base, ("position", "prompt_len"))
        _check_choice("key_rotation", self.key_rotation, KEY_ROTATIONS)
        _check_range("rotation_seed", self.rotation_seed, 0, 2**31 - 1)
        _check_range("score_pool_tokens", self.score_pool_tokens, 1, 63)
        if self.score_pool_tokens % 2 == 0:
            raise ValueError(f"score_pool_tokens={self.score_pool_tokens} must be odd (a window centred on the token)")
        if self.calibrated_for is not None:
            shape = self.calibrated_for
            if (not isinstance(shape, tuple) or len(shape) != 3
                    or any(not is_int(x) or x <= 0 for x in shape)):
                raise ValueError(f"calibrated_for={shape!r} must be (num_heads, num_kv_heads, head_dim), "
                                 "three positive integers")
        if isinstance(self.layers, list):
            object.__setattr__(self, "layers", tuple(self.layers))
        if not isinstance(self.layers, tuple) or not all(isinstance(x, LayerSettings) for x in self.layers):
            raise ValueError(f"layers={self.layers!r} must be a tuple of LayerSettings (one per decoder layer) or ()")
        if self.compress and (self.high.key_bits < self.low.key_bits or self.high.value_bits < self.low.value_bits):
            raise ValueError(
                f"high tier {self.high.name} must have at least the bits of low tier {self.low.name}"
            )

    def replace(self, **changes) -> "DiffKVConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def same_configuration(self, other: "DiffKVConfig") -> bool:
        """Whether ``other`` is this configuration under another name (every field but ``name`` equal): how the
        ``default`` preset is told from the named point it currently is."""
        return dataclasses.replace(self, name=other.name) == other

    def sliding_window_of(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (:class:`LayerSettings`), ``None`` for full attention
        (and for every layer when :attr:`layers` is empty)."""
        return self.layers[layer_idx].sliding_window_tokens if self.layers else None

    def sliding_windows(self, num_layers: int) -> tuple[int | None, ...]:
        """``num_layers`` entries of :meth:`sliding_window_of` (``None``: full attention).

        Raises:
            ValueError: :attr:`layers` set for another number of layers.
        """
        self._check_layer_count(num_layers)
        return tuple(self.sliding_window_of(i) for i in range(num_layers)) if self.layers else (None,) * num_layers

    def for_model(self, model_config) -> "DiffKVConfig":
        """This configuration with :attr:`layers` holding ``model_config``'s sliding windows: the one place a
        model's sliding-window layers enter the policy (every engine calls it before building a cache).

        Args:
            model_config: an object with ``num_layers`` and ``sliding_windows`` (one ``int | None`` per layer;
                :class:`~trtllm_diffkv.model.llama.ModelConfig`).

        Returns:
            ``self`` when the model has no sliding-window layer and :attr:`layers` sets none, or when
            :attr:`layers` already holds exactly the model's windows; else a copy with them.

        Raises:
            ValueError: :attr:`layers` set (a kv-config file) with another length or other windows than the
                model's, naming the first differing layer.
        """
        windows = tuple(model_config.sliding_windows)
        mine = self.sliding_windows(len(windows)) if self.layers else None
        if mine is not None and mine != windows:
            i = next(i for i, (a, b) in enumerate(zip(mine, windows)) if a != b)
            raise ValueError(f"kv-config {self.name!r} sets layers[{i}].sliding_window_tokens={mine[i]}; the model's "
                             f"layer {i} has sliding window {windows[i]}")
        if mine is not None or all(w is None for w in windows):
            return self
        return self.replace(layers=tuple(LayerSettings(w) for w in windows))

    def _check_layer_count(self, num_layers: int) -> None:
        if self.layers and len(self.layers) != num_layers:
            raise ValueError(f"kv-config {self.name!r} has settings for {len(self.layers)} layers; the model has "
                             f"{num_layers}")

    def validate_for_model(self, head_dim: int, num_heads: int, num_kv_heads: int,
                           num_layers: int | None = None) -> None:
        """Refuse a model this configuration cannot run, at configuration time.

        Raises:
            ValueError: unsupported head_dim for a quantized tier or for
                ``key_rotation``, ``num_heads`` not a positive multiple of
                ``num_kv_heads``, a model other than ``calibrated_for``
                (naming the differing field), or (with ``num_layers``)
                :attr:`layers` set for another number of layers.
        """
        if num_layers is not None:
            self._check_layer_count(num_layers)
        if num_kv_heads <= 0 or num_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}"
            )
        if self.calibrated_for is not None:
            for field_name, want, got in zip(("num_heads", "num_kv_heads", "head_dim"), self.calibrated_for,
                                             (num_heads, num_kv_heads, head_dim)):
                if want != got:
                    raise ValueError(f"kv-config {self.name!r} was calibrated for {field_name}={want}; "
                                     f"this model has {field_name}={got}")
        if self.key_rotation != "none" and head_dim not in ROTATION_HEAD_DIMS:
            raise ValueError(f"key_rotation={self.key_rotation!r} needs head_dim in {list(ROTATION_HEAD_DIMS)}; "
                             f"this model has head_dim={head_dim} (use key_rotation='none')")
        if self.compress:
            self.high.validate_for_head_dim(head_dim)
            self.low.validate_for_head_dim(head_dim)

    @property
    def tiered(self) -> bool:
        """Whether tokens are tiered by the attention they receive (paper section 4.2).

        ``compress`` and ``alpha_high > 0``. Otherwise (``fp16``; uniform quantization such as ``k8v4`` and
        ``k8v8``, whose ``alpha_high`` and ``alpha_low`` are 0) every token stays in the high tier for good:
        no prompt scoring, no decode decisions, no score updates, no low-tier pages, and no per-token score
        and position in the pages (:data:`TOKEN_METADATA_BYTES`), as a uniform INT8/INT4 cache would store
        it. With ``alpha_high == 0`` every importance is ``> 0 / N`` or ties it, so the tiered rules would
        keep every token at the high tier's format anyway: the outputs are the same, the work and bytes are not.
        """
        return self.compress and self.alpha_high > 0

    def token_bytes(self, tier: str, head_dim: int) -> int:
        """Bytes per token per KV head in ``tier`` ("high" or "low"), metadata included.

        Without compression every token is FP16 keys and values, whatever the tiers say. The per-token score
        and position (:data:`TOKEN_METADATA_BYTES`) count only where tokens are :attr:`tiered`.
        """
        if not self.compress:
            return FP16_TIER.token_bytes(head_dim)
        fmt = {"high": self.high, "low": self.low}[tier]
        return fmt.token_bytes(head_dim) + (TOKEN_METADATA_BYTES if self.tiered else 0)


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
    # Uniform INT8 keys and values (LMDeploy's quant_policy 8, vLLM's int8 KV): the other uniform baseline.
    "k8v8": _preset("k8v8", high=TierConfig(8, 8), low=TierConfig(8, 8), alpha_low=0.0, alpha_high=0.0),
    # No compression at all: the reference for accuracy and memory.
    "fp16": _preset("fp16", high=FP16_TIER, low=FP16_TIER, alpha_low=0.0, alpha_high=0.0, compress=False),
}
# Calibrated on the default model (SmolLM2-135M-Instruct) with examples/calibrate_thresholds.py over
# HumanEval problems 100-123 (docs/CALIBRATION.md): pruning at any alpha_low > 0 broke greedy agreement.
PRESETS["smollm2-135m"] = _preset("smollm2-135m", alpha_low=0.0, alpha_high=1.0)
# `diffkv`: the tiered DiffKV point (K8V4 high / K4V2 low, alpha_high 1.0, alpha_low 0.0: those thresholds) with
# the keys rotated (key_rotation="hadamard"). Code and tests that mean "the tiered point" name `diffkv`.
# `default-unrotated` is the previous default, `default-rotated` the name the measurements used (the same
# configuration as `diffkv`).
PRESETS["default-unrotated"] = PRESETS["smollm2-135m"].replace(name="default-unrotated")
PRESETS["diffkv"] = PRESETS["smollm2-135m"].replace(name="diffkv", key_rotation="hadamard")
PRESETS["default-rotated"] = PRESETS["diffkv"].replace(name="default-rotated")
# `default`: what every surface runs when the user names no kv-config: the lowest-memory point within noise of fp16
# on every long-context task of both models of docs/QUALITY.md's generation-level harness (issue 41). No tiered
# point qualifies (Gemma 3 270M, n = 100: `diffkv` copies 18/100 exactly against fp16's 33, k8v4 29), so it is
# the best point within noise of FP16: uniform K8V4.
PRESETS["default"] = PRESETS["k8v4"].replace(name="default")
# The paper's rules as its text states them (section 4.2): alpha / i in the prompt phase, no key centering,
# the Llama3-8B thresholds (alpha_low 0.02, alpha_high 1). docs/CALIBRATION.md lists each departure of
# `diffkv` from it with its measured effect.
PRESETS["paper"] = _preset("paper", alpha_low=0.02, alpha_high=1.0, prompt_threshold_base="position",
                           center_keys=False)
# Low-tier variant of `default-unrotated` (issue 18 section 3; docs/CALIBRATION.md "Low-tier formats").
PRESETS["default-k8v2"] = PRESETS["default-unrotated"].replace(name="default-k8v2", low=TierConfig(8, 2))


def get_preset(name: str) -> DiffKVConfig:
    """Look up a named preset (see :data:`PRESETS`).

    Raises:
        ValueError: unknown name, listing the known ones.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown kv-config preset {name!r}; known presets: {sorted(PRESETS)}") from None


# --------------------------------------------------------------------------- calibration files

KV_CONFIG_FILE_FORMAT = "trtllm-diffkv-kv-config"
"""``format`` value of a kv-config JSON file (written by ``trtllm-diffkv calibrate``)."""

KV_CONFIG_FILE_VERSION = 1

_TOP_KEYS = ("format", "version", "model", "kv_config", "calibration")
_MODEL_KEYS = ("num_heads", "num_kv_heads", "head_dim")
_TIER_KEYS = ("key_bits", "value_bits", "key_groups", "value_groups")
_LAYER_KEYS = tuple(f.name for f in dataclasses.fields(LayerSettings))
_CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(DiffKVConfig) if f.name != "calibrated_for")


def kv_config_to_dict(config: DiffKVConfig) -> dict:
    """JSON-ready dict of every field but ``calibrated_for`` (tiers as ``{key_bits, value_bits, ...}``, ``layers``
    as a list of ``{sliding_window_tokens}`` objects)."""
    out = {}
    for name in _CONFIG_KEYS:
        value = getattr(config, name)
        if isinstance(value, TierConfig):
            value = {k: getattr(value, k) for k in _TIER_KEYS}
        elif name == "layers":
            value = [{k: getattr(layer, k) for k in _LAYER_KEYS} for layer in value]
        out[name] = value
    return out


def _layers_from_list(where: str, value) -> tuple[LayerSettings, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a JSON list of per-layer objects, got {type(value).__name__}")
    layers = []
    for i, item in enumerate(value):
        _refuse_unknown(f"{where}[{i}]", item, _LAYER_KEYS)
        try:
            layers.append(LayerSettings(**item))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}[{i}]: {exc}") from None
    return tuple(layers)


def _refuse_unknown(where: str, data, known) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; known keys: {list(known)}")


def kv_config_from_dict(data: dict, model: dict | None = None, where: str = "kv_config") -> DiffKVConfig:
    """Inverse of :func:`kv_config_to_dict`; missing keys take :class:`DiffKVConfig`'s defaults.

    Args:
        data: the ``kv_config`` object of a file.
        model: the file's ``model`` object (``num_heads``, ``num_kv_heads``, ``head_dim``) or ``None``;
            becomes ``calibrated_for``.
        where: prefix of error messages (the file and object).

    Raises:
        ValueError: an unknown key or a value out of range, naming the field (``where.field``).
    """
    _refuse_unknown(where, data, _CONFIG_KEYS)
    kwargs = {}
    for name, value in data.items():
        if name in ("high", "low"):
            _refuse_unknown(f"{where}.{name}", value, _TIER_KEYS)
            try:
                value = TierConfig(**value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{where}.{name}: {exc}") from None
        elif name == "layers":
            value = _layers_from_list(f"{where}.layers", value)
        kwargs[name] = value
    if model is not None:
        _refuse_unknown("model", model, _MODEL_KEYS)
        missing = [k for k in _MODEL_KEYS if k not in model]
        if missing:
            raise ValueError(f"model: missing key {missing[0]!r}; a calibration file names {list(_MODEL_KEYS)}")
        kwargs["calibrated_for"] = tuple(model[k] for k in _MODEL_KEYS)
    try:
        return DiffKVConfig(**kwargs)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def save_kv_config_file(path, config: DiffKVConfig, model_shape: tuple[int, int, int] | None = None,
                        calibration: dict | None = None) -> None:
    """Write ``config`` as a kv-config JSON file (what :func:`load_kv_config_file` reads).

    Args:
        path: the file to write.
        model_shape: ``(num_heads, num_kv_heads, head_dim)`` of the model the file is for; default
            ``config.calibrated_for``. ``None`` writes a file any model may use.
        calibration: free-form record of how it was chosen (command, date, commit, table).
    """
    import json
    from pathlib import Path

    shape = model_shape if model_shape is not None else config.calibrated_for
    data = {"format": KV_CONFIG_FILE_FORMAT, "version": KV_CONFIG_FILE_VERSION}
    if shape is not None:
        data["model"] = dict(zip(_MODEL_KEYS, (int(x) for x in shape)))
    data["kv_config"] = kv_config_to_dict(config)
    if calibration is not None:
        data["calibration"] = calibration
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")


@contextlib.contextmanager
def replaced_atomically(path):
    """Write a result file all at once: yields a temporary path beside ``path`` (same folder, same suffix, so that
    matplotlib picks the format from it); when the ``with`` block ends without an error the temporary file is
    renamed onto ``path`` with ``os.replace`` (atomic on POSIX: a reader, or a run killed mid-write, sees the old
    file or the whole new one, never half of it); on an error it is removed and ``path`` is left as it was.

    The one home of this rule: every result file of ``bench``, ``eval`` and ``calibrate`` (JSON, PNG, kv-config
    files) is written through it.

    Raises:
        OSError: the folder is not writable (from the write or the rename).
    """
    import os
    from pathlib import Path

    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through :func:`replaced_atomically`.

    Raises:
        OSError: the folder is not writable.
    """
    with replaced_atomically(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def load_kv_config_file(path) -> DiffKVConfig:
    """Read a kv-config JSON file (``trtllm-diffkv calibrate`` writes them).

    Layout: ``{"format": "trtllm-diffkv-kv-config", "version": 1, "model": {"num_heads", "num_kv_heads",
    "head_dim"} (optional), "kv_config": {DiffKVConfig fields; tiers as objects; ``layers`` as a list of
    ``{"sliding_window_tokens": int or null}``, one per decoder layer, optional}, "calibration": {...}
    (optional, not read)}``. The ``model`` object makes the config refuse any other model
    (:meth:`DiffKVConfig.validate_for_model`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not JSON, another format or version, an unknown key, a value out of range, each
            naming the file and the field.
    """
    import json
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"kv-config file {path} is a directory")
    if not path.is_file():
        raise FileNotFoundError(f"kv-config file {path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))  # a leading byte-order mark is ignored
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise ValueError(f"kv-config file {path}: not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    _refuse_unknown(f"kv-config file {path}", data, _TOP_KEYS)
    if data.get("format") != KV_CONFIG_FILE_FORMAT:
        raise ValueError(f"kv-config file {path}: format={data.get('format')!r}, expected {KV_CONFIG_FILE_FORMAT!r}")
    if data.get("version") != KV_CONFIG_FILE_VERSION:
        raise ValueError(f"kv-config file {path}: version={data.get('version')!r}, expected {KV_CONFIG_FILE_VERSION}")
    if "kv_config" not in data:
        raise ValueError(f"kv-config file {path}: missing key 'kv_config'")
    try:
        return kv_config_from_dict(data["kv_config"], data.get("model"), where="kv_config")
    except ValueError as exc:
        raise ValueError(f"kv-config file {path}: {exc}") from None


def resolve_kv_config(spec) -> DiffKVConfig:
    """The one way a user's ``--kv-config`` / ``kv_config=`` becomes a :class:`DiffKVConfig`.

    Args:
        spec: a :class:`DiffKVConfig` (returned as is), a preset name (:data:`PRESETS`), or the path of a
            kv-config JSON file (a name ending in ``.json``, or any existing file).

    Raises:
        ValueError: an unknown preset, or a bad file (see :func:`load_kv_config_file`).
        FileNotFoundError: a ``.json`` path that does not exist.
    """
    import os

    if isinstance(spec, DiffKVConfig):
        return spec
    if isinstance(spec, os.PathLike) or (isinstance(spec, str) and spec not in PRESETS
                                          and (spec.endswith(".json") or os.path.isfile(spec))):
        return load_kv_config_file(spec)
    if not isinstance(spec, str):
        raise ValueError(f"kv_config must be a preset name, a JSON file path or a DiffKVConfig; got "
                         f"{type(spec).__name__}")
    return get_preset(spec)
