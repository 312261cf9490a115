"""A tiny random Gemma 3 text model, saved by transformers, for the parity tests of the Gemma 3 decoder and of the
sliding-window layers through every engine.

Shape: 4 layers (sliding, full, sliding, full), hidden 64, 4 query heads over 1 KV head (MQA, group 4, as
gemma-3-270m) of head_dim 64, sliding window 8, vocabulary 128. Weights: N(0, 0.15) matrices, N(0, 0.05)
embeddings, N(0, 0.2) norm weights, untied LM head: greedy continuations vary (a tied head on this scale repeats one
token) and depend on the window (28-29 of 30 greedy tokens change when the window is lifted).
"""
from __future__ import annotations

import torch

SLIDING_WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
VOCAB = 128


def hf_config(**overrides):
    """transformers' ``Gemma3TextConfig`` of the tiny model (keyword arguments override fields)."""
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=64, sliding_window=SLIDING_WINDOW, max_position_embeddings=512,
                  layer_types=list(LAYER_TYPES), tie_word_embeddings=False)
    fields.update(overrides)
    return transformers.Gemma3TextConfig(**fields)


def random_hf_gemma3(seed: int = 0, **overrides):
    """transformers' ``Gemma3ForCausalLM`` of :func:`hf_config` with seeded random weights, fp32, eval mode."""
    import transformers

    torch.manual_seed(seed)
    hf = transformers.Gemma3ForCausalLM(hf_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
            elif "embed" in name:
                p.normal_(0.0, 0.05)
            else:
                p.normal_(0.0, 0.15)
    return hf


def save_tiny_gemma3(folder, seed: int = 0, **overrides):
    """Save :func:`random_hf_gemma3` to ``folder`` (``save_pretrained``); returns the transformers model."""
    hf = random_hf_gemma3(seed, **overrides)
    hf.save_pretrained(folder)
    return hf


def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of ``prompt`` and the fp32 logits ``[len(prompt) + max_new_tokens - 1,
    vocab]`` of one teacher-forced forward over prompt + continuation (row ``i``: the logits after token ``i``).

    The attention mask is given: without it ``generate`` masks every prompt token equal to ``pad_token_id`` (0)."""
    with torch.no_grad():
        ids = torch.tensor([prompt], device=hf.device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          min_new_tokens=max_new_tokens, do_sample=False)
        tokens = out[0, len(prompt):].tolist()
        logits = hf(out[:, :-1]).logits[0].float()
    return tokens, logits


def setup(folder, prompt_lens=(29, 5), decode_steps: int = 12, seed: int = 0):
    """Save the tiny model to ``folder``, load it with our loader (fp32, CPU), draw prompts of ``prompt_lens`` tokens
    and transformers' greedy references.

    Returns:
        ``(hf, model, config, prompts, refs)``: ``refs[i] = hf_greedy(hf, prompts[i], decode_steps)``.
    """
    from trtllm_diffkv.model import load_model

    hf = save_tiny_gemma3(folder, seed=seed)
    model, _, config = load_model(folder, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    refs = {i: hf_greedy(hf, p, decode_steps) for i, p in enumerate(prompts)}
    return hf, model, config, prompts, refs
