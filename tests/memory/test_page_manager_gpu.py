"""GPU page manager (Triton) against the CPU oracle, call by call: identical page tables and rings.

Run on the device: ``python -m pytest -q -m gpu tests/memory/test_page_manager_gpu.py`` (``tools/gpu_check.sh``).
Seeded random sequences only (no Hypothesis needed on the device).
"""
import pytest
import torch

from trtllm_diffkv.config import DiffKVConfig, TierConfig
from trtllm_diffkv.memory import CpuPageManager, PageFormat, PageStatus
from support.page_manager import Lockstep, duplicate_slot_calls, long_row_calls, random_calls, simulate_serving

pytestmark = pytest.mark.gpu

FMT = PageFormat.for_config(DiffKVConfig(), 128)


def pair(fmt, *geometry):
    from trtllm_diffkv.memory.triton_page_manager import TritonPageManager

    return [CpuPageManager(fmt, *geometry), TritonPageManager(fmt, *geometry, device="cuda")]


@pytest.mark.parametrize("fmt", [FMT, PageFormat.for_config(DiffKVConfig(low=TierConfig(4, 2, 1, 1)), 64, 8)])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_calls_identical_to_cpu(fmt, seed):
    driver = Lockstep(pair(fmt, 400, 12, 3, 4, 600))
    random_calls(driver, seed=seed, num_calls=1500, max_batch=8)
    seen = " ".join(driver.status_counts)
    assert "OUT_OF_PAGES" in seen and "ROW_FULL" in seen


def test_serving_200_requests_identical_to_cpu():
    """Edge case 9 on the GPU: 200 requests, aborts at every stage, preemption on out-of-pages."""
    driver = Lockstep(pair(FMT, 600, 24, 4, 8, 640), compare_every=3)
    report = simulate_serving(driver, seed=7, num_requests=200, max_prompt_tokens=400, max_output_tokens=200)
    assert report.finished + sum(report.aborted.values()) == 200
    assert driver.managers[1].free_pages() == 600


def test_long_rows_and_overlapping_shifts_identical_to_cpu():
    fmt = PageFormat.for_config(DiffKVConfig(), 64, high_tokens_per_page=8)  # 8 / 12 tokens per page
    geometry = (4 * 64 * 260, 4, 8, 8, 2048)  # rows of 257 pages: three kernel chunks
    driver = Lockstep(pair(fmt, *geometry))
    long_row_calls(driver, seed=4, rounds=6)


def test_llama3_8b_shaped_batch_identical_to_cpu():
    """512 requests x 32 layers x 8 KV heads in one call: thousands of scan blocks, 4096-token prompts."""
    n, layers, heads, context = 512, 32, 8, 4096
    managers = pair(FMT, n * layers * heads * 131, n, layers, heads, context + 256)
    driver = Lockstep(managers, compare_every=8)
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(n, generator=gen)
    prompts = torch.randint(context - 64, context + 1, (n,), generator=gen)
    driver.call("reserve_prompt", slots, prompts)
    prompt = prompts[:, None, None].expand(n, layers, heads)
    high = (torch.rand(n, layers, heads, generator=gen) * 0.4 * (prompt - 64)).long() + 64
    low = (torch.rand(n, layers, heads, generator=gen) * (prompt - high)).long()
    driver.call("commit_prompt", slots, high, low)
    driver.compare()
    for _ in range(20):
        dh = torch.randint(0, 2, (n, layers, heads), generator=gen, dtype=torch.int8)
        dl = torch.randint(0, 2, (n, layers, heads), generator=gen, dtype=torch.int8)
        assert driver.call("append_decode", slots, dh, dl).status == PageStatus.OK
    driver.call("release", slots[: n // 2])
    driver.compare()
    driver.call("release", slots[n // 2:])
    driver.compare()
    assert managers[1].free_pages() == managers[1].num_pages


def test_decode_step_replays_in_a_cuda_graph():
    """A decode step launches no allocation and no sync: it can be captured and replayed."""
    cpu, gpu = pair(FMT, 4000, 8, 4, 8, 1024)
    slots = torch.arange(8)
    for m in (cpu, gpu):
        m.reserve_prompt(slots.to(m.device), torch.full((8,), 200, device=m.device))
        m.commit_prompt(slots.to(m.device), torch.full((8, 4, 8), 31, device=m.device), torch.full((8, 4, 8), 51, device=m.device))
    slots_gpu = slots.cuda()
    dh_buf = torch.zeros(8, 4, 8, dtype=torch.int8, device="cuda")
    dl_buf = torch.zeros_like(dh_buf)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up: compile kernels outside the capture
        gpu.append_decode(slots_gpu, dh_buf, dl_buf)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu.append_decode(slots_gpu, dh_buf, dl_buf)
    gen = torch.Generator().manual_seed(3)
    for _ in range(70):
        dh = torch.randint(0, 2, (8, 4, 8), generator=gen, dtype=torch.int8)
        dl = torch.randint(-1, 2, (8, 4, 8), generator=gen, dtype=torch.int8)
        dl = torch.where(cpu.snapshot().tokens[:8, ..., 1] + dl < 0, 0, dl).to(torch.int8)
        dh_buf.copy_(dh)
        dl_buf.copy_(dl)
        graph.replay()
        cpu.append_decode(slots, dh, dl)
        assert cpu.read_status() == gpu.read_status()
    assert not cpu.snapshot().diff(gpu.snapshot())
    gpu.check_invariants()


def test_invalid_values_flagged_on_device_without_change():
    _, gpu = pair(FMT, 100, 3, 1, 2, 200)
    gpu.reserve_prompt(torch.tensor([0], device="cuda"), torch.tensor([40], device="cuda"))
    z = torch.zeros(1, 1, 2, dtype=torch.int32, device="cuda")
    before = gpu.snapshot()
    gpu.append_decode(torch.tensor([0], device="cuda"), z, z)  # reserved, not active
    gpu.commit_prompt(torch.tensor([0], device="cuda"), z + 1000, z)  # more than reserved
    assert gpu.read_status().status == PageStatus.INVALID
    assert not before.diff(gpu.snapshot())


@pytest.mark.parametrize("launch", [{}, dict(row_block=4, decode_block=8, scan_chunk=2)])
def test_duplicate_slots_flagged_on_device_without_change(launch):
    """A slot listed twice: INVALID, nothing changes (device claim counters, reset by each call)."""
    from trtllm_diffkv.memory.triton_page_manager import TritonPageManager

    gpu = TritonPageManager(FMT, 60, 6, 1, 2, 200, device="cuda", **launch)
    duplicate_slot_calls(gpu)
    assert not gpu._claim.any()
