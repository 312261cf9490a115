"""Reproduce the open GPU-only lockstep difference (docs/PERFORMANCE.md, paged path) at its configuration.

    TRITON_INTERPRET=1 python3 build_scripts/repro_gpu_lockstep.py triton   # whole Triton path, interpreted
    TRITON_INTERPRET=1 python3 build_scripts/repro_gpu_lockstep.py torch    # torch ops, CPU page manager
    python3 build_scripts/repro_gpu_lockstep.py gpu                          # on a CUDA machine
    python3 build_scripts/repro_gpu_lockstep.py gpu-torch-writes   # CUDA, torch write ops + Triton page manager
    python3 build_scripts/repro_gpu_lockstep.py gpu-torch-prefill  # CUDA, Triton write kernels, torch scored prefill

The edge-case-4 configuration of tests/gpu/test_paged_gpu.py (peaked tiny Llama, prompt lengths
around both tiers' page capacities), 3 decode steps, torch read path; prints the largest output
difference against the reference cache and where it is.
"""
import os, sys, time
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "tests"), REPO]
import torch
from trtllm_diffkv.paged.testing import patch_interpreter_for_numpy_2_4, run_lockstep
patch_interpreter_for_numpy_2_4()
from conftest import peaked_tiny_llama
from trtllm_diffkv.config import DiffKVConfig
from trtllm_diffkv.paged import PagedDiffKVCache
CFG = DiffKVConfig(recent_window_tokens=16, prompt_score_window_tokens=32, alpha_high=1.0, alpha_low=0.3)
model = peaked_tiny_llama()
probe = PagedDiffKVCache(CFG, 1, 8, 2, 64, num_pages=1, max_slots=1, max_seq_len_tokens=8)
caps = (probe.page_format.high_tokens_per_page, probe.page_format.low_tokens_per_page)
lengths = sorted({n for p in caps for n in (p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1)})
print("caps", caps, "lengths", lengths, flush=True)
g = torch.Generator().manual_seed(4)
prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
which = sys.argv[1]
t = time.time()
kw = {"triton": dict(use_triton=True, page_manager="triton"), "torch": dict(use_triton=False, page_manager="cpu"),
      "gpu": dict(use_triton=True, page_manager="triton"),
      "gpu-torch-writes": dict(use_triton=False, page_manager="triton"),
      "gpu-torch-prefill": dict(use_triton=True, page_manager="triton")}[which]
if which == "gpu-torch-prefill":  # everything Triton except the prefill attention + scores (torch_ops)
    import trtllm_diffkv.paged.cache as cache_module
    from trtllm_diffkv.paged import torch_ops
    _kernels = cache_module._kernels
    cache_module._kernels = lambda *a, **k: (*_kernels(*a, **k)[:2], torch_ops.scored_prefill_attention)
if which.startswith("gpu"):
    model = model.cuda()
rep = run_lockstep(model, CFG, prompts, 3, num_pages=6000, kv_atol=1e-4, out_atol=1e-3, stable_check=True, read_path="torch", **kw)
print(which, "OK max_out_diff", rep.max_out_diff, rep.max_out_diff_at, time.time() - t, flush=True)
