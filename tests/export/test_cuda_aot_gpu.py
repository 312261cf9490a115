"""The CUDA decode kernels' AOT build (``export/cuda_aot.py``) launched as TensorRT launches it give the NVRTC path's
results bit for bit.

How: for an engine shape (default and k8v4 presets, fp16, head_dim 128 and 64, 16 query / 4 KV heads) the ABI
entries are compiled with nvcc (``build_cuda_kernels``) and loaded through ``cupy.RawModule(path=...)``, once from
the cubin and once from the PTX (what TensorRT receives; the driver compiles it). The reference is
``paged_decode_attention(backend="cuda")`` on the same pages and query: the NVRTC partial kernel
(``cuda_decode.launch_partial``, whose ``-D`` macros are recorded and must equal the manifest's), then the
NVRTC merge with the score update folded in (``cuda/decode_merge.cu``; its score arithmetic is the score
entry's, on the ``lse`` it writes). The AOT partial entry then runs on a second workspace and must write the same
``part_m / part_l / part_acc / page_probs / page_max`` bytes; the reference's ``lse`` (a function of those same
partials) is copied over and the AOT score entry runs on a second copy of the pool, whose bytes must equal the
reference's pool. Arguments in TensorRT's QDP AOT order (``cuda_aot.launch_args``): ``numpy.uint64`` input
pointers, ``numpy.int32`` extras (the scale as its float bits), ``numpy.uint64`` output pointers (the same
buffers again: the outputs are aliased to inputs). The step runs 3 sequences of the engine's 4, one (sequence, KV head)
of them a padding row (row id -1).

Run on the device: ``python -m pytest -q -m gpu tests/export/test_cuda_aot_gpu.py``. Without nvcc on the device,
prebuild here (``python tests/export/test_cuda_aot_gpu.py DIR``, DIR inside the repository so that it travels) and
set ``TRTLLM_DIFFKV_CUDA_AOT_DIR=DIR`` there.
"""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy") if torch.cuda.is_available() else None

from trtllm_diffkv.export import cuda_aot  # noqa: E402
from trtllm_diffkv.export.fields import EngineShape  # noqa: E402
from trtllm_diffkv.config import get_preset  # noqa: E402

PREBUILT_ENV = "TRTLLM_DIFFKV_CUDA_AOT_DIR"
CASES = {"diffkv-d128": ("diffkv", 128), "diffkv-d64": ("diffkv", 64), "k8v4-d128": ("k8v4", 128),
         "k8v4-d64": ("k8v4", 64)}
COUNTS = [(0, 0), (1, 0), (0, 1), (31, 52), (33, 53), (700, 900), (64, 1500), (1500, 47), (2, 1000), (320, 0),
          (0, 640), (17, 17)]
"""(high, low) tokens of the 12 rows (3 real sequences x 4 KV heads): empty rows, single tokens, page boundaries,
rows spread over many partitions; every one fits the engine's 65-slot page-table rows."""


def _shape(preset: str, head_dim: int) -> EngineShape:
    return EngineShape(num_layers=2, num_heads=16, num_kv_heads=4, head_dim=head_dim, kv_config=get_preset(preset),
                       dtype="float16", max_batch_size=4, max_seq_len=2048)


