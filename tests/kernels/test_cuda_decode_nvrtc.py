"""The ring's register cap as the GPU's compiler settles it, on the CPU machine (``support.nvrtc``).

nvcc's frontend spills differently from NVRTC's at the same macros (Llama-3-8B's shape at 4 CTAs with the merge
prefetch's first form: nvcc 13.0 spills 4 bytes, NVRTC 13.0 16), so the nvcc tests in ``test_cuda_decode.py`` did not
see that Llama's kernel ran at 3 CTAs a multiprocessor instead of 4 (found on an H100 by
``tests/kernels/test_attention_gpu.py::test_the_ring_runs_a_kernel_without_local_memory``). Here
``_spill_free_kernel`` itself runs on NVRTC's real spills. Skipped without the ``nvidia-cuda-nvrtc`` 13.0 wheel.
"""
import pytest

from trtllm_diffkv.kernels import cuda_decode as cd
from support.nvrtc import load_nvrtc, partial_defines, settled_cap, stack_bytes


@pytest.fixture(scope="module")
def nvrtc():
    lib, why = load_nvrtc()
    if lib is None:
        pytest.skip(why)
    return lib


@pytest.mark.parametrize("preset,head_dim,group,q_bf16,expect_blocks,expect_bytes,expect_form", [
    ("llama3-8b", 128, 4, 0, 4, 8, 1), ("llama3-8b", 128, 4, 1, 4, 8, 1),  # Llama-3-8B (the first form: 16 B at 4)
    ("diffkv", 64, 3, 1, 6, 0, 0),  # the default model (SmolLM2: 9 / 3 heads, bf16)
    ("default-k8v2", 64, 7, 1, 6, 8, 1),  # a GQA-7 head_dim-64 model (the first form alone: 4 CTAs)
    ("k8v4", 128, 8, 1, 3, 0, 0),  # the second form alone: 64 bytes at the register path's cap
])
def test_the_step_down_under_nvrtc(nvrtc, preset, head_dim, group, q_bf16, expect_blocks, expect_bytes, expect_form):
    """``_spill_free_kernel`` on NVRTC 13.0's spills: the cap, local memory and prefetch form it settles on for the
    shapes measured or served (the second form keeps Llama's 4 CTAs, the first keeps ``k8v4``'s bf16 kernel free of
    spills at 3)."""
    blocks, local_bytes, chosen = settled_cap(nvrtc, partial_defines(preset, head_dim, group, q_bf16))
    assert (blocks, local_bytes, chosen["PREFETCH_RELOAD"]) == (expect_blocks, expect_bytes, expect_form), chosen


def test_the_compile_reproduces_the_h200s_record(nvrtc):
    """The H200's NVRTC figures of 2026-12-03 (docs/PERFORMANCE.md): Llama's head_dim-128 kernel 8 bytes at 4 CTAs,
    ``default-k8v2`` at head_dim 64 group 8 56 at 6, ``k8v4`` at head_dim 128 group 8 24 at 4, from that day's
    kernel source (``2bc6ed1``, here as this tree's first prefetch form without the prefetch: ``MERGE_PREFETCH=0``,
    the page loop unchanged since)."""
    source = cd.SOURCE_PATH.read_text()
    got = [stack_bytes(nvrtc, source, {**partial_defines(p, hd, g), "MERGE_PREFETCH": 0})
           for p, hd, g in (("llama3-8b", 128, 4), ("default-k8v2", 64, 8), ("k8v4", 128, 8))]
    assert got == [8, 56, 24], got
