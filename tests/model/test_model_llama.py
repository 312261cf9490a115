"""LlamaForCausalLM against transformers on tiny random models, plus packing and decode.

Reference: transformers' own Llama / Mistral / Qwen2 with random weights, saved
with ``save_pretrained`` and loaded by our loader. Metric: max relative error
``|ours - ref|.max() / |ref|.max()`` over the logits, fp32, <= 1e-4.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from trtllm_diffkv.model import DenseCausalAttention, LlamaForCausalLM, load_model  # noqa: E402

NUM_TOKENS = 37
VOCAB = 128
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # small, so the test positions cross all three bands
}
COMMON = dict(
    vocab_size=VOCAB,
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


def _hf_config(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(**COMMON, head_dim=16)
    if kind == "llama_head_dim32":  # explicit head_dim != hidden_size // num_heads
        return transformers.LlamaConfig(**COMMON, head_dim=32, rope_theta=500000.0)
    if kind == "llama3_rope":
        return transformers.LlamaConfig(**COMMON, head_dim=16, rope_scaling=dict(LLAMA3_ROPE))
    if kind == "yarn_rope":  # positions cross original_max_position_embeddings; beta_fast=16 moves the ramp
        return transformers.LlamaConfig(**COMMON, head_dim=16, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0})
    if kind == "qwen2_yarn":  # Qwen2.5's long-context setting (legacy "type" key), tiny
        return transformers.Qwen2Config(**COMMON, rope_scaling={
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    if kind == "linear_rope":
        return transformers.LlamaConfig(**COMMON, head_dim=16, rope_scaling={"rope_type": "linear", "factor": 4.0})
    if kind == "smollm_tied":
        return transformers.LlamaConfig(**{**COMMON, "num_key_value_heads": 1}, tie_word_embeddings=True)
    if kind == "qwen2":
        return transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    if kind == "mistral":
        return transformers.MistralConfig(**COMMON, head_dim=32, sliding_window=64)
    raise KeyError(kind)


KINDS = ["llama", "llama_head_dim32", "llama3_rope", "yarn_rope", "qwen2_yarn", "linear_rope", "smollm_tied", "qwen2",
         "mistral"]


def _randomize(model: torch.nn.Module) -> None:
    """Weights big enough that attention is far from uniform; biases non-zero."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)


def _save_random_hf(kind: str, folder) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(kind), dtype=torch.float32)
    _randomize(hf)
    hf.eval()
    hf.save_pretrained(folder)
    return hf


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = _save_random_hf(request.param, folder)
    model, tokenizer, config = load_model(folder)
    return request.param, hf, model, config


def test_parity_with_transformers(pair):
    kind, hf, model, config = pair
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (NUM_TOKENS,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours = model(ids, torch.arange(NUM_TOKENS), DenseCausalAttention())
    assert ours.dtype == torch.float32 and ours.shape == (NUM_TOKENS, VOCAB)
    assert _rel_err(ours, ref) <= 1e-4, kind


def test_config_fields(pair):
    kind, hf, model, config = pair
    assert config.num_kv_heads == hf.config.num_key_value_heads
    assert config.head_dim == (getattr(hf.config, "head_dim", None) or 64 // 4)
    assert config.qkv_bias == kind.startswith("qwen2")
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    rope_types = {"llama3_rope": "llama3", "linear_rope": "linear", "yarn_rope": "yarn", "qwen2_yarn": "yarn"}
    assert config.rope_type == rope_types.get(kind, "default")


class PackedDenseAttention:
    """Causal attention per request over packed tokens; requests start at position 0."""

    def __init__(self, seq_lens: list[int]) -> None:
        self.seq_lens = seq_lens

    def forward(self, layer_idx, q, k, v):
        dense = DenseCausalAttention()
        outs = [dense.forward(layer_idx, *parts) for parts in zip(*(t.split(self.seq_lens) for t in (q, k, v)))]
        return torch.cat(outs)


class SingleRequestCache:
    """Dense per-layer KV cache for one request: prefill, then decode steps."""

    def __init__(self) -> None:
        self.k, self.v = {}, {}

    def forward(self, layer_idx, q, k, v):
        self.k[layer_idx] = torch.cat([self.k.get(layer_idx, k[:0]), k])
        self.v[layer_idx] = torch.cat([self.v.get(layer_idx, v[:0]), v])
        keys, values = self.k[layer_idx], self.v[layer_idx]
        group = q.shape[1] // keys.shape[1]
        num_new, num_all = q.shape[0], keys.shape[0]
        q_pos = torch.arange(num_all - num_new, num_all)[:, None]
        mask = torch.arange(num_all)[None, :] <= q_pos  # [num_new, num_all]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.transpose(0, 1).repeat_interleave(group, 0),
            values.transpose(0, 1).repeat_interleave(group, 0),
            attn_mask=mask,
        )
        return out.transpose(0, 1)


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen_packed")
    _save_random_hf("qwen2", folder)
    return load_model(folder)[0]


def test_packed_requests_match_separate_runs(qwen_model):
    torch.manual_seed(2)
    seq_lens = [13, 1, 23]
    ids = [torch.randint(0, VOCAB, (n,)) for n in seq_lens]
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    last = torch.tensor(seq_lens).cumsum(0) - 1
    packed = qwen_model(torch.cat(ids), positions, PackedDenseAttention(seq_lens), logits_indices=last)
    assert packed.shape == (3, VOCAB)
    for i, request_ids in enumerate(ids):
        alone = qwen_model(request_ids, torch.arange(len(request_ids)), DenseCausalAttention())
        assert _rel_err(packed[i], alone[-1]) <= 1e-5


def test_prefill_then_decode_matches_full_forward(qwen_model):
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (NUM_TOKENS,))
    full = qwen_model(ids, torch.arange(NUM_TOKENS), DenseCausalAttention())
    cache = SingleRequestCache()
    prefill_tokens = 30
    step = [qwen_model(ids[:prefill_tokens], torch.arange(prefill_tokens), cache)]
    for pos in range(prefill_tokens, NUM_TOKENS):
        step.append(qwen_model(ids[pos : pos + 1], torch.tensor([pos]), cache))
    assert _rel_err(torch.cat(step), full) <= 1e-5


