"""Reference generation loop: one request at a time, greedy, DiffKV cache.

This is the exact path every faster one (paged cache, Triton kernels,
in-flight batching) is checked against. Errors of one request are caught and
reported in its :class:`GenerationResult`; the others go on.
"""
from __future__ import annotations

import numbers
import time
from dataclasses import asdict, dataclass, field

import torch

from .cache import DiffKVReferenceCache
from .config import DiffKVConfig
from .model.rotation import model_for_kv_config


@dataclass
class GenerationResult:
    """Outcome of one request.

    Attributes:
        text: decoded generated text (special tokens removed).
        token_ids: generated token ids (the stop token included).
        prompt_tokens, generated_tokens: counts.
        finish_reason: "stop" (a stop token), "length" or "error".
        stop_token_id: the id that ended generation when ``finish_reason ==
            "stop"``, else ``None``.
        kv_memory_fraction: packed KV bytes / FP16 KV bytes at the end.
        high_fraction, low_fraction, pruned_fraction: share of (layer, KV
            head, token) triples in each tier at the end; they sum to 1.
            ``None`` without compression (the ``fp16`` preset has no tiers).
        kv_cache_bytes, fp16_kv_cache_bytes: the two byte counts.
        prefill_tokens_per_s: prompt tokens / prefill wall time.
        decode_tokens_per_s: decode steps / decode wall time; ``None`` when
            no decode step ran (one generated token).
        error: the message when ``finish_reason == "error"``.

    Every metric is ``None`` (JSON ``null``) for a failed request.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finish_reason: str = "length"
    stop_token_id: int | None = None
    kv_memory_fraction: float | None = None
    high_fraction: float | None = None
    low_fraction: float | None = None
    pruned_fraction: float | None = None
    kv_cache_bytes: int | None = None
    fp16_kv_cache_bytes: int | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    error: str | None = None

    def to_json_dict(self) -> dict:
        """JSON-ready dict (the CLI's ``--json`` line)."""
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ReferenceGenerator:
    """Greedy generation with a :class:`DiffKVReferenceCache` per request.

    Args:
        model: a model with ``forward(input_ids, positions, backend, logits_indices)``
            (see :mod:`trtllm_diffkv.model.llama`).
        tokenizer: a transformers tokenizer (for chat template, decode, EOS).
        model_config: the model's shape (num_layers, num_heads, num_kv_heads,
            head_dim, max_position_embeddings).
        kv_config: the DiffKV policy.
        stop_token_ids: ids that end generation, besides the tokenizer's
            ``eos_token_id``; pass
            :func:`trtllm_diffkv.model.loader.stop_token_ids` of the
            checkpoint (config, generation config, GGUF metadata).

    Raises:
        ValueError: ``kv_config`` cannot run this model (checked here, at
            configuration time).
    """

    def __init__(self, model, tokenizer, model_config, kv_config: DiffKVConfig,
                 stop_token_ids: set[int] | None = None):
        kv_config.validate_for_model(model_config.head_dim, model_config.num_heads, model_config.num_kv_heads)
        model = model_for_kv_config(model, kv_config)  # key_rotation: the rotated copy (model/rotation.py)
        self.model, self.tokenizer, self.model_config, self.kv_config = model, tokenizer, model_config, kv_config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        self.stop_token_ids = set(stop_token_ids or ()) | ({eos} if eos is not None else set())

    def warm_up(self) -> None:
        """Run one tiny request so the first real request's throughput excludes one-time setup."""
        self.generate_ids([0, 1], 2)

    def encode(self, prompt: str, chat_template: bool = True) -> list[int]:
        """Token ids of ``prompt``, wrapped in the tokenizer's chat template if it has one."""
        if chat_template and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(prompt)["input_ids"])

    def generate(self, prompt: str, max_new_tokens: int, chat_template: bool = True) -> GenerationResult:
        """Encode and generate; errors come back in the result, never raised.

        An empty or whitespace-only prompt is an error (edge case 8).
        """
        try:
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError("empty prompt: at least one non-blank character is needed")
            if self.tokenizer is None:
                raise ValueError("the model has no tokenizer files; pass token ids to generate_ids")
            ids = self.encode(prompt, chat_template)
        except Exception as exc:  # noqa: BLE001 - a bad request must not stop the others
            return GenerationResult(finish_reason="error", error=f"{type(exc).__name__}: {exc}")
        return self.generate_ids(ids, max_new_tokens)

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int) -> GenerationResult:
        """Greedy generation from token ids; errors come back in the result, never raised."""
        try:
            return self._generate(prompt_ids, max_new_tokens)
        except Exception as exc:  # noqa: BLE001 - a bad request must not stop the others
            return GenerationResult(prompt_tokens=len(prompt_ids) if hasattr(prompt_ids, "__len__") else 0,
                                    finish_reason="error", error=f"{type(exc).__name__}: {exc}")

    def new_cache(self, max_seq_len_tokens: int) -> DiffKVReferenceCache:
        """An empty cache for one request of up to ``max_seq_len_tokens`` tokens."""
        mc = self.model_config
        return DiffKVReferenceCache(self.kv_config, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                                    max_seq_len_tokens, self.device, self.dtype)

    def _generate(self, prompt_ids: list[int], max_new_tokens: int) -> GenerationResult:
        prompt_ids = check_prompt_ids(prompt_ids, max_new_tokens, self.model_config)
        prompt_len = len(prompt_ids)
        cache = self.new_cache(prompt_len + max_new_tokens)
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            _sync(self.device)
            t0 = time.perf_counter()
            logits = self.model(ids, torch.arange(prompt_len, device=self.device), cache,
                                logits_indices=torch.tensor([prompt_len - 1], device=self.device))
            token = int(logits[-1].argmax())
            _sync(self.device)
            t1 = time.perf_counter()
            out = [token]
            finish = "stop" if token in self.stop_token_ids else "length"
            while finish == "length" and len(out) < max_new_tokens:
                pos = prompt_len + len(out) - 1
                logits = self.model(torch.tensor([token], device=self.device),
                                    torch.tensor([pos], device=self.device), cache)
                token = int(logits[-1].argmax())
                out.append(token)
                if token in self.stop_token_ids:
                    finish = "stop"
            _sync(self.device)
            t2 = time.perf_counter()
        return GenerationResult(**self.result_fields(prompt_len, out, cache.stats(), t1 - t0, t2 - t1))

    def result_fields(self, prompt_len: int, out: list[int], stats, prefill_s: float, decode_s: float) -> dict:
        """The :class:`GenerationResult` fields of a finished request (:func:`result_fields` with this generator's setup)."""
        return result_fields(prompt_len, out, stats, prefill_s, decode_s, kv_config=self.kv_config,
                             tokenizer=self.tokenizer, stop_token_ids=self.stop_token_ids)


