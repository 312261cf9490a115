"""The ``diffkv`` custom ops (``kernels/custom_ops.py``): ``torch.library.opcheck`` on each (schema and declared
mutations, fake against real, AOT dispatch with dynamic shapes), the op's outputs bit-equal to the direct
function's, a page format through ``int[]`` and back, and a ``fullgraph`` compile of a small step through the ops
equal to eager. Tiny shapes; the Triton paths run under the interpreter on the CPU, on the GPU where there is one.

``opcheck`` runs with its default sub-tests; ``test_autograd_registration`` needs inputs that require grad and
is vacuous otherwise, so it runs once more on its own with such inputs (the ops register no backward: inference
kernels); the other sub-tests take inputs without grad, since with grad ``test_aot_dispatch_dynamic`` would
need a backward.
"""
import os
import timeit

if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton defines the kernels

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from trtllm_diffkv.config import PRESETS, DiffKVConfig  # noqa: E402
from trtllm_diffkv.kernels.interpreter import patch_interpreter_for_numpy_2_4  # noqa: E402

patch_interpreter_for_numpy_2_4()

from trtllm_diffkv.kernels import custom_ops as ops  # noqa: E402
from trtllm_diffkv.kernels import quant_write  # noqa: E402
from trtllm_diffkv.kernels.decode_attention import DecodeWorkspace, paged_decode_attention  # noqa: E402
from trtllm_diffkv.kernels.prefill_attention import scored_prefill_attention  # noqa: E402
from trtllm_diffkv.memory import KVCachePool, PageFormat  # noqa: E402
from trtllm_diffkv.model import fused  # noqa: E402
from support.attention import build_paged_rows  # noqa: E402

D = torch.ops.diffkv
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton paths: the GPU, else the interpreter


def _on(*tensors):
    """The tensors (made on the CPU from seeded generators) on the test device."""
    return tuple(t.to(DEVICE) for t in tensors)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fused_cases(use_triton):
    """(op, args, direct call) for each fused step, tiny fp32 shapes."""
    g = _gen(0)
    x, res, w = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g), torch.randn(32, generator=g)
    gate_up = torch.randn(3, 2 * 24, generator=g)
    qkv = torch.randn(1, (4 + 2 * 2) * 16, generator=g)  # one token: the torch path's v is a view of qkv
    cos, sin = torch.randn(1, 16, generator=g), torch.randn(1, 16, generator=g)
    q, k = torch.randn(2, 4, 16, generator=g), torch.randn(2, 2, 16, generator=g)
    rot = torch.randn(2, 16, 16, generator=g)
    x, res, w, gate_up, qkv, cos, sin, q, k, rot = _on(x, res, w, gate_up, qkv, cos, sin, q, k, rot)
    t = dict(use_triton=use_triton)
    return {
        "rms_norm": (D.rms_norm, (x, w, 1e-5, use_triton), lambda: fused.rms_norm(x, w, 1e-5, **t)[0]),
        "add_rms_norm": (D.add_rms_norm, (x, res, w, 1e-5, use_triton), lambda: fused.rms_norm(x, w, 1e-5, res, **t)),
        "silu_mul": (D.silu_mul, (gate_up, use_triton), lambda: fused.silu_mul(gate_up, **t)),
        "qkv_rope": (D.qkv_rope, (qkv, cos, sin, 4, 2, 16, use_triton),
                     lambda: fused.qkv_rope(qkv, cos, sin, 4, 2, 16, **t)),
        "rotate_heads": (D.rotate_heads, (q, k, rot, use_triton), lambda: fused.rotate_heads(q, k, rot, **t)),
    }


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "silu_mul", "qkv_rope", "rotate_heads"])
def test_fused_ops(name, use_triton):
    op, args, direct = _fused_cases(use_triton)[name]
    torch.library.opcheck(op, args)
    got, want = _as_tuple(op(*args)), _as_tuple(direct())
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_autograd_registration_with_grad_inputs():
    g = _gen(1)
    x, w = torch.randn(2, 16, generator=g, requires_grad=True), torch.randn(16, generator=g)
    torch.library.opcheck(D.rms_norm, (x, w, 1e-5, False), test_utils="test_autograd_registration")
    with pytest.raises(RuntimeError):  # no backward registered: inference only
        D.rms_norm(x, w, 1e-5, False).sum().backward()