def test_backend_sees_post_rope_packed_layout(qwen_model):
    seen = []

    class Recorder(DenseCausalAttention):
        def forward(self, layer_idx, q, k, v):
            seen.append((layer_idx, q.shape, k.shape, v.shape, q.dtype))
            return super().forward(layer_idx, q, k, v)

    qwen_model(torch.arange(5), torch.arange(5), Recorder())
    cfg = qwen_model.config
    assert [s[0] for s in seen] == list(range(cfg.num_layers))
    assert seen[0][1:] == (
        (5, cfg.num_heads, cfg.head_dim),
        (5, cfg.num_kv_heads, cfg.head_dim),
        (5, cfg.num_kv_heads, cfg.head_dim),
        torch.float32,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_close_to_fp32(qwen_model, dtype):
    torch.manual_seed(4)
    ids = torch.randint(0, VOCAB, (NUM_TOKENS,))
    ref = qwen_model(ids, torch.arange(NUM_TOKENS), DenseCausalAttention())
    low = LlamaForCausalLM.from_weights(
        qwen_model.config, {n: t.to(dtype) for n, t in qwen_model.state_dict().items()}
    )
    out = low(ids, torch.arange(NUM_TOKENS), DenseCausalAttention())
    assert low.dtype == dtype and out.dtype == torch.float32
    assert low.model.rotary_emb.inv_freq.dtype == torch.float32
    assert _rel_err(out, ref) <= 5e-2


def test_to_dtype_keeps_rope_table_fp32(qwen_model, tmp_path):
    model = LlamaForCausalLM.from_weights(qwen_model.config, {n: t.clone() for n, t in qwen_model.state_dict().items()})
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    model.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)


def test_sliding_window_refused_beyond_window(tmp_path):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.MistralConfig(**COMMON, head_dim=16, sliding_window=16)
    )
    hf.save_pretrained(tmp_path)
    model, _, config = load_model(tmp_path)
    assert config.sliding_window == 16 and config.max_supported_positions == 16
    model(torch.arange(16), torch.arange(16), DenseCausalAttention())  # positions 0..15: exact
    with pytest.raises(ValueError, match="sliding_window=16"):
        model(torch.arange(17), torch.arange(17), DenseCausalAttention())


def test_input_shape_errors(qwen_model):
    with pytest.raises(ValueError, match="num_tokens"):
        qwen_model(torch.arange(4)[None], torch.arange(4)[None], DenseCausalAttention())
    with pytest.raises(ValueError, match="num_tokens"):
        qwen_model(torch.arange(4), torch.arange(3), DenseCausalAttention())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2), (torch.float16, 2e-2)])
def test_cuda_matches_cpu(tmp_path, dtype, tolerance):
    _save_random_hf("llama3_rope", tmp_path)
    cpu = load_model(tmp_path)[0]
    cuda = load_model(tmp_path, device="cuda", dtype=dtype)[0]
    assert cuda.device.type == "cuda" and cuda.model.rotary_emb.inv_freq.device.type == "cuda"
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (NUM_TOKENS,))
    ref = cpu(ids, torch.arange(NUM_TOKENS), DenseCausalAttention())
    out = cuda(ids.cuda(), torch.arange(NUM_TOKENS, device="cuda"), DenseCausalAttention())
    assert out.dtype == torch.float32 and out.device.type == "cuda"
    assert _rel_err(out.cpu(), ref) <= tolerance
