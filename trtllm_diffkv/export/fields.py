"""Plain-data forms of the DiffKV configuration and engine shape: plugin fields, ONNX attributes, config.json.

TensorRT plugin fields, ONNX node attributes and the engine directory's
``config.json`` all carry the same facts: the :class:`~trtllm_diffkv.config.DiffKVConfig`
and the model/engine sizes. This module turns them into flat ``{name: int | float | str}``
dicts and back, with no TensorRT import, so the round trip is tested on any machine.

Flat field names (plugin fields and ONNX attributes; TensorRT plugin fields are
scalars or 1-D arrays, so the config is flattened): ``high_key_bits``,
``high_value_bits``, ``high_key_groups``, ``high_value_groups`` (and ``low_*``),
``alpha_high``, ``alpha_low``, ``recent_window_tokens``,
``prompt_score_window_tokens``, ``prompt_threshold_base``, ``center_keys`` (0/1),
``compress`` (0/1), ``key_rotation``, ``rotation_seed``, ``score_pool_tokens``
(these three default to the config's defaults when absent: engine directories
written before they existed), ``kv_config_name``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import DiffKVConfig, TierConfig
from ..validators import positive_int

_TIER_FIELDS = ("key_bits", "value_bits", "key_groups", "value_groups")
_BOOL_FIELDS = ("center_keys", "compress")
_NUMBER_FIELDS = ("alpha_high", "alpha_low", "recent_window_tokens", "prompt_score_window_tokens")

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
"""Model / activation dtypes an engine may be built for (torch names)."""


def kv_config_to_fields(config: DiffKVConfig) -> dict[str, int | float | str]:
    """Flatten a :class:`DiffKVConfig` into scalar fields (ints, floats, strings; bools as 0/1)."""
    fields: dict[str, int | float | str] = {}
    for tier in ("high", "low"):
        t = getattr(config, tier)
        for name in _TIER_FIELDS:
            fields[f"{tier}_{name}"] = int(getattr(t, name))
    for name in _NUMBER_FIELDS:
        fields[name] = getattr(config, name)
    fields["alpha_high"], fields["alpha_low"] = float(config.alpha_high), float(config.alpha_low)
    fields["prompt_threshold_base"] = config.prompt_threshold_base
    for name in _BOOL_FIELDS:
        fields[name] = int(getattr(config, name))
    fields["key_rotation"] = config.key_rotation
    fields["rotation_seed"], fields["score_pool_tokens"] = int(config.rotation_seed), int(config.score_pool_tokens)
    fields["kv_config_name"] = config.name
    return fields


def kv_config_from_fields(fields: dict) -> DiffKVConfig:
    """Inverse of :func:`kv_config_to_fields` (extra keys are ignored).

    Raises:
        ValueError: a missing field (naming it) or a value the config refuses.
    """
    try:
        tiers = {tier: TierConfig(**{n: int(fields[f"{tier}_{n}"]) for n in _TIER_FIELDS}) for tier in ("high", "low")}
        return DiffKVConfig(
            high=tiers["high"], low=tiers["low"], alpha_high=float(_text(fields["alpha_high"])),
            alpha_low=float(_text(fields["alpha_low"])), recent_window_tokens=int(fields["recent_window_tokens"]),
            prompt_score_window_tokens=int(fields["prompt_score_window_tokens"]),
            prompt_threshold_base=str(_text(fields["prompt_threshold_base"])),
            center_keys=bool(int(fields["center_keys"])), compress=bool(int(fields["compress"])),
            key_rotation=str(_text(fields.get("key_rotation", "none"))),
            rotation_seed=int(fields.get("rotation_seed", 0)), score_pool_tokens=int(fields.get("score_pool_tokens", 1)),
            name=str(_text(fields.get("kv_config_name", "custom"))))
    except KeyError as exc:
        raise ValueError(f"DiffKV fields are missing {exc.args[0]!r}") from None


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class EngineShape:
    """The sizes one engine's kernels are specialized for (what ``trtllm-diffkv build`` fixes).

    Attributes:
        num_layers, num_heads, num_kv_heads, head_dim: model shape.
        kv_config: the DiffKV policy (tier formats decide the kernels' bit widths).
        dtype: activation dtype, one of :data:`SUPPORTED_DTYPES`.
        max_batch_size: request slots of the page manager.
        max_seq_len: longest request in tokens (prompt + generated); sets the page-table width.
        high_tokens_per_page: page sizing (:meth:`PageFormat.for_config`).

    Raises:
        ValueError: a non-positive size, an unknown dtype, or a model the
            configuration / kernels cannot run (unsupported head_dim, query:KV ratio).
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_config: DiffKVConfig
    dtype: str = "float16"
    max_batch_size: int = 8
    max_seq_len: int = 2048
    high_tokens_per_page: int = 32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "max_batch_size", "max_seq_len",
                     "high_tokens_per_page"):
            value = getattr(self, name)
            positive_int(name, value)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; allowed: {list(SUPPORTED_DTYPES)}")
        from ..kernels.prefill_attention import SUPPORTED_HEAD_DIMS

        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim={self.head_dim} has no DiffKV kernels; supported: {list(SUPPORTED_HEAD_DIMS)}")
        self.kv_config.validate_for_model(self.head_dim, self.num_heads, self.num_kv_heads)
        from ..kernels.decode_attention import MAX_GROUP

        if self.num_heads // self.num_kv_heads > MAX_GROUP:
            raise ValueError(f"query:KV head ratio {self.num_heads // self.num_kv_heads} exceeds the {MAX_GROUP} "
                             "the decode kernel supports")

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def page_format(self):
        """The pool's :class:`~trtllm_diffkv.memory.PageFormat`."""
        from ..memory import PageFormat

        return PageFormat.for_config(self.kv_config, self.head_dim, self.high_tokens_per_page)

    @property
    def max_pages_per_row(self) -> int:
        """Page-table width ``R`` (as :class:`~trtllm_diffkv.memory.page_manager.PageManager` computes it)."""
        return -(-self.max_seq_len // self.page_format.min_tokens_per_page) + 1

    def to_fields(self) -> dict[str, int | float | str]:
        """Flat fields: the sizes plus :func:`kv_config_to_fields`."""
        sizes = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "kv_config"}
        return {**sizes, **kv_config_to_fields(self.kv_config)}

    @classmethod
    def from_fields(cls, fields: dict) -> "EngineShape":
        """Inverse of :meth:`to_fields`.

        Raises:
            ValueError: a missing or invalid field.
        """
        try:
            sizes = {f.name: (str(_text(fields[f.name])) if f.name == "dtype" else int(fields[f.name]))
                     for f in dataclasses.fields(cls) if f.name != "kv_config"}
        except KeyError as exc:
            raise ValueError(f"engine fields are missing {exc.args[0]!r}") from None
        return cls(kv_config=kv_config_from_fields(fields), **sizes)
