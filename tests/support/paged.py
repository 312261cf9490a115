"""Lockstep runs of the paged cache against the reference cache: shared by the CPU, interpreter and GPU tests.

:func:`run_lockstep` prefills a batch of prompts into one
:class:`~.cache.PagedDiffKVCache` and, per request, into its own
:class:`~trtllm_diffkv.cache.DiffKVReferenceCache`, feeding both the same
q/k/v of every layer (the model runs once, on the paged outputs), decodes
greedily and after every step compares, per request, layer and KV head
(:func:`compare_request`):

* the kept positions and their tiers, and the tier counts of the page manager;
* the pages each row holds: ``ceil(count / tokens_per_page)`` per tier (counts
  only grow, so no page is ever surplus);
* the paged oracle's dequantized K/V against the reference's (within a
  tolerance for rare requantization rounding differences) and the scores;
* every layer's attention output.

:func:`teacher_forced_agreement` runs the model twice (paged and reference)
on the reference's greedy tokens and reports top-1 agreement and KL: the
comparison for deep real models.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4  # noqa: F401 - re-exported for the tests

from trtllm_diffkv.cache import DiffKVReferenceCache
from trtllm_diffkv.policy import TIER_PRUNED
from trtllm_diffkv.engine_config import EngineConfig
from trtllm_diffkv.paged.cache import PagedDiffKVCache
from .paged_oracle import gather_request


@dataclass
class LockstepReport:
    """What a lockstep run saw.

    Attributes:
        steps: steps compared (prefill = step 0).
        max_kv_diff: largest |paged - reference| over every compared key/value element.
        max_logit_diff: largest |paged - reference| logit (teacher-forced runs).
        max_out_diff: largest |paged - reference| attention output element (lockstep runs).
        max_score_rel_diff: largest relative score difference.
        tier_changes: unused (kept for reports).
        top1_agreement: share of compared logits rows whose argmax equals the reference's.
        mean_kl_nats: mean KL(reference || paged) of the next-token distributions.
        reference_stats: per request, the reference cache's :class:`CacheStats` at the end.
        rounding_flips: compared (token, side) rows differing by more than 1e-5 (one-step code flips).
        final_stats: per request, the cache's :class:`PagedCacheStats` at the end.
    """

    steps: int = 0
    max_kv_diff: float = 0.0
    max_logit_diff: float = 0.0
    max_score_rel_diff: float = 0.0
    tier_changes: int = 0
    rounding_flips: int = 0
    max_out_diff: float = 0.0
    max_out_diff_at: str = ""
    top1_agreement: float = 1.0
    mean_kl_nats: float = 0.0
    reference_stats: list = field(default_factory=list)
    final_stats: list = field(default_factory=list)


def compare_request(cache: PagedDiffKVCache, slot: int, ref: DiffKVReferenceCache, report: LockstepReport,
                    kv_atol: float, where: str) -> None:
    """Assert that the request in ``slot`` holds what ``ref`` holds (positions, tiers, counts, pages, K/V, scores)."""
    rows = gather_request(cache, slot)
    n = ref.seq_len
    fmt = cache.page_format
    tokens = cache.manager.tokens.cpu().reshape(cache.max_slots, cache.num_layers, cache.num_kv_heads, 2)
    pages = cache.manager.pages.cpu().reshape(cache.max_slots, cache.num_layers, cache.num_kv_heads, 2)
    for layer in range(cache.num_layers):
        for head in range(cache.num_kv_heads):
            got = rows[layer][head]
            tiers = ref.tiers[layer, head, :n].cpu()
            kept = torch.nonzero(tiers != TIER_PRUNED).flatten()
            at = f"{where}, layer {layer}, KV head {head}"
            assert torch.equal(got.positions, kept), f"{at}: kept positions {got.positions.tolist()} != {kept.tolist()}"
            assert torch.equal(got.tiers, tiers[kept]), f"{at}: tiers differ"
            high, low = int((got.tiers == 1).sum()), int((got.tiers == 2).sum())
            assert tokens[slot, layer, head].tolist() == [high, low], f"{at}: manager counts {tokens[slot, layer, head].tolist()}"
            want_pages = [-(-high // fmt.high_tokens_per_page), -(-low // fmt.low_tokens_per_page)]
            assert pages[slot, layer, head].tolist() == want_pages, f"{at}: pages {pages[slot, layer, head].tolist()} != {want_pages}"
            if kept.numel():
                kd = _excess(got.keys, ref.keys[layer, head, kept].cpu().float(), got.tiers, cache.config, "key")
                vd = _excess(got.values, ref.values[layer, head, kept].cpu().float(), got.tiers, cache.config, "value")
                report.max_kv_diff = max(report.max_kv_diff, kd[0], vd[0])
                report.rounding_flips += kd[1] + vd[1]
                assert kd[2] <= kv_atol and vd[2] <= kv_atol, (
                    f"{at}: K/V differ by more than one quantization step: {kd[2]:.3g}/{vd[2]:.3g}")
            if cache.config.compress and kept.numel():
                ref_scores = ref.scores[layer, head, kept].cpu()
                rel = ((got.scores - ref_scores).abs() / ref_scores.abs().clamp(min=1e-6)).max().item()
                report.max_score_rel_diff = max(report.max_score_rel_diff, rel)


def _excess(got: torch.Tensor, want: torch.Tensor, tiers: torch.Tensor, config, side: str):
    """(max |diff|, tokens differing by more than 1e-5, max |diff| beyond one quantization step of the token's row).

    A new token's K/V come from hidden states that differ from the
    reference's by float rounding (~1e-6); when that moves a value across a
    rounding boundary its code differs by one step: allowed, and counted.
    """
    diff = (got - want).abs()
    bits = torch.tensor([getattr(config.high if t == 1 else config.low, f"{side}_bits") for t in tiers.tolist()])
    span = (want.amax(1) - want.amin(1))
    step = torch.where(bits < 16, span / (2.0 ** bits.clamp(max=15) - 1), torch.zeros_like(span))
    flips = int((diff.amax(1) > 1e-5).sum())
    return diff.max().item(), flips, (diff - 1.01 * step[:, None]).clamp(min=0).max().item()


class _Tee:
    """Attention backend feeding the same q/k/v to the paged cache and to each request's reference cache.

    Both caches see bit-identical inputs, so their states can be compared
    exactly (a deep model would otherwise amplify float-rounding differences
    into whole-step code flips); the paged output is what flows on.
    """

    def __init__(self, cache, refs, bounds, report, where):
        self.cache, self.refs, self.bounds, self.report, self.where = cache, refs, bounds, report, where

    def forward(self, layer_idx, q, k, v):
        out = self.cache.forward(layer_idx, q, k, v)
        for i, (ref, (s, e)) in enumerate(zip(self.refs, self.bounds)):
            want = ref.forward(layer_idx, q[s:e], k[s:e], v[s:e])
            diff = (out[s:e].float() - want.float()).abs().max().item()
            if diff > self.report.max_out_diff:
                self.report.max_out_diff = diff
                self.report.max_out_diff_at = f"{self.where}, layer {layer_idx}, request {i}"
        return out


def run_lockstep(model, kv_config, prompts: list[list[int]], decode_steps: int, *, num_pages: int,
                 kv_atol: float = 1e-3, out_atol: float = 1e-3, use_triton: bool | None = None,
                 high_tokens_per_page: int = 32, compare_every: int = 1, stable_check: bool = False,
                 page_manager: str = "auto", read_path: str = "auto") -> LockstepReport:
    """Prefill ``prompts`` as one static batch, decode greedily; every layer's q/k/v go to both caches.

    After the prefill and every ``compare_every`` decode steps each request's
    state is compared with its reference cache (:func:`compare_request`), and
    every layer's attention output with the reference's (``out_atol``).
    ``stable_check``: also assert that every token keeping its tier between two
    steps keeps its stored K/V bit for bit (later appends and moves never touch
    it; edge case 4). Pages are released at the end and must all come back.

    Raises:
        AssertionError: the first disagreement, naming request, step, layer and head.
    """
    cache, refs = _caches(model, kv_config, prompts, decode_steps, num_pages, use_triton, high_tokens_per_page,
                          page_manager, read_path)
    device = model.device
    report = LockstepReport()
    slots = list(range(len(prompts)))
    lens = [len(p) for p in prompts]
    with torch.inference_mode():
        bounds = list(zip(torch.tensor([0] + lens).cumsum(0).tolist(), torch.tensor(lens).cumsum(0).tolist()))
        cache.plan(slots, lens, [0] * len(prompts), [True] * len(prompts))
        logits = model(torch.tensor([t for p in prompts for t in p], device=device),
                       torch.cat([torch.arange(n, device=device) for n in lens]), _Tee(cache, refs, bounds, report, "prefill"),
                       logits_indices=torch.tensor([e - 1 for _, e in bounds], device=device))
        cache.end_step()
        _compare_all(cache, refs, report, kv_atol, "prefill")
        before = [gather_request(cache, s) for s in slots] if stable_check else None
        for step in range(1, decode_steps + 1):
            tokens = logits.argmax(-1)
            cache.plan(slots, [n + 1 for n in lens], lens, [False] * len(prompts))
            bounds = [(i, i + 1) for i in range(len(prompts))]
            logits = model(tokens, torch.tensor(lens, device=device), _Tee(cache, refs, bounds, report, f"decode step {step}"))
            cache.end_step()
            lens = [n + 1 for n in lens]
            if step % compare_every == 0 or step == decode_steps:
                _compare_all(cache, refs, report, kv_atol, f"decode step {step}")
            if stable_check:
                after = [gather_request(cache, s) for s in slots]
                _check_stable(before, after, step)
                before = after
            report.steps = step
    assert report.max_out_diff <= out_atol, (
        f"attention outputs differ by {report.max_out_diff:.3g} at {report.max_out_diff_at} (every stored token, "
        f"tier, count and page agreed at each compared step)")
    return _finish(cache, refs, report, num_pages, exact=True)


def teacher_forced_agreement(model, kv_config, prompts: list[list[int]], decode_steps: int, *, num_pages: int,
                             use_triton: bool | None = None, high_tokens_per_page: int = 32,
                             read_path: str = "auto") -> LockstepReport:
    """Top-1 agreement and KL of the paged cache's logits with the reference's, both fed the reference's greedy tokens.

    For deep real models, where the two caches' float-rounding differences
    flip quantization codes and the runs drift apart by whole quantization
    steps (the comparison ``tests/generation/test_near_lossless.py`` makes between presets).
    """
    cache, refs = _caches(model, kv_config, prompts, decode_steps, num_pages, use_triton, high_tokens_per_page,
                          "auto", read_path)
    device = model.device
    report, agree = LockstepReport(), []

    def pair(got, want):
        report.max_logit_diff = max(report.max_logit_diff, (got - want).abs().max().item())
        kl = torch.nn.functional.kl_div(got.float().log_softmax(-1), want.float().log_softmax(-1), log_target=True,
                                        reduction="sum")
        agree.append((int(got.argmax() == want.argmax()), float(kl)))
        return int(want.argmax())

    slots, lens = list(range(len(prompts))), [len(p) for p in prompts]
    with torch.inference_mode():
        cache.plan(slots, lens, [0] * len(prompts), [True] * len(prompts))
        last = torch.tensor(lens, device=device).cumsum(0) - 1
        logits = model(torch.tensor([t for p in prompts for t in p], device=device),
                       torch.cat([torch.arange(n, device=device) for n in lens]), cache, logits_indices=last)
        cache.end_step()
        tokens = [pair(logits[i], model(torch.tensor(p, device=device), torch.arange(len(p), device=device), refs[i],
                                        logits_indices=torch.tensor([len(p) - 1], device=device))[0])
                  for i, p in enumerate(prompts)]
        for _ in range(decode_steps):
            cache.plan(slots, [n + 1 for n in lens], lens, [False] * len(prompts))
            logits = model(torch.tensor(tokens, device=device), torch.tensor(lens, device=device), cache)
            cache.end_step()
            tokens = [pair(logits[i], model(torch.tensor([tokens[i]], device=device),
                                            torch.tensor([lens[i]], device=device), refs[i])[0])
                      for i in range(len(prompts))]
            lens = [n + 1 for n in lens]
            report.steps += 1
    report.top1_agreement = sum(a for a, _ in agree) / len(agree)
    report.mean_kl_nats = sum(k for _, k in agree) / len(agree)
    return _finish(cache, refs, report, num_pages)


def _caches(model, kv_config, prompts, decode_steps, num_pages, use_triton, high_tokens_per_page, page_manager,
            read_path):
    mc = model.config
    device, dtype = model.device, model.dtype
    kv_config = kv_config.for_model(mc)  # the model's sliding-window layers, if any
    max_len = max(len(p) for p in prompts) + decode_steps
    cache = PagedDiffKVCache(kv_config, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                             EngineConfig(max_batch_size=len(prompts), max_seq_len=max_len, device=device,
                                          use_triton=use_triton, high_tokens_per_page=high_tokens_per_page,
                                          page_manager=page_manager, read_path=read_path), num_pages=num_pages,
                             dtype=dtype)
    refs = [DiffKVReferenceCache(kv_config, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim, max_len,
                                 device, dtype) for _ in prompts]
    return cache, refs


def _finish(cache, refs, report, num_pages, exact: bool = False) -> LockstepReport:
    assert cache.step_errors() == {}
    slots = list(range(len(refs)))
    report.final_stats = [cache.request_stats(s) for s in slots]
    report.reference_stats = [ref.stats() for ref in refs]
    # the ring's free count and the rows' page counts tell the same story: pool bytes held = what requests hold
    assert cache.pool_used_bytes() == sum(s.pool_used_bytes for s in report.final_stats)
    for got, want in zip(report.final_stats, report.reference_stats):
        assert got.pool_used_bytes >= got.kv_cache_bytes or not cache.config.compress
        if exact:  # same tiers: the same accounted packed bytes and memory fraction as the reference
            assert (got.high_tokens, got.low_tokens, got.kv_cache_bytes) == \
                (want.high_tokens, want.low_tokens, want.kv_cache_bytes), (got, want)
    cache.release(slots)
    cache.manager.check_invariants()
    assert cache.manager.free_pages() == num_pages, "pages leaked after release"
    return report


def _check_stable(before, after, step) -> None:
    for slot, (old_req, new_req) in enumerate(zip(before, after)):
        for layer, (old_l, new_l) in enumerate(zip(old_req, new_req)):
            for head, (old, new) in enumerate(zip(old_l, new_l)):
                common, i_old, i_new = _common(old.positions, new.positions)
                same = old.tiers[i_old] == new.tiers[i_new]
                for name in ("keys", "values"):
                    a, b = getattr(old, name)[i_old][same], getattr(new, name)[i_new][same]
                    assert torch.equal(a, b), (
                        f"request {slot}, step {step}, layer {layer}, KV head {head}: stored {name} changed in place")


def _common(a: torch.Tensor, b: torch.Tensor):
    common = a[torch.isin(a, b)]
    return common, torch.searchsorted(a, common), torch.searchsorted(b, common)


def _compare_all(cache, refs, report, kv_atol, where) -> None:
    for slot, ref in enumerate(refs):
        compare_request(cache, slot, ref, report, kv_atol, f"request {slot}, {where}")
