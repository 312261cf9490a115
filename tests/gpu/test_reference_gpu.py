"""The reference DiffKV path on a GPU gives what it gives on the CPU (run on the device)."""
import pytest
import torch

from trtllm_diffkv.config import get_preset
from trtllm_diffkv.engine import ReferenceGenerator
from conftest import tiny_llama

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", ["default", "llama3-8b", "fp16"])
def test_teacher_forced_logits_gpu_equal_cpu(preset):
    cpu_model = tiny_llama()
    gpu_model = tiny_llama().cuda()
    prompt = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    steps = torch.randint(0, 512, (80,), generator=torch.Generator().manual_seed(2)).tolist()
    results = []
    for model in (cpu_model, gpu_model):
        gen = ReferenceGenerator(model, None, model.config, get_preset(preset))
        cache = gen.new_cache(len(prompt) + len(steps))
        dev = gen.device
        logits = [model(torch.tensor(prompt, device=dev), torch.arange(len(prompt), device=dev), cache,
                        logits_indices=torch.tensor([len(prompt) - 1], device=dev))[-1].cpu()]
        for i, tok in enumerate(steps):
            logits.append(model(torch.tensor([tok], device=dev), torch.tensor([len(prompt) + i], device=dev),
                                cache)[-1].cpu())
        results.append((torch.stack(logits), cache.stats()))
    (cpu_logits, cpu_stats), (gpu_logits, gpu_stats) = results
    rel = (gpu_logits - cpu_logits).abs().max() / cpu_logits.abs().max()
    assert float(rel) < 1e-3
    assert abs(gpu_stats.kv_memory_fraction - cpu_stats.kv_memory_fraction) < 0.01
