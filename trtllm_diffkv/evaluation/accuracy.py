"""Accuracy measures of a compressed KV cache against the uncompressed one.

Greedy identity over many tokens flips on near-tied logits (a 135M model has
many: top-2 margins of 0.006-0.03 were seen flipping under K8V4 alone), so the
measures that carry margin are teacher-forced: both caches are fed the same
tokens (the reference's greedy continuation) and their next-token
distributions are compared at every step:

* top-1 agreement: share of steps whose argmax equals the reference's;
* KL divergence ``KL(p_ref || p)`` in nats, averaged over steps.

Used by ``tests/generation/test_near_lossless.py`` and ``examples/calibrate_thresholds.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def teacher_forced_logits(generator, prompt_ids: list[int], forced_ids: list[int], cache=None) -> torch.Tensor:
    """Next-token logits at every step of a forced continuation, through ``generator``'s cache.

    Args:
        generator: a :class:`~trtllm_diffkv.generation.reference.ReferenceGenerator` (its
            model, device and KV configuration are used).
        prompt_ids: prompt token ids, at least one.
        forced_ids: the continuation fed one token per step, at least one.
        cache: an empty cache to run in (``generator.new_cache(len(prompt_ids) + len(forced_ids))``, so the
            caller can read its ``stats()`` afterwards); default: a new one.

    Returns:
        ``float32 [len(forced_ids), vocab_size]`` on the CPU: row ``i`` is the
        distribution that predicts ``forced_ids[i]`` (row 0 comes from the
        prefill, row ``i`` from the decode step fed ``forced_ids[i - 1]``).

    Raises:
        ValueError: empty ``prompt_ids`` or ``forced_ids``.
    """
    cache = generator.new_cache(len(prompt_ids) + len(forced_ids)) if cache is None else cache
    return teacher_forced_logits_shared_prefill(generator.model, [cache], prompt_ids, forced_ids)[0]


class _FanOut:
    """Attention backend that runs every cache on the same q/k/v and returns the first one's output."""

    def __init__(self, caches):
        self.caches = caches

    def forward(self, layer_idx, q, k, v):
        outs = [c.forward(layer_idx, q, k, v) for c in self.caches]
        return outs[0]


def teacher_forced_logits_shared_prefill(model, caches: list, prompt_ids: list[int],
                                         forced_ids: list[int]) -> list[torch.Tensor]:
    """:func:`teacher_forced_logits` for several empty caches of one model, with one prefill forward.

    The prefill runs the model once; every cache stores the same prompt q/k/v at its own
    configuration, and the output of the first is used. That is exact for
    :class:`~trtllm_diffkv.cache.DiffKVReferenceCache` (its prefill attention reads the
    unquantized prompt, whatever the configuration); the decode steps run each cache on its own.

    Args:
        model: the model (its device is used).
        caches: empty caches of at least ``len(prompt_ids) + len(forced_ids)`` tokens.

    Returns:
        One ``float32 [len(forced_ids), vocab_size]`` CPU tensor per cache, as :func:`teacher_forced_logits`.

    Raises:
        ValueError: empty ``prompt_ids`` or ``forced_ids``, or no cache.
    """
    if not prompt_ids or not forced_ids or not caches:
        raise ValueError("teacher forcing needs a non-empty prompt, a non-empty continuation and a cache")
    device = next(model.parameters()).device
    rows = [[] for _ in caches]
    with torch.inference_mode():
        logits = model(torch.tensor(prompt_ids, device=device), torch.arange(len(prompt_ids), device=device),
                       _FanOut(caches) if len(caches) > 1 else caches[0],
                       logits_indices=torch.tensor([len(prompt_ids) - 1], device=device))
        for r in rows:
            r.append(logits[-1].float().cpu())
        for r, cache in zip(rows, caches):
            for step, token in enumerate(forced_ids[:-1]):
                pos = torch.tensor([len(prompt_ids) + step], device=device)
                r.append(model(torch.tensor([token], device=device), pos, cache)[-1].float().cpu())
    return [torch.stack(r) for r in rows]


@dataclass(frozen=True)
class ForcedComparison:
    """Teacher-forced comparison of one continuation.

    Attributes:
        steps: compared steps.
        top1_agreement: share of steps with the same argmax, in [0, 1].
        mean_kl_nats: mean over steps of ``KL(p_ref || p)``, nats.
        max_kl_nats: the largest step KL, nats.
    """

    steps: int
    top1_agreement: float
    mean_kl_nats: float
    max_kl_nats: float


def compare_logits(reference: torch.Tensor, candidate: torch.Tensor) -> ForcedComparison:
    """Compare two ``[steps, vocab]`` logit tensors step by step (float64 math).

    Raises:
        ValueError: shapes differ or there is no step.
    """
    if reference.shape != candidate.shape or reference.dim() != 2 or reference.shape[0] == 0:
        raise ValueError(f"need two equal [steps, vocab] tensors, got {tuple(reference.shape)} and {tuple(candidate.shape)}")
    log_p = torch.log_softmax(reference.double(), -1)
    log_q = torch.log_softmax(candidate.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)
    agree = (reference.argmax(-1) == candidate.argmax(-1)).double()
    return ForcedComparison(reference.shape[0], float(agree.mean()), float(kl.mean()), float(kl.max()))


def compare_to_reference(reference_generator, generator, prompt_ids: list[int], new_tokens: int) -> tuple[ForcedComparison, list[int]]:
    """Greedy-decode ``new_tokens`` with the reference, then teacher-force both on that continuation.

    Returns:
        ``(comparison, reference_token_ids)``.

    Raises:
        RuntimeError: the reference generation failed (its message).
    """
    ref = reference_generator.generate_ids(prompt_ids, new_tokens)
    if ref.error is not None:
        raise RuntimeError(f"reference generation failed: {ref.error}")
    forced = ref.token_ids
    comparison = compare_logits(teacher_forced_logits(reference_generator, prompt_ids, forced),
                                teacher_forced_logits(generator, prompt_ids, forced))
    return comparison, forced