def position_limit(model_config) -> int:
    """Most positions (prompt + generated tokens) a request may use: ``max_position_embeddings``, or the
    sliding window when smaller (sliding-window models are exact only inside the window)."""
    limit = model_config.max_position_embeddings
    window = model_config.max_supported_positions
    return window if window is not None and window < limit else limit


def check_prompt_ids(prompt_ids, max_new_tokens: int, model_config) -> list[int]:
    """Check one request's token ids and length; return the ids as Python ints (shared by every generator).

    Args:
        prompt_ids: list or tuple of integer token ids (any integer type, ``bool`` refused).
        max_new_tokens: new tokens to generate, an integer >= 1.
        model_config: the model's ``vocab_size`` and position limit (:func:`position_limit`).

    Raises:
        ValueError: not a list, an empty prompt (edge case 8), a non-integer id, a bad
            ``max_new_tokens``, an id outside ``[0, vocab_size)``, or prompt + ``max_new_tokens``
            beyond the model's positions; the message names the value.
    """
    if not isinstance(prompt_ids, (list, tuple)):
        raise ValueError(f"a prompt is a list of token ids, got {type(prompt_ids).__name__}")
    if len(prompt_ids) == 0:
        raise ValueError("empty prompt: at least one token is needed")
    not_int = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if not_int:
        raise ValueError(f"token id {not_int[0]!r} is not an integer")
    prompt_ids = [int(t) for t in prompt_ids]
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    vocab = model_config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]!r} is outside the model's vocabulary [0, {vocab})")
    limit = position_limit(model_config)
    if len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's {limit} positions")
    return prompt_ids


def result_fields(prompt_len: int, out: list[int], stats, prefill_s: float, decode_s: float, *, kv_config,
                  tokenizer, stop_token_ids, finish_reason: str | None = None, stop_token_id: int | None = None,
                  text: str | None = None) -> dict:
    """The :class:`GenerationResult` fields of a finished request (shared by every generator and the executor).

    Args:
        prompt_len: prompt tokens.
        out: generated token ids, at least one.
        stats: the request's cache statistics (``kv_memory_fraction``, ``fraction(tier)``,
            ``kv_cache_bytes``, ``fp16_kv_cache_bytes``).
        prefill_s, decode_s: wall seconds of the prefill and of the decode steps.
        kv_config: the DiffKV policy (tier fractions only with ``compress``).
        tokenizer: decodes the text (``None``: empty text).
        stop_token_ids: ids that end generation; removed from the text.
        finish_reason, stop_token_id: given by the caller's stop rule (stop strings, per-request
            stop ids); default: ``"stop"`` when the last id is a stop id, else ``"length"``.
        text: the caller's text (e.g. truncated before a stop string); default: ``out`` decoded
            without stop ids and special tokens.
    """
    if finish_reason is None:
        finish_reason = "stop" if out[-1] in stop_token_ids else "length"
        stop_token_id = out[-1] if finish_reason == "stop" else None
    if text is None:
        text_ids = [t for t in out if t not in stop_token_ids]
        text = tokenizer.decode(text_ids, skip_special_tokens=True) if tokenizer else ""
    tiers = kv_config.compress
    decode_steps = len(out) - 1
    return dict(
        text=text, token_ids=list(out), prompt_tokens=prompt_len, generated_tokens=len(out),
        finish_reason=finish_reason, stop_token_id=stop_token_id,
        kv_memory_fraction=stats.kv_memory_fraction,
        high_fraction=stats.fraction("high") if tiers else None,
        low_fraction=stats.fraction("low") if tiers else None,
        pruned_fraction=stats.fraction("pruned") if tiers else None,
        kv_cache_bytes=stats.kv_cache_bytes, fp16_kv_cache_bytes=stats.fp16_kv_cache_bytes,
        prefill_tokens_per_s=prompt_len / max(prefill_s, 1e-9),
        decode_tokens_per_s=decode_steps / max(decode_s, 1e-9) if decode_steps else None,
    )
