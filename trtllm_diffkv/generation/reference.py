"""Reference generation loop: one request at a time, greedy, DiffKV cache.

This is the exact path every faster one (paged cache, Triton kernels,
in-flight batching) is checked against. Errors of one request are caught and
reported in its :class:`GenerationResult`; the others go on.
"""
from __future__ import annotations

import time

import torch

from ..cache import DiffKVReferenceCache
from ..config import DiffKVConfig
from ..model.rotation import model_for_kv_config
from .prompts import check_prompt_ids
from .results import GenerationResult, result_fields


def sync_device(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA), so a wall-clock reading covers it; no-op on the CPU."""
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
        kv_config: the DiffKV policy (with the model's sliding windows added, :meth:`DiffKVConfig.for_model`).
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
        kv_config = kv_config.for_model(model_config)  # the model's sliding-window layers, if any
        kv_config.validate_for_model(model_config.head_dim, model_config.num_heads, model_config.num_kv_heads,
                                     model_config.num_layers)
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
            sync_device(self.device)
            t0 = time.perf_counter()
            logits = self.model(ids, torch.arange(prompt_len, device=self.device), cache,
                                logits_indices=torch.tensor([prompt_len - 1], device=self.device))
            token = int(logits[-1].argmax())
            sync_device(self.device)
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
            sync_device(self.device)
            t2 = time.perf_counter()
        return GenerationResult(**self.result_fields(prompt_len, out, cache.stats(), t1 - t0, t2 - t1))

    def result_fields(self, prompt_len: int, out: list[int], stats, prefill_s: float, decode_s: float) -> dict:
        """The :class:`GenerationResult` fields of a finished request (:func:`result_fields` with this generator's setup)."""
        return result_fields(prompt_len, out, stats, prefill_s, decode_s, kv_config=self.kv_config,
                             tokenizer=self.tokenizer, stop_token_ids=self.stop_token_ids)
