"""Ahead-of-time compilation of every Triton kernel specialization an engine needs (no GPU needed).

An engine (:class:`~.fields.EngineShape`: head_dim, query:KV ratio, dtype, tier
formats, page-table width) runs a fixed set of kernel specializations:

* write / read (``kernels/quant_write.py``): prompt tokens into the high and
  low tiers, the decode token into the high tier, demotions (read high, write low);
* paged decode attention (``kernels/decode_attention.py``): partial (split-K),
  merge, score update;
* scored prefill (``kernels/prefill_attention.py``): log-sum-exp, its merge and
  the prompt scores, one variant per range of the longest prompt of a step
  (the kernels' padded sizes depend on it);
* page manager (``memory/triton_page_manager.py``): count, scan and apply of
  reserve, commit, decode and release;
* decode plan (``kernels/decision_kernel.py``): the DiffKV tier decisions of every
  row (``_decide_kernel``) and the locations of the new tokens and the moves
  (``_locate_kernel``), as ``paged/decode.py::plan_device`` launches them.

How the set is derived: :func:`kernel_specs` calls the real launchers
(:func:`~trtllm_diffkv.kernels.quant_write.write_tokens`,
:func:`~trtllm_diffkv.kernels.decode_attention.paged_decode_attention`,
:func:`~trtllm_diffkv.kernels.prefill_attention.scored_prefill_attention`,
``TritonPageManager``, :func:`~trtllm_diffkv.kernels.decision_kernel.decide_rows` /
:func:`~trtllm_diffkv.kernels.decision_kernel.locate_rows`) on ``meta`` tensors of the engine's shapes with the
kernels replaced by recorders, so the argument order, types, constexprs, grids
and launch options are exactly those of the JIT path (nothing is restated by
hand except three CUDA-only launch choices the launchers make from the tensor's
device, :func:`.launches.cuda_launch_choices`), and each kernel is specialized as Triton's JIT
specializes that launch (:func:`.launches.jit_specialization`: divisibility by 16 of the
pointers and the engine-fixed integers, engine-fixed integers equal to 1 as constexprs). :func:`compile_specs` then compiles each with
``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", cc, 32))``
for sm_80 and sm_90 and writes PTX, cubin and ``manifest.json``.

Compilation needs Triton's compiler, not its interpreter: with
``TRITON_INTERPRET=1`` set (the CPU test suite), :func:`build_kernels` runs
the compilation in a child process without it
(``python -m trtllm_diffkv.export.aot``).

Manifest (``manifest.json``, version 1)::

    {"version": 1, "triton_version": ..., "engine": EngineShape.to_fields(),
     "targets": ["sm_80", "sm_90"],
     "kernels": [{"name", "op", "kernel": "module:function", "arg_names": [...all, in order],
                  "signature": {arg: "*fp16" | "i32" | "fp32" | "constexpr", ...},
                  "constexprs": {...}, "params": [runtime args in kernel-parameter order],
                  "grid": ["num_seqs", "num_kv_heads", "num_partitions * NCHUNK"],
                  "sizes": {named sizes of the recorded launch}, "scalars": {runtime scalar: recorded value},
                  "options": {"num_warps", "num_stages", ...}, "select": "condition or null",
                  "step_scalars": {runtime scalar that varies per call: expression of sizes/constexprs},
                  "divisible": [params compiled with tt.divisibility=16, as the JIT specializes them],
                  "buffers": [per pointer param: its buffer among the launch's distinct buffers],
                  "compiled": {"sm_90": {"kernel_name", "ptx", "cubin", "shared_bytes", "num_warps",
                               "num_stages", "global_scratch_bytes", "profile_scratch_bytes",
                               "extra_params": 2}}}],
     "trt_abi": [TensorRT-convention wrappers: export/trt_abi.py::AbiKernel.to_json()]}

A compiled kernel takes its runtime arguments (``params``) followed by
``extra_params`` (2 in Triton 3.6: the global and profile scratch pointers; null
when their sizes are 0). Block size: ``num_warps * 32`` threads. Grid expressions
use ``cdiv`` and the named sizes of ``sizes`` plus the constexprs. The ``trt_abi`` wrappers
(:func:`abi_kernels`) take TensorRT's AOT parameter list instead: inputs, int32 extra args, outputs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from . import trt_abi
from .fields import EngineShape
from .launches import (KernelSpec, Recorder, cuda_launch_choices, decode_constexpr, spec_name,
                       spec_of_launch)

SUPPORTED_TARGETS = (80, 90)
"""Compute capabilities engines are compiled for (A100: sm_80; H100/H200: sm_90)."""

MANIFEST_VERSION = 1


def _meta(shape, dtype):
    import torch

    return torch.empty(shape, dtype=dtype, device="meta")


def _write_read_specs(shape: EngineShape) -> list[KernelSpec]:
    import torch

    from ..kernels import quant_write as qw

    fmt, cfg, D = shape.page_format, shape.kv_config, shape.head_dim
    dt = getattr(torch, shape.dtype)
    n = 5  # rows of the recorded launch (any count: it only sets the grid)
    pages = _meta((7, fmt.page_size_bytes), torch.uint8)
    i32 = lambda: _meta((n,), torch.int32)  # noqa: E731
    centered = cfg.compress and cfg.center_keys
    meta = dict(scores=_meta((n,), torch.float32), positions=i32())
    err = dict(error_flags=_meta((n,), torch.int32), error_index=i32())
    offsets = dict(key_offsets=_meta((n, D), torch.float16), offset_rows=i32()) if centered else {}
    calls = [("write_high", "high", dt, {**offsets, **meta, **err})]  # prompt and decode tokens (int32 offset rows)
    if cfg.tiered:
        calls += [("write_low_prompt", "low", dt, {**offsets, **meta, **err}),  # low-tier prompt tokens
                  ("write_low_move", "low", torch.float32, meta)]  # demotions: dequantized fp32 rows
    if centered:  # the offset rows as PagedDiffKVCache passes them (int64 table rows: prefill and decode)
        rows64 = dict(offsets, offset_rows=_meta((n,), torch.int64))
        calls += [("write_high_cache", "high", dt, {**rows64, **meta, **err}),
                  ("write_low_prompt_cache", "low", dt, {**rows64, **meta, **err})]
    specs = []
    for op, tier, kdt, kwargs in calls:
        with Recorder([(qw, "_write_tokens_kernel")]) as rec:
            qw.write_tokens(pages, fmt, tier, i32(), i32(), _meta((n, D), kdt), _meta((n, D), kdt), **kwargs)
        specs.append(spec_of_launch(rec.launches[0], op, {"n_rows": n}))
    if cfg.tiered:
        with Recorder([(qw, "_read_tokens_kernel")]) as rec:
            qw.read_tokens(pages, fmt, "high", i32(), i32(), _meta((n, D), torch.float32),
                           _meta((n, D), torch.float32), _meta((n,), torch.float32), i32())
        specs.append(spec_of_launch(rec.launches[0], "read_high_move", {"n_rows": n}))
    return specs


def _decode_specs(shape: EngineShape) -> list[KernelSpec]:
    import torch

    from ..kernels import decode_attention as da
    from ..kernels.attn_decode_kernels import LOG2E

    fmt, R = shape.page_format, shape.max_pages_per_row
    B, H = shape.max_batch_size, shape.num_kv_heads
    rows = B * shape.num_layers * H
    ws = da.DecodeWorkspace.allocate(B, shape.num_heads, H, fmt, R, "meta", update_scores=shape.kv_config.tiered)
    q = _meta((B, shape.num_heads, shape.head_dim), getattr(torch, shape.dtype))
    with Recorder([(da, "_decode_partial_kernel"), (da, "_decode_merge_kernel"), (da, "_decode_score_kernel")]) as rec:
        da.paged_decode_attention(q, _meta((7, fmt.page_size_bytes), torch.uint8), fmt, _meta((rows, R), torch.int32),
                                  _meta((rows, 2), torch.int32), _meta((B, H), torch.int32), torch.empty_like(q),
                                  sm_scale=shape.head_dim ** -0.5, update_scores=shape.kv_config.tiered, workspace=ws,
                                  backend="triton")  # the AOT set holds the Triton kernels
    sizes = dict(num_seqs=B, num_kv_heads=H, num_partitions=ws.num_partitions, R=R)
    specs = [spec_of_launch(launch, "decode_attention", sizes) for launch in rec.launches]
    specs[0].scalars["qk_scale"] = f"sm_scale * {LOG2E}"  # the recorded value for head_dim ** -0.5, as a formula
    return specs


def _prefill_variants(shape: EngineShape) -> list[tuple[int, int]]:
    """[(first, last)] ranges of the step's longest prompt over which the prefill kernels' constexprs stay fixed."""
    from ..kernels.prefill_attention import LSE_CHUNK_TOKENS
    from ..kernels.sizes import next_pow2

    S = shape.kv_config.prompt_score_window_tokens
    key = lambda n: (max(16, next_pow2(min(S, n))), next_pow2(-(-n // LSE_CHUNK_TOKENS)))  # noqa: E731
    ranges, first = [], 1
    for n in range(2, shape.max_seq_len + 2):
        if n > shape.max_seq_len or key(n) != key(first):
            ranges.append((first, n - 1))
            first = n
    return ranges


def _prefill_specs(shape: EngineShape) -> list[KernelSpec]:
    import types

    import torch

    from ..kernels import prefill_attention as pa

    dt = getattr(torch, shape.dtype)
    specs = []
    fake_f = types.SimpleNamespace(scaled_dot_product_attention=lambda q, k, v, **kw: torch.empty_like(q))
    for first, last in _prefill_variants(shape):
        n = last  # one prompt of the range's longest length: every constexpr of the range
        q = _meta((n, shape.num_heads, shape.head_dim), dt)
        k, v = (_meta((n, shape.num_kv_heads, shape.head_dim), dt) for _ in range(2))  # distinct (the buffers)
        saved_f, pa.F = pa.F, fake_f
        try:
            with Recorder([(pa, "_prompt_lse_kernel"), (pa, "_prompt_lse_merge_kernel"),
                            (pa, "_prompt_score_kernel")]) as rec:
                pa.scored_prefill_attention(q, k, v, torch.tensor([0, n], dtype=torch.int32),
                                            sm_scale=shape.head_dim ** -0.5,
                                            num_scoring_queries=shape.kv_config.prompt_score_window_tokens,
                                            out=torch.empty_like(q), score_sums=_meta((n, shape.num_kv_heads),
                                                                                      torch.float32))
        finally:
            pa.F = saved_f
        sizes = dict(num_seqs=1, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, max_len=n)
        specs += [spec_of_launch(launch, "prefill_scores", sizes, select=f"{first} <= max_len <= {last}")
                  for launch in rec.launches]
    return specs


def _page_manager_specs(shape: EngineShape) -> list[KernelSpec]:
    import torch

    from ..memory import triton_page_manager as tpm

    mgr = tpm.TritonPageManager(shape.page_format, 64, shape.max_batch_size, shape.num_layers, shape.num_kv_heads,
                                shape.max_seq_len, device="meta")
    n = min(2, shape.max_batch_size)
    slots = _meta((n,), torch.int64)  # the dtypes PagedDiffKVCache passes (paged/prefill.py, decode.py, cache.py)
    per_head = lambda: _meta((n, shape.num_layers, shape.num_kv_heads), torch.int32)  # noqa: E731 - distinct buffers
    kernels = ["_count_kernel", "_scan_kernel", "_reserve_apply_kernel", "_commit_apply_kernel",
               "_decode_apply_kernel", "_release_apply_kernel"]
    specs = []
    for scan_chunk in (tpm.SCAN_CHUNK, 0):  # fused (block sums fit one chunk), then the separate scan launch
        mgr.scan_chunk = scan_chunk
        with Recorder([(tpm, k) for k in kernels]) as rec:
            mgr.reserve_prompt(slots, _meta((n,), torch.int64))
            mgr.commit_prompt(slots, per_head(), per_head())
            mgr.append_decode(slots, per_head(), per_head())
            mgr.release(slots)
        sizes = dict(num_slots=n, rows_per_slot=mgr.rows_per_slot, num_pages=mgr.num_pages)
        for launch in rec.launches:
            fused = launch[3].get("FUSED")
            select = None if fused is None else ("num_blocks <= CHUNK" if fused else "num_blocks > CHUNK")
            spec = spec_of_launch(launch, "page_manager", sizes, select)
            if "CHUNK" in spec.constexprs:  # chunk 0 only forced the unfused path; the kernels use the real one
                spec.constexprs["CHUNK"] = tpm.SCAN_CHUNK
            specs.append(spec)
    return specs


def _decision_specs(shape: EngineShape) -> list[KernelSpec]:
    """The decode plan's two kernels (``kernels/decision_kernel.py``), recorded as ``paged/decode.py::plan_device``
    launches them: ``decide_rows`` (the DiffKV tier decisions of every row; ``COMPRESS`` = the preset's) and
    ``locate_rows`` (token and move locations; ``MOVES`` = the preset tiers its tokens) for a bucket of
    ``max_batch_size`` sequences. The moves themselves are the write family's ``read_high_move`` /
    ``write_low_move``."""
    import torch

    from ..kernels import decision_kernel as dk

    fmt, cfg, R = shape.page_format, shape.kv_config, shape.max_pages_per_row
    L, H, B = shape.num_layers, shape.num_kv_heads, shape.max_batch_size
    G = L * H
    n = min(2, B)  # real sequences of the recorded step (any count: it only sets the grids)
    i32, i64 = torch.int32, torch.int64
    table, tokens = _meta((B * G, R), i32), _meta((B * G, 2), i32)
    slots, pos = _meta((n,), i64), _meta((n,), i64)
    m = n * G
    actions = (_meta((m,), i32), _meta((m,), i32), _meta((m,), i64), _meta((m,), i64), _meta((m,), i64))
    located = (_meta((L, B, H), i64), _meta((L, B, H), i32), _meta((L, B, H), i32), _meta((L, B, H), i32),
               _meta((B * H,), i32), _meta((B * H,), i32))  # rows, row_ids, page, slot, positions, err_idx
    moves = tuple(_meta((m,), i32) for _ in range(4)) if cfg.tiered else None
    with Recorder([(dk, "_decide_kernel"), (dk, "_locate_kernel")]) as rec:
        act = dk.decide_rows(_meta((7, fmt.page_size_bytes), torch.uint8), fmt, table, tokens, slots, pos,
                             _meta((B,), i64), _meta((2,), torch.float64), rows_per_slot=G,
                             recent_window_tokens=cfg.recent_window_tokens,
                             prompt_score_window_tokens=cfg.prompt_score_window_tokens, out=actions,
                             compress=cfg.tiered)
        dk.locate_rows(table, fmt, slots, pos, act, located, moves, num_kv_heads=H, rows_per_slot=G)
    sizes = dict(num_seqs=n, bucket=B, rows_per_slot=G)
    return [spec_of_launch(launch, "decode_plan", sizes) for launch in rec.launches]


DEFAULT_OPS = ("write", "decode", "prefill", "page_manager", "decision")
"""Every kernel family of an engine (:func:`kernel_specs`)."""


def kernel_specs(shape: EngineShape, ops: tuple[str, ...] = DEFAULT_OPS) -> list[KernelSpec]:
    """Every kernel specialization ``shape`` needs (deduplicated), as launched on CUDA.

    Args:
        shape: the engine.
        ops: which families: ``"write"`` (write/read), ``"decode"``, ``"prefill"``, ``"page_manager"``,
            ``"decision"`` (the decode plan: DiffKV decisions and token locations).

    Raises:
        KeyError: an unknown family.

    Returns:
        Specs named ``<kernel>__<hash>`` (hash of signature, constexprs and options), in a stable order.
    """
    makers = {"write": _write_read_specs, "decode": _decode_specs, "prefill": _prefill_specs,
              "page_manager": _page_manager_specs, "decision": _decision_specs}
    out, seen = [], {}
    for op in ops:
        for spec in makers[op](shape):
            spec = cuda_launch_choices(spec)
            digest = spec_name(spec)
            if digest in seen:  # same kernel for another range of the longest prompt: widen its range
                seen[digest].select = _merge_ranges(seen[digest].select, spec.select)
                continue
            spec.name = digest
            seen[digest] = spec
            out.append(spec)
    return out


def _merge_ranges(a: str | None, b: str | None) -> str | None:
    """``"lo <= max_len <= hi"`` conditions of adjacent prefill ranges joined (other conditions kept as they are)."""
    if a is None or b is None or "max_len" not in a or a == b:
        return a
    (lo_a, hi_a), (lo_b, hi_b) = ([int(x) for x in c.split(" <= max_len <= ")] for c in (a, b))
    if lo_b != hi_a + 1:
        raise AssertionError(f"prefill ranges {a!r} and {b!r} are not adjacent")
    return f"{lo_a} <= max_len <= {hi_b}"


# --------------------------------------------------------------------------- compilation


def compile_specs(specs: list[KernelSpec], out_dir: str | Path, targets=SUPPORTED_TARGETS) -> None:
    """Compile every spec for every target; write ``<name>.sm<cc>.ptx`` / ``.cubin`` and fill ``spec.compiled``.

    Raises:
        RuntimeError: ``TRITON_INTERPRET=1`` is set (the interpreter cannot compile), or a kernel fails
            to compile (naming it and the target).
        ValueError: an unsupported target.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 is set: Triton's interpreter cannot compile; use build_kernels(), "
                           "which compiles in a child process")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    check_targets(targets)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        constexprs = {k: decode_constexpr(v) for k, v in spec.constexprs.items()}
        attrs = {(spec.arg_names.index(n),): [["tt.divisibility", 16]] for n in spec.divisible}  # as the JIT's
        for cc in targets:
            src = ASTSource(fn=spec.jit_function(), signature=dict(spec.signature), constexprs=constexprs,
                            attrs=attrs)
            try:
                compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(spec.options))
            except Exception as exc:  # noqa: BLE001 - report which kernel and target
                raise RuntimeError(f"{spec.name} failed to compile for sm_{cc}: {str(exc)[:400]}") from exc
            md = compiled.metadata
            stem = f"{spec.name}.sm{cc}"
            (out / f"{stem}.ptx").write_text(compiled.asm["ptx"])
            (out / f"{stem}.cubin").write_bytes(compiled.asm["cubin"])
            spec.compiled[f"sm_{cc}"] = dict(
                kernel_name=md.name, ptx=f"{stem}.ptx", cubin=f"{stem}.cubin", shared_bytes=int(md.shared),
                num_warps=int(md.num_warps), num_stages=int(md.num_stages), maxnreg=md.maxnreg,
                global_scratch_bytes=int(md.global_scratch_size), profile_scratch_bytes=int(md.profile_scratch_size),
                extra_params=_extra_params(compiled.asm["ptx"], md.name, len(spec.params)),
                cubin_sha256=hashlib.sha256(compiled.asm["cubin"]).hexdigest())


