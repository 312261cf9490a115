"""The AOT decode graph's launches, one decode step, on the GPU as TensorRT would launch them: each launch's
TensorRT-convention wrapper loaded from its PTX through the CUDA driver (CuPy ``RawModule``: the driver compiles the
PTX, as TensorRT does with what ``aot_impl`` returns) and launched with exactly the inputs, the int32 extra args and
the outputs (the inputs again), the grid and shared memory of the node's attributes == the plugins' JIT
implementations on the same prefilled cache state, byte for byte: every state and plan tensor and both layers'
outputs (``tests/export/aot_step.py``; the CPU twin, through Triton's interpreter: ``tests/export/test_aot.py``).

Run on the device: ``python3 -m pytest -q -m gpu tests/export/test_aot_graph_gpu.py``.
"""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy") if torch.cuda.is_available() else None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import aot_step  # noqa: E402

from trtllm_diffkv.export import aot  # noqa: E402


@pytest.mark.parametrize("name", ["demote", "diffkv", "fp16"])
def test_decode_step_through_the_wrappers_ptx_equals_the_plugins(name, tmp_path):
    major, _ = torch.cuda.get_device_capability()
    cc = 90 if major >= 9 else 80
    kv = aot_step.preset(name)
    manifest = aot.build_kernels(aot_step.engine(kv), tmp_path, targets=(cc,),
                                 ops=("write", "decode", "page_manager", "decision"))
    modules = {}

    def launch(abi, attrs, inputs, grid, extras):
        c = abi.compiled[f"sm_{cc}"]  # KeyError: the graph's wrapper was not compiled
        if c["ptx"] not in modules:
            modules[c["ptx"]] = cupy.RawModule(path=str(tmp_path / c["ptx"])).get_function(c["kernel_name"])
        fn = modules[c["ptx"]]
        if c["shared_bytes"] > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = c["shared_bytes"]
        ptrs = [np.uint64(t.data_ptr()) for t in inputs]
        assert c["params"] == [".u64"] * len(ptrs) + [".u32"] * len(extras) + [".u64"] * len(ptrs)
        assert attrs["shared_mem"] == c["shared_bytes"]
        fn(tuple(int(g) for g in grid), (32 * c["num_warps"], 1, 1),
           tuple(ptrs + [np.int32(e) for e in extras] + ptrs), shared_mem=c["shared_bytes"])

    mine, ref, outs_mine, outs_ref, launched = aot_step.run_decode_step(kv, "cuda", manifest, launch,
                                                                        target=f"sm_{cc}")
    aot_step.check_equal(mine, ref, outs_mine, outs_ref)
    assert len(launched) == (6 if kv.compress else 4) + aot_step.L * (4 if kv.compress else 3)
    if name == "demote":
        assert int((mine["move_from"] >= 0).sum()) > 0  # the step moved tokens
