"""Near-lossless on the real default model (issue acceptance): the ``default`` preset keeps greedy
output identical to ``fp16`` for the first 32 new tokens on most >= 500-token prompts, at a KV
memory fraction below 0.4.

Prompts: the product's path — the chat template around "Complete the last function." and a
HumanEval few-shot block (3 solved problems + 1 to complete, problems 0-99); the first ten of at
least 500 tokens. Thresholds were calibrated on problems 100+ (docs/CALIBRATION.md, which also
records raw-completion prompts and the quantization-only baseline: near-tied logits flip some
greedy tokens under any perturbation, K8V4 alone included)."""
import pytest

from conftest import humaneval_prompts
from trtllm_diffkv.config import get_preset
from trtllm_diffkv.engine import ReferenceGenerator

pytestmark = pytest.mark.slow
NEW_TOKENS = 32
NUM_PROMPTS = 10


def test_default_preset_near_lossless_on_default_model(default_model):
    model, tokenizer, model_config = default_model
    fp16 = ReferenceGenerator(model, tokenizer, model_config, get_preset("fp16"))
    diffkv = ReferenceGenerator(model, tokenizer, model_config, get_preset("default"))
    candidates = [fp16.encode("Complete the last function.\n\n" + p) for p in humaneval_prompts(0, 25)]
    prompts = [ids for ids in candidates if len(ids) >= 500][:NUM_PROMPTS]
    assert len(prompts) == NUM_PROMPTS
    identical, fractions = [], []
    for ids in prompts:
        ref = fp16.generate_ids(ids, NEW_TOKENS)
        out = diffkv.generate_ids(ids, NEW_TOKENS)
        assert ref.error is None and out.error is None
        assert ref.kv_memory_fraction == 1.0
        n = min(NEW_TOKENS, len(ref.token_ids))
        identical.append(out.token_ids[:n] == ref.token_ids[:n])
        fractions.append(out.kv_memory_fraction)
    print(f"\nidentical first {NEW_TOKENS} tokens: {sum(identical)}/{len(prompts)} {identical}; "
          f"kv_memory_fraction: {[round(f, 3) for f in fractions]}; prompt tokens {[len(p) for p in prompts]}")
    assert sum(identical) > len(prompts) / 2
    assert max(fractions) < 0.4
