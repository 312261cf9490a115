"""Model side: the Llama-family and Gemma 3 decoders, their loader and the attention contract."""
from .attention_api import AttentionBackend, DenseCausalAttention
from .gemma3 import Gemma3Config, Gemma3ForCausalLM
from .llama import LlamaForCausalLM, ModelConfig
from .loader import default_model_path, load_model, resolve_model_path, stop_token_ids

__all__ = [
    "AttentionBackend",
    "DenseCausalAttention",
    "Gemma3Config",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "ModelConfig",
    "default_model_path",
    "load_model",
    "resolve_model_path",
    "stop_token_ids",
]
