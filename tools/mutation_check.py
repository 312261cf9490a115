#!/usr/bin/env python3
"""Mutation check of the product: plant small bugs, see which fast test catches each.

Each mutation is a textual replacement in one module, a realistic slip (a comparison, an
off-by-one, swapped operands, a dropped term, a wrong axis), in one of the areas of ``AREAS``:
policy, quantizer, reference cache, page manager, runtime (scheduler, executor, sampler, stop
checks, resource manager), OpenAI server, paged cache (decisions, decode planning and moves,
gather, row metadata) and the Triton kernels (decode attention, decision, write, prompt scores)
run by the interpreter at small shapes. The script snapshots the repository into a throwaway
directory under /tmp (never touching the checkout, which others edit live), checks that the
chosen fast tests pass there unmutated, then for each mutation restores the pristine file,
applies the replacement and runs the mutation's tests with ``pytest -x -q -p no:cacheprovider
-m "not slow and not gpu"`` under a timeout. A mutation is *caught* when a test fails; the first
failing test is reported. A replacement whose text is not found (the module changed) is
reported ``STALE``: update its snippet (``--list`` marks them without running anything).

Paths are relative to the repository root (the parent of this script's folder); a module that
moved is found by its file name under the same package, and a test file by its name anywhere
under ``tests/``, so the check survives the layout change (issue 17).

Usage (repository root; one core is enough)::

    OMP_NUM_THREADS=1 python3 tools/mutation_check.py            # all mutations (~20 min budget)
    OMP_NUM_THREADS=1 python3 tools/mutation_check.py --area runtime --area serve
    OMP_NUM_THREADS=1 python3 tools/mutation_check.py -k policy  # ids containing "policy"
    python3 tools/mutation_check.py --list

Options: ``--tests FILE...`` runs those files for every mutation instead of its own list (to
see whether one test file alone catches them all); ``--source head`` (default) takes the
modules from ``git archive HEAD`` and ``tests/`` from the working tree; ``--source worktree``
copies the whole working tree. ``--budget S`` (default 1200) stops starting mutations after S
seconds (the rest are reported ``NOT-RUN``); ``--timeout`` bounds one mutation. ``--json PATH``
writes the results; ``--markdown`` prints the tables for docs/TESTING.md. Exit status 1 when a
mutation survives, is stale or was not run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository (tools/ or tools/)

# Modules, relative to the repository root; a module moved to another folder is found by its name (resolve_module).
POLICY = "trtllm_diffkv/policy.py"
CACHE = "trtllm_diffkv/cache/reference.py"
QUANT = "trtllm_diffkv/quant.py"
PAGES = "trtllm_diffkv/memory/page_manager.py"
SCHEDULER = "trtllm_diffkv/runtime/scheduler.py"
EXECUTOR = "trtllm_diffkv/runtime/executor.py"
RESOURCES = "trtllm_diffkv/runtime/resource_manager.py"
SAMPLING = "trtllm_diffkv/runtime/sampling.py"
OUTPUTS = "trtllm_diffkv/llmapi/outputs.py"
STOPS = "trtllm_diffkv/runtime/stop_checker.py"
SERVER = "trtllm_diffkv/serve/openai_server.py"
PROTOCOL = "trtllm_diffkv/serve/openai_protocol.py"
DECISIONS = "trtllm_diffkv/paged/decisions.py"
DECODE = "trtllm_diffkv/paged/decode.py"
PREFILL = "trtllm_diffkv/paged/prefill.py"
GATHER = "trtllm_diffkv/paged/gather.py"
ROW_META = "trtllm_diffkv/paged/row_meta.py"
PAGED_ORACLE = "tests/support/paged_oracle.py"
DECODE_KERNELS = "trtllm_diffkv/kernels/attn_decode_kernels.py"
PREFILL_KERNELS = "trtllm_diffkv/kernels/attn_prefill_kernels.py"
DECISION_KERNEL = "trtllm_diffkv/kernels/decision_kernel.py"
WRITE_KERNEL = "trtllm_diffkv/kernels/quant_write.py"
FUSED = "trtllm_diffkv/model/fused.py"
CUSTOM_OPS = "trtllm_diffkv/kernels/custom_ops.py"
CUDA_DECODE = "trtllm_diffkv/kernels/cuda_decode.py"
PAGED_CACHE = "trtllm_diffkv/paged/cache.py"
PLUGIN_OPS = "trtllm_diffkv/export/plugin_ops.py"
TRTLLM_MANAGER = "trtllm_diffkv/trtllm_backend/manager.py"
STAGING = "trtllm_diffkv/paged/staging.py"
METRICS = "trtllm_diffkv/serve/metrics.py"
BASELINES = "trtllm_diffkv/evaluation/baselines.py"
CALIBRATION = "trtllm_diffkv/evaluation/calibration.py"
TP_HOOK = "trtllm_diffkv/parallel/executor_hook.py"
ATTENTION_API = "trtllm_diffkv/model/attention_api.py"
GEMMA3 = "trtllm_diffkv/model/gemma3.py"

# Fast (not slow-marked) tests, cheapest and most specific first: -x stops at the first failure. A test is named
# by its file name (found anywhere under tests/, so that moving tests into subfolders keeps the check working),
# optionally with ``::test_name`` to run only that test (all its parameters).
REFERENCE_TESTS = ["test_oracle_rules.py", "test_policy.py", "test_oracle_cache.py", "test_cache.py"]
CACHE_TESTS = ["test_oracle_cache.py", "test_cache.py", "test_policy.py"]
QUANT_TESTS = ["test_quant.py", "test_quant_pages.py", "test_oracle_cache.py"]
PAGE_TESTS = ["test_oracle_page_manager.py", "test_page_manager.py"]
SCHEDULER_TESTS = ["test_scheduler_rules.py", "test_executor.py::test_preemption_fp16_keeps_outputs_equal_to_solo_runs",
                   "test_executor.py::test_preemption_diffkv_loses_and_duplicates_no_token",
                   "test_executor.py::test_random_traffic_edge_case_9"]
EXECUTOR_TESTS = ["test_executor.py::test_bad_requests_fail_alone", "test_executor.py::test_max_seq_len_is_inclusive",
                  "test_executor.py::test_abort_at_every_stage_returns_every_page",
                  "test_executor.py::test_request_larger_than_the_pool_fails_alone",
                  "test_executor.py::test_staggered_batch_equals_each_request_alone_and_the_reference",
                  "test_resource_manager.py"]
SAMPLING_TESTS = ["test_sampling.py::test_top_p_on_the_exact_boundary_drops_the_token_as_transformers",
                  "test_sampling.py::test_top_p_on_the_boundary_with_ties_keeps_as_transformers",
                  "test_sampling.py::test_filtered_logits_match_transformers_and_numpy",
                  "test_sampling.py::test_top_k_keeps_ties_with_the_kth",
                  "test_sampling.py::test_greedy_rows_are_exactly_argmax_of_the_penalized_logits",
                  "test_sampling.py::test_same_seed_same_tokens_whatever_the_batch"]
STOP_TESTS = ["test_sampling.py::test_stop_strings_across_tokens_tiny_tokenizer",
              "test_sampling.py::test_stop_ids_max_tokens_and_ignore_eos", "test_executor.py::test_stop_ids_and_stop_strings"]
SERVE_TESTS = ["test_openai_app_rules.py"]
NEUTRAL_TESTS = SERVE_TESTS + ["test_trtllm_sampling_fields.py::test_other_values_fail_the_request_naming_the_field"]
PENALTY_TESTS = ["test_sampling.py::test_presence_and_frequency_penalties_match_the_loop_reference"]
LOGPROB_TESTS = ["test_sampling.py::test_logprobs_are_log_softmax_of_the_penalized_tempered_logits"]
PROMPT_LOGPROB_TESTS = ["test_llm_logprobs.py::test_prompt_logprobs_equal_a_dense_forward"]
BEST_OF_TESTS = ["test_llm_logprobs.py::test_best_of_keeps_the_highest_cumulative_logprobs"]
ECHO_TESTS = ["test_openai_logprobs.py::test_echo_with_max_tokens_zero_returns_the_prompt_alone"]
PAGED_TESTS = ["test_paged_cache.py", "test_paged_metadata_rules.py"]
DECISION_TESTS = ["test_decision_kernel.py::test_decision_kernel_equals_reference_all_presets"]
DECODE_KERNEL_TESTS = ["test_kernels_decode_attention.py"]
PREFILL_KERNEL_TESTS = ["test_kernels_prefill_scores.py"]
WRITE_KERNEL_TESTS = ["test_kernels_quant_write.py::test_triton_write_path_bit_exact_under_interpreter"]
# issue 43's survivors: each names the boundary test written for it
STAGING_TESTS = ["test_chunked_prefill_cache.py::test_a_second_staging_that_exactly_fills_the_limit_is_planned",
                 "test_chunked_prefill.py::test_a_prompt_whose_staging_exactly_fills_the_limit_runs_beside_the_decodes",
                 "test_chunked_prefill.py::test_a_second_chunked_prompt_that_exactly_fills_what_is_left_starts_beside_the_first"]
CHOICE_TESTS = ["test_openai_choice_rules.py"]
BASELINE_TESTS = ["test_eval_baselines.py"]
CALIBRATION_TESTS = ["test_calibrate_command.py::test_choose_keeps_a_setting_exactly_at_each_tolerance",
                     "test_calibrate_command.py::test_sweep_grid_keeps_alpha_low_equal_to_alpha_high",
                     "test_calibrate_command.py::test_choose_takes_the_lowest_memory_within_the_tolerances"]
HELD_OUT_TESTS = ["test_calibrate_heldout.py"]
TP_STATUS_TESTS = ["test_tensor_parallel.py::test_step_status_takes_rank_0_tokens_every_rank_flag_and_the_fewest_free_pages",
                   "test_tensor_parallel.py::test_a_non_finite_key_on_rank_1_only_fails_its_request_on_rank_0"]
FAILED_PLAN_TESTS = ["test_end_step.py::test_a_failed_plan_gives_back_its_new_prompts_and_leaves_its_decoding_slots_to_the_caller",
                     "test_end_step.py::test_a_plan_failing_after_its_reservation_gives_the_new_prompts_back"]
REFUSED_STEP_TESTS = ["test_executor.py::test_a_step_the_cache_refuses_fails_its_requests_and_the_executor_goes_on",
                      "test_executor.py::test_a_step_refused_for_pages_is_retried_and_loses_nothing"]
SLIDING_TESTS = ["test_sliding_window.py", "test_model_gemma3.py", "test_sliding_window_engines.py"]
GEMMA_TESTS = ["test_model_gemma3.py"]
GGUF_CONVERT = "trtllm_diffkv/model/gguf_convert.py"
LOADER = "trtllm_diffkv/model/loader.py"
GGUF_TESTS = ["test_gguf_tokenizer_check.py"]

AREAS = {"policy": "policy", "cache": "reference cache", "quant": "quantizer", "pages": "page manager",
         "runtime": "runtime (scheduler, executor, sampler, stop checks, resource manager)",
         "serve": "OpenAI server", "paged": "paged cache (decisions, decode planning and moves, gather, row metadata)",
         "kernels": "Triton kernels (decode attention, decision, write, prompt scores; interpreter)",
         "eval": "evaluation baselines and calibration", "parallel": "tensor parallelism (the executor hook)",
         "sliding": "sliding-window layers (Gemma 3) through the caches, kernels and engines",
         "gemma": "the Gemma 3 decoder",
         "gguf": "GGUF conversion (the rebuilt tokenizer's check, converting a stale folder again)"}
"""Areas (``--area``): a mutation's area is its id's first word."""


@dataclass(frozen=True)
class Mutation:
    """One planted bug: ``replacements`` (old, new) applied to ``path``; ``tests`` run in order.

    A replacement's ``old`` must occur exactly once in the module, unless the replacement is
    ``(old, new, "all")``: then every occurrence (at least one) is replaced.
    """

    id: str
    path: str
    description: str
    replacements: tuple[tuple[str, ...], ...]
    tests: tuple[str, ...]

    @property
    def area(self) -> str:
        return self.id.split("-")[0]


def m(id, path, description, replacements, tests):
    return Mutation(id, path, description, tuple(tuple(r) for r in replacements), tuple(tests))


MUTATIONS = [
    # ------------------------------------------------------------------ policy
    m("policy-gqa-merge-order", POLICY, "prompt GQA merge: max per query first, then the sum",
      [("return merge_query_heads(last_query_probs.float().sum(1), num_kv_heads)",
        "return merge_query_heads(last_query_probs.float(), num_kv_heads).sum(1)")], REFERENCE_TESTS),
    m("policy-candidate-never-low", POLICY, "decode: a candidate is never sent to the low tier (kept high)",
      [("    cand = classify(imp_c, alpha_high, alpha_low, float(seq_len))\n",
        "    cand = classify(imp_c, alpha_high, alpha_low, float(seq_len))\n"
        "    cand = torch.where(cand == TIER_LOW, torch.full_like(cand, TIER_HIGH), cand)\n")], REFERENCE_TESTS),
    m("policy-victim-never-retiered", POLICY, "decode: the victim keeps its tier whatever its importance",
      [("victim_tier = torch.where(heads, new, victim_tier)",
        "victim_tier = torch.where(heads, torch.full_like(new, joined), victim_tier)")], REFERENCE_TESTS),
    m("policy-victim-excludes-candidate", POLICY, "decode: the victim search skips the candidate",
      [("masked = torch.where(after == joined, importance,", "masked = torch.where(tiers == joined, importance,")],
      REFERENCE_TESTS),
    m("policy-victim-most-important", POLICY, "decode: the most important token is re-checked, not the least",
      [("        pos = masked.argmin(-1)\n",
        "        pos = torch.where(masked.isinf(), -masked, masked).argmax(-1)\n")], REFERENCE_TESTS),
    m("policy-prompt-window-off-by-one", POLICY, "prompt: recent window one token short",
      [("tier[:, max(prompt_len - recent_window_tokens, 0):] = TIER_HIGH",
        "tier[:, max(prompt_len - recent_window_tokens + 1, 0):] = TIER_HIGH")], REFERENCE_TESTS),
    m("policy-decode-window-off-by-one", POLICY, "decode: the candidate is one position too old",
      [("return pos - max(recent_window_tokens, 1)", "return pos - max(recent_window_tokens, 1) - 1")],
      REFERENCE_TESTS),
    m("policy-counts-unclamped", POLICY, "query counts: prompt tokens counted by every later prompt query (S ignored)",
      [("(prompt_len - p).clamp(max=prompt_score_window_tokens)", "(prompt_len - p)")], REFERENCE_TESTS),
    m("policy-prompt-threshold-position", POLICY, "prompt: alpha/(p+1) used under the prompt_len base",
      [("        length = float(prompt_len)\n", "        length = (positions + 1).float()\n")], REFERENCE_TESTS),
    m("policy-high-threshold-inclusive", POLICY, "classify: high tier for importance >= alpha_high/N (not >)",
      [("torch.where(importance > high_threshold, TIER_HIGH, tier)",
        "torch.where(importance >= high_threshold, TIER_HIGH, tier)")], REFERENCE_TESTS),
    m("policy-low-threshold-strict", POLICY, "classify: low tier needs importance > alpha_low/N (not >=)",
      [("torch.where(importance >= low_threshold, TIER_LOW, TIER_PRUNED)",
        "torch.where(importance > low_threshold, TIER_LOW, TIER_PRUNED)")], REFERENCE_TESTS),
    # --------------------------------------------------------- reference cache
    m("cache-prefill-no-causal-mask", ATTENTION_API, "prefill attention without the causal mask",
      [("return sdpa(q.transpose(0, 1), kh, vh, is_causal=True, scale=scale)",
        "return sdpa(q.transpose(0, 1), kh, vh, scale=scale)")],
      CACHE_TESTS),
    m("cache-prefill-wrong-kv-head", ATTENTION_API, "prefill: query heads of a group mapped to the wrong KV head",
      [("kh, vh = (x.transpose(0, 1).repeat_interleave(group, 0) for x in (k, v))",
        "kh, vh = (x.transpose(0, 1).repeat(group, 1, 1) for x in (k, v))")], CACHE_TESTS),
    m("cache-decode-wrong-kv-head", CACHE, "decode attention: query heads of a group mapped to the wrong KV head",
      [("qg = q.float().reshape(keys.shape[0], group, head_dim)",
        "qg = q.float().reshape(group, keys.shape[0], head_dim).transpose(0, 1)")], CACHE_TESTS),
    m("cache-scores-wrong-kv-head", CACHE, "prompt scoring: query heads mapped to the wrong KV head",
      [("logits = q @ k.repeat_interleave(group, 0).transpose(1, 2)", "logits = q @ k.repeat(group, 1, 1).transpose(1, 2)")],
      CACHE_TESTS),
    m("cache-n-pos-plus-one", CACHE, "decode: thresholds alpha/N with N = pos + 1",
      [("decision = policy.decode_step(self.tiers[layer_idx, :, :cand + 1], importance, pos,",
        "decision = policy.decode_step(self.tiers[layer_idx, :, :cand + 1], importance, pos + 1,")], CACHE_TESTS),
    m("cache-n-prompt-len", CACHE, "decode: thresholds alpha/N with N = prompt_len",
      [("decision = policy.decode_step(self.tiers[layer_idx, :, :cand + 1], importance, pos,",
        "decision = policy.decode_step(self.tiers[layer_idx, :, :cand + 1], importance, self.prompt_len,")],
      CACHE_TESTS),
    m("cache-counts-include-current-step", CACHE, "decode: query counts include the step's own query",
      [("counts = policy.query_counts(positions, self.prompt_len, pos, cfg.prompt_score_window_tokens)",
        "counts = policy.query_counts(positions, self.prompt_len, pos + 1, cfg.prompt_score_window_tokens)")],
      CACHE_TESTS),
    m("cache-values-with-key-format", CACHE, "values quantized with the keys' bits and groups",
      [("return fake_quantize(v, tier.value_bits, tier.value_groups,", "return fake_quantize(v, tier.key_bits, tier.key_groups,")],
      CACHE_TESTS),
    m("cache-scores-not-accumulated", CACHE, "decode: probabilities never added to the scores",
      [("self.scores[layer_idx, :, :seq_len] += policy.merge_query_heads(probs, self.num_kv_heads)",
        "self.scores[layer_idx, :, :seq_len] += 0 * policy.merge_query_heads(probs, self.num_kv_heads)")], CACHE_TESTS),
    m("cache-scores-overwritten", CACHE, "decode: scores overwritten by the step's probabilities",
      [("self.scores[layer_idx, :, :seq_len] += policy.merge_query_heads(probs, self.num_kv_heads)",
        "self.scores[layer_idx, :, :seq_len] = policy.merge_query_heads(probs, self.num_kv_heads)")], CACHE_TESTS),
    m("cache-candidate-never-low", CACHE, "decode: a candidate classified low is left high",
      [("self._retier(layer_idx, cand_pos, decision.candidate_tier, k_low[:h]",
        "self._retier(layer_idx, cand_pos, torch.where(decision.candidate_tier == TIER_LOW, TIER_HIGH, "
        "decision.candidate_tier).to(torch.int8), k_low[:h]")], CACHE_TESTS),
    m("cache-victim-never-retiered", CACHE, "decode: the victim's decision is never applied",
      [("victim_tier = torch.where(decision.victim_pos >= 0, ", "victim_tier = torch.where(decision.victim_pos < -1, ")],
      CACHE_TESTS),
    m("cache-demotion-at-high-format", CACHE, "a demoted token is re-quantized at the high tier's format",
      [("        low = self.config.low\n        offset = self.key_offsets",
        "        low = self.config.high\n        offset = self.key_offsets")], CACHE_TESTS),
    m("cache-decide-after-attention", CACHE, "decode in the old order: attend, accumulate, then decide (N = pos + 1)",
      [("            self._compact(layer_idx, pos)  # decide from the scores through the previous step\n", ""),
       ("            self.scores[layer_idx, :, :seq_len] += policy.merge_query_heads(probs, self.num_kv_heads)\n",
        "            self.scores[layer_idx, :, :seq_len] += policy.merge_query_heads(probs, self.num_kv_heads)\n"
        "            self._compact(layer_idx, seq_len)\n")], CACHE_TESTS),
    m("cache-key-offset-not-restored", CACHE, "centred keys: the channel offset is not added back",
      [("        return q + offset\n", "        return q\n")], CACHE_TESTS),
    m("cache-prompt-score-window-ignored", CACHE, "prompt: every query scores (S ignored)",
      [("num_scoring = min(cfg.prompt_score_window_tokens, n)", "num_scoring = n")], CACHE_TESTS),
    m("cache-pruned-attended", CACHE, "decode: pruned tokens still attended",
      [("kept = self.tiers[layer_idx, :, :seq_len] != TIER_PRUNED", "kept = self.tiers[layer_idx, :, :seq_len] >= 0")],
      CACHE_TESTS),
    m("cache-stats-low-at-high-bytes", CACHE, "memory accounting: low tokens counted at the high format's bytes",
      [('low * self.config.token_bytes("low", self.head_dim)', 'low * self.config.token_bytes("high", self.head_dim)')],
      CACHE_TESTS),
    m("cache-stats-fp16-counts-query-heads", CACHE, "memory accounting: FP16 bytes counted per query head",
      [("fp16_bytes = total * 2 * self.head_dim * 2",
        "fp16_bytes = total * (self.num_heads // self.num_kv_heads) * 2 * self.head_dim * 2")], CACHE_TESTS),
    # -------------------------------------------------------------------- quant
    m("quant-round-to-floor", QUANT, "rounding replaced by flooring",
      [("codes = torch.round(", "codes = torch.floor(")], QUANT_TESTS),
    m("quant-2bit-field-order-swapped", QUANT, "2-bit fields in reverse order in both pack and unpack",
      [("    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits\n",
        "    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits\n"
        "    shifts = shifts.flip(0) if bits == 2 else shifts\n"),
       ("    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits\n",
        "    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits\n"
        "    shifts = shifts.flip(0) if bits == 2 else shifts\n")], QUANT_TESTS),
    m("quant-4bit-nibbles-swapped", QUANT, "4-bit nibbles in reverse order in both pack and unpack",
      [("    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits\n",
        "    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits\n"
        "    shifts = shifts.flip(0) if bits == 4 else shifts\n"),
       ("    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits\n",
        "    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits\n"
        "    shifts = shifts.flip(0) if bits == 4 else shifts\n")], QUANT_TESTS),
    m("quant-zero-not-fp16", QUANT, "codes computed against the fp32 minimum, not the stored fp16 zero",
      [("codes = torch.round((xg - zero.float().unsqueeze(-1))", "codes = torch.round((xg - lo.unsqueeze(-1))")],
      QUANT_TESTS),
    m("quant-no-scale-epsilon", QUANT, "constant rows get scale 0 (no epsilon clamp)",
      [(".clamp_min(SCALE_EPSILON).to(torch.float16)", ".to(torch.float16)")], QUANT_TESTS),
    m("quant-no-saturation", QUANT, "codes not clamped to [0, 2**bits - 1]",
      [(".clamp_(0, qmax)", "")], QUANT_TESTS),
    m("quant-scale-one-level-short", QUANT, "scale divides the range by 2**bits instead of 2**bits - 1",
      [("torch.full_like(hi, float(qmax))", "torch.full_like(hi, float(qmax + 1))")], QUANT_TESTS),
    # ------------------------------------------------------------- page manager
    m("pages-take-wraps-early", PAGES, "ring: allocation wraps one slot early",
      [("idx = (self.ring_start + torch.arange(count)) % self.num_pages",
        "idx = (self.ring_start + torch.arange(count)) % max(self.num_pages - 1, 1)")], PAGE_TESTS),
    m("pages-give-off-by-one", PAGES, "ring: reclaimed ids written one slot past the end",
      [("idx = (self.ring_end + torch.arange(ids.numel())) % self.num_pages",
        "idx = (self.ring_end + 1 + torch.arange(ids.numel())) % self.num_pages")], PAGE_TESTS),
    m("pages-release-drops-low", PAGES, "release returns only the high pages",
      [("self._give(torch.gather(tile, 1, order)[pos < nh + nl])", "self._give(torch.gather(tile, 1, order)[pos < nh])")],
      PAGE_TESTS),
    m("pages-decode-ignores-low-delta", PAGES, "append_decode ignores the low-tier delta",
      [("new_tokens = tokens + torch.stack([dh.flatten(), dl.flatten()], 1)",
        "new_tokens = tokens + torch.stack([dh.flatten(), 0 * dl.flatten()], 1)")], PAGE_TESTS),
    m("pages-commit-keeps-surplus", PAGES, "commit_prompt never returns the surplus reservation",
      [("self._give(tile[(pos >= kh[:, None]) & (pos < (reserved - kl)[:, None])])",
        "self._give(tile[(pos >= kh[:, None]) & (pos < (reserved - kl)[:, None]) & (pos < 0)])")], PAGE_TESTS),
    m("pages-decode-low-slot-off-by-one", PAGES, "a new low page is written one column too far left",
      [("self.page_table[rows[lo], self.max_pages_per_row - 1 - pages[lo, 1]]",
        "self.page_table[rows[lo], self.max_pages_per_row - 2 - pages[lo, 1]]")],
      PAGE_TESTS),
    m("pages-low-capacity-as-high", PAGES, "decode sizes low pages with the high tier's tokens per page",
      [("capacity = pages * torch.tensor([self.high_tokens_per_page, self.low_tokens_per_page])\n        need",
        "capacity = pages * torch.tensor([self.high_tokens_per_page, self.high_tokens_per_page])\n        need")],
      PAGE_TESTS),
    # ------------------------------------------------------------------ runtime: scheduler (issue 24's survivors 2-4)
    m("runtime-preempt-oldest", SCHEDULER, "preemption takes the oldest running request, not the newest",
      [("victim = self.running[-1]", "victim = self.running[0]")], SCHEDULER_TESTS),
    m("runtime-estimate-never-stale", SCHEDULER, "a release never marks the free-page estimate stale (never re-read)",
      [("            self.rm.free_resources(request)\n            self._stale = True\n",
        "            self.rm.free_resources(request)\n")], SCHEDULER_TESTS),
    m("runtime-estimate-always-reread", SCHEDULER, "every refusal re-reads the free pages (a device read), stale or not",
      [("        if self._stale:\n            self.observe_free(self.rm.free_pages())",
        "        if True:\n            self.observe_free(self.rm.free_pages())")], SCHEDULER_TESTS),
    m("runtime-unschedule-order-reversed", SCHEDULER, "a refused plan's new requests go back in reverse order",
      [("for request in reversed(batch.context_requests):", "for request in batch.context_requests:")],
      SCHEDULER_TESTS),
    m("runtime-admission-no-decode-reserve", SCHEDULER, "admission forgets the running requests' decode reserve",
      [("need = reserve + self.rm.prefill_pages_needed(n)", "need = self.rm.prefill_pages_needed(n)")],
      SCHEDULER_TESTS),
    m("runtime-fifo-rejects-waiting-head", SCHEDULER, "a head that waits for pages behind new admissions is rejected",
      [("if self.running or batch.context_requests:", "if self.running:")], SCHEDULER_TESTS),
    m("runtime-chunks-a-prompt-one-step-holds", SCHEDULER, "a prompt one step could carry whole is chunked into "
      "what earlier prompts left (a chunk step costs ~2.7x)",
      [("                if n <= self.max_num_tokens - len(batch.generation_requests):\n",
        "                if False:\n")], SCHEDULER_TESTS),
    m("runtime-whole-wait-ignores-decodes", SCHEDULER, "the whole-prompt wait compares with max_num_tokens, not "
      "what a step leaves beside the decodes (the head idles behind decode-only steps)",
      [("                if n <= self.max_num_tokens - len(batch.generation_requests):\n",
        "                if n <= self.max_num_tokens:\n")], SCHEDULER_TESTS),
    m("runtime-preempt-forgets-output", SCHEDULER, "a preempted request re-prefills its prompt only (tokens lost)",
      [("request.prefill_token_ids = request.prompt_token_ids + request.output_token_ids",
        "request.prefill_token_ids = list(request.prompt_token_ids)")], SCHEDULER_TESTS),
    m("runtime-free-resources-keeps-pages", RESOURCES, "free_resources frees the slot but not the cache's pages",
      [("        self.cache.release([request.slot])\n        self._give_slot(request)",
        "        self._give_slot(request)")], EXECUTOR_TESTS),
    m("runtime-max-seq-len-inclusive", EXECUTOR, "a prompt + max_tokens of exactly max_seq_len is refused",
      [("if n + params.max_tokens > self.max_seq_len:", "if n + params.max_tokens >= self.max_seq_len:")],
      EXECUTOR_TESTS),
    # ------------------------------------------------------------------ runtime: sampler (survivor 1) and stops
    m("runtime-n-unbounded", SAMPLING, "n has no upper bound: n = 10**9 builds 10**9 children before any check",
      [('_check_int("n", self.n, 1, MAX_SEQUENCES,', '_check_int("n", self.n, 1, None,')],
      ["test_sampling.py::test_sequence_counts_are_bounded_before_any_child_is_built"]),
    m("runtime-group-stream-repeats-ended", OUTPUTS, "a streamed n > 1 group repeats a finished sequence's last "
      "diffs in every later update", [("            if i in self._ended:\n", "            if False:\n")],
      ["test_llm_logprobs.py::test_a_streamed_group_reports_a_finished_sequence_once"]),
    m("runtime-top-p-boundary-strict", SAMPLING, "top-p keeps a token whose cumulative mass equals 1 - top_p (< not <=)",
      [("drop_sorted = cumulative <= (1 - top_p)", "drop_sorted = cumulative < (1 - top_p)")], SAMPLING_TESTS),
    m("runtime-top-p-may-drop-all", SAMPLING, "top-p may drop the most likely token too",
      [("    drop_sorted[:, -1] = False\n", "")], SAMPLING_TESTS),
    m("runtime-penalty-direction", SAMPLING, "repetition penalty divides negative logits (CTRL rule inverted)",
      [("torch.where(chosen < 0, chosen * penalty, chosen / penalty)",
        "torch.where(chosen < 0, chosen / penalty, chosen * penalty)")], SAMPLING_TESTS),
    m("runtime-top-k-drops-kth", SAMPLING, "top-k drops the k-th logit and its ties (<= not <)",
      [("scores.masked_fill(scores < kth, -math.inf)", "scores.masked_fill(scores <= kth, -math.inf)")],
      SAMPLING_TESTS),
    m("runtime-temperature-multiplies", SAMPLING, "logits multiplied by the temperature",
      [("scores = scores / temperature.unsqueeze(1)", "scores = scores * temperature.unsqueeze(1)")], SAMPLING_TESTS),
    m("runtime-greedy-ignores-penalty", SAMPLING, "greedy rows take the argmax of the raw logits (penalty skipped)",
      [("        tokens = torch.argmax(scores, dim=-1)\n", "        tokens = torch.argmax(logits.float(), dim=-1)\n")],
      SAMPLING_TESTS),
    m("runtime-penalty-counts-prompt", SAMPLING, "presence/frequency penalties count the prompt's tokens too",
      [("start = self._prompt_tokens.get(request_id, 0)", "start = 0")], PENALTY_TESTS),
    m("runtime-presence-per-count", SAMPLING, "the presence penalty is subtracted once per occurrence",
      [("- (counts > 0).float() * presence", "- counts * presence")], PENALTY_TESTS),
    m("runtime-logprobs-untempered", SAMPLING, "logprobs ignore the temperature",
      [("torch.log_softmax(scores[asked] / temperature, dim=-1)", "torch.log_softmax(scores[asked], dim=-1)")],
      LOGPROB_TESTS),
    m("runtime-prompt-logprobs-shifted", SAMPLING, "prompt logprobs read each position's own token (off by one)",
      [("prompt_token_ids[start + 1:start + 1 + used]", "prompt_token_ids[start:start + used]", "all")],
      PROMPT_LOGPROB_TESTS),
    m("runtime-best-of-worst", SAMPLING, "best_of keeps the least likely sequences",
      [("key=lambda i: (-cumulative_logprobs[i], i))[:n]", "key=lambda i: (cumulative_logprobs[i], i))[:n]")],
      BEST_OF_TESTS),
    m("runtime-max-tokens-one-late", STOPS, "max_tokens stops one token late (> not >=)",
      [("if len(generated_ids) >= self.params.max_tokens:", "if len(generated_ids) > self.params.max_tokens:")],
      STOP_TESTS),
    m("runtime-stop-string-search-late", STOPS, "the stop-string search starts one character late",
      [("text.find(s, max(0, settled - len(s) + 1))", "text.find(s, max(0, settled - len(s) + 2))")], STOP_TESTS),
    m("runtime-ignore-eos-ignored", STOPS, "ignore_eos has no effect (the model's stop ids always apply)",
      [("        if not params.ignore_eos:\n            self._stop_ids |= set(stop_token_ids)",
        "        if True:\n            self._stop_ids |= set(stop_token_ids)")], STOP_TESTS),
    # ------------------------------------------------------------------ OpenAI server (survivors 5, 6)
    m("serve-usage-first-prompt", SERVER, "completion usage counts the first prompt only",
      [("usage = request.state.usage = _usage(finals, len(finals) if prompt_only else 0, k)",
        "usage = request.state.usage = _usage(finals[:k], len(finals) if prompt_only else 0, k)")], SERVE_TESTS),
    m("serve-neutral-ignores-type", SAMPLING, "neutral-value check by == only (True == 1, 0 == False accepted)",
      [("               (type(value) is type(neutral) or {type(value), type(neutral)} <= {int, float}) and value == neutral",
        "               value == neutral")], NEUTRAL_TESTS),
    m("serve-echo-keeps-generated", SERVER, "echo with max_tokens 0 returns the dropped generated token too",
      [("        if not self.prompt_only:\n            ids += list(token_ids)",
        "        if True:\n            ids += list(token_ids)")], ECHO_TESTS),
    m("serve-completion-default-max-tokens", SERVER, "completions default to SamplingParams' 64 tokens, not OpenAI's 16",
      [("16 if body.max_tokens is None else body.max_tokens", "64 if body.max_tokens is None else body.max_tokens")],
      SERVE_TESTS),
    m("serve-chat-limit-priority", SERVER, "chat: max_tokens wins over max_completion_tokens",
      [("body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens",
        "body.max_tokens if body.max_tokens is not None else body.max_completion_tokens")], SERVE_TESTS),
    m("serve-chat-default-ignores-prompt", SERVER, "chat default max_tokens is max_seq_len (prompt not subtracted)",
      [("max(1, llm.max_seq_len - len(ids))", "max(1, llm.max_seq_len)")], SERVE_TESTS),
    # ------------------------------------------------------------------ paged: decisions, planning, moves, gather
    m("paged-prefill-whole-beside-chunk-misplaced", PREFILL, "paged prefill: the whole prompts batched beside a chunk "
      "take their neighbour's score rows",
      [("keys.append(wk[a:b]), values.append(wv[a:b]), sums.append(ws[a:b])",
        "keys.append(wk[a:b]), values.append(wv[a:b]), sums.append(ws[a:b].roll(1, 0))")],
      ["test_chunked_prefill_cache.py::test_whole_prompts_beside_a_chunk_equal_an_unchunked_step"]),
    m("paged-prefill-window-off-by-one", PREFILL, "paged prefill: recent window one token short",
      [("window=t >= n_tok - W,", "window=t > n_tok - W,")], PAGED_TESTS),
    m("paged-prefill-counts-unclamped", PREFILL, "paged prefill: query counts not clamped to S",
      [("count=torch.minimum(n_tok - t, torch.full_like(t, S)).float()", "count=(n_tok - t).float()")], PAGED_TESTS),
    m("paged-prefill-low-strict", PREFILL, "paged prefill: low tier needs importance > alpha_low/N",
      [("low = ~high & (importance >= p.thr_l[:, None])", "low = ~high & (importance > p.thr_l[:, None])")],
      PAGED_TESTS),
    m("paged-prefill-low-page-column", PREFILL, "paged prefill: low tokens written one reserved page too far left",
      [('col = (p.reserved[:, None] - 1 - index // per_page).clamp(min=0)',
        'col = (p.reserved[:, None] - 2 - index // per_page).clamp(min=0)')], PAGED_TESTS),
    m("paged-prefill-inclusive-prefix", PREFILL, "paged prefill: a tier's slot index counts the token itself",
      [("excl = torch.cumsum(sel64.transpose(1, 2).contiguous(), 2).transpose(1, 2) - sel64",
        "excl = torch.cumsum(sel64.transpose(1, 2).contiguous(), 2).transpose(1, 2)")],
      PAGED_TESTS),
    m("paged-prefill-last-group-unwritten", PREFILL, "paged prefill: a partial last group of layers is never written",
      [("    if j == kb.shape[0] - 1:\n", "    if j == group - 1:\n")],
      ["test_chunked_prefill_cache.py::test_prompt_writes_in_layer_groups_equal_the_per_layer_writes"]),
    m("paged-decode-candidate-off-by-one", DECISIONS, "paged decode: the candidate one position too old",
      [("    cand = pos - max(recent_window_tokens, 1)\n", "    cand = pos - max(recent_window_tokens, 1) - 1\n")],
      PAGED_TESTS),
    m("paged-moves-unmasked", DECODE, "decode moves: rows that move nothing still copy token 0 into the low tier",
      [("    src_page = torch.where(moving, src_page, -1)\n    dst_page = torch.where(moving, dst_page, -1)\n", "")],
      PAGED_TESTS),
    m("paged-low-column-off-by-one", GATHER, "low tier pages located one column left of the right edge",
      [("        col = width - 1 - col\n", "        col = width - col\n")], PAGED_TESTS),
    m("paged-gather-one-past-count", GATHER, "a tier view counts one token past the tier's count as valid",
      [("valid = index < count[:, None]", "valid = index <= count[:, None]")], PAGED_TESTS),
    m("paged-threshold-n-plus-one", DECISIONS, "decode thresholds alpha/N with N = pos + 1",
      [("    n = pos.clamp(min=1)\n", "    n = (pos + 1).clamp(min=1)\n")], PAGED_TESTS),
    m("paged-counts-prompt-twice", DECISIONS, "query counts: decode queries also counted for prompt tokens' window",
      [("from_decode = (n - torch.maximum(p, pl)).clamp(min=0)", "from_decode = (n - p).clamp(min=0)")],
      PAGED_TESTS),
    m("paged-new-token-slot-swapped", DECISIONS, "a freed high slot: the new token takes the candidate's, not the victim's",
      [("torch.where(~found | (c_high & v_stays), h_count, torch.where(c_high, iv_h, ic))",
        "torch.where(~found | (c_high & v_stays), h_count, torch.where(c_high, ic, iv_h))")],
      PAGED_TESTS + DECISION_TESTS),
    m("paged-victim-after-candidate", DECISIONS, "high victim search includes tokens newer than the candidate",
      [("elig_h = high.valid & (high.positions.long() <= cand[:, None])", "elig_h = high.valid")], PAGED_TESTS),
    m("paged-row-meta-half-bytes", ROW_META, "row metadata counts head_dim bytes for the fp16 key offset",
      [("return 2 * self.head_dim if self.key_offset else 0", "return self.head_dim if self.key_offset else 0")],
      PAGED_TESTS),
    m("paged-oracle-drops-last-token", PAGED_ORACLE, "the gather oracle reads one token short of each tier",
      [("view = gather_tier(pool, table, tokens, rows, tier, count)",
        "view = gather_tier(pool, table, tokens, rows, tier, max(count - 1, 0))")], PAGED_TESTS),
    # ------------------------------------------------------------------ kernels: decode attention (interpreter)
    m("kernels-merge-no-rescale", DECODE_KERNELS, "merge: partial sums added without their max rescale",
      [("        acc += a * w_s[:, None]\n", "        acc += a\n")], DECODE_KERNEL_TESTS),
    m("kernels-partial-sum-not-rescaled", DECODE_KERNELS, "online softmax: the running sum is not rescaled",
      [("        l = l * alpha + tl.sum(p, axis=1)\n", "        l = l + tl.sum(p, axis=1)\n", "all")],
      DECODE_KERNEL_TESTS),
    m("kernels-tail-unmasked", DECODE_KERNELS, "the last page's slots past the tier count are read",
      [("valid = (sub < PPI) & (j < last) & (j * TOKENS + slot < n_tok)", "valid = (sub < PPI) & (j < last)", "all")],
      DECODE_KERNEL_TESTS),
    m("kernels-scale-zero-swapped", DECODE_KERNELS, "folded path: scale and zero read from each other's half-word",
      [("        scale = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)\n"
        "        zero = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)\n",
        "        zero = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)\n"
        "        scale = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)\n")], DECODE_KERNEL_TESTS),
    m("kernels-zero-term-dropped", DECODE_KERNELS, "folded path: the key zero-point term q . zero is dropped",
      [("logits = tl.sum(l3 * ks[:, None, :] + kz[:, None, :] * qsum3[:, :, None], axis=0)",
        "logits = tl.sum(l3 * ks[:, None, :], axis=0)")], DECODE_KERNEL_TESTS),
    m("kernels-partition-overrun", DECODE_KERNELS, "a partition reads past its last page into the next one",
      [("    last = tl.minimum(first + per_part, n_pages)\n", "    last = tl.minimum(first + per_part + 1, n_pages)\n",
        "all")], DECODE_KERNEL_TESTS),
    m("kernels-score-sum-over-group", DECODE_KERNELS, "score update sums the group's probabilities (not the max)",
      [("prob = tl.max(e.to(tl.float32) * factor[:, None, :], axis=2)",
        "prob = tl.sum(e.to(tl.float32) * factor[:, None, :], axis=2)")], DECODE_KERNEL_TESTS),
    m("kernels-score-overwritten", DECODE_KERNELS, "score update overwrites the accumulated score",
      [("tl.store(score_ptr, old + prob, mask=tok_ok)", "tl.store(score_ptr, prob, mask=tok_ok)")],
      DECODE_KERNEL_TESTS),
    m("kernels-score-low-column-off-by-one", DECODE_KERNELS, "score update: the low tier's first page is missed",
      [("    is_low = pos >= R - lp\n", "    is_low = pos > R - lp\n")], DECODE_KERNEL_TESTS),
    # ------------------------------------------------------------------ kernels: decision kernel
    m("kernels-decision-high-inclusive", DECISION_KERNEL, "decision kernel: HIGH for importance >= alpha_high/N",
      [("return tl.where(imp > thr_h, 1, tl.where(imp >= thr_l, 2, 0))",
        "return tl.where(imp >= thr_h, 1, tl.where(imp >= thr_l, 2, 0))")], DECISION_TESTS),
    m("kernels-decision-low-strict", DECISION_KERNEL, "decision kernel: LOW needs importance > alpha_low/N",
      [("return tl.where(imp > thr_h, 1, tl.where(imp >= thr_l, 2, 0))",
        "return tl.where(imp > thr_h, 1, tl.where(imp > thr_l, 2, 0))")], DECISION_TESTS),
    m("kernels-decision-new-slot-swapped", DECISION_KERNEL, "decision kernel: new token into the candidate's slot",
      [("tl.where(append, h_count, tl.where(c_high, iv_h, ic))", "tl.where(append, h_count, tl.where(c_high, ic, iv_h))")],
      DECISION_TESTS),
    m("kernels-decision-candidate-off-by-one", DECISION_KERNEL, "decision kernel: the candidate one position too old",
      [("    cand = pos - W\n", "    cand = pos - W - 1\n")], DECISION_TESTS),
    m("kernels-decision-tie-to-newest", DECISION_KERNEL, "decision kernel: importance ties go to the newest token",
      [("best_pos = tl.min(tl.where(tie, b_pos, BIG), 1)", "best_pos = tl.max(tl.where(tie, b_pos, -1), 1)")],
      DECISION_TESTS),
    m("kernels-decision-counts-unclamped", DECISION_KERNEL, "decision kernel: prompt counts not clamped to S",
      [("from_prompt = tl.where(p < prompt_len, tl.minimum(prompt_len - p, S), 0)",
        "from_prompt = tl.where(p < prompt_len, prompt_len - p, 0)")], DECISION_TESTS),
    # ------------------------------------------------------------------ kernels: the model's key rotation
    m("kernels-rotation-one-matrix", FUSED, "key rotation kernel: every KV head rotated by head 0's matrix",
      [("r_base = r_ptr + kvh.to(tl.int64) * HEAD_DIM * HEAD_DIM", "r_base = r_ptr")],
      ["test_model_fused_ops.py::test_rotate_heads_kernel_matches_the_einsum"]),
    m("kernels-rotation-key-row", FUSED, "key rotation kernel: the key read into the first query row",
      [("is_k = rows == GROUP", "is_k = rows == 0")],
      ["test_model_fused_ops.py::test_rotate_heads_kernel_matches_the_einsum"]),
    # ------------------------------------------------------------------ kernels: the torch custom ops
    m("kernels-op-fake-silu-shape", CUSTOM_OPS, "custom op: silu_mul's fake returns the input's width",
      [("return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)",
        "return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1])")],
      ["test_custom_ops.py::test_fused_ops"]),
    m("kernels-op-fake-v-dtype", CUSTOM_OPS, "custom op: qkv_rope's fake gives v in fp16",
      [("qkv.new_empty(n, num_kv_heads, head_dim))", "qkv.new_empty(n, num_kv_heads, head_dim, dtype=torch.float16))")],
      ["test_custom_ops.py::test_fused_ops"]),
    m("kernels-op-decode-pool-not-mutated", CUSTOM_OPS, "custom op: decode attention's pool not declared mutated",
      [('mutates_args=("pool_pages", "out", "workspace")', 'mutates_args=("out", "workspace")')],
      ["test_custom_ops.py::test_decode_attention_op"]),
    m("kernels-op-write-flags-not-mutated", CUSTOM_OPS, "custom op: write_tokens' error flags not declared mutated",
      [('mutates_args=("pages", "error_flags")', 'mutates_args=("pages",)')],
      ["test_custom_ops.py::test_write_tokens_op"]),
    m("decode-runner-any-dtype", DECODE, "paged decode: the resolved runner takes a query of another dtype",
      [("if out.dtype == q.dtype and q.device == out.device else None", "if True else None")],
      ["test_paged_robustness.py::test_a_decode_query_of_another_dtype_than_the_cache_is_refused"]),
    m("cuda-decode-spill-tolerance", CUDA_DECODE, "CUDA decode: the ring keeps its cap at any local memory",
      [("mb == floor or partial.local_size_bytes <= LOCAL_BYTES_TOLERATED", "mb == floor or partial.local_size_bytes < 1 << 20")],
      ["test_cuda_decode.py::test_the_ring_steps_down_to_a_spill_free_register_cap"]),
    m("cuda-decode-fused-slots-unchecked", CUDA_DECODE, "CUDA decode: a fused launch takes more CTAs a row than it holds",
      [("if not 1 <= num_slots <= min(self.max_slots, 2 * workspace.num_partitions):", "if num_slots < 1:")],
      ["test_cuda_decode.py::test_the_fused_launch_is_resolved_as_one_kernel_and_checks_its_slots"]),
    m("cuda-decode-slots-not-passed", "trtllm_diffkv/kernels/decode_attention.py",
      "CUDA decode: the resolved attention launches the workspace's capacity, not the policy's CTAs a row",
      [("self.qk_scale, out, num_slots=slots)", "self.qk_scale, out)")],
      ["test_cuda_decode.py::test_the_resolved_decode_attention_launches_the_policys_ctas_per_batch"]),
    m("cuda-decode-fused-counters-unchecked", CUDA_DECODE, "CUDA decode: a fused launch without row counters",
      [("        if workspace.row_done is None:\n", "        if False:\n")],
      ["test_cuda_decode.py::test_the_fused_launch_is_resolved_as_one_kernel_and_checks_its_slots"]),
    m("cache-release-planned-slot", PAGED_CACHE, "paged cache: a slot of the planned step is released",
      [("        if busy:\n", "        if False:\n")],
      ["test_end_step.py::test_a_slot_of_the_planned_step_is_not_released_until_the_step_ends"]),
    m("plugin-layer-error-keeps-step", PLUGIN_OPS, "composite layer op: a failed layer leaves its step planned",
      [("        cache.discard_step()  # else every", "        pass  # else every")],
      ["test_end_step.py::test_a_failed_composite_layer_op_discards_its_step"]),
    # ------------------------------------------------------------------ the executor's overlap
    m("overlap-stale-input-ids", EXECUTOR, "overlap: the next step's input ids from the host (one token stale)",
      [("launched = self._launch(batch, updates, t0, input_ids=ids, failed=failed)",
        "launched = self._launch(batch, updates, t0, failed=failed)")],
      ["test_overlap.py::test_overlapped_steps_equal_unoverlapped_ones"]),
    m("overlap-lengths-not-noted", EXECUTOR, "overlap: a deferred step leaves its requests' lengths one step behind",
      [("        self.rm.note_lengths(launched.batch)\n", "")],
      ["test_overlap.py::test_overlapped_steps_equal_unoverlapped_ones"]),
    m("overlap-no-reserve", EXECUTOR, "overlap: the in-flight step's worst case stays in the free-page bound",
      [("        self.scheduler.reserve(launched.worst_case_pages)\n", "")],
      ["test_overlap.py::test_overlapped_steps_equal_unoverlapped_ones"]),
    m("overlap-admission-starved", SCHEDULER, "overlap: a waiting request that fits never ends the overlap",
      [("        return head > self.free_estimate + in_flight_pages",
        "        return True")],
      ["test_overlap.py::test_a_request_arriving_during_the_overlap_is_admitted_at_once"]),
    m("runtime-fp16-two-pages-per-row", PAGED_CACHE, "decode worst case: fp16 and uniform formats counted at two pages per row (preempts early)",
      [("low_tier_grows=self.config.tiered)", "low_tier_grows=True)")],
      ["test_executor.py::test_fp16_decode_worst_case_is_one_page_per_row"]),
    m("runtime-one-page-per-row-for-all", PAGED_CACHE, "decode worst case: one page per row for tiered presets too",
      [("low_tier_grows=self.config.tiered)", "low_tier_grows=False)")],
      ["test_executor.py::test_fp16_decode_worst_case_is_one_page_per_row"]),
    m("policy-uncompressed-keeps-quantized-tiers", "trtllm_diffkv/config.py",
      "compress=False with quantized tiers lays pages out quantized",
      [('            object.__setattr__(self, "high", FP16_TIER)\n            object.__setattr__(self, "low", FP16_TIER)\n',
        "            pass\n")],
      ["test_executor.py::test_a_custom_uncompressed_config_is_the_fp16_preset"]),
    m("overlap-tp-forced-on-spawns", "trtllm_diffkv/parallel/launcher.py",
      "overlap: disable_overlap_scheduler=False with tensor parallelism refused only after the ranks start",
      [('        check_overlap_setting(executor_kwargs.get("disable_overlap_scheduler"), tensor_parallel=True)\n', "")],
      ["test_tensor_parallel.py::test_forced_overlap_is_refused_before_any_rank_starts"]),
    m("overlap-bench-setting-dropped", "trtllm_diffkv/evaluation/throughput.py",
      "overlap: the bench's disable_overlap_scheduler never reaches the measured executor",
      [("tokenizer, profile, cuda_graphs, disable_overlap_scheduler)", "tokenizer, profile, cuda_graphs)")],
      ["test_bench.py::test_the_overlap_setting_reaches_the_measured_executor"]),
    # ------------------------------------------------------------------ kernels: write (quantize) and prompt scores
    m("kernels-write-no-clamp", WRITE_KERNEL, "write kernel: codes not clamped to [0, 2**bits - 1]",
      [("code = tl.minimum(tl.maximum(_round_half_even(y), 0.0), QMAX * 1.0).to(tl.int32)",
        "code = _round_half_even(y).to(tl.int32)")], WRITE_KERNEL_TESTS),
    m("kernels-write-scale-divisor", WRITE_KERNEL, "write kernel: scale divides the range by 2**bits",
      [("tl.math.div_rn(hi - lo, tl.full(hi.shape, QMAX, tl.float32))",
        "tl.math.div_rn(hi - lo, tl.full(hi.shape, QMAX + 1, tl.float32))")], WRITE_KERNEL_TESTS),
    m("kernels-prefill-scores-self-masked", PREFILL_KERNELS, "prompt scores: a query's own key masked (< not <=)",
      [("keep = i_mask[:, None] & (t[None, :] <= pos[:, None]) & t_mask[None, :]",
        "keep = i_mask[:, None] & (t[None, :] < pos[:, None]) & t_mask[None, :]")], PREFILL_KERNEL_TESTS),
    m("kernels-prefill-scores-window-shifted", PREFILL_KERNELS, "prompt scores: the scoring window one query early",
      [("    first_q = n - s\n    # queries before", "    first_q = n - s - 1\n    # queries before")],
      PREFILL_KERNEL_TESTS),
    m("kernels-prefill-lse-not-causal", PREFILL_KERNELS, "prompt log-sum-exp over every key (no causal mask)",
      [("keep = i_mask[:, None] & (t[None, :] <= pos[:, None]) & (t < k_end)[None, :]",
        "keep = i_mask[:, None] & (t < k_end)[None, :]")], PREFILL_KERNEL_TESTS),
    # ------------------------------------------------------------------ issue 43: survivors of an outside round
    m("paged-staging-exact-fill-refused", STAGING, "chunked staging: a prompt whose staging exactly fills "
      "chunk_staging_bytes is refused (<= became <, in the one shared rule)",
      [("    return held_bytes + new_bytes <= limit_bytes\n", "    return held_bytes + new_bytes < limit_bytes\n")],
      STAGING_TESTS),
    m("paged-staging-plan-own-rule", PAGED_CACHE, "chunked staging: the cache's plan refuses an exact fill that the "
      "scheduler admits (its own check, > became >=): the step is retried forever, every decode stalls",
      [("        if staged and not self.staging_fits(staged):\n",
        "        if staged and self.staging_bytes_used() + staged >= self.staging_limit_bytes:\n")],
      STAGING_TESTS[1:] + STAGING_TESTS[:1]),
    m("runtime-staging-admission-own-rule", SCHEDULER, "chunked staging: the scheduler refuses an exact fill that the "
      "cache would plan (its own check): the prompt waits forever",
      [("                if not self.rm.staging_fits(staging):",
        "                if staging >= self.rm.cache.staging_limit_bytes - self.rm.cache.staging_bytes_used():")],
      STAGING_TESTS[1:]),
    m("runtime-top-alternative-ranks-0-based", SAMPLING, "logprobs: the top alternatives ranked from 0 (the sampled "
      "token from 1)", [("entry.setdefault(alternative, Logprob(top_logprobs[j], j + 1))",
                         "entry.setdefault(alternative, Logprob(top_logprobs[j], j))")],
      ["test_sampling.py::test_every_rank_is_the_1_based_place_in_a_sort_of_the_whole_distribution"]),
    m("serve-chat-top-logprobs-unsorted", SERVER, "chat top_logprobs in entry order: a sampled token first, the k-th "
      "alternative dropped", [("        tops = sorted(entry.items(), key=_rank)[:top]\n",
                               "        tops = list(entry.items())[:top]\n")],
      ["test_openai_choice_rules.py::test_a_sampled_chat_choice_lists_the_k_most_likely_tokens_in_rank_order"]),
    m("runtime-best-of-metrics-first-child", OUTPUTS, "best_of: the group reports the first child's metrics, a dropped "
      "sequence's", [("chosen = failed if failed is not None else finals[order[0]]",
                      "chosen = failed if failed is not None else finals[0]")], ["test_request_group.py"]),
    m("serve-best-of-index-stride", SERVER, "best_of > n over several prompts: choice indices stride by best_of",
      [('choices.append({"index": p * params.n + j,', 'choices.append({"index": p * k + j,')], CHOICE_TESTS),
    m("serve-best-of-usage-per-sequence", SERVER, "best_of = 4, n = 1: prompt_tokens counts each prompt 4 times",
      [("usage = request.state.usage = _usage(finals, len(finals) if prompt_only else 0, k)",
        "usage = request.state.usage = _usage(finals, len(finals) if prompt_only else 0, params.n)")], CHOICE_TESTS),
    m("serve-stream-usage-per-sequence", SERVER, "streamed usage with n > 1 counts the prompt once per sequence",
      [("                                     sequences_per_prompt=len(children))",
        "                                     sequences_per_prompt=1)")],
      ["test_openai_choice_rules.py::test_streamed_usage_equals_the_unstreamed_usage"]),
    m("serve-echo-usage-counts-dropped", SERVER, "echo with max_tokens 0 counts the dropped generated tokens",
      [("usage = request.state.usage = _usage(finals, len(finals) if prompt_only else 0, k)",
        "usage = request.state.usage = _usage(finals, 0, k)")],
      ["test_openai_choice_rules.py::test_echo_with_max_tokens_zero_counts_no_completion_token"]),
    m("serve-usage-tier-fractions-averaged", SERVER, "usage: tier fractions of several sequences averaged, not "
      "weighted by FP16 bytes", [("        usage[name] = (sum(v * w for v, w in zip(values, fp16)) / sum(fp16)",
                                  "        usage[name] = (sum(values) / len(values)")], CHOICE_TESTS),
    m("serve-tpot-divides-by-tokens", METRICS, "TPOT histogram divides by the tokens, not the intervals after the "
      "first", [("self.tpot.observe((end - first) / (tokens - 1))", "self.tpot.observe((end - first) / tokens)")],
      ["test_serving_metrics.py"]),
    m("eval-budget-floored", BASELINES, "eviction baselines: a non-integer budget floored (int) instead of rounded",
      [("max(minimum_tokens, round(budget_fraction * prompt_len))",
        "max(minimum_tokens, int(budget_fraction * prompt_len))")], BASELINE_TESTS),
    m("eval-h2o-chunk-offset-lost", BASELINES, "chunked causal probabilities lose the chunk offset (H2O wrong past "
      "256 prompt tokens)", [("rows = torch.arange(first_query_pos + start, first_query_pos + start + qc.shape[1],",
                              "rows = torch.arange(first_query_pos, first_query_pos + qc.shape[1],")],
      BASELINE_TESTS),
    m("eval-calibration-top1-tolerance-strict", CALIBRATION, "calibration: a setting exactly at the top-1 tolerance "
      "is excluded (< became <=)", [('if row["teacher_forced_top1"] < yard["teacher_forced_top1"] - max_top1_drop:',
                                     'if row["teacher_forced_top1"] <= yard["teacher_forced_top1"] - max_top1_drop:')],
      CALIBRATION_TESTS),
    m("eval-calibration-kl-tolerance-strict", CALIBRATION, "calibration: a setting exactly at the KL tolerance is "
      "excluded (> became >=)", [('if row["mean_kl_nats"] > max_kl_nats:', 'if row["mean_kl_nats"] >= max_kl_nats:')],
      CALIBRATION_TESTS),
    m("eval-teacher-forced-windows-dropped", "trtllm_diffkv/evaluation/quality.py", "teacher-forced points: the "
      "reference cache built without the model's sliding windows (DiffKVConfig.for_model skipped)",
      [("DiffKVReferenceCache(cfg.for_model(mc), ", "DiffKVReferenceCache(cfg, ")],
      ["test_eval_quality.py::test_teacher_forced_points_apply_a_models_sliding_windows"]),
    m("eval-windowed-baselines-kept", "trtllm_diffkv/commands/eval.py", "eval keeps a baseline cache that applies "
      "no window on a model with sliding-window layers", [("        if windowed and point.kv_config is None:",
                                                           "        if False:")],
      ["test_eval_quality.py::test_points_a_model_cannot_take_are_dropped_or_refused"]),
    m("eval-calibration-grid-drops-equal", CALIBRATION, "calibration grid: alpha_low == alpha_high silently dropped",
      [("        if al <= ah:\n", "        if al < ah:\n")], CALIBRATION_TESTS),
    m("eval-calibration-greedy-prefix-off-by-one", CALIBRATION, "calibration: the greedy common prefix counts the "
      "first differing token", [("return differs[0] if differs else", "return differs[0] + 1 if differs else")],
      HELD_OUT_TESTS),
    m("eval-calibration-prefix-criterion-dropped", CALIBRATION, "calibration: the greedy prefix tolerance never "
      "rejects", [('        failed.append("greedy_prefix_fraction")', "        pass")], HELD_OUT_TESTS),
    m("eval-calibration-identical-any-prefix", CALIBRATION, "calibration: a prompt counts as greedy-identical once "
      "its first token agrees", [("float(p == t)", "float(p > 0)")], HELD_OUT_TESTS),
    m("eval-calibration-split-overlaps", CALIBRATION, "calibration: the held-out prompts stay in the chosen-on part",
      [("return [i for i in range(count) if i not in held], sorted(held)", "return list(range(count)), sorted(held)")],
      HELD_OUT_TESTS),
    m("eval-calibration-held-out-never-fails", CALIBRATION, "calibration: the held-out check passes whatever it "
      "measures", [('return {**figures, "failed": failed, "pass": not failed}',
                    'return {**figures, "failed": failed, "pass": True}')], HELD_OUT_TESTS),
    m("parallel-nonfinite-rank-0-only", TP_HOOK, "tensor parallelism: non-finite flags from rank 0 only (a NaN in "
      "rank 1's KV heads no longer fails the request)",
      [("tokens, flags = gathered[0, :n], gathered[:, n:-2].amax(0)",
        "tokens, flags = gathered[0, :n], gathered[0, n:-2]")], TP_STATUS_TESTS),
    m("policy-threshold-fp32-division", POLICY, "thresholds alpha / N divided in fp32 (one ulp off the decision "
      "kernel's fp64 quotient)", [("return (alpha / torch.as_tensor(length, dtype=torch.float64)).float()",
                                   "return (alpha / torch.as_tensor(length, dtype=torch.float32)).float()")],
      ["test_policy.py::test_an_importance_exactly_on_a_threshold_is_tiered_by_the_fp64_quotient"] + DECISION_TESTS),
    m("kernels-write-round-half-up", WRITE_KERNEL, "write kernel: a code exactly half-way rounds up, not to even",
      [("    up = (d > 0.5) | ((d == 0.5) & odd)\n", "    up = d >= 0.5\n")], WRITE_KERNEL_TESTS),
    m("paged-failed-plan-keeps-reservation", PAGED_CACHE, "a plan failing after its reservation keeps the new "
      "prompts' pages and staging", [("            self.release([slots[i] for i in first_chunks])\n",
                                      "            pass\n")], FAILED_PLAN_TESTS),
    m("paged-failed-plan-releases-decoding", PAGED_CACHE, "a failed plan also frees its decoding slots (their "
      "callers' to release)", [("            self.release([slots[i] for i in first_chunks])\n",
                                "            self.release(slots)\n")], FAILED_PLAN_TESTS),
    m("runtime-refused-step-retried", EXECUTOR, "a step the cache refuses (not for pages) is put back and retried "
      "instead of failing its requests",
      [("        except Exception as exc:  # noqa: BLE001 - the cache refused the step (nothing changed): its requests fail\n"
        "            for request in requests:\n                fail(request, exc)\n",
        "        except Exception as exc:  # noqa: BLE001 - the cache refused the step (nothing changed): its requests fail\n"
        "            self.scheduler.unschedule(batch)\n")], REFUSED_STEP_TESTS),
    m("runtime-out-of-pages-step-kept", EXECUTOR, "a step refused for pages leaves its new prompts running (never "
      "prefilled)", [("        except OutOfPagesError:  # the estimate was stale: retry next step, nothing changed\n"
                      "            self.scheduler.unschedule(batch)\n",
                      "        except OutOfPagesError:  # the estimate was stale: retry next step, nothing changed\n")],
      REFUSED_STEP_TESTS[1:]),
    # ------------------------------------------------------------------ key rotation
    m("rotation-shard-first-head-zero", "trtllm_diffkv/parallel/sharding.py",
      "tensor parallelism: every rank rotates with global KV head 0's matrices",
      [("    model._first_kv_head = group.rank * local_config.num_kv_heads\n", "    model._first_kv_head = 0\n")],
      ["test_tensor_parallel.py::test_each_rank_rotates_with_its_global_kv_heads_matrices"]),
    m("rotation-in-place-rebinds-v", "trtllm_diffkv/model/rotation.py",
      "in-place rotation rebinds v_proj instead of writing it (the fused q/k/v rows stay unrotated)",
      [("            attn.v_proj.weight.copy_(wv)\n", "            attn.v_proj.weight.data = wv\n")],
      ["test_key_rotation.py::test_in_place_rotation_equals_the_copy_and_keeps_one_set_of_weights"]),
    # ------------------------------------------------------------------ TensorRT-LLM adapter (issue 42)
    m("trtllm-adapter-rotation-seed-dropped", TRTLLM_MANAGER,
      "TensorRT-LLM adapter: the backend rotates with seed 0 whatever the config's rotation_seed",
      [("key_rotation_matrices(mc.num_layers, mc.num_kv_heads, mc.head_dim,\n"
        "                                                    self.kv_config.rotation_seed)",
        "key_rotation_matrices(mc.num_layers, mc.num_kv_heads, mc.head_dim)")],
      ["test_trtllm_compression_adapter.py::test_rotation_inside_tensorrt_llm_equals_the_folded_model"]),
    m("trtllm-adapter-exact-fit-pool-refused", TRTLLM_MANAGER,
      "TensorRT-LLM adapter: a pool that exactly fits one max_seq_len prefill is refused at bind (>= for >)",
      [("        if need > total:  # else a prompt TensorRT-LLM admits",
        "        if need >= total:  # else a prompt TensorRT-LLM admits")],
      ["test_trtllm_compression_adapter.py::test_a_pool_that_exactly_fits_one_max_seq_len_prefill_is_accepted"]),
    m("trtllm-adapter-context-parallel-accepted", TRTLLM_MANAGER,
      "TensorRT-LLM adapter: cp_size left out of the parallelism refusal (context parallelism accepted)",
      [('for name in ("tp_size", "pp_size", "cp_size"):', 'for name in ("tp_size", "pp_size"):')],
      ["test_trtllm_compression_adapter.py::test_only_the_unsupported_parallel_size_is_refused",
       "test_trtllm_compression_adapter.py::test_refused_at_admission"]),
    m("trtllm-adapter-gemma-accepted", TRTLLM_MANAGER,
      "TensorRT-LLM adapter: a Gemma 3 config (parsed as Gemma3Config) served as if it were a Llama decoder",
      [("    if type(model_config) is not ModelConfig:  # another family", "    if False:  # another family")],
      ["test_trtllm_compression_adapter.py::test_unsupported_models_refused"]),
    # ------------------------------------------------------------------ sliding-window layers (Gemma 3)
    m("sliding-mask-off-by-one", POLICY, "window mask: a query also attends the key W positions back",
      [("mask &= kp > qp - sliding_window_tokens", "mask &= kp >= qp - sliding_window_tokens")], SLIDING_TESTS),
    m("sliding-prefill-mask-missing", ATTENTION_API,
      "prompt attention ignores the window (plain causal)",
      [("    window = sliding_window_tokens\n", "    window = None\n")], SLIDING_TESTS),
    m("sliding-prompt-keeps-one-more", POLICY, "prompt tiers of a sliding layer keep W + 1 tokens",
      [("tier[:, max(prompt_len - sliding_window_tokens, 0):] = TIER_HIGH",
        "tier[:, max(prompt_len - sliding_window_tokens - 1, 0):] = TIER_HIGH")], SLIDING_TESTS),
    m("sliding-reference-never-prunes", CACHE, "reference cache: the token leaving the window stays",
      [("            self._slide(layer_idx, pos)", "            pass")], SLIDING_TESTS),
    m("sliding-ring-off-by-one", DECISIONS, "paged decode: the new token replaces the window's second-oldest token",
      [("ring = (pos - (prompt_len.long() - w).clamp(min=0)) % w",
        "ring = (pos + 1 - (prompt_len.long() - w).clamp(min=0)) % w")], SLIDING_TESTS),
    m("sliding-uniform-prompt-keeps-all", CACHE,
      "reference cache, uniform presets (k8v4, k8v8): a sliding layer keeps the prompt tokens older than the window",
      [("self._store_tiered(layer_idx, n, kh, vh, untiered)",
        "self._store_tiered(layer_idx, n, kh, vh, torch.full_like(untiered, TIER_HIGH))")], SLIDING_TESTS),
    m("sliding-paged-prompt-window-off-by-one", PREFILL, "paged prefill keeps W - 1 tokens of a sliding layer",
      [("in_window = (p.t.long()[None, :] >= p.prompt_tokens[None, :] - w)",
        "in_window = (p.t.long()[None, :] > p.prompt_tokens[None, :] - w)")], SLIDING_TESTS),
    m("sliding-chunk-mask-missing", PREFILL, "chunked prefill: the chunks attend without the window",
      [('chunk_causal_attention(qi, kf, vf, start, cache.sm_scale, window.get("sliding_window_tokens"))',
        "chunk_causal_attention(qi, kf, vf, start, cache.sm_scale, None)")], SLIDING_TESTS),
    m("sliding-kernel-ring-off-by-one", DECISION_KERNEL, "decision kernel: the ring slot one ahead",
      [("w_new = tl.where(w_append, h_count, (pos - tl.maximum(prompt_len - w_safe, 0)) % w_safe)",
        "w_new = tl.where(w_append, h_count, (pos + 1 - tl.maximum(prompt_len - w_safe, 0)) % w_safe)")],
      DECISION_TESTS),
    m("sliding-kernel-scores-unwindowed", PREFILL_KERNELS, "prompt scores: the window mask dropped in the score pass",
      [("                keep = keep & (t[None, :] > pos[:, None] - WINDOW)\n            p = tl.where(keep",
        "                pass\n            p = tl.where(keep")], ["test_kernels_prefill_scores.py::test_sliding_window"]),
    m("gemma-norm-without-one", GEMMA3, "Gemma RMSNorm scales by w, not (1 + w)",
      [("(normed * (1.0 + self.weight.float()))", "(normed * self.weight.float())")], GEMMA_TESTS),
    m("gemma-query-scale-inverted", GEMMA3, "query scale sqrt(scalar / head_dim)",
      [("ratio = config.head_dim / config.query_pre_attn_scalar", "ratio = config.query_pre_attn_scalar / config.head_dim")],
      GEMMA_TESTS),
    m("gemma-local-rope-global-theta", GEMMA3, "sliding layers use the global RoPE base",
      [("rope = {False: self.model.rotary_emb(positions, h.dtype), True: self.model.rotary_emb_local(positions, h.dtype)}",
        "rope = {False: self.model.rotary_emb(positions, h.dtype), True: self.model.rotary_emb(positions, h.dtype)}")],
      GEMMA_TESTS),
    # ------------------------------------------------------------------ GGUF conversion
    m("gguf-tokenizer-split-word-passes", GGUF_CONVERT, "tokenizer check: a vocabulary word split into pieces passes",
      [("if whole and not set(whole) & set(ids):", "if whole and not set(whole) | set(ids):")], GGUF_TESTS),
    m("gguf-tokenizer-missing-bos-passes", GGUF_CONVERT, "tokenizer check: a missing BOS passes",
      [("if first != [bos]:", "if not first:")], GGUF_TESTS),
    m("gguf-tokenizer-id-names-unchecked", GGUF_CONVERT, "tokenizer check: ids are not compared with the file's names",
      [("if not 0 <= i < len(vocab) or vocab[i]", "if not 0 <= i < len(vocab) or name")], GGUF_TESTS),
    m("gguf-stale-folder-kept", LOADER, "a folder an older converter made is used as it is",
      [("if made_by >= GGUF_CONVERSION_VERSION:", "if made_by >= 0:")], GGUF_TESTS),
    m("gguf-failed-reconversion-loses-folder", LOADER, "a failed reconversion does not put the old folder back",
      [("if not target.exists():\n", "if False:\n")], GGUF_TESTS),
]


def snapshot(source: str) -> str:
    """A throwaway copy of the repository under /tmp; returns its path."""
    dest = tempfile.mkdtemp(prefix="diffkv-mutation-")
    repo = os.path.join(dest, "repo")
    ignore = shutil.ignore_patterns(".git", "__pycache__", ".hypothesis", ".pytest_cache", "*.egg-info", "build", "dist",
                                    ".carry_*")
    if source == "worktree":
        shutil.copytree(ROOT, repo, ignore=ignore)
        return repo
    os.makedirs(repo)
    archive = subprocess.run(["git", "-C", ROOT, "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", repo], input=archive, check=True)
    shutil.rmtree(os.path.join(repo, "tests"))
    shutil.copytree(os.path.join(ROOT, "tests"), os.path.join(repo, "tests"), ignore=ignore)
    return repo


def resolve_module(repo: str, path: str) -> str:
    """``path`` if it exists in ``repo``, else the one module of that file name under the same package folder
    (e.g. ``trtllm_diffkv/generation/reference.py`` after a move to ``trtllm_diffkv/generation/engine.py``)."""
    if os.path.exists(os.path.join(repo, path)):
        return path
    top, name = path.split("/")[0], os.path.basename(path)
    found = sorted(os.path.relpath(os.path.join(d, name), repo)
                   for d, _, files in os.walk(os.path.join(repo, top)) if name in files)
    if len(found) != 1:
        raise SystemExit(f"module {path}: {len(found)} files named {name} under {top}/ ({found})")
    return found[0]


def resolve_tests(repo: str, tests) -> list[str]:
    """pytest arguments for test names ``file.py`` or ``file.py::test`` (the file found anywhere under tests/)."""
    files = {}
    for d, _, names in os.walk(os.path.join(repo, "tests")):
        for name in names:
            if name.startswith("test_") and name.endswith(".py"):
                files.setdefault(name, []).append(os.path.relpath(os.path.join(d, name), repo))
    out = []
    for test in tests:
        name, sep, node = test.partition("::")
        where = files.get(os.path.basename(name), [])
        if len(where) != 1:
            raise SystemExit(f"test file {name}: {len(where)} matches under tests/ ({where})")
        out.append(where[0] + sep + node)
    return out


def run_tests(repo: str, tests, timeout_s: float) -> tuple[str, str, float]:
    """Run ``tests`` in ``repo``: ``("pass" | "fail" | "timeout" | "error", first failing test or note, seconds)``."""
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONDONTWRITEBYTECODE="1", DIFFKV_PAGE_FUZZ_OPS=os.environ.get("DIFFKV_PAGE_FUZZ_OPS", "3000"))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not slow and not gpu",
           "-o", "addopts=", *resolve_tests(repo, tests)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timeout", f"no result in {timeout_s:.0f} s", time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return "pass", "", seconds
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", out, re.M)
    if failed:
        return "fail", failed[0].split("/")[-1], seconds
    return "error", (out.strip().splitlines() or ["?"])[-1][:200], seconds


def check_imports_copy(repo: str) -> None:
    """Make sure the copy's package, not the editable install of the checkout, is what the tests import."""
    env = dict(os.environ, PYTHONPATH=repo)
    path = subprocess.run([sys.executable, "-c", "import trtllm_diffkv; print(trtllm_diffkv.__file__)"],
                          cwd=repo, env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not path.startswith(repo):
        raise SystemExit(f"the copy imports {path}, not its own package under {repo}")


def mutate(text: str, mutation: Mutation) -> str | None:
    """The module text with the mutation's replacements; None when a snippet is not found as required."""
    for old, new, *mode in mutation.replacements:
        count = text.count(old)
        if count == 0 or (count != 1 and mode != ["all"]):
            return None
        text = text.replace(old, new)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="run only mutations whose id contains this")
    parser.add_argument("--area", action="append", choices=sorted(AREAS),
                        help="run only this area's mutations (repeatable)")
    parser.add_argument("--source", choices=["head", "worktree"], default="head")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per mutation")
    parser.add_argument("--budget", type=int, default=1200,
                        help="seconds for the whole check: mutations not started by then are reported NOT-RUN")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--keep", action="store_true", help="keep the /tmp copy")
    parser.add_argument("--tests", nargs="+", help="run these test files for every mutation instead of its own list")
    args = parser.parse_args()
    t_start = time.perf_counter()
    chosen = [mu for mu in MUTATIONS if args.k in mu.id and (not args.area or mu.area in args.area)]
    if args.tests:
        chosen = [Mutation(mu.id, mu.path, mu.description, mu.replacements, tuple(args.tests)) for mu in chosen]
    if args.list:  # against the checkout's modules: STALE marks a snippet that no longer matches
        for mu in chosen:
            text = open(os.path.join(ROOT, resolve_module(ROOT, mu.path))).read()
            stale = "STALE " if mutate(text, mu) is None else ""
            print(f"{stale}{mu.id:42s} {mu.path:44s} {mu.description}")
        return 0
    repo = snapshot(args.source)
    check_imports_copy(repo)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"copy: {repo} (source {args.source}, HEAD {commit}); {len(chosen)} mutations", flush=True)
    where = {mu.path: resolve_module(repo, mu.path) for mu in chosen}
    pristine = {p: open(os.path.join(repo, where[p])).read() for p in sorted(where)}
    all_tests = list(dict.fromkeys(t for mu in chosen for t in mu.tests))
    status, note, baseline_s = run_tests(repo, all_tests, args.timeout * 3)
    print(f"baseline ({len(all_tests)} test selections): {status} {note} in {baseline_s:.0f} s", flush=True)
    if status != "pass":
        print("the unmutated copy must pass its tests first", file=sys.stderr)
        return 2
    results = []
    for mu in chosen:
        text = mutate(pristine[mu.path], mu)
        elapsed = time.perf_counter() - t_start
        if text is None:
            result = dict(outcome="STALE", test="", seconds=0.0)
        elif elapsed > args.budget:
            result = dict(outcome="NOT-RUN", test=f"budget of {args.budget} s spent", seconds=0.0)
        else:
            with open(os.path.join(repo, where[mu.path]), "w") as f:
                f.write(text)
            status, note, seconds = run_tests(repo, mu.tests, min(args.timeout, max(args.budget - elapsed, 30)))
            result = dict(outcome={"fail": "caught", "pass": "SURVIVED"}.get(status, status), test=note,
                          seconds=round(seconds, 1))
            with open(os.path.join(repo, where[mu.path]), "w") as f:
                f.write(pristine[mu.path])
        result = dict(id=mu.id, area=mu.area, path=where[mu.path], description=mu.description, **result)
        results.append(result)
        print(f"{result['outcome']:8s} {mu.id:42s} {result['test']} ({result['seconds']} s)", flush=True)
    total_s = time.perf_counter() - t_start
    summary = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit,
                   source=args.source, total_s=round(total_s, 1), baseline_s=round(baseline_s, 1), results=results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if args.markdown:
        print("\n| area | mutations | caught | survived or not run |\n|---|---|---|---|")
        for area in AREAS:
            rows = [r for r in results if r["area"] == area]
            if rows:
                caught = sum(r["outcome"] == "caught" for r in rows)
                print(f"| {AREAS[area]} | {len(rows)} | {caught} | {len(rows) - caught} |")
        print("\n| mutation | file | planted bug | outcome | first failing test | s |\n|---|---|---|---|---|---|")
        for r in results:
            print(f"| `{r['id']}` | `{r['path'].split('/')[-1]}` | {r['description']} | {r['outcome']} | "
                  f"`{r['test']}` | {r['seconds']} |")
    if not args.keep:
        shutil.rmtree(os.path.dirname(repo), ignore_errors=True)
    bad = [r for r in results if r["outcome"] != "caught"]
    print(f"\n{len(results) - len(bad)} of {len(results)} mutations caught in {total_s:.0f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
