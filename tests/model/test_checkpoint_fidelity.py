"""Checkpoint fidelity, edge cases 11-14: stop ids, GGUF RoPE scaling, weight files, finite checks.

Every checkpoint is a tiny random model written here: a Hugging Face folder
through transformers' ``save_pretrained``, a GGUF through the ``gguf``
package's ``GGUFWriter`` laid out as llama.cpp's converter lays it out
(q/k rows permuted, ``rope_freqs.weight`` for Llama 3 RoPE). The reference for
logits is transformers on the equivalent HF folder.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
import numpy as np  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tiny_checkpoint import write_gguf_tensors  # noqa: E402
from trtllm_diffkv import get_preset  # noqa: E402
from trtllm_diffkv.generation.reference import ReferenceGenerator  # noqa: E402
from trtllm_diffkv.model import DenseCausalAttention, load_model  # noqa: E402
from trtllm_diffkv.model import loader  # noqa: E402
from trtllm_diffkv.quant import fake_quantize, quantize  # noqa: E402

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path / "cache"))


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _random_hf(config, seed: int = 0):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    return hf.eval()


def _llama3_freq_factors(rope: dict, theta: float, head_dim: int) -> list[float]:
    """``rope_freqs`` as llama.cpp's ``convert_hf_to_gguf.py`` computes it for ``rope_type: llama3``."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)):
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (HF rotate-half -> GGML interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf, path, fields: dict | None = None, rope_freqs=None, arch: str = "llama") -> None:
    """Write ``hf`` (a transformers Llama) as an F32 GGUF; ``fields``: extra metadata (``{arch}`` expanded)."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    # a minimal byte-level tokenizer: 0 <s>, 1 </s>, 2 <unk>, then "a" .. "z", "aa" ..
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<s>", "</s>", "<unk>"] + [chr(97 + i % 26) * (1 + i // 26) for i in range(c.vocab_size - 3)])
    w.add_token_types([3, 3, 2] + [1] * (c.vocab_size - 3))
    w.add_token_scores([0.0] * c.vocab_size)
    w.add_token_merges([])
    for key, value in (fields or {}).items():
        key = key.format(arch=arch)
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    sd = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not c.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = np.asarray(rope_freqs, dtype=np.float32)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors.update({
            f"blk.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
            f"blk.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
            f"blk.{i}.attn_q.weight": _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads),
            f"blk.{i}.attn_k.weight": _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads),
            f"blk.{i}.attn_v.weight": sd[p + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": sd[p + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_gate.weight": sd[p + "mlp.gate_proj.weight"],
            f"blk.{i}.ffn_up.weight": sd[p + "mlp.up_proj.weight"],
            f"blk.{i}.ffn_down.weight": sd[p + "mlp.down_proj.weight"],
        })
    write_gguf_tensors(w, tensors)


def write_tiny_gguf(path, fields: dict | None = None, arch: str = "llama"):
    """A tiny random Llama as a GGUF at ``path``; returns the transformers model it was written from."""
    hf = _random_hf(transformers.LlamaConfig(**COMMON))
    write_gguf(hf, path, fields, arch=arch)
    return hf


# ---------------------------------------------------------------- edge case 11: stop ids from every source


def _word_tokenizer(folder) -> None:
    """A word-level tokenizer: 0 "<stop0>", 1 "<s>", 2 "</s>" (eos), 3 "<unk>", then w4 ... w127."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<stop0>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(str(folder))


@pytest.fixture
def always_zero_folder(tmp_path):
    """Edge case 11: config ``eos_token_id: [0, 2]``, no generation_config.json, tokenizer eos 2, greedy emits 0."""
    folder = tmp_path / "always_zero"
    hf = _random_hf(transformers.LlamaConfig(**{**COMMON, "head_dim": 64}, eos_token_id=[0, 2], bos_token_id=1))
    with torch.no_grad():  # residual stream = embedding; embeddings all ones; only lm_head row 0 non-zero
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hf.model.embed_tokens.weight.fill_(1.0)
        hf.lm_head.weight.zero_()
        hf.lm_head.weight[0].fill_(1.0)
    hf.save_pretrained(folder)
    (folder / "generation_config.json").unlink()
    _word_tokenizer(folder)
    return folder, hf


