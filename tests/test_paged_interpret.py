"""The paged cache on its Triton path (write kernels, read-path kernels, TritonPageManager) under the
Triton interpreter, step by step against the reference cache (CI, no GPU).

``TRITON_INTERPRET=1`` must be set before Triton is imported, so the test
runs this file as a script in a fresh interpreter process. Shapes are tiny:
interpreted programs are slow.
"""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch

    from trtllm_diffkv.config import DiffKVConfig, get_preset
    from trtllm_diffkv.model import LlamaForCausalLM, ModelConfig
    from trtllm_diffkv.paged.testing import patch_interpreter_for_numpy_2_4, run_lockstep

    patch_interpreter_for_numpy_2_4()
    cfg = ModelConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, max_position_embeddings=256)
    g = torch.Generator().manual_seed(0)
    model = LlamaForCausalLM(cfg)
    weights = {name: torch.randn(shape, generator=g) * (0.3 if "q_proj" in name or "k_proj" in name else 0.05)
               if len(shape) > 1 else torch.ones(shape) for name, shape in model.expected_weight_shapes().items()}
    model = LlamaForCausalLM.from_weights(cfg, weights)
    kv = DiffKVConfig(recent_window_tokens=4, prompt_score_window_tokens=8, alpha_high=1.0, alpha_low=0.3)
    prompts = [list(range(5, 16)), list(range(30, 36))]
    report = run_lockstep(model, kv, prompts, 6, num_pages=80, kv_atol=1e-4, out_atol=1e-3, use_triton=True,
                          high_tokens_per_page=4, page_manager="triton", compare_every=3)
    stats = report.final_stats
    assert sum(s.low_tokens + s.pruned_tokens for s in stats) > 0, stats
    run_lockstep(model, get_preset("fp16"), prompts, 2, num_pages=80, kv_atol=1e-2, out_atol=1e-2,
                 use_triton=True, high_tokens_per_page=4, page_manager="triton")
    print("OK", report.max_kv_diff, report.max_score_rel_diff)


def test_paged_cache_triton_path_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-4000:] + result.stderr[-8000:]


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
