"""The page manager's Triton kernels compile for the H100/H200 (sm_90) without a GPU.

Uses Triton's ahead-of-time compiler and the ``ptxas`` its wheel ships, so a
typo or type error in a kernel fails in CI, not only on the device. The
compilation runs in a child process without ``TRITON_INTERPRET``: the kernel
tests of this suite run under the interpreter (set by tests/conftest.py on a
machine without a GPU), and an interpreted kernel cannot be compiled.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = str(Path(__file__).resolve().parents[2])

SCRIPT = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from trtllm_diffkv.memory import triton_page_manager as tpm

""" + 'POINTER_TYPES = {\n    "slots_ptr": "*i64", "prompt_ptr": "*i32", "high_ptr": "*i32", "low_ptr": "*i32", "a_ptr": "*i32",\n    "b_ptr": "*i32", "dh_ptr": "*i8", "dl_ptr": "*i8", "state_ptr": "*i32", "pages_ptr": "*i32",\n    "tokens_ptr": "*i32", "table_ptr": "*i32", "ring_ptr": "*i32", "block_sum_ptr": "*i64",\n    "block_flag_ptr": "*i32", "block_off_ptr": "*i64", "ctrl_ptr": "*i64", "ring_state_ptr": "*i64",\n    "claim_ptr": "*i32",\n}\n\nCASES = [\n    (tpm._count_kernel, dict(OP=op, BLOCK=block))\n    for op, block in ((tpm.OP_RESERVE, tpm.ROW_BLOCK), (tpm.OP_COMMIT, tpm.ROW_BLOCK),\n                      (tpm.OP_DECODE, tpm.DECODE_BLOCK), (tpm.OP_RELEASE, tpm.ROW_BLOCK))\n] + [\n    (tpm._scan_kernel, dict(ALLOC=True, CHUNK=tpm.SCAN_CHUNK)),\n    (tpm._scan_kernel, dict(ALLOC=False, CHUNK=tpm.SCAN_CHUNK)),\n] + [\n    (kernel, dict(BLOCK=block, FUSED=fused, CHUNK=tpm.SCAN_CHUNK, **extra))\n    for fused in (True, False)\n    for kernel, block, extra in (\n        (tpm._reserve_apply_kernel, tpm.ROW_BLOCK, dict(RCHUNK=tpm.ROW_CHUNK)),\n        (tpm._commit_apply_kernel, tpm.ROW_BLOCK, dict(RCHUNK=tpm.ROW_CHUNK)),\n        (tpm._decode_apply_kernel, tpm.DECODE_BLOCK, {}),\n        (tpm._release_apply_kernel, tpm.ROW_BLOCK, dict(RCHUNK=tpm.ROW_CHUNK)),\n    )\n]\n\n\n' + """
results = {}
for kernel, constexprs in CASES:
    name = kernel.__name__ + "-" + "-".join(f"{a}{b}" for a, b in constexprs.items())
    signature = {n: "constexpr" if n in constexprs else POINTER_TYPES.get(n, "i32") for n in kernel.arg_names}
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        results[name] = {"cubin_bytes": len(compiled.asm["cubin"]), "shared": compiled.metadata.shared}
    except RuntimeError as exc:
        results[name] = {"error": str(exc)[:500]}
print(json.dumps(results))
"""


def test_page_manager_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) == 14
    errors = {name: r["error"] for name, r in results.items() if "error" in r}
    if errors and all("ptxas" in e.lower() for e in errors.values()):
        pytest.skip(f"cannot assemble for sm_90 here: {next(iter(errors.values()))}")
    assert errors == {}
    for name, r in results.items():
        assert r["cubin_bytes"] > 0, name
        assert r["shared"] <= 228 * 1024, name
