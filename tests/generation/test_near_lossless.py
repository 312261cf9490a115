"""Near-lossless on the real default model: ``diffkv`` (the tiered preset) against ``fp16``.

Prompts: the product's path — the chat template around "Complete the last function." and a
HumanEval few-shot block (3 solved problems + 1 to complete, problems 0-99); the first ten of at
least 500 tokens. Thresholds were calibrated on problems 100+ (docs/CALIBRATION.md).

What is asserted carries margin: teacher-forced top-1 agreement and mean KL divergence against
``fp16`` over 10 prompts x 32 steps (both caches fed fp16's greedy continuation). The bounds were
set from runs under two dependency sets (docs/CALIBRATION.md, "Test prompts"). The number of
prompts whose first 32 greedy tokens are identical is printed, not asserted: it flips on
near-tied logits (one dependency upgrade moved it from 6/10 to 5/10 with no code change).

Run ``python3 tests/generation/test_near_lossless.py`` to print the figures as JSON.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import humaneval_prompts  # noqa: E402
from trtllm_diffkv.evaluation.accuracy import compare_to_reference, teacher_forced_logits  # noqa: E402
from trtllm_diffkv.config import get_preset  # noqa: E402
from trtllm_diffkv.generation.reference import ReferenceGenerator  # noqa: E402

pytestmark = pytest.mark.slow
NEW_TOKENS = 32
NUM_PROMPTS = 10
# Bounds with margin over what was measured (docs/CALIBRATION.md, "Test prompts"): the default
# preset gave top-1 0.981 (314/320 steps) and mean KL 0.0076 nats under both dependency sets
# (torch 2.13 CPU with transformers 5.24 / tokenizers 0.23.3, and with 4.57.3 / 0.22.1).
MIN_TOP1_AGREEMENT = 0.95
MAX_MEAN_KL_NATS = 0.03
MAX_KV_MEMORY_FRACTION = 0.4


def near_lossless_figures(default_model, preset: str = "diffkv") -> dict:
    """Teacher-forced top-1, mean KL, greedy identity and memory of ``preset`` against ``fp16``."""
    model, tokenizer, model_config = default_model
    fp16 = ReferenceGenerator(model, tokenizer, model_config, get_preset("fp16"))
    diffkv = ReferenceGenerator(model, tokenizer, model_config, get_preset(preset))
    candidates = [fp16.encode("Complete the last function.\n\n" + p) for p in humaneval_prompts(0, 25)]
    prompts = [ids for ids in candidates if len(ids) >= 500][:NUM_PROMPTS]
    assert len(prompts) == NUM_PROMPTS
    per_prompt = []
    for ids in prompts:
        comparison, forced = compare_to_reference(fp16, diffkv, ids, NEW_TOKENS)
        out = diffkv.generate_ids(ids, NEW_TOKENS)
        assert out.error is None, out.error
        n = min(NEW_TOKENS, len(forced))
        per_prompt.append({
            "prompt_tokens": len(ids), "steps": comparison.steps, "top1": comparison.top1_agreement,
            "mean_kl_nats": comparison.mean_kl_nats, "max_kl_nats": comparison.max_kl_nats,
            "greedy_identical": out.token_ids[:n] == forced[:n], "kv_memory_fraction": out.kv_memory_fraction,
        })
    steps = sum(p["steps"] for p in per_prompt)
    return {
        "preset": preset,
        "versions": {"torch": torch.__version__, "transformers": _version("transformers"),
                     "tokenizers": _version("tokenizers")},
        "top1_agreement": sum(p["top1"] * p["steps"] for p in per_prompt) / steps,
        "mean_kl_nats": sum(p["mean_kl_nats"] * p["steps"] for p in per_prompt) / steps,
        "greedy_identical_prompts": sum(p["greedy_identical"] for p in per_prompt),
        "max_kv_memory_fraction": max(p["kv_memory_fraction"] for p in per_prompt),
        "per_prompt": per_prompt,
    }


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def test_diffkv_preset_near_lossless_on_default_model(default_model):
    figures = near_lossless_figures(default_model)
    print("\n" + json.dumps({k: v for k, v in figures.items() if k != "per_prompt"}))
    assert figures["top1_agreement"] >= MIN_TOP1_AGREEMENT
    assert figures["mean_kl_nats"] <= MAX_MEAN_KL_NATS
    assert figures["max_kv_memory_fraction"] < MAX_KV_MEMORY_FRACTION


def test_fp16_teacher_forcing_is_exactly_fp16(default_model):
    """The measure itself: fp16 against fp16 is top-1 1.0 and KL 0 (so the bounds above measure compression)."""
    model, tokenizer, model_config = default_model
    fp16 = ReferenceGenerator(model, tokenizer, model_config, get_preset("fp16"))
    ids = fp16.encode("Complete the last function.\n\n" + humaneval_prompts(0, 1)[0])
    comparison, forced = compare_to_reference(fp16, fp16, ids, 8)
    assert comparison.top1_agreement == 1.0 and comparison.mean_kl_nats < 1e-9
    # Row i predicts forced[i]: the greedy continuation is the argmax of every row.
    assert teacher_forced_logits(fp16, ids, forced).argmax(-1).tolist() == forced


if __name__ == "__main__":  # print the figures, e.g. under another dependency set
    from trtllm_diffkv.model import load_model

    loaded = load_model(None, device="cpu", dtype=torch.float32)
    for name in sys.argv[1:] or ["diffkv", "k8v4"]:
        print(json.dumps(near_lossless_figures(loaded, name)), flush=True)
