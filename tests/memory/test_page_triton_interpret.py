"""The Triton page manager equals the CPU one, call by call, under the Triton interpreter (CI, no GPU).

``TRITON_INTERPRET=1`` must be set before the kernels are defined, so the test
runs this file as a script in a fresh interpreter process.
"""
import os


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4

    patch_interpreter_for_numpy_2_4()
    import torch

    from trtllm_diffkv.config import DiffKVConfig, TierConfig
    from trtllm_diffkv.memory import CpuPageManager, PageFormat, PageStatus
    from support.page_manager import Lockstep, duplicate_slot_calls, long_row_calls, random_calls, simulate_serving
    from trtllm_diffkv.memory.triton_page_manager import TritonPageManager

    # tiny launch shapes: several blocks per call, several scan and row chunks, on small problems
    small = dict(device="cpu", row_block=4, decode_block=8, row_chunk=4, scan_chunk=2)
    for fmt, geometry, launch in (
        (PageFormat.for_config(DiffKVConfig(), 128), (60, 5, 3, 2, 200), small),
        (PageFormat.for_config(DiffKVConfig(low=TierConfig(4, 2, 1, 1)), 64, 8), (90, 4, 3, 1, 150), small),
        (PageFormat.for_config(DiffKVConfig(), 128), (60, 5, 3, 2, 200), dict(device="cpu")),  # GPU shapes
    ):
        driver = Lockstep([CpuPageManager(fmt, *geometry), TritonPageManager(fmt, *geometry, **launch)])
        random_calls(driver, seed=11, num_calls=300, max_batch=5)
        print("random calls:", driver.status_counts)
        assert any("OUT_OF_PAGES" in k for k in driver.status_counts)
    fmt = PageFormat.for_config(DiffKVConfig(), 64, high_tokens_per_page=8)  # rows of 139 pages: two chunks
    geometry = (4 * 6 * 139, 4, 2, 3, 1100)
    driver = Lockstep([CpuPageManager(fmt, *geometry), TritonPageManager(fmt, *geometry, device="cpu", row_block=8)])
    long_row_calls(driver, seed=2)
    print("long rows:", driver.status_counts)
    fmt = PageFormat.for_config(DiffKVConfig(), 128)
    driver = Lockstep([CpuPageManager(fmt, 80, 6, 1, 2, 300), TritonPageManager(fmt, 80, 6, 1, 2, 300, **small)],
                      compare_every=5)
    report = simulate_serving(driver, seed=3, num_requests=24, max_prompt_tokens=200, max_output_tokens=60)
    print("serving:", report)

    # invalid values are caught on the device: status INVALID, nothing changes
    m = TritonPageManager(fmt, 40, 3, 1, 2, 200, device="cpu")
    m.reserve_prompt(torch.tensor([0, 1]), torch.tensor([40, 40]))
    m.commit_prompt(torch.tensor([0]), torch.tensor([[[10, 10]]]), torch.tensor([[[0, 0]]]))
    assert m.read_status().status == PageStatus.OK
    z = torch.zeros(1, 1, 2, dtype=torch.int64)
    bad_calls = [
        lambda: m.append_decode(torch.tensor([2]), z, z),  # free slot
        lambda: m.append_decode(torch.tensor([0]), z + 2, z),  # delta 2
        lambda: m.append_decode(torch.tensor([0]), z, z - 1),  # low count below 0
        lambda: m.commit_prompt(torch.tensor([1]), z + 200, z),  # more than reserved
        lambda: m.commit_prompt(torch.tensor([0]), z, z),  # not reserved
        lambda: m.reserve_prompt(torch.tensor([0]), torch.tensor([5])),  # not free
        lambda: m.reserve_prompt(torch.tensor([2]), torch.tensor([0])),  # empty prompt
        lambda: m.reserve_prompt(torch.tensor([7]), torch.tensor([5])),  # no such slot
        lambda: m.release(torch.tensor([1, 3])),  # no such slot
    ]
    for call in bad_calls:
        before = m.snapshot()
        call()
        assert m.read_status().status == PageStatus.INVALID
        before.status = 0
        assert not before.diff(m.snapshot())
    # duplicate slot ids: INVALID and no change, the copies in one block, in two, or past the scan launch
    for launch in (small, dict(device="cpu")):
        duplicate_slot_calls(TritonPageManager(fmt, 60, 6, 1, 2, 200, **launch))
    duplicate_slot_calls(TritonPageManager(fmt, 60, 6, 1, 2, 200, device="cpu", validate=True))  # ValueError
    m = TritonPageManager(fmt, 40, 3, 1, 2, 200, device="cpu")  # QA's case: pages entered the ring twice
    m.reserve_prompt(torch.tensor([2]), torch.tensor([5]))
    m.release(torch.tensor([2, 2]))
    assert m.read_status() == (PageStatus.INVALID, 36)
    m.release(torch.tensor([2]))
    assert m.read_status() == (PageStatus.OK, 40)
    m.check_invariants()
    print("duplicates refused")
    checked = TritonPageManager(fmt, 40, 3, 1, 2, 200, device="cpu", validate=True)
    try:
        checked.append_decode(torch.tensor([2]), z, z)
    except ValueError as exc:
        assert "slot 2 is FREE" in str(exc)
    else:
        raise AssertionError("validate=True did not raise")
    print("OK")


def test_triton_page_manager_matches_cpu_under_interpreter():
    import pytest

    pytest.importorskip("triton")
    from conftest import run_script_under_interpreter

    result = run_script_under_interpreter(__file__, timeout=900)
    assert result.returncode == 0 and result.stdout.rstrip().endswith("OK"), result.stdout[-4000:] + result.stderr[-8000:]


if __name__ == "__main__":
    main()