def check_targets(targets) -> None:
    """Raise ``ValueError`` for a compute capability outside :data:`SUPPORTED_TARGETS` (naming it), or one listed
    twice (``--targets 90,90``: the same files would be compiled twice and listed twice in the manifest)."""
    targets = list(targets)
    for cc in targets:
        if cc not in SUPPORTED_TARGETS:
            raise ValueError(f"target sm_{cc} is not supported; supported: {['sm_%d' % t for t in SUPPORTED_TARGETS]}")
    repeated = sorted({cc for cc in targets if targets.count(cc) > 1})
    if repeated:
        raise ValueError(f"target(s) {', '.join('sm_%d' % cc for cc in repeated)} listed more than once: {targets}")


def _extra_params(ptx: str, kernel_name: str, runtime_params: int) -> int:
    """Parameters of the PTX entry beyond the runtime arguments (Triton 3.6: 2 scratch pointers)."""
    return len(trt_abi.ptx_entry_params(ptx, kernel_name)) - runtime_params


def manifest(shape: EngineShape, specs: list[KernelSpec], targets=SUPPORTED_TARGETS) -> dict:
    """The manifest dict (see the module docstring)."""
    import triton

    return {"version": MANIFEST_VERSION, "triton_version": triton.__version__, "engine": shape.to_fields(),
            "targets": [f"sm_{cc}" for cc in targets], "kernels": [s.to_json() for s in specs]}


