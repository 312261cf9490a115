"""What a GGUF file says about its model, read from the file's own metadata.

transformers' GGUF import (used once, to dequantize the weights) drops part of
what a Llama-family GGUF carries: ``{arch}.rope.scaling.*`` (linear RoPE
scaling), the ``rope_freqs.weight`` tensor (per-frequency RoPE factors; Llama
3.1 GGUFs carry their ``llama3`` scaling this way) and the end-of-generation
ids other than ``eos`` (``eot``, ``eom``, FIM). This module reads those from
the header (:mod:`.gguf_meta`), builds the Hugging Face config the file
describes and refuses, by name, anything the model cannot represent, before
any weight is read.
"""
from __future__ import annotations

import math
from typing import Any

from .gguf_meta import EOG_TOKEN_KEYS, GGUFMetadata, SkippedArray
from .llama import ModelConfig
from ..validators import is_int

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "gemma3": "Gemma3ForCausalLM"}
"""``general.architecture`` values this package runs -> HF architecture."""
GEMMA3_27B_BLOCK_COUNT = 62
"""llama.cpp tells Gemma 3 27B by its 62 layers (``LLM_TYPE_27B``): its attention scale is ``1 / sqrt(hidden /
heads)``, every other size's ``1 / sqrt(head_dim)``."""

_ROPE_SCALING_TYPES = ("none", "linear", "yarn")
_ROPE_SCALING_IGNORED = ("type", "factor", "original_context_length", "finetuned")  # read below or informational
_YARN_KEYS = ("yarn_beta_fast", "yarn_beta_slow")
_YARN_NEUTRAL = {"yarn_ext_factor": (1.0, -1.0), "yarn_attn_factor": (1.0,), "yarn_log_multiplier": (0.0,)}
ROPE_FREQS_TENSOR = "rope_freqs.weight"


def check_architecture(meta: GGUFMetadata) -> str:
    """HF architecture name of a GGUF file.

    Raises:
        ValueError: ``general.architecture`` missing or not one of
            :data:`GGUF_ARCHITECTURES`, naming it.
    """
    arch = meta.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{meta.path.name}: GGUF architecture {arch!r} is not supported; "
                         f"supported: {sorted(GGUF_ARCHITECTURES)}")
    return GGUF_ARCHITECTURES[arch]


def rope_scaling(meta: GGUFMetadata, head_dim: int) -> dict | None:
    """The ``rope_scaling`` dict (HF/:class:`ModelConfig` form) a GGUF file carries.

    Read as llama.cpp reads it (``llama-model.cpp``, ``ggml_rope_yarn_corr_dims``):
    ``{arch}.rope.scaling.factor`` (or the older ``{arch}.rope.scale_linear``)
    divides every frequency for scaling types ``none`` and ``linear``; type
    ``yarn`` blends between the divided and the original frequencies (ramp
    from ``yarn_beta_fast``/``yarn_beta_slow``, defaults 32/1, at
    ``original_context_length``, default the context length) and scales
    cos/sin by ``0.1 ln(factor) + 1``, which is transformers' ``yarn``; a
    ``rope_freqs.weight`` tensor (``[head_dim // 2]``) divides each frequency
    by its own factor.

    Returns:
        ``None`` (plain RoPE), ``{"rope_type": "linear", "factor": f}``,
        ``{"rope_type": "yarn", ...}`` or ``{"rope_type": "freq_factors",
        "freq_factors": [...]}`` (the tensor times the linear factor).

    Raises:
        ValueError: scaling type ``longrope`` or unknown; an ``attn_factor``
            other than 1; YaRN keys with non-default effects
            (``yarn_ext_factor``, ``yarn_attn_factor``, ``yarn_log_multiplier``)
            or with a ``rope_freqs`` tensor; any other ``rope.scaling`` key
            (e.g. NTK ``alpha``, YaRN keys on a non-YaRN type); a partial
            rotary dimension; each naming the key.
    """
    arch, name = meta.architecture, meta.path.name
    prefix = f"{arch}.rope.scaling."
    keys = {k[len(prefix):]: v for k, v in meta.fields.items() if k.startswith(prefix)}
    scaling_type = str(keys.get("type", "none"))
    if scaling_type not in _ROPE_SCALING_TYPES:
        raise ValueError(f"{name}: RoPE scaling type {scaling_type!r} ({prefix}type) cannot be represented; "
                         f"supported: {list(_ROPE_SCALING_TYPES)} and per-frequency factors ({ROPE_FREQS_TENSOR})")
    if float(keys.pop("attn_factor", 1.0)) != 1.0:
        raise ValueError(f"{name}: {prefix}attn_factor={meta.fields[prefix + 'attn_factor']} (scaled attention "
                         "logits) cannot be represented")
    allowed = _ROPE_SCALING_IGNORED + (_YARN_KEYS + tuple(_YARN_NEUTRAL) if scaling_type == "yarn" else ())
    unknown = sorted(k for k in keys if k not in allowed)
    unknown += sorted(k for k, neutral in _YARN_NEUTRAL.items() if k in keys and float(keys[k]) not in neutral)
    if unknown:
        raise ValueError(f"{name}: RoPE scaling keys {[prefix + k for k in unknown]} cannot be represented"
                         + (f" with scaling type {scaling_type!r}" if scaling_type != "yarn" else ""))
    rotary = meta.arch_field("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(f"{name}: {arch}.rope.dimension_count={rotary} != head_dim={head_dim} "
                         "(partial rotary) cannot be represented")
    factor = keys.get("factor", meta.arch_field("rope.scale_linear"))
    factor = float(factor) if factor else 1.0  # llama.cpp: a missing or 0 factor means 1
    if not math.isfinite(factor) or factor <= 0 or (scaling_type == "yarn" and factor < 1):
        raise ValueError(f"{name}: {prefix}factor={factor} must be a positive number (>= 1 for yarn)")
    if scaling_type == "yarn":
        if ROPE_FREQS_TENSOR in meta.tensors:
            raise ValueError(f"{name}: YaRN together with {ROPE_FREQS_TENSOR} cannot be represented")
        original = keys.get("original_context_length") or meta.arch_field("context_length", 4096)
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(original),
                "beta_fast": float(keys.get("yarn_beta_fast", 32.0)), "beta_slow": float(keys.get("yarn_beta_slow", 1.0))}
    if ROPE_FREQS_TENSOR in meta.tensors:
        freqs = meta.read_f32_tensor(ROPE_FREQS_TENSOR)
        return {"rope_type": "freq_factors", "freq_factors": [f * factor for f in freqs]}
    return {"rope_type": "linear", "factor": factor} if factor != 1.0 else None


