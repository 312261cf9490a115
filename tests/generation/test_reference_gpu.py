"""The reference DiffKV path on a GPU against the independent float64 oracle (run on the device).

Not "the same code on two devices": every prefill and decode step of the cache
running on CUDA is checked by :class:`oracle.checked_cache.CheckedCache`
(dense float64 attention over the kept tokens on the CPU, loop-based tier
rules, per-group quantization bounds, memory accounting), and with the
``fp16`` preset the logits of a teacher-forced run equal those of dense
float64 attention at every position.
"""
import pytest
import torch

from oracle import attention
from oracle.checked_cache import CheckedCache
from oracle.drive import spiky_tiny_llama, teacher_forced
from trtllm_diffkv.cache import DiffKVReferenceCache
from trtllm_diffkv.config import get_preset

pytestmark = pytest.mark.gpu

def _tokens(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("preset", ["diffkv", "llama3-8b", "qwen2.5-32b", "k8v4", "fp16"])
def test_gpu_cache_every_step_matches_the_float64_oracle(preset):
    model = spiky_tiny_llama().cuda()
    cfg = model.config
    prompt, steps = _tokens(100, 1), _tokens(40, 2)
    cache = DiffKVReferenceCache(get_preset(preset), cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 len(prompt) + len(steps), device="cuda")
    checked = CheckedCache(cache, atol=1e-4)
    with torch.inference_mode():
        teacher_forced(model, checked, prompt, steps)
    assert checked.layer_len == [140] * cfg.num_layers and checked.ambiguous == 0
    checked.assert_stats()


def test_gpu_fp16_preset_teacher_forced_equals_dense_attention_at_every_position():
    model = spiky_tiny_llama().cuda()
    cfg = model.config
    tokens = _tokens(120, 3)
    cache = DiffKVReferenceCache(get_preset("fp16"), cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 len(tokens), device="cuda")
    with torch.inference_mode():
        cached = teacher_forced(model, CheckedCache(cache, atol=1e-4), tokens[:80], tokens[80:]).cpu()
        dense = model(torch.tensor(tokens, device="cuda"), torch.arange(len(tokens), device="cuda"),
                      attention.DenseBackend()).cpu()
    torch.testing.assert_close(cached, dense, rtol=1e-3, atol=1e-3)