def build_kernels(shape: EngineShape, out_dir: str | Path, targets=SUPPORTED_TARGETS,
                  ops: tuple[str, ...] = DEFAULT_OPS, timeout_s: int = 1800) -> dict:
    """Compile ``shape``'s kernels into ``out_dir`` and write ``out_dir/manifest.json``; returns the manifest.

    Runs in this process, or in a child process without ``TRITON_INTERPRET`` when it is set here.

    Raises:
        RuntimeError: compilation failed (the child's last error line).
    """
    check_targets(targets)
    out = Path(out_dir)
    if os.environ.get("TRITON_INTERPRET") == "1":
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        repo = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "trtllm_diffkv.export.aot", "--fields", json.dumps(shape.to_fields()),
               "--out", str(out), "--targets", ",".join(map(str, targets)), "--ops", ",".join(ops)]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if run.returncode != 0:
            lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
            raise RuntimeError(lines[-1] if lines else f"AOT compilation failed (exit {run.returncode})")
        return json.loads((out / "manifest.json").read_text())
    specs = kernel_specs(shape, ops)
    compile_specs(specs, out, targets)
    data = manifest(shape, specs, targets)
    abi = abi_kernels(shape, data["kernels"])
    trt_abi.compile_abi(abi, out, targets)
    data["trt_abi"] = [k.to_json() for k in abi]
    (out / "manifest.json").write_text(json.dumps(data, indent=1))
    return data