def test_config_eos_list_stops_after_one_token_as_transformers_does(always_zero_folder):
    folder, hf = always_zero_folder
    prompt = [1, 5, 6, 7]
    reference = hf.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)[0, len(prompt):].tolist()
    assert reference == [0]  # transformers stops on config.json's eos list
    model, tokenizer, config = load_model(folder)
    assert tokenizer.eos_token_id == 2
    assert loader.stop_token_ids(folder) == {0, 2}
    generator = ReferenceGenerator(model, tokenizer, config, get_preset("default"),
                                   stop_token_ids=loader.stop_token_ids(folder))
    result = generator.generate_ids(prompt, 5)
    assert result.token_ids == reference and result.finish_reason == "stop" and result.stop_token_id == 0
    assert result.decode_tokens_per_s is None  # one token: no decode step ran


def test_cli_json_reports_stop_id_and_null_metrics(always_zero_folder, tmp_path):
    folder, _ = always_zero_folder
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w5 w6 w7"}\n{"text": "no prompt"}\n', encoding="utf-8")
    run = subprocess.run([sys.executable, "-m", "trtllm_diffkv", "generate", "--model", str(folder), "--json",
                          "--prompts-file", str(prompts), "--kv-config", "fp16", "--no-chat-template",
                          "--max-new-tokens", "5", "--device", "cpu", "--threads", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr  # the second line fails, alone
    ok, failed = (json.loads(line) for line in run.stdout.splitlines())
    assert ok["finish_reason"] == "stop" and ok["stop_token_id"] == 0 and ok["token_ids"] == [0]
    assert ok["decode_tokens_per_s"] is None and ok["prefill_tokens_per_s"] > 0
    assert ok["high_fraction"] is ok["low_fraction"] is ok["pruned_fraction"] is None  # fp16: no tiers
    assert ok["kv_memory_fraction"] is not None
    assert failed["error"] and "line 2" in failed["error"] and failed["stop_token_id"] is None
    metrics = ("kv_memory_fraction", "high_fraction", "low_fraction", "pruned_fraction", "kv_cache_bytes",
               "fp16_kv_cache_bytes", "prefill_tokens_per_s", "decode_tokens_per_s")
    assert all(failed[key] is None for key in metrics)
    assert "CPU threads: 1" in run.stderr


def test_stop_ids_union_of_config_and_generation_config(tmp_path):
    hf = _random_hf(transformers.LlamaConfig(**COMMON, eos_token_id=5))
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 7]}))
    assert loader.stop_token_ids(tmp_path) == {5, 6, 7}


def test_gguf_end_of_generation_keys_survive_conversion(tmp_path):
    eog = {"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 5, "tokenizer.ggml.eom_token_id": 6,
           "tokenizer.ggml.fim_pad_token_id": 9, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.padding_token_id": 3}
    write_tiny_gguf(tmp_path / "m.gguf", eog)
    assert loader.stop_token_ids(tmp_path / "m.gguf") == {2, 5, 6, 9}
    load_model(tmp_path / "m.gguf")
    converted = loader.gguf_cache_path(tmp_path / "m.gguf")
    assert loader.stop_token_ids(converted) == {2, 5, 6, 9}
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == [2, 5, 6, 9]


def test_folder_converted_before_stop_ids_were_recorded_reads_them_from_its_gguf(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", {"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 5})
    folder = tmp_path / "old_conversion"  # what earlier versions wrote: config with eos 2 and the source file
    _random_hf(transformers.LlamaConfig(**COMMON, eos_token_id=2)).save_pretrained(folder)
    (folder / "trtllm_diffkv_source.json").write_text(json.dumps({"gguf": str(tmp_path / "m.gguf")}))
    assert loader.stop_token_ids(folder) == {2, 5}


# ---------------------------------------------------------------- edge case 12: RoPE scaling inside a GGUF