def _target() -> int:
    major, _ = torch.cuda.get_device_capability()
    return 90 if major >= 9 else 80


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``get(case) -> (shape, out_dir, {source kernel: manifest entry})``, built once per case."""
    cache = {}

    def get(case):
        if case not in cache:
            shape = _shape(*CASES[case])
            if cuda_aot.nvcc_path() is not None:
                out = tmp_path_factory.mktemp(case)
                cuda_aot.build_cuda_kernels(shape, out, targets=(_target(),))
            elif os.environ.get(PREBUILT_ENV):
                out = Path(os.environ[PREBUILT_ENV]) / case
            else:
                pytest.skip(f"nvcc is not on PATH and {PREBUILT_ENV} is not set (prebuild: "
                            "python tests/export/test_cuda_aot_gpu.py DIR)")
            manifest = json.loads((out / cuda_aot.MANIFEST_NAME).read_text())
            assert manifest["engine"] == shape.to_fields(), "the prebuilt kernels are for another engine"
            cache[case] = (shape, out, {e["source_kernel"]: e for e in manifest["cuda_kernels"]})
        return cache[case]

    return get


def _function(out: Path, entry: dict, binary: str):
    """The entry's kernel from its cubin or PTX (``cupy.RawModule(path=...)``: the driver loads either)."""
    c = entry["compiled"][f"sm_{_target()}"]
    try:
        return cupy.RawModule(path=str(out / c[binary])).get_function(entry["kernel_name"])
    except Exception as exc:  # noqa: BLE001 - say which file, which PTX ISA and which driver
        pytest.fail(f"the driver ({cupy.cuda.runtime.driverGetVersion()}) cannot load {c[binary]} "
                    f"(PTX ISA {c.get('ptx_version')}, {type(exc).__name__}: {exc})")


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("binary", ["cubin", "ptx"])
@pytest.mark.parametrize("case", list(CASES))
def test_aot_entries_match_the_nvrtc_kernels_bit_for_bit(built, case, binary, monkeypatch):
    from trtllm_diffkv.kernels import cuda_decode as cd
    from support.attention import build_paged_rows
    from trtllm_diffkv.kernels.decode_attention import DecodeWorkspace, paged_decode_attention

    shape, out, entries = built(case)
    partial, scores = entries["diffkv_decode_partial"], entries["diffkv_decode_scores"]
    sizes = partial["sizes"]
    fmt, B, H, R = shape.page_format, shape.max_batch_size, shape.num_kv_heads, shape.max_pages_per_row
    assert sizes["R"] == R and sizes["num_seqs"] == B
    num_seqs = len(COUNTS) // H  # 3: a step smaller than the engine's batch
    rows = build_paged_rows(fmt, COUNTS, max_pages_per_row=R, device="cuda", seed=sum(map(ord, case)))
    row_ids = torch.arange(len(COUNTS), dtype=torch.int32, device="cuda").view(num_seqs, H)
    row_ids[1, 2] = -1  # a padding row: nothing written for it but its partial slots (m = -inf, l = 0)
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(num_seqs, shape.num_heads, shape.head_dim, device="cuda", generator=g).to(torch.float16)
    pool_ref = rows.pool.pages().clone()
    pool_aot = pool_ref.clone()
    workspaces = []
    for _ in range(2):
        ws = DecodeWorkspace.allocate(B, shape.num_heads, H, fmt, R, "cuda", num_partitions=sizes["num_partitions"])
        for t in (ws.part_m, ws.part_l, ws.part_acc, ws.page_probs, ws.page_max, ws.lse):
            t.fill_(-3.0)  # same starting bytes: unwritten parts compare equal too
        workspaces.append(ws)
    ws_ref, ws_aot = workspaces

    # the reference: the NVRTC kernels (recording the partial kernel's macros), the merge with the scores
    compiled = []
    nvrtc_kernel = cd._kernel
    monkeypatch.setattr(cd, "_kernel", lambda defines, *rest: (compiled.append(dict(defines)),
                                                                nvrtc_kernel(defines, *rest))[1])
    monkeypatch.setattr(cd, "STAGES", 0)  # the AOT build is the register path (cuda_aot.cuda_kernel_defines)
    # and launches the workspace's 2 * num_partitions CTAs a row (an engine's count is fixed; the JIT path picks
    # cuda_num_slots per batch): the reference launches as many
    monkeypatch.setattr(cd, "cuda_num_slots", lambda rows, max_pages, capacity, ctas_per_wave: capacity)
    out_ref = torch.empty_like(q)
    paged_decode_attention(q, pool_ref, fmt, rows.page_table, rows.tier_tokens, row_ids, out_ref,
                           sm_scale=sizes["sm_scale"], update_scores=True, workspace=ws_ref, backend="cuda")
    torch.cuda.synchronize()
    assert compiled == [partial["defines"]] and scores["defines"] == partial["defines"]
    assert torch.isfinite(out_ref).all()
    assert not _same_bytes(pool_ref, pool_aot)  # the reference updated scores

    buffers = dict(q=q, pool=pool_aot, table=rows.page_table, tier_tokens=rows.tier_tokens, row_ids=row_ids,
                   part_m=ws_aot.part_m, part_l=ws_aot.part_l, part_acc=ws_aot.part_acc,
                   page_probs=ws_aot.page_probs, page_max=ws_aot.page_max, lse=ws_aot.lse)
    grid, block, args = cuda_aot.launch_args(partial, buffers, num_seqs)
    assert grid == (num_seqs, H, 2 * sizes["num_partitions"])
    _function(out, partial, binary)(grid, block, tuple(args), shared_mem=partial["shared_mem"])
    cupy.cuda.Device().synchronize()
    for name in ("part_m", "part_l", "part_acc", "page_probs", "page_max"):
        assert _same_bytes(getattr(ws_aot, name), getattr(ws_ref, name)), name

    ws_aot.lse.copy_(ws_ref.lse)  # the merge's result of these (equal) partials
    grid, block, args = cuda_aot.launch_args(scores, buffers, num_seqs)
    _function(out, scores, binary)(grid, block, tuple(args), shared_mem=scores["shared_mem"])
    cupy.cuda.Device().synchronize()
    assert _same_bytes(pool_aot, pool_ref)


def prebuild(root: str) -> None:
    """Build every case for sm_80 and sm_90 into ``root/<case>`` (for a device without nvcc)."""
    for case, (preset, head_dim) in CASES.items():
        cuda_aot.build_cuda_kernels(_shape(preset, head_dim), Path(root) / case, targets=(80, 90))
        print(f"built {case} in {Path(root) / case}")


if __name__ == "__main__":
    prebuild(sys.argv[1])
