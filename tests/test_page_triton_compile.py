"""The page manager's Triton kernels compile for the H100/H200 (sm_90) without a GPU.

Uses Triton's ahead-of-time compiler and the ``ptxas`` its wheel ships, so a
typo or type error in a kernel fails in CI, not only on the device.
"""
import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from trtllm_diffkv.memory import triton_page_manager as tpm  # noqa: E402

POINTER_TYPES = {
    "slots_ptr": "*i64", "prompt_ptr": "*i32", "high_ptr": "*i32", "low_ptr": "*i32", "a_ptr": "*i32",
    "b_ptr": "*i32", "dh_ptr": "*i8", "dl_ptr": "*i8", "state_ptr": "*i32", "pages_ptr": "*i32",
    "tokens_ptr": "*i32", "table_ptr": "*i32", "ring_ptr": "*i32", "block_sum_ptr": "*i64",
    "block_flag_ptr": "*i32", "block_off_ptr": "*i64", "ctrl_ptr": "*i64", "ring_state_ptr": "*i64",
    "claim_ptr": "*i32",
}

CASES = [
    (tpm._count_kernel, dict(OP=op, BLOCK=block))
    for op, block in ((tpm.OP_RESERVE, tpm.ROW_BLOCK), (tpm.OP_COMMIT, tpm.ROW_BLOCK),
                      (tpm.OP_DECODE, tpm.DECODE_BLOCK), (tpm.OP_RELEASE, tpm.ROW_BLOCK))
] + [
    (tpm._scan_kernel, dict(ALLOC=True, CHUNK=tpm.SCAN_CHUNK)),
    (tpm._scan_kernel, dict(ALLOC=False, CHUNK=tpm.SCAN_CHUNK)),
] + [
    (kernel, dict(BLOCK=block, FUSED=fused, CHUNK=tpm.SCAN_CHUNK, **extra))
    for fused in (True, False)
    for kernel, block, extra in (
        (tpm._reserve_apply_kernel, tpm.ROW_BLOCK, dict(RCHUNK=tpm.ROW_CHUNK)),
        (tpm._commit_apply_kernel, tpm.ROW_BLOCK, dict(RCHUNK=tpm.ROW_CHUNK)),
        (tpm._decode_apply_kernel, tpm.DECODE_BLOCK, {}),
        (tpm._release_apply_kernel, tpm.ROW_BLOCK, dict(RCHUNK=tpm.ROW_CHUNK)),
    )
]


@pytest.mark.parametrize("kernel,constexprs", CASES,
                         ids=[f"{k.__name__}-{'-'.join(f'{a}{b}' for a, b in c.items())}" for k, c in CASES])
def test_kernel_compiles_for_sm90(kernel, constexprs):
    fn = getattr(kernel, "fn", kernel)
    if not hasattr(kernel, "arg_names"):
        pytest.skip("Triton interpreter active: no compilation")
    signature = {}
    for name in kernel.arg_names:
        signature[name] = "constexpr" if name in constexprs else POINTER_TYPES.get(name, "i32")
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
    except RuntimeError as exc:  # no ptxas / CUDA backend in this Triton build
        if "ptxas" in str(exc).lower():
            pytest.skip(f"cannot assemble for sm_90 here: {exc}")
        raise
    assert compiled.asm["cubin"], fn
    assert compiled.metadata.shared <= 228 * 1024
