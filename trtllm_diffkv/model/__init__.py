"""Model side: the Llama-family decoder, its loader and the attention contract."""
from .attention_api import AttentionBackend, DenseCausalAttention
from .llama import LlamaForCausalLM, ModelConfig
from .loader import default_model_path, load_model, resolve_model_path, stop_token_ids

__all__ = [
    "AttentionBackend",
    "DenseCausalAttention",
    "LlamaForCausalLM",
    "ModelConfig",
    "default_model_path",
    "load_model",
    "resolve_model_path",
    "stop_token_ids",
]
