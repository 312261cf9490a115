"""The paged cache on its Triton path (write kernels, read-path kernels, TritonPageManager) under the
Triton interpreter, step by step against the reference cache (CI, no GPU).

``TRITON_INTERPRET=1`` must be set before Triton is imported, so the test
runs this file as a script in a fresh interpreter process. Shapes are tiny:
interpreted programs are slow.
"""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from conftest import random_llama
    from trtllm_diffkv.config import DiffKVConfig, get_preset
    from support.paged import patch_interpreter_for_numpy_2_4, run_lockstep

    patch_interpreter_for_numpy_2_4()
    from trtllm_diffkv.kernels import decode_attention as da

    built = []  # the cache resolves its decode kernels once, not per layer and step
    resolve = da.DecodeAttention.__init__
    da.DecodeAttention.__init__ = lambda self, *a, **kw: (built.append(a[:3]), resolve(self, *a, **kw))[1]
    model = random_llama(0, vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, max_position_embeddings=256)
    kv = DiffKVConfig(recent_window_tokens=4, prompt_score_window_tokens=8, alpha_high=1.0, alpha_low=0.3)
    prompts = [list(range(5, 16)), list(range(30, 36))]
    report = run_lockstep(model, kv, prompts, 6, num_pages=80, kv_atol=1e-4, out_atol=1e-3, use_triton=True,
                          high_tokens_per_page=4, page_manager="triton", compare_every=3)
    assert len(built) == 1, built
    stats = report.final_stats
    assert sum(s.low_tokens + s.pruned_tokens for s in stats) > 0, stats
    run_lockstep(model, get_preset("fp16"), prompts, 2, num_pages=80, kv_atol=1e-2, out_atol=1e-2,
                 use_triton=True, high_tokens_per_page=4, page_manager="triton")
    print("OK", report.max_kv_diff, report.max_score_rel_diff)


def test_paged_cache_triton_path_under_interpreter():
    pytest.importorskip("triton")
    from conftest import run_script_under_interpreter

    result = run_script_under_interpreter(__file__, timeout=900)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-4000:] + result.stderr[-8000:]


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
