"""Gemma 3 text decoder (``Gemma3ForCausalLM``: gemma-3-270m, gemma-3-1b) in plain PyTorch.

One file for the architecture, beside :mod:`.llama`; the attention contract
(:mod:`.attention_api`), the RoPE tables (:mod:`.rope`), the projection fusing
and the weight loading are shared. What differs from the Llama family, each
as transformers' ``models/gemma3/modeling_gemma3.py`` (5.x) computes it, the
parity reference:

* embeddings scaled by ``sqrt(hidden_size)`` (the scale rounded to the model
  dtype first, ``Gemma3TextScaledWordEmbedding``);
* RMSNorm ``x / rms(x) * (1 + w)`` with statistics and the product in fp32,
  cast once at the end (``Gemma3RMSNorm``; the stored ``w`` is HF's, without
  the ``+ 1`` a GGUF file folds in);
* four norms per layer: ``x + post_attention_norm(attn(input_norm(x)))``, then
  ``x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))``;
* ``q_norm`` / ``k_norm``: the same RMSNorm over each head's ``head_dim``,
  before RoPE;
* attention scale ``query_pre_attn_scalar ** -0.5``: the backends use
  ``head_dim ** -0.5``, so queries are multiplied by ``sqrt(head_dim /
  query_pre_attn_scalar)`` after RoPE (exactly 1, no multiply, when the two are
  equal: every Gemma 3 size but 27B);
* GELU (tanh approximation) gated MLP;
* ``layer_types``: ``"sliding_attention"`` layers attend the last
  ``sliding_window`` keys (the query's own included) and use RoPE base
  ``rope_local_theta`` (transformers' ``rope_parameters["sliding_attention"]``,
  default 10000); ``"full_attention"`` layers attend every earlier key with
  ``rope_theta`` and ``rope_scaling``. The window is applied by the backend:
  :attr:`Gemma3Config.sliding_windows` goes into the cache's configuration
  (:meth:`~trtllm_diffkv.config.DiffKVConfig.for_model`) and
  :meth:`Gemma3ForCausalLM.forward` refuses a backend without it
  (:func:`~.attention_api.check_backend_windows`);
* ``final_logit_softcapping`` (``tanh(logits / c) * c``) when set.

Refused by name (:meth:`Gemma3Config.from_hf_dict`): attention logit
soft-capping, bidirectional attention, attention biases, another activation,
RoPE scaling on the sliding layers, the multimodal ``Gemma3ForConditionalGeneration``.

Numerics: the CPU forward is transformers' sequence of operations (the parity
tests compare fp32 logits). On CUDA the q/k/v and gate/up products run as one
matrix product each over the concatenated weights (:meth:`~.llama.CausalLM.fuse_projections`);
norms, RoPE and GELU stay plain PyTorch (the Llama fused kernels compute
Llama's RMSNorm rounding, not Gemma's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..validators import is_number
from .attention_api import AttentionBackend, check_backend_windows
from .fused import rotate_heads
from .llama import MLP, Attention, CausalLM, ModelConfig
from .rope import RotaryEmbedding, apply_rope

GEMMA3_ARCHITECTURE = "Gemma3ForCausalLM"
"""HF ``architectures`` name of the text-only Gemma 3 decoder."""
GEMMA3_MODEL_TYPE = "gemma3_text"
LAYER_TYPES = ("sliding_attention", "full_attention")
"""``layer_types`` values (transformers' names)."""
DEFAULT_SLIDING_WINDOW_PATTERN = 6
"""transformers' and llama.cpp's default: every 6th layer full attention, the others sliding."""
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def default_layer_types(num_layers: int, pattern: int = DEFAULT_SLIDING_WINDOW_PATTERN) -> tuple[str, ...]:
    """``layer_types`` of a config that gives none: layer ``i`` full when ``(i + 1) % pattern == 0`` (transformers'
    ``Gemma3TextConfig.__post_init__``, llama.cpp's ``set_swa_pattern``)."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    """Frozen, validated description of a Gemma 3 text decoder (a :class:`~.llama.ModelConfig` plus its own fields).

    Shared fields mean what they mean for Llama; ``rope_theta`` / ``rope_scaling`` are the full-attention
    layers' RoPE, ``sliding_window`` the sliding layers' window in tokens (implemented: unlike Mistral's, no
    position limit follows from it, :attr:`max_supported_positions` is ``None``).

    Attributes:
        layer_types: one of :data:`LAYER_TYPES` per layer.
        query_pre_attn_scalar: the attention scale is ``query_pre_attn_scalar ** -0.5``.
        rope_local_theta: RoPE base of the sliding layers (plain RoPE).
        final_logit_softcapping: ``None`` or ``c > 0``: logits become ``tanh(logits / c) * c``.

    Raises:
        ValueError: as :class:`~.llama.ModelConfig`; ``layer_types`` of another length or with another value; a
            sliding layer without a positive ``sliding_window``; non-positive scalars.
    """

    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float = 256.0
    rope_local_theta: float = 10000.0
    final_logit_softcapping: float | None = None
    architecture: str = GEMMA3_ARCHITECTURE
    tie_word_embeddings: bool = True

    ARCHITECTURES: ClassVar[tuple[str, ...]] = (GEMMA3_ARCHITECTURE,)

    def __post_init__(self) -> None:
        super().__post_init__()
        types = tuple(self.layer_types) or default_layer_types(self.num_layers)
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"layer_types={list(types)} must give one of {list(LAYER_TYPES)} for each of the "
                             f"{self.num_layers} layers")
        if "sliding_attention" in types and (self.sliding_window is None or self.sliding_window <= 0):
            raise ValueError(f"sliding_window={self.sliding_window!r} must be a positive integer: the config has "
                             "sliding_attention layers")
        for name in ("query_pre_attn_scalar", "rope_local_theta"):
            value = getattr(self, name)
            if not is_number(value) or not value > 0:
                raise ValueError(f"{name}={value!r} must be a positive number")
        cap = self.final_logit_softcapping
        if cap is not None and (not is_number(cap) or not cap > 0):
            raise ValueError(f"final_logit_softcapping={cap!r} must be a positive number or None")

    @property
    def max_supported_positions(self) -> int | None:
        """``None``: the sliding window is implemented, so it bounds no position."""
        return None

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """``sliding_window`` for each ``"sliding_attention"`` layer, ``None`` for each full one."""
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def local_rope_config(self) -> "Gemma3Config":
        """This config with the sliding layers' RoPE (``rope_local_theta``, no scaling) as ``rope_theta``."""
        return replace(self, rope_theta=self.rope_local_theta, rope_scaling=None)

    @staticmethod
    def describes(hf: Mapping[str, Any]) -> bool:
        """Whether a HF ``config.json`` dict is a Gemma 3 one (text or multimodal; the latter is refused)."""
        archs = hf.get("architectures") or []
        name = archs[0] if archs else ""
        return name.startswith("Gemma3") or hf.get("model_type") in ("gemma3", GEMMA3_MODEL_TYPE)

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> "Gemma3Config":
        """Parse a Gemma 3 text ``config.json`` (transformers ``Gemma3TextConfig``), either RoPE layout.

        transformers >= 5: ``rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}``, each with
        ``rope_theta`` and ``rope_type``; earlier: ``rope_theta`` (full), ``rope_local_base_freq`` (sliding) and
        ``rope_scaling`` (full layers only). ``layer_types`` missing: every ``sliding_window_pattern``-th layer
        (default 6) full.

        Raises:
            ValueError: the multimodal ``Gemma3ForConditionalGeneration`` / ``gemma3`` (take its text
                checkpoint), ``attn_logit_softcapping``, ``use_bidirectional_attention``, ``attention_bias``, an
                activation other than GELU-tanh, RoPE scaling on the sliding layers, a missing required key.
        """
        archs = hf.get("architectures") or []
        if (archs and archs[0] != GEMMA3_ARCHITECTURE) or (not archs and hf.get("model_type") != GEMMA3_MODEL_TYPE):
            raise ValueError(f"unsupported architecture {archs[0] if archs else hf.get('model_type')!r}: only the "
                             f"text-only {GEMMA3_ARCHITECTURE} (model_type {GEMMA3_MODEL_TYPE!r}) of Gemma 3 runs")
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_activation={act!r} is not supported; only {list(_ACTIVATIONS)}")
        for key in ("attn_logit_softcapping", "use_bidirectional_attention", "attention_bias"):
            if hf.get(key):
                raise ValueError(f"Gemma 3 {key}={hf[key]!r} is not supported")
        try:
            num_layers, num_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
            full_theta, full_scaling, local_theta = _gemma_rope_params(hf)
            pattern = hf.get("sliding_window_pattern") or DEFAULT_SLIDING_WINDOW_PATTERN
            return cls(
                vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
                num_layers=num_layers, num_heads=num_heads,
                num_kv_heads=hf.get("num_key_value_heads") or num_heads, head_dim=hf.get("head_dim") or 256,
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=full_theta, rope_scaling=full_scaling,
                max_position_embeddings=hf.get("max_position_embeddings", 131072),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                sliding_window=hf.get("sliding_window", 4096),
                layer_types=tuple(hf.get("layer_types") or default_layer_types(num_layers, pattern)),
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                rope_local_theta=local_theta, final_logit_softcapping=hf.get("final_logit_softcapping"),
            )
        except KeyError as e:
            raise ValueError(f"config is missing required key {e.args[0]!r}") from None


def _gemma_rope_params(hf: Mapping[str, Any]) -> tuple[float, dict | None, float]:
    """(full-layer theta, full-layer rope_scaling, sliding-layer theta) from either config layout."""
    params = hf.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = dict(hf.get("rope_scaling") or {})
        full["rope_theta"] = hf.get("rope_theta", 1_000_000.0)
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    local_type = local.pop("rope_type", local.pop("type", "default"))
    if local_type != "default" or set(local) - {"rope_theta"}:
        raise ValueError(f"RoPE scaling on Gemma 3's sliding layers ({local_type!r}, {sorted(local)}) is not supported")
    full_theta = float(full.pop("rope_theta", 1_000_000.0))
    if full.get("rope_type", full.get("type")) == "default":
        full = {}
    return full_theta, full or None, float(local.get("rope_theta", 10_000.0))


# --------------------------------------------------------------------------- layers


class Gemma3RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * (1 + weight)`` over the last dim, all in fp32, cast back to x's dtype once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., dim]`` -> same shape and dtype."""
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(Attention):
    """Llama's projections plus per-head ``q_norm`` / ``k_norm`` before RoPE and the query scale (module docstring).

    Keeps :class:`~.llama.Attention`'s parameter names, fused q/k/v buffer and ``key_rotation``, so the key
    rotation (:mod:`.rotation`) folds into its ``v_proj`` / ``o_proj`` as for Llama.
    """

    def __init__(self, config: Gemma3Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = Gemma3RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(config.head_dim, config.rms_norm_eps)
        ratio = config.head_dim / config.query_pre_attn_scalar
        self.query_scale = math.sqrt(ratio) if ratio != 1 else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        n, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self._fused(x):
            q, k, v = F.linear(x, self._qkv_weight).split([H * D, Hkv * D, Hkv * D], dim=1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = apply_rope(self.q_norm(q.view(n, H, D)), cos, sin)
        k = apply_rope(self.k_norm(k.view(n, Hkv, D)), cos, sin)
        if self.query_scale is not None:
            q = (q.float() * self.query_scale).to(q.dtype)
        if self.key_rotation is not None:  # values are rotated through the folded v_proj / o_proj weights
            q, k = rotate_heads(q, k, self.key_rotation)
        out = backend.forward(self.layer_idx, q, k, v.reshape(n, Hkv, D))
        return self.o_proj(out.reshape(n, H * D))


class Gemma3MLP(MLP):
    """``down(gelu_tanh(gate(x)) * up(x))``; one gate/up product over the concatenated weight on CUDA."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            gate, up = F.linear(x, self._gate_up_weight).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """``x + post_attention_norm(attn(input_norm(x)))``, then ``x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))``."""

    def __init__(self, config: Gemma3Config, layer_idx: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = Gemma3RMSNorm(config.hidden_size, eps)
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.post_attention_layernorm = Gemma3RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps)
        self.mlp = Gemma3MLP(config)
        self.post_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps)
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden_size]`` -> the layer's output, same shape."""
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, backend))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    """Embedding, decoder layers, final norm and the two RoPE tables (HF prefix ``model.``)."""

    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        embed = torch.empty(config.vocab_size, config.hidden_size)  # skips nn.Embedding's init (meta device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embed)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.rotary_emb_local = RotaryEmbedding(config.local_rope_config)