LINEAR4 = {"rope_type": "linear", "factor": 4.0}
YARN4 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("hf_rope, fields", [
    (LINEAR4, {"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 4.0}),
    (LINEAR4, {"{arch}.rope.scale_linear": 4.0}),  # the older key llama.cpp still reads
    (YARN4, {"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0,
             "{arch}.rope.scaling.original_context_length": 32}),
], ids=["linear", "scale_linear", "yarn"])
def test_gguf_rope_scaling_matches_hf_folder(tmp_path, hf_rope, fields):
    hf = _random_hf(transformers.LlamaConfig(**COMMON, rope_scaling=dict(hf_rope)))
    hf.save_pretrained(tmp_path / "hf")
    write_gguf(hf, tmp_path / "m.gguf", fields)
    ids = torch.randint(0, VOCAB, (96,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf(ids[None]).logits[0]
        unscaled = transformers.AutoModelForCausalLM.from_pretrained(  # transformers' GGUF import drops the scaling
            str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)(ids[None]).logits[0]
    from_folder = load_model(tmp_path / "hf")[0](ids, torch.arange(96), DenseCausalAttention())
    model, _, config = load_model(tmp_path / "m.gguf")
    from_gguf = model(ids, torch.arange(96), DenseCausalAttention())
    assert _rel_err(from_gguf, from_folder) <= 1e-5 and _rel_err(from_gguf, reference) <= 1e-4
    assert config.rope_type == hf_rope["rope_type"] and config.rope_scaling["factor"] == 4.0
    assert _rel_err(unscaled, reference) > 1e-2  # the test can tell scaled from unscaled


def test_gguf_rope_freqs_tensor_matches_hf_llama3_folder(tmp_path):
    hf = _random_hf(transformers.LlamaConfig(**COMMON, rope_scaling=dict(LLAMA3_ROPE)))
    write_gguf(hf, tmp_path / "m.gguf", rope_freqs=_llama3_freq_factors(LLAMA3_ROPE, 10000.0, 16))
    ids = torch.randint(0, VOCAB, (96,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = hf(ids[None]).logits[0]
    model, _, config = load_model(tmp_path / "m.gguf")
    assert _rel_err(model(ids, torch.arange(96), DenseCausalAttention()), reference) <= 1e-4
    assert config.rope_type == "freq_factors"


@pytest.mark.parametrize("fields, words", [
    ({"{arch}.rope.scaling.type": "longrope"}, "'longrope'"),
    ({"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0,
      "{arch}.rope.scaling.yarn_log_multiplier": 0.1}, "yarn_log_multiplier"),
    ({"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 2.0,
      "{arch}.rope.scaling.attn_factor": 1.5}, "attn_factor"),
    ({"{arch}.rope.scaling.yarn_beta_fast": 32.0}, "yarn_beta_fast"),
    ({"{arch}.rope.dimension_count": 8}, "partial rotary"),
], ids=["longrope", "yarn_log_multiplier", "attn_factor", "yarn_key_without_yarn", "partial"])
def test_gguf_unrepresentable_rope_refused_by_name_before_any_weight(tmp_path, monkeypatch, fields, words):
    write_tiny_gguf(tmp_path / "m.gguf", fields)

    def dequantize(*args, **kwargs):
        raise AssertionError("weights were read before the header was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", dequantize)
    with pytest.raises(ValueError, match=words):
        load_model(tmp_path / "m.gguf")


def test_gguf_unsupported_architecture_refused_before_any_weight(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "m.gguf", arch="gpt2")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", None)
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        load_model(tmp_path / "m.gguf")


def test_gguf_converted_once_then_read_from_cache(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "m.gguf")
    first = load_model(tmp_path / "m.gguf")[0]
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", None)  # a second dequantization fails
    second = load_model(tmp_path / "m.gguf")[0]
    ids = torch.arange(9)
    assert torch.equal(first(ids, ids, DenseCausalAttention()), second(ids, ids, DenseCausalAttention()))
    assert (loader.gguf_cache_path(tmp_path / "m.gguf") / "model.safetensors").is_file()


# ---------------------------------------------------------------- edge case 13: which files hold the weights

_MISTRAL_NATIVE = {"embed_tokens": "tok_embeddings", "self_attn.q_proj": "attention.wq", "self_attn.k_proj":
                   "attention.wk", "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
                   "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2", "mlp.up_proj":
                   "feed_forward.w3", "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
                   "lm_head": "output"}


def _native_mistral_name(name: str) -> str:
    name = name.removeprefix("model.")
    for hf_part, native in _MISTRAL_NATIVE.items():
        name = name.replace(hf_part, native)
    return name


def test_mistral_folder_with_consolidated_file_reads_model_safetensors(tmp_path, caplog):
    hf = _random_hf(transformers.MistralConfig(**COMMON, sliding_window=None))
    hf.save_pretrained(tmp_path)
    save_file({_native_mistral_name(n): t.contiguous() for n, t in hf.state_dict().items()},
              str(tmp_path / "consolidated.safetensors"))
    with caplog.at_level("DEBUG", logger="trtllm_diffkv.model.loader"):
        model, _, config = load_model(tmp_path)
    assert config.architecture == "MistralForCausalLM"
    assert "ignoring ['consolidated.safetensors']" in caplog.text
    ids = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = hf(ids[None]).logits[0]
    assert _rel_err(model(ids, torch.arange(21), DenseCausalAttention()), reference) <= 1e-4


@pytest.mark.parametrize("name", ["consolidated.safetensors", "pytorch_model.bin"])
def test_folder_without_the_standard_weight_file_is_refused_by_name(tmp_path, name):
    hf = _random_hf(transformers.LlamaConfig(**COMMON))
    hf.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / name)
    with pytest.raises(ValueError, match=f"no model.safetensors.*{name}"):
        load_model(tmp_path)


def test_config_dtype_differing_from_stored_dtype_is_used_with_a_warning(tmp_path, caplog):
    hf = _random_hf(transformers.LlamaConfig(**COMMON))
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING"):
        model = load_model(tmp_path)[0]
    assert model.dtype == torch.bfloat16  # transformers' dtype="auto" (the default from 5.0) picks the config's
    assert "bfloat16" in caplog.text and "float32" in caplog.text


# ---------------------------------------------------------------- edge case 14: finite checks in every dtype


@pytest.mark.parametrize("value, stored", [(-65504.0, -65536.0), (65536.0, 65536.0), (70000.0, 70144.0)])
def test_bfloat16_rows_beyond_fp16_range_refused_naming_layer_head_token(value, stored):
    x = torch.zeros(2, 5, 64, dtype=torch.bfloat16)
    x[1, 3, 7] = value
    assert float(x[1, 3, 7]) == stored
    message = rf"value {stored} at layer 4, KV head 1, token 3 is not finite or exceeds the fp16 range"
    with pytest.raises(ValueError, match=message):
        fake_quantize(x, 16, what="key", layer_idx=4)  # the fp16 (unquantized) path
    with pytest.raises(ValueError, match=message):
        quantize(x, 8, what="key", layer_idx=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_largest_value_within_fp16_range_passes_in_every_dtype(dtype):
    x = torch.zeros(1, 2, 64, dtype=dtype)
    x[0, 1, 0] = 65280.0 if dtype == torch.bfloat16 else 65504.0  # largest value <= 65504 the dtype holds
    assert torch.equal(fake_quantize(x, 16), x.float())


def test_reference_cache_fp16_preset_refuses_bfloat16_overflow_by_layer_head_token():
    from trtllm_diffkv.cache import DiffKVReferenceCache

    cache = DiffKVReferenceCache(get_preset("fp16"), num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                                 max_seq_len_tokens=8, dtype=torch.bfloat16)
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    k, v = torch.zeros(3, 2, 64, dtype=torch.bfloat16), torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    v[2, 1, 5] = 65536.0
    with pytest.raises(ValueError, match="cannot quantize value: value 65536.0 at layer 0, KV head 1, token 2"):
        cache.forward(0, q, k, v)