def hf_config(meta: GGUFMetadata) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict a Llama-family GGUF describes, validated.

    Keys follow transformers' GGUF mapping (``integrations/ggml.py``), plus
    ``rope_scaling`` from :func:`rope_scaling` and ``eos_token_id`` from
    :func:`stop_token_ids`.

    Raises:
        ValueError: unsupported architecture, a required key missing (naming
            it), per-layer KV head counts, RoPE scaling it cannot represent, or
            anything :meth:`ModelConfig.from_hf_dict` refuses.
    """
    architecture = check_architecture(meta)
    name = meta.path.name

    def need(suffix: str):
        value = meta.arch_field(suffix)
        if value is None:
            raise ValueError(f"{name}: GGUF metadata lacks {meta.architecture}.{suffix}")
        return value

    heads, hidden = need("attention.head_count"), need("embedding_length")
    kv_heads = meta.arch_field("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise ValueError(f"{name}: per-layer KV head counts {kv_heads} are not supported")
        kv_heads = kv_heads[0]
    head_dim = meta.arch_field("attention.key_length") or hidden // heads  # as llama.cpp: n_embd_head_k
    tokens = meta.fields.get("tokenizer.ggml.tokens")
    vocab = meta.arch_field("vocab_size") or (tokens.length if isinstance(tokens, SkippedArray) else len(tokens or []))
    config = {
        "architectures": [architecture],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.arch_field("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling(meta, head_dim),
        "max_position_embeddings": meta.arch_field("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in meta.tensors,
        "eos_token_id": sorted(stop_token_ids(meta)),
    }
    if architecture == "Gemma3ForCausalLM":
        config.update(_gemma3_fields(meta, config))
    ModelConfig.from_hf_dict(config)
    return config


def _gemma3_fields(meta: GGUFMetadata, config: dict) -> dict[str, Any]:
    """What a Gemma 3 config needs beyond the Llama keys, as llama.cpp reads a ``gemma3`` GGUF
    (``llama-model.cpp``, ``LLM_ARCH_GEMMA3``): the window from ``gemma3.attention.sliding_window``; the
    layer pattern (every 6th layer full), the sliding layers' RoPE base 10000 and the attention scale are
    fixed there, not in the file.

    Raises:
        ValueError: the file lacks ``gemma3.attention.sliding_window``.
    """
    window = meta.arch_field("attention.sliding_window")
    if window is None:
        raise ValueError(f"{meta.path.name}: GGUF metadata lacks gemma3.attention.sliding_window")
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    scalar = config["hidden_size"] // heads if layers == GEMMA3_27B_BLOCK_COUNT else config["head_dim"]
    from .gemma3 import GEMMA3_MODEL_TYPE, default_layer_types

    return {"model_type": GEMMA3_MODEL_TYPE, "sliding_window": int(window),
            "layer_types": list(default_layer_types(layers)), "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": scalar, "hidden_activation": "gelu_pytorch_tanh"}


def stop_token_ids(meta: GGUFMetadata) -> set[int]:
    """Token ids that end generation per the file's own metadata (:data:`EOG_TOKEN_KEYS`)."""
    ids = (meta.fields.get(key) for key in EOG_TOKEN_KEYS)
    return {int(i) for i in ids if is_int(i)}
