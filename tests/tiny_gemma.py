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

    The continuation is the argmax of transformers' forward step by step over its own KV cache (the
    ``DynamicCache`` with sliding-window layers that ``forward`` builds), not ``generate``: ``generate`` runs logits
    processors, and the tiny model's config names token 1 as EOS, so ``min_new_tokens`` would set token 1's logit
    to ``-inf`` while our engines (no tokenizer, no stop tokens) may pick it."""
    import inspect

    cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"  # renamed in 5.x
    with torch.no_grad():
        step_ids, cache, tokens = torch.tensor([prompt], device=hf.device), None, []
        for _ in range(max_new_tokens):
            out = hf(step_ids, use_cache=True, **({} if cache is None else {cache_arg: cache}))
            cache = getattr(out, cache_arg)
            tokens.append(int(out.logits[0, -1].argmax()))
            step_ids = torch.tensor([tokens[-1:]], device=hf.device)
        logits = hf(torch.tensor([prompt + tokens[:-1]], device=hf.device)).logits[0].float()
    return tokens, logits


def greedy_margins(logits: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Top-1 minus top-2 logit of each greedy step: ``logits`` from :func:`hf_greedy` ``[prompt_len + steps - 1,
    vocab]``; returns fp32 ``[steps]`` (logit units, equal to log-probability units)."""
    top2 = logits[prompt_len - 1:].topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def check_greedy(got: list[int], tokens: list[int], logits: torch.Tensor, prompt_len: int, logprob_tol: float,
                 label="") -> int:
    """Assert an engine's greedy ``got`` against :func:`hf_greedy`'s ``(tokens, logits)``; returns the number of
    leading steps that agree.

    An engine whose log-probabilities are within ``logprob_tol`` of transformers' (fp16 K/V pages round them) may
    swap transformers' top-2 tokens only where their margin is below ``2 * logprob_tol``; every later step may then
    differ. So ``got`` must equal ``tokens`` up to its first difference, and there transformers' margin must be
    below ``2 * logprob_tol`` and ``got`` must hold transformers' second token.

    Raises:
        AssertionError: naming ``label``, the step, the tokens and the margin."""
    assert len(got) == len(tokens), (label, len(got), len(tokens))
    first = next((s for s, (a, b) in enumerate(zip(got, tokens)) if a != b), None)
    if first is None:
        return len(got)
    margin = float(greedy_margins(logits, prompt_len)[first])
    second = int(logits[prompt_len - 1 + first].topk(2).indices[1])
    assert margin < 2 * logprob_tol and got[first] == second, (
        f"{label}: step {first} got {got[first]}, transformers {tokens[first]} (second {second}, margin {margin:.3g})")
    return first


def check_window_rows(cache) -> list[tuple[int, int, int, bool]]:
    """Assert that each sliding layer's page-table rows of each active slot of a
    :class:`~trtllm_diffkv.paged.cache.PagedDiffKVCache` hold what they should now (after a step; on CUDA after a
    synchronize); returns the ``(slot, layer, seq_len, staged)`` rows checked.

    * A compacted request (``cache.prompt_len[slot] > 0``) of ``seq_len`` tokens: exactly ``(min(seq_len, W), 0)``
      (high, low) tokens in each of the layer's ``num_kv_heads`` rows (the window, at the high tier).
    * A prompt half-prefilled in chunks (``slot in cache.staging``): ``(0, 0)``. Its K/V so far live in the
      full-precision staging outside the pool; its rows stay ``RESERVED`` with no tokens counted until the final
      chunk commits the prompt (``seq_len`` counts the staged tokens, not the pool's).

    Rows of slot ``s``, layer ``l``: ``s * cache.rows_per_slot + l * num_kv_heads + arange(num_kv_heads)``.

    Raises:
        AssertionError: naming the slot, layer, seq_len, whether staged, and the counts.
    """
    H, checked = cache.num_kv_heads, []
    for slot in cache.active_slots:
        seq, staged = cache.seq_len[slot], slot in cache.staging
        for layer, window in enumerate(cache.sliding_windows):
            if window is None:
                continue
            rows = torch.arange(H, device=cache.device) + slot * cache.rows_per_slot + layer * H
            counts = [tuple(c) for c in cache.manager.tokens[rows].tolist()]
            want = (0, 0) if staged else (min(seq, window), 0)
            assert counts == [want] * H, (slot, layer, seq, "staged" if staged else "compacted", counts)
            checked.append((slot, layer, seq, staged))
    return checked


def check_window_coverage(checked: list[tuple[int, int, int, bool]], cache, min_compacted_rows: int) -> None:
    """Assert that :func:`check_window_rows` calls over a run were not vacuous: ``checked`` (their rows, joined)
    holds at least ``min_compacted_rows`` rows of compacted requests, such rows both below and past their window
    (a request decoding across it), and a row of a prompt half-prefilled in chunks.

    Raises:
        AssertionError: naming what was not seen.
    """
    compacted = [(seq, cache.sliding_windows[layer]) for _, layer, seq, staged in checked if not staged]
    assert len(compacted) >= min_compacted_rows, f"{len(compacted)} compacted sliding rows checked"
    assert {seq < window for seq, window in compacted} == {True, False}, "no row below or none past its window"
    assert any(staged for *_, staged in checked), "no prompt seen half-prefilled in chunks"


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
