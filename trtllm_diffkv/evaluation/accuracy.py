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


def _shared_windows(caches) -> tuple | None:
    """The sliding windows every cache applies (``sliding_windows``, read by the model's window check), or ``None``
    when one cache applies none or they differ: the model then refuses the step rather than let a cache attend
    past a window (a baseline cache knows no windows)."""
    windows = {tuple(w) if (w := getattr(c, "sliding_windows", None)) is not None else None for c in caches}
    return next(iter(windows)) if len(windows) == 1 else None


class _FanOut:
    """Prefill backend: the first cache attends and its output is returned; every other cache stores the same
    q/k/v (``store_prompt``: the prefill without its attention output, where the cache has one)."""

    def __init__(self, caches):
        self.caches = caches
        self.sliding_windows = _shared_windows(caches)

    def forward(self, layer_idx, q, k, v):
        out = self.caches[0].forward(layer_idx, q, k, v)
        for c in self.caches[1:]:
            store = getattr(c, "store_prompt", None)
            if store is not None:
                store(layer_idx, q, k, v)
            else:
                c.forward(layer_idx, q, k, v)
        return out


class _Rows:
    """Decode backend of one step for several one-request caches: token row ``i`` goes to ``caches[i]``."""

    def __init__(self, caches):
        self.caches = caches
        self.sliding_windows = _shared_windows(caches)

    def forward(self, layer_idx, q, k, v):
        return torch.cat([c.forward(layer_idx, q[i:i + 1], k[i:i + 1], v[i:i + 1]) for i, c in enumerate(self.caches)])


def teacher_forced_logits_shared_prefill(model, caches: list, prompt_ids: list[int],
                                         forced_ids: list[int], batch_decode: bool = False) -> list[torch.Tensor]:
    """:func:`teacher_forced_logits` for several empty caches of one model, with one prefill forward.

    The prefill runs the model once; every cache stores the same prompt q/k/v at its own
    configuration, and the output of the first is used. That is exact for
    :class:`~trtllm_diffkv.cache.DiffKVReferenceCache` and the baselines of
    :mod:`~trtllm_diffkv.evaluation.baselines` (their prefill attention reads the unquantized prompt,
    whatever the configuration): every cache's prefill logits are bit-identical to its own run's.

    Decode steps: with ``batch_decode=False`` each cache runs on its own; with ``batch_decode=True`` the
    caches after the first run together, one forward of ``len(caches) - 1`` token rows per step (the
    same token at the same position, row ``i`` attending in its own cache), so the model's weights are
    read once per step instead of once per cache. A row's logits then equal its own run's to fp32
    reassociation (a matrix product over more rows may sum in another order). The first cache always
    decodes alone: its logits are bit-identical to :func:`teacher_forced_logits`'s.

    Args:
        model: the model (its device is used).
        caches: empty caches of at least ``len(prompt_ids) + len(forced_ids)`` tokens.
        batch_decode: run the decode steps of ``caches[1:]`` as one batch.

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
        first = logits[-1].float().cpu()
        for r in rows:
            r.append(first)
        solo = list(zip(rows, caches)) if not batch_decode else list(zip(rows[:1], caches[:1]))
        for r, cache in solo:
            for step, token in enumerate(forced_ids[:-1]):
                pos = torch.tensor([len(prompt_ids) + step], device=device)
                r.append(model(torch.tensor([token], device=device), pos, cache)[-1].float().cpu())
        if batch_decode and len(caches) > 1:
            batch, m = _Rows(caches[1:]), len(caches) - 1
            for step, token in enumerate(forced_ids[:-1]):
                pos = torch.full((m,), len(prompt_ids) + step, dtype=torch.long, device=device)
                out = model(torch.full((m,), token, dtype=torch.long, device=device), pos, batch).float().cpu()
                for i, r in enumerate(rows[1:]):
                    r.append(out[i])
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