@pytest.mark.parametrize("preset", ["diffkv", "k8v4", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_page_format_through_ints(preset, head_dim):
    fmt = PageFormat.for_config(PRESETS[preset], head_dim, high_tokens_per_page=8)
    ints = ops.page_format_ints(fmt)
    assert len(ints) == 39 and all(type(i) is int for i in ints)
    assert ops.page_format_from_ints(ints) == fmt
    with pytest.raises(ValueError, match="39 ints"):
        ops.page_format_from_ints(ints[:-1])


# --------------------------------------------------------------------------- decode attention
def _decode_inputs(update_scores=True):
    fmt = PageFormat.for_config(DiffKVConfig(), 64, high_tokens_per_page=8)
    rows = build_paged_rows(fmt, [(5, 9), (3, 0)], seed=3, device=DEVICE)
    row_ids, q = _on(torch.arange(2, dtype=torch.int32).view(2, 1), torch.randn(2, 2, 64, generator=_gen(4)))
    ws = DecodeWorkspace.allocate(2, 2, 1, fmt, rows.page_table.shape[1], DEVICE, num_partitions=1,
                                  update_scores=update_scores)
    for name in ops._WORKSPACE_FIELDS:
        getattr(ws, name).zero_()  # opcheck compares the mutated workspace: no uninitialized NaNs
    out = torch.zeros_like(q)
    return fmt, rows, row_ids, q, ws, out


def _decode_op_args(fmt, rows, row_ids, q, ws, out, update_scores):
    return (q, rows.pool.pages(), ops.page_format_ints(fmt), rows.page_table, rows.tier_tokens, row_ids, out,
            [getattr(ws, n) for n in ops._WORKSPACE_FIELDS], 64**-0.5, update_scores, "triton")


@pytest.mark.parametrize("update_scores", [True, False])
def test_decode_attention_op(update_scores):
    fmt, rows, row_ids, q, ws, out = _decode_inputs(update_scores)
    args = _decode_op_args(fmt, rows, row_ids, q, ws, out, update_scores)
    torch.library.opcheck(D.paged_decode_attention, args)
    pages = rows.pool.pages().clone()
    D.paged_decode_attention(*args)
    want = torch.zeros_like(q)
    paged_decode_attention(q, pages, fmt, rows.page_table, rows.tier_tokens, row_ids, want, sm_scale=64**-0.5,
                           update_scores=update_scores, backend="triton")
    assert torch.equal(out, want) and want.abs().sum() > 0
    assert torch.equal(rows.pool.pages(), pages)  # the same score updates (none without update_scores)


# --------------------------------------------------------------------------- KV write
def test_write_tokens_op():
    fmt = PageFormat.for_config(DiffKVConfig(), 64, high_tokens_per_page=4)
    pool = KVCachePool(fmt, 3, device=DEVICE)
    pool.buffer.zero_()
    g = _gen(5)
    keys, values = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    keys[3, 7] = float("inf")  # flagged
    page = torch.tensor([2, 0, 0, 1, -1], dtype=torch.int32)  # the last row skipped
    slot = torch.tensor([1, 0, 3, 0, 2], dtype=torch.int32)
    scores, positions = torch.rand(5, generator=g), torch.arange(5, dtype=torch.int32)
    flags, index = torch.zeros(5, dtype=torch.int32), torch.arange(5, dtype=torch.int32)
    keys, values, page, slot, scores, positions, flags, index = _on(keys, values, page, slot, scores, positions,
                                                                    flags, index)
    args = (pool.pages(), ops.page_format_ints(fmt), "low", page, slot, keys, values, None, None, scores, positions,
            flags, index)
    torch.library.opcheck(D.write_tokens, args)
    want_pages, want_flags = pool.pages().clone(), flags.clone()
    quant_write.write_tokens(want_pages, fmt, "low", page, slot, keys, values, scores=scores, positions=positions,
                             error_flags=want_flags, error_index=index)
    D.write_tokens(*args)
    assert torch.equal(pool.pages(), want_pages) and torch.equal(flags, want_flags)
    assert want_flags.tolist() == [0, 0, 0, 1, 0] and want_pages.any()
    # without flags: the other op (no mutated argument is None: torch 2.11's Dynamo failed on one)
    keys[3, 7] = 0.5
    args = (pool.pages(), ops.page_format_ints(fmt), "high", page, slot, keys, values, None, None, scores, positions)
    torch.library.opcheck(D.write_tokens_unflagged, args)
    quant_write.write_tokens(want_pages, fmt, "high", page, slot, keys, values, scores=scores, positions=positions)
    D.write_tokens_unflagged(*args)
    assert torch.equal(pool.pages(), want_pages)
    with pytest.raises(ValueError, match="go together"):  # the compiled-path wrapper, run directly
        ops.write_tokens.__wrapped__(pool.pages(), fmt, "low", page, slot, keys, values, scores=scores,
                                     positions=positions, error_flags=flags)


# --------------------------------------------------------------------------- prefill attention
def test_scored_prefill_attention_op():
    g = _gen(6)
    q, k, v = (torch.randn(13, h, 64, generator=g) for h in (4, 2, 2))
    q, k, v, cu = _on(q, k, v, torch.tensor([0, 5, 13], dtype=torch.int32))
    args = (q, k, v, cu, 0.125, 4)
    torch.library.opcheck(D.scored_prefill_attention, args)
    got = D.scored_prefill_attention(*args)
    want = scored_prefill_attention(q, k, v, cu, sm_scale=0.125, num_scoring_queries=4)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# --------------------------------------------------------------------------- a compiled step
def _step(rms_norm, silu_mul, decode, x, residual, w, gate_up, q, pages, fmt, page_table, tier_tokens, row_ids, out,
          ws):
    normed, s = rms_norm(x, w, 1e-5, residual)
    decode(q * normed[:, None, :64], pages, fmt, page_table, tier_tokens, row_ids, out, sm_scale=0.125,
           update_scores=True, workspace=ws, backend="triton")
    return silu_mul(gate_up) + s[:, :24], out * 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_step_without_graph_breaks_equals_eager(backend):
    fmt, rows, row_ids, q, ws, out = _decode_inputs()
    g = _gen(7)
    x, res, w, gate_up = (torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g),
                          torch.randn(64, generator=g), torch.randn(2, 48, generator=g))
    x, res, w, gate_up = _on(x, res, w, gate_up)
    pages = rows.pool.pages().clone()
    want = _step(fused.rms_norm, fused.silu_mul, paged_decode_attention, x, res, w, gate_up, q, pages, fmt,
                 rows.page_table, rows.tier_tokens, row_ids, torch.zeros_like(q), ws)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    step = torch.compile(_step, fullgraph=True, backend=recording)
    got = step(ops.rms_norm, ops.silu_mul, ops.paged_decode_attention, x, res, w, gate_up, q, rows.pool.pages(), fmt,
               rows.page_table, rows.tier_tokens, row_ids, out, ws)
    assert len(graphs) == 1
    called = {str(n.target).removesuffix(".default") for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert {"diffkv.add_rms_norm", "diffkv.silu_mul", "diffkv.paged_decode_attention"} <= called, called
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(out, want[1] / 2)                # out written in place through the compiled graph
    assert torch.equal(rows.pool.pages(), pages)        # and the same score updates in the pool


def _prefill_step(qkv_rope, rotate_heads, prefill, write, qkv, cos, sin, rot, cu, pages, fmt, page, slot, scores):
    q, k, v = qkv_rope(qkv, cos, sin, 4, 2, 64)
    q, k = rotate_heads(q, k, rot)
    out, sums = prefill(q, k, v, cu, sm_scale=0.125, num_scoring_queries=4)
    write(pages, fmt, "high", page, slot, k.reshape(-1, 64), v.reshape(-1, 64), scores=sums.reshape(-1) + scores,
          positions=torch.arange(page.numel(), dtype=torch.int32, device=page.device))
    return out


def test_compiled_prefill_step_through_the_other_ops_equals_eager():
    """qkv_rope, rotate_heads, scored prefill attention and the KV write in one ``fullgraph`` aot_eager graph."""
    g = _gen(8)
    qkv, cos, sin = (torch.randn(6, n, generator=g) for n in (8 * 64, 64, 64))
    rot = torch.linalg.qr(torch.randn(2, 64, 64, generator=g))[0]
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    fmt = PageFormat.for_config(DiffKVConfig(), 64, high_tokens_per_page=8)
    pool = KVCachePool(fmt, 3, device=DEVICE)
    pool.buffer.zero_()
    want_pages = pool.pages().clone()
    page, slot = torch.arange(12, dtype=torch.int32) % 3, torch.arange(12, dtype=torch.int32) // 3
    scores = torch.rand(12, generator=g)
    qkv, cos, sin, rot, cu, page, slot, scores = _on(qkv, cos, sin, rot, cu, page, slot, scores)
    args = (qkv, cos, sin, rot, cu)
    want = _prefill_step(fused.qkv_rope, fused.rotate_heads, scored_prefill_attention, quant_write.write_tokens, *args,
                         want_pages, fmt, page, slot, scores)
    torch._dynamo.reset()
    step = torch.compile(_prefill_step, fullgraph=True, backend="aot_eager")
    got = step(ops.qkv_rope, ops.rotate_heads, ops.scored_prefill_attention, ops.write_tokens, *args, pool.pages(), fmt,
               page, slot, scores)
    assert torch.equal(got, want) and torch.equal(pool.pages(), want_pages) and want_pages.any()


def test_wrappers_call_the_direct_functions_in_eager(monkeypatch):
    """Outside a trace a wrapper is its direct function (no op dispatch)."""
    seen = []
    monkeypatch.setattr(torch.ops.diffkv, "silu_mul", lambda *a: seen.append(a))
    x = torch.randn(2, 8)
    assert torch.equal(ops.silu_mul(x), fused.silu_mul(x)) and not seen
    with pytest.raises(ValueError, match="DecodeWorkspace"):  # the compiled-path check, run directly
        ops.paged_decode_attention.__wrapped__(None, None, None, None, None, None, None, sm_scale=1.0)


def test_dispatch_overhead_is_what_the_docstring_says():
    """Direct call, wrapper outside a trace, op call: best of 5 (figures in the module docstring)."""
    x = torch.randn(1, 8)

    def best(fn):
        return min(timeit.repeat(fn, number=200, repeat=5)) / 200 * 1e6

    direct, wrapper, op = best(lambda: fused.silu_mul(x)), best(lambda: ops.silu_mul(x)), best(lambda: D.silu_mul(x))
    print(f"silu_mul [1, 8] CPU: direct {direct:.1f} us, wrapper {wrapper:.1f} us, op {op:.1f} us")
    assert wrapper < op