# --------------------------------------------------------------------------- causal LM


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text causal LM over packed tokens; KV storage lives in the backend.

    Same contract as :class:`~.llama.LlamaForCausalLM` (HF parameter names, ``from_weights``, ``.to``), built
    by :func:`~trtllm_diffkv.model.loader.load_model` for a Gemma 3 checkpoint or GGUF.
    """

    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._embed_scales: dict[torch.dtype, float] = {}

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        return [self.model.rotary_emb, self.model.rotary_emb_local]

    def _embed_scale(self, dtype: torch.dtype) -> float:
        """``sqrt(hidden_size)`` rounded to fp32, then to ``dtype`` (transformers' ``embed_scale`` buffer cast to
        the weights' dtype), as a Python float: multiplying by it rounds as multiplying by that tensor does."""
        if dtype not in self._embed_scales:
            scale = torch.tensor(self.config.hidden_size ** 0.5, dtype=torch.float32).to(dtype)
            self._embed_scales[dtype] = float(scale)
        return self._embed_scales[dtype]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step over packed tokens (arguments and result as :meth:`LlamaForCausalLM.forward`).

        ``backend`` must apply the sliding windows (:attr:`Gemma3Config.sliding_windows`); no host
        synchronization (the check reads host attributes only), so the decode forward is CUDA-graph capturable.

        Raises:
            ValueError: ``input_ids`` / ``positions`` not 1-D of equal length; a backend without the model's
                sliding windows (:func:`~.attention_api.check_backend_windows`).
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must both be [num_tokens]")
        check_backend_windows(backend, self.config.sliding_windows)
        h = self.model.embed_tokens(input_ids)
        h = h * self._embed_scale(h.dtype)
        rope = {False: self.model.rotary_emb(positions, h.dtype), True: self.model.rotary_emb_local(positions, h.dtype)}
        for layer in self.model.layers:
            h = layer(h, *rope[layer.is_sliding], backend)
        if logits_indices is not None:
            h = h[logits_indices]
        logits = self.lm_head(self.model.norm(h)).float()
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap is not None else logits


__all__ = ["Gemma3Config", "Gemma3ForCausalLM", "GEMMA3_ARCHITECTURE", "LAYER_TYPES", "default_layer_types"]