def abi_kernels(shape: EngineShape, entries: list[dict]) -> list:
    """The TensorRT-convention wrappers an engine needs (``export/trt_abi.py``): every entry as its launcher binds it,
    plus the bindings of the AOT prefill and decode graphs (fp32 engines, ``export/aot_prefill.py::prefill_graph_abi``,
    ``export/aot_graph.py::decode_graph_abi``), deduplicated."""
    from .aot_graph import decode_graph_abi
    from .aot_prefill import prefill_graph_abi

    out = {k.name: k for k in (trt_abi.from_launcher(e) for e in entries)}
    by_name = {e["name"]: e for e in entries}
    for k in [*prefill_graph_abi(shape, by_name), *decode_graph_abi(shape, by_name)]:
        out.setdefault(k.name, k)
    return list(out.values())


def main(argv: list[str] | None = None) -> int:
    """``python -m trtllm_diffkv.export.aot --fields JSON --out DIR [--targets 80,90] [--ops ...]``."""
    parser = argparse.ArgumentParser(description="compile an engine's DiffKV kernels ahead of time")
    parser.add_argument("--fields", required=True, help="EngineShape.to_fields() as JSON")
    parser.add_argument("--out", required=True)
    parser.add_argument("--targets", default="80,90")
    parser.add_argument("--ops", default=",".join(DEFAULT_OPS))
    args = parser.parse_args(argv)
    shape = EngineShape.from_fields(json.loads(args.fields))
    targets = tuple(int(t) for t in args.targets.split(","))
    build_kernels(shape, args.out, targets, tuple(args.ops.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
