"""Llama-family decoder in plain PyTorch: Llama 2/3, Mistral, Qwen2/2.5, SmolLM2.

One readable file in the spirit of gpt-fast. The model owns weights only; it
never stores keys or values. Each decoder layer projects q/k/v, applies RoPE
at the tokens' absolute positions and hands them to
:meth:`AttentionBackend.forward` (``attention_api.py``), which returns the
attention output.

Token layout ("packed"): the new tokens of one step, all requests
concatenated: ``input_ids`` and ``positions`` are ``[num_tokens]``; hidden
states are ``[num_tokens, hidden_size]``; q is ``[num_tokens, num_heads,
head_dim]``, k and v are ``[num_tokens, num_kv_heads, head_dim]``.

Numerics follow Hugging Face ``transformers`` (the parity reference): RoPE
angles and RMSNorm statistics in fp32, everything else in the model dtype,
rotate-half RoPE layout (HF weight layout, not Meta's interleaved one).

Weight names equal the Hugging Face Llama names
(``model.layers.N.self_attn.q_proj.weight``, ...), so a checkpoint's tensors
load by name.

Supported architectures (:data:`SUPPORTED_ARCHITECTURES`):

* ``LlamaForCausalLM``: Llama 2, Llama 3/3.1/3.2 (``rope_type`` ``"llama3"``),
  SmolLM2 (tied embeddings). ``attention_bias`` / ``mlp_bias`` are refused.
* ``MistralForCausalLM``: no sliding-window attention. A config with
  ``sliding_window`` set loads (attention is exactly causal while every
  position is below the window), but :meth:`LlamaForCausalLM.forward` raises
  ``ValueError`` for any position ``>= sliding_window``; executors can check
  requests host-side against :attr:`ModelConfig.max_supported_positions`.
* ``Qwen2ForCausalLM``: Qwen2 / Qwen2.5 (bias on q/k/v projections). Sliding
  window (``use_sliding_window``) is handled as for Mistral.

RoPE and its scalings live in :mod:`.rope` (``default``, ``linear``,
``llama3``, ``yarn``, ``freq_factors``); anything else (``dynamic``,
``longrope``, ...) raises ``ValueError`` naming it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .attention_api import AttentionBackend
from . import fused as _fused_ops
from .fused import qkv_rope, rms_norm, rms_norm_reference, rotate_heads, silu_mul
from .rope import SUPPORTED_ROPE_TYPES, RotaryEmbedding, apply_rope, normalize_rope_scaling, rope_inv_freq  # noqa: F401
from ..validators import positive_int

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
"""HF ``architectures`` names this module runs."""

_MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ModelConfig:
    """Frozen, validated description of a Llama-family decoder.

    Attributes:
        vocab_size: number of token ids.
        hidden_size: residual stream width.
        intermediate_size: SwiGLU MLP inner width.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA; ``num_heads % num_kv_heads == 0``).
        head_dim: per-head width (may differ from ``hidden_size // num_heads``).
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: ``None`` (plain RoPE) or a dict with a ``"rope_type"``
            of :data:`~trtllm_diffkv.model.rope.SUPPORTED_ROPE_TYPES` and its
            keys (see :func:`~trtllm_diffkv.model.rope.normalize_rope_scaling`).
            Not hashed.
        max_position_embeddings: trained context length (informational; not enforced).
        tie_word_embeddings: ``lm_head`` shares ``embed_tokens``' weight.
        qkv_bias: q/k/v projections carry a bias (Qwen2).
        architecture: one of :data:`SUPPORTED_ARCHITECTURES`.
        sliding_window: Mistral/Qwen2 sliding window in tokens, or ``None``.
            Not implemented: positions ``>= sliding_window`` are refused.

    Raises:
        ValueError: unsupported architecture or RoPE type, non-positive sizes,
            ``num_heads`` not a multiple of ``num_kv_heads``, odd ``head_dim``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    architecture: str = "LlamaForCausalLM"
    sliding_window: int | None = None

    ARCHITECTURES: ClassVar[tuple[str, ...]] = SUPPORTED_ARCHITECTURES
    """The ``architecture`` values this config class describes (a subclass names its own)."""

    def __post_init__(self) -> None:
        if self.architecture not in self.ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {list(self.ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            positive_int(name, value)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window!r} must be positive or None")
        scaling = normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings, self.head_dim)
        object.__setattr__(self, "rope_scaling", scaling)

    @property
    def rope_type(self) -> str:
        """One of :data:`~trtllm_diffkv.model.rope.SUPPORTED_ROPE_TYPES`."""
        return self.rope_scaling["rope_type"] if self.rope_scaling else "default"

    @property
    def max_supported_positions(self) -> int | None:
        """Exclusive bound on positions this implementation computes exactly.

        ``sliding_window`` for sliding-window configs (attention differs from
        plain causal beyond it), else ``None`` (no bound; RoPE extrapolates as
        in the reference).
        """
        return self.sliding_window

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """The sliding window each layer's attention applies, ``None`` for full attention: all ``None`` here
        (a Mistral/Qwen2 window is refused beyond it instead, :attr:`max_supported_positions`); Gemma 3's
        local layers in :class:`~trtllm_diffkv.model.gemma3.Gemma3Config`."""
        return (None,) * self.num_layers

    @staticmethod
    def describes(hf: Mapping[str, Any]) -> bool:
        """Whether a HF ``config.json`` dict belongs to a subclass's family (:meth:`from_hf_dict` asks each
        subclass); the Llama family is what no subclass describes."""
        return False

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Parse a Hugging Face ``config.json`` dict.

        A config another family's subclass :meth:`describes` is parsed by that
        subclass: a Gemma 3 text config (``Gemma3ForCausalLM`` / ``gemma3_text``)
        gives a :class:`~trtllm_diffkv.model.gemma3.Gemma3Config`
        (:meth:`~trtllm_diffkv.model.gemma3.Gemma3Config.from_hf_dict`; the
        subclasses are found as such, not imported, so ``trtllm_diffkv.model``
        must be imported, which importing this module does).

        Accepts both the transformers<5 layout (top-level ``rope_theta`` and
        ``rope_scaling``) and the transformers>=5 layout (``rope_parameters``
        holding ``rope_theta`` and ``rope_type``). The architecture comes from
        ``architectures[0]``, else from ``model_type``.

        Raises:
            ValueError: unsupported architecture (naming it and the supported
                list), unsupported RoPE type, ``hidden_act`` other than silu,
                Llama ``attention_bias``/``mlp_bias``, partial rotary, missing
                required keys.
        """
        if cls is ModelConfig:
            for family in cls.__subclasses__():  # another family's config parses its own (no import: no circle)
                if family.describes(hf):
                    return family.from_hf_dict(hf)
        architecture = _architecture_of(hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU)")
        if architecture == "LlamaForCausalLM" and (hf.get("attention_bias") or hf.get("mlp_bias")):
            raise ValueError("Llama attention_bias/mlp_bias=True (bias on o_proj / MLP) is not supported")
        try:
            num_heads = hf["num_attention_heads"]
            hidden_size = hf["hidden_size"]
            rope_theta, rope_scaling = _rope_params_of(hf)
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hidden_size,
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=hf.get("num_key_value_heads") or num_heads,
                head_dim=hf.get("head_dim") or hidden_size // num_heads,
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=hf.get("max_position_embeddings", 4096),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=architecture == "Qwen2ForCausalLM",
                architecture=architecture,
                sliding_window=_sliding_window_of(hf, architecture),
            )
        except KeyError as e:
            raise ValueError(f"config is missing required key {e.args[0]!r}") from None


def _architecture_of(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if archs:
        arch = archs[0]
    elif hf.get("model_type") in _MODEL_TYPE_TO_ARCHITECTURE:
        arch = _MODEL_TYPE_TO_ARCHITECTURE[hf["model_type"]]
    else:
        arch = f"<model_type {hf.get('model_type')!r}>"
    if arch not in SUPPORTED_ARCHITECTURES:
        others = [a for family in ModelConfig.__subclasses__() for a in family.ARCHITECTURES]
        raise ValueError(f"unsupported architecture {arch!r}; supported: {list(SUPPORTED_ARCHITECTURES) + others}")
    return arch


def _rope_params_of(hf: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config layout."""
    params = dict(hf.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    scaling = dict(hf.get("rope_scaling") or {}) or params
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    scaling.pop("rope_theta", None)
    scaling.pop("partial_rotary_factor", None)
    return float(theta), scaling or None


def _sliding_window_of(hf: Mapping[str, Any], architecture: str) -> int | None:
    window = hf.get("sliding_window")
    if architecture == "MistralForCausalLM":
        return window
    if architecture == "Qwen2ForCausalLM":
        layer_types = hf.get("layer_types") or []
        if hf.get("use_sliding_window") or "sliding_attention" in layer_types:
            return window
    return None


# --------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; statistics in fp32, output in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, dim]`` -> same shape and dtype."""
        return rms_norm_reference(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = x + residual`` (``x`` when ``residual`` is None) -> ``(norm(s), s)``; one Triton kernel on
        CUDA (:func:`~trtllm_diffkv.model.fused.rms_norm`)."""
        return rms_norm(x, self.weight, self.eps, residual)


def _concat_rows(modules: list[nn.Linear], attr: str) -> torch.Tensor | None:
    """Concatenate the modules' ``attr`` tensors along dim 0 and make each module's parameter a view of
    its rows of the result (the same values and HF names, one buffer); ``None`` when they have none."""
    tensors = [getattr(m, attr) for m in modules]
    if any(t is None for t in tensors):
        return None
    fused = torch.cat([t.detach() for t in tensors], dim=0)
    start = 0
    for module, t in zip(modules, tensors):
        setattr(module, attr, nn.Parameter(fused[start:start + t.shape[0]], requires_grad=t.requires_grad))
        start += t.shape[0]
    return fused


def _is_concat_of(fused: torch.Tensor | None, modules: list[nn.Linear], attr: str) -> bool:
    """Whether the modules' ``attr`` parameters are still consecutive row views of ``fused`` (a ``.to()``
    or a parameter reassigned since the concatenation makes them separate tensors again)."""
    if fused is None:
        return all(getattr(m, attr) is None for m in modules)
    ptr, row_bytes = fused.data_ptr(), fused[0].numel() * fused.element_size()
    for m in modules:
        t = getattr(m, attr)
        if t is None or t.data_ptr() != ptr or t.dtype != fused.dtype or t.device != fused.device:
            return False
        ptr += t.shape[0] * row_bytes
    return True


class Attention(nn.Module):
    """q/k/v projections, RoPE, backend attention, output projection.

    After :meth:`fuse_projections` (done at load), q/k/v are one matrix product over the concatenated
    weight and one RoPE kernel on CUDA (:func:`~trtllm_diffkv.model.fused.qkv_rope`); without the
    concatenated weight (a model never fused, or a rotated copy made off CUDA,
    :func:`~trtllm_diffkv.model.rotation.rotate_model`) CUDA runs three products, their concatenation and the
    same RoPE kernel; the CPU keeps the separate products
    and PyTorch's RoPE (bit-identical to the transformers parity path).

    ``key_rotation`` (a non-persistent fp32 buffer, ``None`` unless the model
    was made by :func:`~trtllm_diffkv.model.rotation.rotate_model`): ``float32
    [num_kv_heads, head_dim, head_dim]``; keys after RoPE become ``k @ R`` and
    queries ``q @ R`` of their KV head, in fp32, cast back to the model dtype.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        hidden, bias = config.hidden_size, config.qkv_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self._qkv_weight: torch.Tensor | None = None
        self._qkv_bias: torch.Tensor | None = None
        self.register_buffer("key_rotation", None, persistent=False)

    def fuse_projections(self) -> None:
        """Concatenate the q/k/v weights (and biases) into one buffer; the parameters become its row views."""
        projections = [self.q_proj, self.k_proj, self.v_proj]
        self._qkv_weight = _concat_rows(projections, "weight")
        self._qkv_bias = _concat_rows(projections, "bias")

    def _fused(self, x: torch.Tensor) -> bool:
        projections = [self.q_proj, self.k_proj, self.v_proj]
        return (_fused_ops.use_fused_kernels(x) and self._qkv_weight is not None
                and _is_concat_of(self._qkv_weight, projections, "weight")
                and _is_concat_of(self._qkv_bias, projections, "bias"))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        n = x.shape[0]
        if self._fused(x):
            q, k, v = qkv_rope(F.linear(x, self._qkv_weight, self._qkv_bias), cos, sin, self.num_heads,
                               self.num_kv_heads, self.head_dim)
        elif _fused_ops.use_fused_kernels(x):  # separate products (a rotated copy's own v rows): one RoPE kernel
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=1)
            q, k, v = qkv_rope(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        else:
            q = apply_rope(self.q_proj(x).view(n, self.num_heads, self.head_dim), cos, sin)
            k = apply_rope(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim), cos, sin)
            v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.key_rotation is not None:  # values are rotated through the folded v_proj / o_proj weights
            q, k = rotate_heads(q, k, self.key_rotation)
        out = backend.forward(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; after :meth:`fuse_projections`, on CUDA, one product over the
    concatenated gate/up weight and one :func:`~trtllm_diffkv.model.fused.silu_mul` kernel."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self._gate_up_weight: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        """Concatenate the gate/up weights into one buffer; the parameters become its row views."""
        self._gate_up_weight = _concat_rows([self.gate_proj, self.up_proj], "weight")

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether the gate/up product runs as one over the concatenated weight (CUDA; still its row views)."""
        return (_fused_ops.use_fused_kernels(x) and self._gate_up_weight is not None
                and _is_concat_of(self._gate_up_weight, [self.gate_proj, self.up_proj], "weight"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            return self.down_proj(silu_mul(F.linear(x, self._gate_up_weight)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``, over a carried residual stream.

    :meth:`forward` takes the previous block's output ``h`` and the residual stream (``None`` at the
    first layer: ``h`` is the embedding) and adds them inside the norm's kernel (vLLM's fused add-norm);
    the sums are the same model-dtype additions as ``x + ...``.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """``h``, ``residual`` ``[num_tokens, hidden_size]`` -> ``(mlp output, residual stream)``; the layer's
        output (the next layer's input) is their sum."""
        x, residual = self.input_layernorm.add_norm(h, residual)
        h = self.self_attn(x, cos, sin, backend)
        x, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF prefix ``model.``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Explicit storage skips nn.Embedding's normal_ init (slow on the meta device).
        embed = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embed)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


# --------------------------------------------------------------------------- causal LM


class CausalLM(nn.Module):
    """What every decoder of this package shares (weights, dtype/device moves, fused projections).

    A subclass builds ``self.model`` (``embed_tokens``, ``layers`` whose ``self_attn`` / ``mlp`` have
    ``fuse_projections``, ``self_attn.key_rotation``) and ``self.lm_head``, lists its RoPE modules in
    :meth:`rotary_embeddings`, and defines ``forward(input_ids, positions, backend, logits_indices=None)``.
    """

    config: ModelConfig

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        """The model's RoPE modules (their ``inv_freq`` stays fp32 across dtype moves)."""
        return [self.model.rotary_emb]

    def _apply(self, fn, recurse=True):
        # Keep the RoPE tables and the key rotations fp32 across ``.to(dtype)`` / ``.half()``; concatenate the
        # projections again (``fn`` makes each parameter a separate tensor; the old buffers are dropped first).
        inv_freqs = [r.inv_freq for r in self.rotary_embeddings()]
        rotations = [layer.self_attn.key_rotation for layer in self.model.layers]
        fused = any(layer.self_attn._qkv_weight is not None for layer in self.model.layers)
        for layer in self.model.layers:
            layer.self_attn._qkv_weight = layer.self_attn._qkv_bias = layer.mlp._gate_up_weight = None
        out = super()._apply(fn, recurse)
        device = self.model.embed_tokens.weight.device
        for r, inv_freq in zip(self.rotary_embeddings(), inv_freqs):
            r.inv_freq = inv_freq.to(device=device)
        for layer, r in zip(self.model.layers, rotations):
            if r is not None:
                layer.self_attn.key_rotation = r.to(device=device)
        if fused and device.type != "meta":
            self.fuse_projections()
        return out

    def fuse_projections(self) -> None:
        """Concatenate each layer's q/k/v and gate/up weights into one buffer each (done by
        :meth:`from_weights`); the HF-named parameters become row views of them, so ``state_dict``,
        in-place weight edits and ``load_state_dict`` see the same values. CUDA forwards then run one
        matrix product per group; CPU forwards keep the separate products. Transiently needs one more
        copy of those weights."""
        with torch.no_grad():
            for layer in self.model.layers:
                layer.self_attn.fuse_projections()
                layer.mlp.fuse_projections()

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights (the activations' dtype)."""
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # ----------------------------------------------------------------- weights

    def expected_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor names and shapes a checkpoint must provide (HF names).

        ``lm_head.weight`` is omitted when embeddings are tied.
        """
        shapes = {name: tuple(t.shape) for name, t in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            shapes.pop("lm_head.weight")
        return shapes

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: Mapping[str, torch.Tensor]) -> "CausalLM":
        """Build a model around ready tensors without allocating random weights.

        Args:
            config: the model description.
            weights: HF-named tensors, all on one device in one float dtype
                (they are used as-is, not copied). With tied embeddings an
                extra ``lm_head.weight`` is ignored.

        Returns:
            The model in eval mode with ``requires_grad`` off, on the weights'
            device and dtype, its q/k/v and gate/up weights concatenated
            (:meth:`fuse_projections`: the parameters are views of the new
            buffers, so while the caller keeps ``weights`` those matrices exist
            twice).

        Raises:
            ValueError: a missing, unexpected or mis-shaped tensor, naming it;
                tensors on several devices/dtypes or of a non-float dtype.
        """
        placements = {(t.device, t.dtype) for t in weights.values()}
        if len(placements) > 1 or any(not dtype.is_floating_point for _, dtype in placements):
            raise ValueError(f"weights must share one device and one float dtype; got {sorted(map(str, placements))}")
        with torch.device("meta"):
            model = cls(config)
        expected = model.expected_weight_shapes()
        weights = dict(weights)
        if config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        check_weight_names_and_shapes(expected, {k: tuple(v.shape) for k, v in weights.items()})
        model.load_state_dict(weights, strict=False, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        for rotary in model.rotary_embeddings():
            rotary.reset_inv_freq(model.device)
        model.requires_grad_(False)
        model.fuse_projections()
        return model.eval()


class LlamaForCausalLM(CausalLM):
    """Llama-family causal LM over packed tokens; KV storage lives in the backend.

    Parameters have HF names and are uninitialized after ``__init__`` (weights
    come from a checkpoint); ``model.to(dtype)`` / ``model.to(device)`` work
    as for any module (``inv_freq`` stays fp32). Build from a checkpoint with
    :func:`trtllm_diffkv.model.loader.load_model` or :meth:`from_weights`.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one step over packed tokens.

        Args:
            input_ids: ``[num_tokens]`` int64 token ids, all requests concatenated.
            positions: ``[num_tokens]`` int64 absolute position of each token
                within its request (0-based), same device.
            backend: attention for the step; ``backend.forward(layer_idx, q, k, v)``
                is called once per layer, layers in order, with q
                ``[num_tokens, num_heads, head_dim]`` and k/v
                ``[num_tokens, num_kv_heads, head_dim]`` (q/k after RoPE, model dtype).
            logits_indices: optional ``[num_selected]`` int64 indices into the
                ``num_tokens`` axis (e.g. each request's last token); ``None``
                computes logits for every token.

        Returns:
            ``[num_tokens or num_selected, vocab_size]`` float32 logits.

        Raises:
            ValueError: ``input_ids``/``positions`` not 1-D of equal length, or
                (sliding-window configs only; costs a host sync) a position
                ``>= config.sliding_window``.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must both be [num_tokens]"
            )
        self._check_sliding_window(positions)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, h.dtype)
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, cos, sin, backend)
        if logits_indices is not None:
            h, residual = h[logits_indices], (residual[logits_indices] if residual is not None else None)
        x, _ = self.model.norm.add_norm(h, residual)
        return self.lm_head(x).float()

    def _check_sliding_window(self, positions: torch.Tensor) -> None:
        window = self.config.sliding_window
        if window is None or positions.numel() == 0:
            return
        max_position = int(positions.max())
        if max_position >= window:
            raise ValueError(
                f"position {max_position} reaches sliding_window={window}; sliding-window attention is not "
                f"implemented, so this model is exact only for positions < {window}"
            )



def check_weight_names_and_shapes(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    where: Mapping[str, str] | None = None,
) -> None:
    """Compare a checkpoint's tensor names/shapes with the model's.

    Args:
        expected: name -> shape the model needs.
        found: name -> shape the checkpoint holds.
        where: optional name -> file, quoted in errors.

    Raises:
        ValueError: the first missing, unexpected or mis-shaped tensor (all
            missing/unexpected names are listed, up to 10).
    """
    where = where or {}
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {missing[:10]}")
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        files = sorted({where[n] for n in unexpected if n in where})
        raise ValueError(f"checkpoint has {len(unexpected)} unexpected tensor(s): {unexpected[:10]}"
                         + (f" in {files}" if files else ""))
    for name, shape in expected.items():
        if tuple(found[name]) != tuple(shape):
            at = f" in {where[name]}" if name in where else ""
            raise ValueError(f"tensor {name!r}{at} has shape {tuple(found[name])}, expected {tuple(shape)}")
