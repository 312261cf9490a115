"""The decode attention's partial kernel in CUDA C++ (``cuda/decode_partial.cu``), compiled with NVRTC.

Why a second implementation: the Triton partial kernel stalls at 43 % of the copy bandwidth (Llama-3-8B
shape, all-high) and 11-24 % on the low tier (docs/PERFORMANCE.md, issue 6), because Triton moves every
dequantized tile through shared memory into the matrix-unit layout. The CUDA kernel loads the codes
into the ``mma.sync`` fragment registers without a shared-memory transpose (by default from a per-warp ring of
page buffers that ``cp.async`` fills ahead of the work, :data:`STAGES`), keeps the probabilities in registers
(``movmatrix`` turns the first product's accumulator into the second product's operand) and has no
barrier in its page loop; see the header of the ``.cu`` file for the design.

It writes the same :class:`~.decode_attention.DecodeWorkspace` buffers as the Triton partial kernel
(one slot per CTA: up to ``2 * num_partitions`` CTAs per row, :func:`cuda_num_slots` of them a launch through
:class:`CudaDecodeKernels`). The merge after it is CUDA too
(``cuda/decode_merge.cu``): the Triton merge's arithmetic with the score update folded into the same
launch (the update needs the final log-sum-exp the merge computes; one launch per layer instead of two).
The Triton kernel stays the portable path for everything this one does not
cover (:func:`unsupported_reason`).

Known limit: the kernel dequantizes values in fp16 (``s c + z`` rounded to fp16), so a value group whose
stored maximum ``zero + (2**bits - 1) * scale`` lies within one scale rounding of fp16's largest value
(65504) reads back as ``inf`` here where the Triton kernel (fp32 accumulation of ``p s`` and ``p z``) stays
finite. The page format's fp16 scale/zero already restrict stored K/V to fp16's range; this narrows it by
about 0.1 % at the top.

Compilation: NVRTC through CuPy (``cupy.RawModule``), a few seconds per configuration on first use,
cached per process; no torch headers, no ninja. Launches go on torch's current stream, so they are
captured by CUDA graphs like the Triton launches.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from ..memory.page_format import PageFormat, TierLayout

SOURCE_PATH = Path(__file__).with_name("cuda") / "decode_partial.cu"
MERGE_SOURCE_PATH = Path(__file__).with_name("cuda") / "decode_merge.cu"
WARPS = 4
BACKEND_ENV = "TRTLLM_DIFFKV_DECODE_BACKEND"
"""Environment override of the decode backend: ``auto`` (default), ``cuda`` or ``triton``."""
BACKENDS = ("auto", "cuda", "triton")


def _tier_reason(lay: TierLayout, head_dim: int) -> str | None:
    tier = lay.tier
    if tier.key_bits not in (8, 4):
        return f"tier {tier.name}: key_bits={tier.key_bits} (the CUDA kernel reads 8- or 4-bit keys)"
    if tier.value_bits not in (8, 4, 2):
        return f"tier {tier.name}: value_bits={tier.value_bits} (the CUDA kernel reads 8-, 4- or 2-bit values)"
    if head_dim % tier.key_groups or head_dim % tier.value_groups:
        return f"tier {tier.name}: groups do not divide head_dim={head_dim}"
    key_group_bytes = head_dim // tier.key_groups * tier.key_bits // 8
    if key_group_bytes % 16:
        return f"tier {tier.name}: {tier.key_groups} key groups of {tier.key_bits} bits are not 16-byte chunks"
    dims_per_lane = head_dim // 8
    if (head_dim // tier.value_groups) % dims_per_lane:
        return f"tier {tier.name}: {tier.value_groups} value groups are narrower than {dims_per_lane} dims"
    # the lanes read codes with up to 16-byte vector loads and meta/scores as 4-byte words
    for seg, need in (("key_codes", 16), ("value_codes", 16), ("key_meta", 4), ("value_meta", 4), ("score", 4)):
        offset = lay.segment(seg).offset_bytes
        if offset % need:
            return f"tier {tier.name}: the {seg} segment starts at byte {offset}, not a multiple of {need}"
    return None


@functools.lru_cache(maxsize=256)  # asked per layer and step on eager paths; the answer depends on these alone
def unsupported_reason(page_format: PageFormat, num_heads: int, num_kv_heads: int,
                       q_dtype: torch.dtype) -> str | None:
    """Why the CUDA kernel cannot run this configuration, or ``None`` when it can.

    Covered: head_dim 64 or 128, query:KV head ratio 1-8, fp16 or bf16 queries (bf16 is converted
    to fp16 for the products, as the Triton path does), tiers with 8- or 4-bit keys and 8-, 4- or
    2-bit values whose groups fit the lanes' chunks (every compressing preset of ``config.PRESETS``).
    Everything else runs on the Triton kernel.
    """
    head_dim = page_format.head_dim
    if page_format.page_size_bytes % 16:
        return f"page size {page_format.page_size_bytes} bytes is not a multiple of 16 (the kernel's vector loads)"
    if head_dim not in (64, 128):
        return f"head_dim={head_dim} (the CUDA kernel covers 64 and 128)"
    if num_kv_heads < 1 or num_heads % num_kv_heads or num_heads // num_kv_heads > 8:
        return f"query:KV head ratio {num_heads}/{num_kv_heads} (the CUDA kernel covers 1-8)"
    if q_dtype not in (torch.float16, torch.bfloat16):
        return f"query dtype {q_dtype} (the CUDA kernel takes fp16/bf16)"
    for lay in (page_format.high, page_format.low):
        reason = _tier_reason(lay, head_dim)
        if reason:
            return reason
    return None


@functools.lru_cache(maxsize=1)
def runtime_reason() -> str | None:
    """Why the CUDA kernel cannot be compiled and launched in this process (``None``: it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return f"compute capability {major}.x (mma.sync m16n8k16 and movmatrix need sm_80+)"
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or a CuPy build that does not match the driver
        return f"CuPy (NVRTC) is not importable: {type(exc).__name__}: {exc}"
    return None


def configured_backend() -> str:
    """The decode backend named by :data:`BACKEND_ENV` (unset or empty: ``"auto"``; case and spaces ignored).

    Raises:
        ValueError: a value that is not one of :data:`BACKENDS`, naming the variable.
    """
    raw = os.environ.get(BACKEND_ENV, "")
    value = raw.strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={raw!r} is not one of {BACKENDS}")
    return value


def resolve_backend(backend: str | None, page_format: PageFormat, num_heads: int, num_kv_heads: int,
                    q: torch.Tensor) -> str:
    """``"cuda"`` or ``"triton"`` for one call on ``q``: :func:`choose_backend` with ``q``'s dtype and device."""
    return choose_backend(backend, page_format, num_heads, num_kv_heads, q.dtype, q.is_cuda)


def choose_backend(backend: str | None, page_format: PageFormat, num_heads: int, num_kv_heads: int,
                   q_dtype: torch.dtype, on_cuda: bool) -> str:
    """``"cuda"`` or ``"triton"`` for decode attention of this shape, query dtype and device.

    ``backend``: ``"auto"``/``None`` (the environment variable :data:`BACKEND_ENV`, default ``auto``:
    CUDA where it can run, else Triton), ``"cuda"`` (required: raises when it cannot run), ``"triton"``.

    Raises:
        ValueError: an unknown backend name, or ``"cuda"`` for a configuration or machine it cannot run
            (the message names the reason, and the environment variable when the choice came from it).
    """
    source = "the CUDA decode kernel"
    if backend is None:
        backend = configured_backend()
        source = f"{BACKEND_ENV}=cuda, but the CUDA decode kernel"
    elif backend not in BACKENDS:
        raise ValueError(f"decode backend {backend!r} is not one of {BACKENDS}")
    if backend == "triton":
        return "triton"
    reason = None if on_cuda else "the tensors are not on a CUDA device"
    reason = reason or unsupported_reason(page_format, num_heads, num_kv_heads, q_dtype) or runtime_reason()
    if reason is None:
        return "cuda"
    if backend == "cuda":
        raise ValueError(f"{source} cannot run here: {reason}")
    return "triton"


STAGES = 2
"""Page buffers per warp of the partial kernel's shared-memory ring (``cp.async``; 0: the register path, which
reads each page straight into registers; the TensorRT AOT build keeps 0, see :func:`partial_shared_bytes`)."""


KEY_FOLD = 1
"""1: the key products run on ``1024 + code`` and the offset is folded into the zero-point term (``decode_partial.cu``,
``KEY_FOLD``); 0: a half2 subtraction per two key codes (the A/B baseline)."""

MERGE_PREFETCH = 1
"""1: the staged partial kernel, once its pages are read, asks L2 to keep what the merge reads of them next
(``MERGE_PREFETCH`` in ``decode_partial.cu``: a ``prefetch.global.L2::evict_last`` per 128 bytes of each page's score
segment, which the score update reads and rewrites, and of the probabilities and maxima the CTA has just written);
0: no prefetch. H100, 2026-12-06, executor steps, Llama-3-8B 48 x 4096, A/B in one call: score segments alone 11.394
against 11.467 ms without (merge 486 against 522 us a step); with the probabilities and maxima too (issued before the
warps' merge) 11.254 against 11.336 / 11.337 for the score segments alone (merge 453 against 485 us a step); in its
place now, after the partial states' stores, against ``208333b``'s tree in one call: merge 450 against 486 us, partial
kernel 4208 against 4287 us a step. docs/PERFORMANCE.md (the score-segment A/B:
docs/PERFORMANCE.md, "Decode step"). The register path (the TensorRT AOT build) keeps 0."""

SHARED_RESERVED_BYTES = 1024
"""Shared memory the runtime reserves per CTA on sm_80 and later (CUDA C++ Programming Guide, "Shared Memory"
of compute capabilities 8.x/9.x): a CTA of ``n`` dynamic bytes takes ``n + 1024`` of its multiprocessor's."""

SM90_SHARED_LIMITS = (227 * 1024, 228 * 1024)
"""``(opt-in bytes per block, bytes per multiprocessor)`` of sm_90 (H100/H200): the limits
:func:`compile_defines` assumes when not given a device's (the CPU compile tests). sm_80 has 163/164 KiB,
sm_86/89/120 99/100 KiB (:func:`device_shared_limits` reads them)."""


@functools.lru_cache(maxsize=16)
def device_shared_limits(device: int) -> tuple[int, int]:
    """``(opt-in shared bytes per block, shared bytes per multiprocessor)`` of CUDA device ``device`` (torch's
    device properties, else CuPy's ``MaxSharedMemoryPerBlockOptin`` / ``MaxSharedMemoryPerMultiprocessor``)."""
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    per_sm = getattr(props, "shared_memory_per_multiprocessor", None)
    if not optin or not per_sm:
        import cupy

        attrs = cupy.cuda.Device(device).attributes
        optin, per_sm = attrs["MaxSharedMemoryPerBlockOptin"], attrs["MaxSharedMemoryPerMultiprocessor"]
    return int(optin), int(per_sm)


def register_min_blocks(head_dim: int) -> int:
    """``__launch_bounds__`` blocks per multiprocessor of the register path (168 / 128 registers at head_dim
    128 / 64: the caps whose small spills ``tests/kernels/test_cuda_decode.py`` bounds), also the floor of the
    staged path's step-down (:func:`launch_partial`)."""
    return 3 if head_dim == 128 else 4


def staged_min_blocks(head_dim: int) -> int:
    """Preferred blocks per multiprocessor of the staged path (128 / 80 registers at head_dim 128 / 64; the ring
    frees the registers the register path holds pages in; H200 sweep, ``benchmarks/results/sweep_kv.json``, ``partial_*``)."""
    return 4 if head_dim == 128 else 6


def stage_copy_bytes(lay: TierLayout) -> int:
    """Bytes of a page of this tier the staged kernel copies: ``[0, end of its last code or scale segment)``,
    rounded up to 16 (the ``cp.async`` chunk); the scores and positions are not read by the partial kernel."""
    end = max(s.offset_bytes + s.size_bytes for s in (lay.key_codes, lay.key_meta, lay.value_codes, lay.value_meta))
    return -(-end // 16) * 16


def partial_shared_bytes(page_format: PageFormat, stages: int) -> int:
    """Dynamic shared memory of one partial-kernel CTA, bytes: ``WARPS * stages`` page buffers (page size rounded
    up to 16), at least the warps' merge arrays that reuse them; 0 for the register path (``stages == 0``, whose
    arrays are static)."""
    if stages == 0:
        return 0
    merge = WARPS * 8 * 4 * 2 + WARPS * 8 * page_format.head_dim * 4
    return max(WARPS * stages * (-(-page_format.page_size_bytes // 16) * 16), merge)


def compile_defines(page_format: PageFormat, group: int, group_pad: int, block_d: int, pmax: int,
                    store_probs: bool, min_blocks: int | None = None, stages: int | None = None,
                    shared_limits: tuple[int, int] | None = None) -> dict[str, int]:
    """The ``-D`` macros of one configuration (also used by the CPU compile test with nvcc).

    ``shared_limits``: the device's ``(opt-in bytes per block, bytes per multiprocessor)``
    (:func:`device_shared_limits`; default :data:`SM90_SHARED_LIMITS`).
    ``stages``: page buffers per warp (default :data:`STAGES`, or 0 = the register path where that ring is
    above the per-block opt-in limit or leaves room for fewer CTAs a multiprocessor than the register path runs:
    sm_86/89/120's 100 KiB hold one head_dim-128 ring of 54 KiB, three at head_dim 64).
    ``min_blocks``: ``__launch_bounds__`` blocks per multiprocessor (default: staged,
    :func:`staged_min_blocks` or as many CTAs as the multiprocessor's shared memory holds
    (``bytes + SHARED_RESERVED_BYTES`` each), whichever is fewer; register path, :func:`register_min_blocks`).

    Raises:
        ValueError: ``stages`` of 1 or below 0 (a ring needs two buffers), or a ring above the opt-in limit.
    """
    head_dim = page_format.head_dim
    optin, per_sm = SM90_SHARED_LIMITS if shared_limits is None else shared_limits
    if stages is None:  # the ring where it fits and holds at least the register path's CTAs a multiprocessor
        ring = partial_shared_bytes(page_format, STAGES)
        stages = STAGES if ring <= optin and per_sm // (ring + SHARED_RESERVED_BYTES) >= \
            register_min_blocks(head_dim) else 0
    if stages < 0 or stages == 1:
        raise ValueError(f"stages={stages}: 0 (registers) or >= 2 page buffers a warp")
    shared_bytes = partial_shared_bytes(page_format, stages)
    if shared_bytes > optin:
        raise ValueError(f"stages={stages}: a ring of {shared_bytes} shared bytes a CTA exceeds the device's "
                         f"{optin}-byte opt-in limit")
    if min_blocks is None:
        min_blocks = max(1, min(staged_min_blocks(head_dim), per_sm // (shared_bytes + SHARED_RESERVED_BYTES))) \
            if stages else register_min_blocks(head_dim)
    d = dict(HEAD_DIM=head_dim, GROUP=group, GROUP_PAD=group_pad, BLOCK_D=block_d, PMAX=pmax,
             PAGE_BYTES=page_format.page_size_bytes, STORE_PROBS=int(store_probs), WARPS=WARPS,
             MIN_BLOCKS=min_blocks, SCORE_WARPS=SCORE_WARPS, STAGES=stages, KEY_FOLD=KEY_FOLD,
             MERGE_PREFETCH=MERGE_PREFETCH if stages else 0)
    for prefix, lay in (("H", page_format.high), ("L", page_format.low)):
        t = lay.tier
        d[f"{prefix}_COPY"] = stage_copy_bytes(lay)
        d.update({f"{prefix}_TOKENS": lay.tokens_per_page, f"{prefix}_KB": t.key_bits,
                  f"{prefix}_KG": t.key_groups, f"{prefix}_VB": t.value_bits, f"{prefix}_VG": t.value_groups,
                  f"{prefix}_KC": lay.key_codes.offset_bytes, f"{prefix}_KM": lay.key_meta.offset_bytes,
                  f"{prefix}_VC": lay.value_codes.offset_bytes, f"{prefix}_VM": lay.value_meta.offset_bytes,
                  f"{prefix}_SC": lay.score.offset_bytes})
    return d


@functools.lru_cache(maxsize=64)
def _kernel(defines: tuple[tuple[str, int], ...], arch: str, shared_bytes: int = 0, device: int | None = None):
    """``(diffkv_decode_partial, diffkv_decode_scores)`` of ``decode_partial.cu`` at these macros (with
    ``FUSED_MERGE=1`` in them: ``(diffkv_decode_attend, None)`` of :func:`fused_source`), loaded on CUDA
    device ``device`` (``None``: the current one), the partial kernel allowed ``shared_bytes`` of dynamic shared
    memory (above the default 48 KiB needs the attribute, which belongs to one device's function: the module is
    compiled, loaded and given it with that device current, and cached per device)."""
    import cupy

    fused = dict(defines).get("FUSED_MERGE", 0)
    with cupy.cuda.Device(cupy.cuda.runtime.getDevice() if device is None else device):
        module = _module(fused_source() if fused else SOURCE_PATH.read_text(), defines)
        partial = module.get_function("diffkv_decode_attend" if fused else "diffkv_decode_partial")
        if shared_bytes > 48 * 1024:
            partial.max_dynamic_shared_size_bytes = shared_bytes
        return partial, None if fused else module.get_function("diffkv_decode_scores")


# Local memory a staged partial kernel may use and keep its cap: NVRTC (CUDA 13.0) gives the Llama-3-8B shape's
# kernel (head_dim 128, group 4) 8 bytes at 4 CTAs a multiprocessor (nvcc 13.0's frontend: none), and that kernel ran
# faster than the spill-free one at 3 CTAs (168 registers): 48 x 4096, all-high pages 114.3 vs 118.1 us, 85 % high
# 116.7 vs 118.7 us (H200, benchmarks/results/sweep_kv.json, min_blocks, before the merge prefetch). With the prefetch
# (its second form at 4 CTAs, 8 bytes, 128 registers) the 4-CTA kernel is not faster everywhere: H100 executor steps
# 1.9 % faster at 64 x 1024, 0.6-1.1 % slower at 48 x 4096 and 16 x 4096, where the launch's CTAs fit 3 CTAs a
# multiprocessor anyway (H100 A/B of 2026-12-06, docs/PERFORMANCE.md). More steps down (_spill_free_kernel).
# tests/kernels/test_cuda_decode_nvrtc.py compiles the kernel with that NVRTC on the CPU machine.
LOCAL_BYTES_TOLERATED = 8


def _prefetches(defines: dict[str, int]) -> bool:
    """Whether the partial CTA issues the merge prefetch at these macros (``partial_cta<PREFETCH>`` in
    ``decode_partial.cu``: the fused kernel with its score update, or the partial kernel with ``MERGE_PREFETCH``)."""
    if defines.get("FUSED_MERGE", 0):
        return bool(defines.get("SCORES", 0))
    return bool(defines.get("MERGE_PREFETCH", 0) and defines.get("STORE_PROBS", 0))


@functools.lru_cache(maxsize=64)
def _cap_kernel(defines: tuple[tuple[str, int], ...], arch: str, shared_bytes: int, device: int):
    """:func:`_kernel` at ``defines``' cap with the merge prefetch's form chosen: where the CTA issues the prefetch
    (:func:`_prefetches`) and ``defines`` do not name ``PREFETCH_RELOAD``, the first form (``0``: the page loop's
    bounds and pointers kept live for it) and, when that uses more than :data:`LOCAL_BYTES_TOLERATED` bytes of local
    memory, the second (``1``: the row's bounds and page ids loaded again after the loop); the first within the
    tolerance, else the one with less local memory (the first on a tie). NVRTC 13.0 spills less with one or the other
    depending on the shape: Llama-3-8B's head_dim 128 / group 4 at 4 CTAs 16 bytes with ``0``, 8 with ``1``; with
    bf16 queries ``k8v4`` head_dim 128 group 8 at 3 CTAs 0 with ``0``, 64 with ``1``. Returns ``(partial, scores)``;
    the partial function's local memory is its ``local_size_bytes``."""
    d = dict(defines)
    if "PREFETCH_RELOAD" in d or not _prefetches(d):
        return _kernel(defines, arch, shared_bytes, device)
    built = []
    for form in (0, 1):
        d["PREFETCH_RELOAD"] = form
        partial, scores = _kernel(tuple(sorted(d.items())), arch, shared_bytes, device)
        if partial.local_size_bytes <= LOCAL_BYTES_TOLERATED:
            return partial, scores
        built.append((partial, scores))
    return min(built, key=lambda b: b[0].local_size_bytes)


@functools.lru_cache(maxsize=64)
def _spill_free_kernel(defines: tuple[tuple[str, int], ...], arch: str, shared_bytes: int, device: int):
    """:func:`_cap_kernel` of the staged path at the most blocks per multiprocessor (from ``defines``' ``MIN_BLOCKS``
    down to :func:`register_min_blocks`) whose partial kernel uses at most :data:`LOCAL_BYTES_TOLERATED` bytes of
    local memory (register spills: ptxas spills 4-60 bytes at 6 CTAs of head_dim 64 for group 1 and for 2-bit low
    tiers, at 4 CTAs of head_dim 128 for ``default-k8v2`` / ``k8v4`` at group 8, nvcc 13.0, sm_90a; NVRTC 13.0 with
    the prefetch's first form alone made Llama-3-8B's kernel step down to 3 CTAs). Returns ``(partial, scores,
    min_blocks)``. tests/kernels/test_cuda_decode_nvrtc.py runs this on NVRTC's spills on the CPU machine."""
    d = dict(defines)
    floor = min(d["MIN_BLOCKS"], register_min_blocks(d["HEAD_DIM"]))
    for mb in range(d["MIN_BLOCKS"], floor - 1, -1):
        d["MIN_BLOCKS"] = mb
        partial, scores = _cap_kernel(tuple(sorted(d.items())), arch, shared_bytes, device)
        if mb == floor or partial.local_size_bytes <= LOCAL_BYTES_TOLERATED:
            return partial, scores, mb
    raise AssertionError("unreachable")


@functools.lru_cache(maxsize=64)
def _merge_kernel(defines: tuple[tuple[str, int], ...], arch: str, device: int | None = None):
    """``diffkv_decode_merge`` of :func:`merge_source` at these macros, loaded on CUDA device ``device`` (``None``:
    the current one; a loaded function belongs to one device, as in :func:`_kernel`)."""
    import cupy

    with cupy.cuda.Device(cupy.cuda.runtime.getDevice() if device is None else device):
        return _module(merge_source(), defines).get_function("diffkv_decode_merge")


def clear_compiled_kernels() -> None:
    """Drop every compiled kernel this module holds (:func:`_kernel`, :func:`_cap_kernel`, :func:`_spill_free_kernel`,
    :func:`_merge_kernel`): the next launch or resolve compiles again. For whoever swaps the compiler underneath
    (tests with a faked CuPy, ``tests/support/nvrtc.py``); a running process never needs it."""
    for cache in (_kernel, _cap_kernel, _spill_free_kernel, _merge_kernel):
        cache.cache_clear()


HELPERS_END = "// (end of the helpers cuda/decode_merge.cu is compiled after"


def merge_source(merge_text: str | None = None) -> str:
    """The merge kernel's translation unit: ``decode_partial.cu``'s leading helpers (types, PTX wrappers; no
    macros needed), then ``decode_merge.cu`` (or ``merge_text``: another version of that file, e.g. an earlier
    commit's, which ``tools/sweep_kv_gpu.py`` times beside this one)."""
    partial = SOURCE_PATH.read_text()
    merge = MERGE_SOURCE_PATH.read_text() if merge_text is None else merge_text
    return partial[:partial.index(HELPERS_END)] + merge


def fused_source() -> str:
    """The fused kernel's translation unit (``diffkv_decode_attend``): the whole of ``decode_partial.cu``, then
    ``decode_merge.cu``; compiled with :func:`fused_defines` (``FUSED_MERGE=1`` leaves out the two files' separate
    kernels)."""
    return SOURCE_PATH.read_text() + "\n" + MERGE_SOURCE_PATH.read_text()


def _module(code: str, defines: tuple[tuple[str, int], ...]):
    import cupy

    # CuPy picks the -arch of the current device itself (the callers' ``arch`` only keys their caches)
    options = ("-std=c++17",) + tuple(f"-D{k}={v}" for k, v in defines)
    return cupy.RawModule(code=code, options=options)


def _ptr(t: torch.Tensor):
    """A tensor's device address as the kernel's pointer argument (8 bytes)."""
    import numpy as np

    return np.uint64(t.data_ptr())


@functools.lru_cache(maxsize=16)
def _stream(ptr: int, device: int):
    import cupy

    with cupy.cuda.Device(device):
        return cupy.cuda.ExternalStream(ptr)


MERGE_WARPS = 4
"""Warps of the merge kernel; each CTA also updates the scores of ``MERGE_PAGES_PER_WARP * MERGE_WARPS`` page-table
positions."""
MERGE_PAGES_PER_WARP = 4
"""Pages whose scores one warp of the merge kernel updates (their loads all issued before the merge)."""


def launch_partial(q: torch.Tensor, pool_pages: torch.Tensor, page_format: PageFormat,
                   page_table: torch.Tensor, tier_tokens: torch.Tensor, row_ids: torch.Tensor, workspace,
                   qk_scale: float, update_scores: bool, min_blocks: int | None = None, stages: int | None = None):
    """Fill ``workspace``'s partial states (and probabilities) for ``q`` on the current stream (the kernels
    resolved for this one call; :class:`CudaDecodeKernels` resolves them once for many).

    Returns a callable ``finish(out)`` that launches the merge (``diffkv_decode_merge``, ``cuda/decode_merge.cu``):
    the row's partial states into ``out`` (fp16 or bf16, ``[num_seqs, num_heads, head_dim]`` contiguous) and
    ``workspace.lse``, and, when ``update_scores``, the score update in the same launch (it needs the final
    log-sum-exp the merge computes; it replaces the Triton merge and score kernels on this backend).

    ``min_blocks`` / ``stages``: as :func:`compile_defines` (the register cap, the page ring's buffers a warp;
    for the ring, an unpinned ``min_blocks`` steps down while the kernel uses more than
    :data:`LOCAL_BYTES_TOLERATED` bytes of local memory, :func:`_spill_free_kernel`),
    with ``q``'s device's shared-memory limits (:func:`device_shared_limits`). Arguments as
    :func:`~.decode_attention.paged_decode_attention` (already checked there);
    ``q`` is fp16 or bf16 ``[num_seqs, num_heads, head_dim]`` contiguous (a bf16 query is rounded to fp16 as the
    kernel loads it, ``Q_BF16``); ``qk_scale`` is the softmax scale
    times log2(e). Grid ``(num_seqs, num_kv_heads, 2 * workspace.num_partitions)``.
    """
    num_seqs, num_heads, head_dim = q.shape
    group = num_heads // row_ids.shape[1]
    device = _device_index(q.device)
    fn, shared_bytes, _ = _resolve_partial(page_format, group, workspace.part_m.shape[-1],
                                           workspace.part_acc.shape[-1], update_scores, device, min_blocks, stages,
                                           q.dtype)
    _run_partial(fn, shared_bytes, q, pool_pages, page_table, tier_tokens, row_ids, workspace, qk_scale, device)
    return lambda out: _launch_merge(out, pool_pages, page_format, page_table, tier_tokens, row_ids, workspace,
                                     group, update_scores, device)


class CudaDecodeKernels:
    """The CUDA decode kernels of one configuration, compiled and resolved once (macros, register cap, shared memory,
    grids), so each call only launches (:class:`~.decode_attention.DecodeAttention`): the partial kernel and then the
    merge with the score update, or (``fused``, :data:`FUSED_MERGE`) the one launch ``diffkv_decode_attend``
    (``cuda/decode_merge.cu``).

    Args:
        partial, merge: the loaded functions (``merge`` ``None`` when fused); shared_bytes: the partial kernel's
        dynamic shared memory; merge_scores: the merge updates the scores; merge_pages: page-table positions a merge
        CTA scores; device: the CUDA device index they are loaded on; fused: ``partial`` is ``diffkv_decode_attend``;
        max_slots: the workspace's slot capacity the kernels were compiled for (``2 * num_partitions``).
    """

    __slots__ = ("partial", "merge", "shared_bytes", "merge_scores", "merge_pages", "device", "fused", "max_slots",
                 "ctas_per_wave")

    def __init__(self, partial, merge, shared_bytes: int, merge_scores: bool, merge_pages: int, device: int,
                 fused: bool, max_slots: int, ctas_per_wave: int):
        self.partial, self.merge, self.shared_bytes = partial, merge, shared_bytes
        self.merge_scores, self.merge_pages, self.device = merge_scores, merge_pages, device
        self.fused, self.max_slots, self.ctas_per_wave = fused, max_slots, ctas_per_wave

    def slots_for(self, rows: int, max_pages_per_row: int) -> int:
        """:func:`cuda_num_slots` for a launch over ``rows`` rows with these kernels' capacity and CTAs a wave."""
        return cuda_num_slots(rows, max_pages_per_row, self.max_slots, self.ctas_per_wave)

    @classmethod
    def resolve(cls, page_format: PageFormat, group: int, group_pad: int, block_d: int, num_slots: int,
                out_dtype: torch.dtype, update_scores: bool, device: torch.device | int,
                min_blocks: int | None = None, stages: int | None = None,
                pages_per_warp: int | None = None, q_dtype: torch.dtype | None = None,
                fused: bool | None = None) -> "CudaDecodeKernels":
        """Compile (cached per process) and resolve the kernels for workspaces of ``num_slots`` partition slots
        a row (``2 * num_partitions``), outputs of ``out_dtype`` (fp16/bf16) and queries of ``q_dtype`` (fp16/bf16;
        default ``out_dtype``: a bf16 query is read as it is, no conversion kernel); ``fused`` (default
        :data:`FUSED_MERGE`): one launch, whose workspace needs its ``row_done`` counters; other arguments as
        :func:`launch_partial` and :func:`merge_defines` (``pages_per_warp``: default :data:`MERGE_PAGES_PER_WARP`,
        fused :func:`tail_pages_per_warp`).

        Raises:
            ValueError: an output dtype other than fp16/bf16, or a ring beyond the device's shared memory.
        """
        device = _device_index(torch.device("cuda", device) if isinstance(device, int) else device)
        fused = bool(FUSED_MERGE) if fused is None else fused
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if fused:
            partial, shared_bytes, blocks = _resolve_partial(page_format, group, group_pad, block_d, update_scores,
                                                             device, min_blocks, stages, q_dtype or out_dtype,
                                                             fused=(num_slots, out_dtype, pages_per_warp))
            return cls(partial, None, shared_bytes, update_scores, 0, device, True, num_slots, sms * blocks)
        partial, shared_bytes, blocks = _resolve_partial(page_format, group, group_pad, block_d, update_scores, device,
                                                         min_blocks, stages, q_dtype or out_dtype)
        merge, merge_pages = _resolve_merge(page_format, group, group_pad, block_d, num_slots, out_dtype,
                                            update_scores, device, pages_per_warp or MERGE_PAGES_PER_WARP)
        return cls(partial, merge, shared_bytes, update_scores, merge_pages, device, False, num_slots, sms * blocks)

    def launch(self, q: torch.Tensor, pool_pages: torch.Tensor, page_table: torch.Tensor,
               tier_tokens: torch.Tensor, row_ids: torch.Tensor, workspace, qk_scale: float,
               out: torch.Tensor, num_slots: int | None = None) -> None:
        """The decode attention into ``out`` on the current stream: the fused launch, or the partial kernel then the
        merge (with the score update); arguments as :func:`launch_partial` (``q`` of the resolved ``q_dtype``, the
        workspace of the resolved slot capacity); ``num_slots``: CTAs a row (default the capacity; at most it).

        Raises:
            ValueError: ``num_slots`` outside ``1..max_slots`` (the merge's shared arrays hold ``max_slots``) or above
                the workspace's ``2 * num_partitions`` slots.
        """
        num_slots = self.max_slots if num_slots is None else num_slots
        if not 1 <= num_slots <= min(self.max_slots, 2 * workspace.num_partitions):
            raise ValueError(f"num_slots={num_slots} outside 1..{self.max_slots} (the slots the kernels hold) or "
                             f"above the workspace's {2 * workspace.num_partitions}")
        _run_partial(self.partial, self.shared_bytes, q, pool_pages, page_table, tier_tokens, row_ids, workspace,
                     qk_scale, self.device, num_slots, out if self.fused else None)
        if not self.fused:
            _run_merge(self.merge, self.merge_pages, out, pool_pages, page_table, tier_tokens, row_ids, workspace,
                       self.device, num_slots)


FUSED_MERGE = 0
"""0 (default): the CUDA backend launches ``diffkv_decode_partial`` then ``diffkv_decode_merge`` (merge and score
update); 1: one launch, ``diffkv_decode_attend``, whose row's last CTA merges. Measured slower (H100, 2026-12-06,
``tools/sweep_kv_gpu.py``, ``benchmarks/results/sweep_kv.json`` (``fused``): Llama-3-8B 48 x 4096 one layer 180.7 against
168.6 us, 16 x 1024 39.7 against 28.9): the last CTA updates every score of its row alone, where the merge kernel
spreads them over many CTAs. Kept as the A/B variant (equal bit for bit, ``tests/kernels/test_fused_decode_gpu.py``).
Since its merging CTA shares the merge's functions (without the merge's early loads) nvcc 13.0 (sm_90a) spills 20 bytes
at its cap for ``llama3-8b`` head_dim 128 / group 8 (0 before); with the merge prefetch's probabilities and maxima
(``MERGE_PREFETCH``, which this kernel always issues) ``k8v4`` head_dim 64 / group 8 spills 36 (28 without them, 76
before the shared functions), ``k8v4`` head_dim 128 / group 8 12 (4), ``default-k8v2`` head_dim 128 / group 8 52 (36);
not re-timed."""

SLOT_WAVE_FILL = 0.5
"""The CUDA partial kernel's CTAs a row (:func:`cuda_num_slots`) aim at this fraction of one wave of CTAs over the
launch's rows: fewer, longer CTAs (each pays its row lookups, query load, page-ring fill, warp merge and partial
state writes once). H100, 2026-12-06, one Llama-3-8B layer with its merge from a CUDA graph
(``benchmarks/results/sweep_kv.json`` (``fused``)): 48 x 4096 best at 1 CTA a row (164.2 us; 168.6 at the earlier 6),
64 x 1024 at 1 (65.6; 70.9 at 4), 16 x 1024 at 2 (19.0; 28.9 at 10), SmolLM2's 64 x 1024 at 2 (15.6; 19.4 at 10):
half a wave picks each of these."""


def cuda_num_slots(rows: int, max_pages_per_row: int, capacity: int, ctas_per_wave: int) -> int:
    """CTAs a row of the CUDA partial kernel for a launch over ``rows`` (sequence, KV head) rows:
    ``round(SLOT_WAVE_FILL * ctas_per_wave / rows)`` (``ctas_per_wave``: multiprocessors x the kernel's CTAs a
    multiprocessor), at least 1, at most ``capacity`` (the workspace's slots) and ``max_pages_per_row // 4`` (4 warps
    a CTA: a page each on the longest row the table holds). The kernel splits each row's real pages evenly over them."""
    want = round(SLOT_WAVE_FILL * ctas_per_wave / max(1, rows))
    return int(max(1, min(want, capacity, max(1, max_pages_per_row // WARPS))))


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _resolve_partial(page_format: PageFormat, group: int, group_pad: int, block_d: int, update_scores: bool,
                     device: int, min_blocks: int | None, stages: int | None,
                     q_dtype: torch.dtype = torch.float16, fused: tuple | None = None):
    """``(diffkv_decode_partial, its dynamic shared bytes, its CTAs a multiprocessor)`` for this configuration on
    ``device``; with ``fused`` = ``(max_slots, out_dtype, pages_per_warp)``, ``diffkv_decode_attend``
    (:func:`fused_defines`) instead."""
    if q_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the CUDA decode kernel reads fp16 or bf16 queries, not {q_dtype}")
    limits = device_shared_limits(device)
    if fused is None:
        pmax = max(page_format.high_tokens_per_page, page_format.low_tokens_per_page)
        defines = compile_defines(page_format, group, group_pad, block_d, pmax, update_scores, min_blocks, stages,
                                  limits)
    else:
        max_slots, out_dtype, pages_per_warp = fused
        defines = fused_defines(page_format, group, group_pad, block_d, max_slots, out_dtype, update_scores,
                                min_blocks, stages, limits, pages_per_warp)
    if q_dtype == torch.bfloat16:
        defines["Q_BF16"] = 1
    shared_bytes = partial_shared_bytes(page_format, defines["STAGES"])
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}"
    key = tuple(sorted(defines.items()))
    if defines["STAGES"] and min_blocks is None:
        fn, _, blocks = _spill_free_kernel(key, arch, shared_bytes, device)
        return fn, shared_bytes, blocks
    return _cap_kernel(key, arch, shared_bytes, device)[0], shared_bytes, defines["MIN_BLOCKS"]


def _run_partial(fn, shared_bytes: int, q, pool_pages, page_table, tier_tokens, row_ids, workspace,
                 qk_scale: float, device: int, num_slots: int | None = None, out: torch.Tensor | None = None) -> None:
    """Launch the partial kernel (``out`` ``None``; grid ``(num_seqs, num_kv_heads, num_slots)``) or the fused
    ``diffkv_decode_attend`` into ``out`` (grid ``(num_slots, num_kv_heads, num_seqs)``, the workspace's ``row_done``
    counters); ``num_slots`` default ``2 * workspace.num_partitions``."""
    import numpy as np

    num_seqs, num_kv_heads = row_ids.shape
    num_slots = 2 * workspace.num_partitions if num_slots is None else num_slots
    ptr = _ptr
    args = (ptr(q), ptr(pool_pages), ptr(page_table), ptr(tier_tokens), ptr(row_ids), ptr(workspace.part_m),
            ptr(workspace.part_l), ptr(workspace.part_acc), ptr(workspace.page_probs), ptr(workspace.page_max),
            np.float32(qk_scale), np.int32(num_kv_heads), np.int32(num_slots), np.int32(page_table.shape[1]))
    grid = (num_seqs, num_kv_heads, num_slots)
    if out is not None:
        if workspace.row_done is None:
            raise ValueError("the fused CUDA decode kernel needs the workspace's row_done counters "
                             "(DecodeWorkspace.allocate makes them)")
        args += (ptr(out), ptr(workspace.lse), ptr(workspace.row_done))
        grid = (num_slots, num_kv_heads, num_seqs)
    with _stream(torch.cuda.current_stream(q.device).cuda_stream, device):
        fn(grid, (32 * WARPS, 1, 1), args, shared_mem=shared_bytes)


def merge_defines(page_format: PageFormat, group: int, group_pad: int, block_d: int, num_slots: int,
                  out_dtype: torch.dtype, scores: bool, pages_per_warp: int = MERGE_PAGES_PER_WARP) -> dict[str, int]:
    """The ``-D`` macros of one ``diffkv_decode_merge`` configuration (also used by the CPU compile test).

    Raises:
        ValueError: an output dtype other than fp16/bf16.
    """
    if out_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the CUDA merge writes fp16/bf16 outputs, got {out_dtype}")
    hi, lo = page_format.high, page_format.low
    return dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=page_format.head_dim, BLOCK_D=block_d,
                PMAX=max(hi.tokens_per_page, lo.tokens_per_page), PAGE_BYTES=page_format.page_size_bytes,
                MAX_SLOTS=num_slots, OUT_BF16=int(out_dtype == torch.bfloat16), SCORES=int(scores),
                MERGE_WARPS=MERGE_WARPS, PAGES_PER_WARP=pages_per_warp, H_TOKENS=hi.tokens_per_page, L_TOKENS=lo.tokens_per_page,
                H_SC=hi.score.offset_bytes, L_SC=lo.score.offset_bytes)


def tail_pages_per_warp(group: int) -> int:
    """Pages a warp of ``diffkv_decode_attend``'s merging CTA updates at a time: :data:`MERGE_PAGES_PER_WARP`, fewer for
    large query groups, whose pages hold ``2 * group + 5`` registers each of probabilities, maxima, scores and
    addresses in flight (nvcc 13.0, sm_90, at the 80-register cap of head_dim 64: group 8 spilled 452 bytes with 4
    pages, the partial kernel alone 60)."""
    return max(1, min(MERGE_PAGES_PER_WARP, 16 // group))


def fused_defines(page_format: PageFormat, group: int, group_pad: int, block_d: int, num_slots: int,
                  out_dtype: torch.dtype, scores: bool, min_blocks: int | None = None, stages: int | None = None,
                  shared_limits: tuple[int, int] | None = None,
                  pages_per_warp: int | None = None) -> dict[str, int]:
    """The ``-D`` macros of one ``diffkv_decode_attend`` configuration: :func:`compile_defines` (the partial kernel's,
    ``store_probs = scores``), :func:`merge_defines` (``num_slots``: the workspace's slot capacity, ``MAX_SLOTS``)
    and ``FUSED_MERGE=1``. The macros the two share are equal by construction (checked). ``PAGES_PER_WARP``
    (default :func:`tail_pages_per_warp`) is the pages whose score loads a warp of the row's last CTA has in flight
    at once.

    Raises:
        ValueError: as :func:`compile_defines` and :func:`merge_defines`, or the two disagreeing on a shared macro.
    """
    pmax = max(page_format.high_tokens_per_page, page_format.low_tokens_per_page)
    if pages_per_warp is None:
        pages_per_warp = tail_pages_per_warp(group)
    d = compile_defines(page_format, group, group_pad, block_d, pmax, scores, min_blocks, stages, shared_limits)
    m = merge_defines(page_format, group, group_pad, block_d, num_slots, out_dtype, scores, pages_per_warp)
    differ = sorted(k for k in d.keys() & m.keys() if d[k] != m[k])
    if differ:
        raise ValueError(f"the partial kernel's and the merge's macros disagree on {differ}")
    return {**d, **m, "FUSED_MERGE": 1}


def _resolve_merge(page_format: PageFormat, group: int, group_pad: int, block_d: int, num_slots: int,
                   out_dtype: torch.dtype, scores: bool, device: int, pages_per_warp: int = MERGE_PAGES_PER_WARP):
    """``(diffkv_decode_merge, page-table positions a CTA scores, 0 without scores)`` on ``device``."""
    defines = merge_defines(page_format, group, group_pad, block_d, num_slots, out_dtype, scores, pages_per_warp)
    major, minor = torch.cuda.get_device_capability(device)
    fn = _merge_kernel(tuple(sorted(defines.items())), f"sm_{major}{minor}", device)
    return fn, (pages_per_warp * MERGE_WARPS if scores else 0)


def _run_merge(fn, merge_pages: int, out, pool_pages, page_table, tier_tokens, row_ids, workspace,
               device: int, num_slots: int | None = None) -> None:
    import numpy as np

    num_seqs, num_kv_heads = row_ids.shape
    num_slots = 2 * workspace.num_partitions if num_slots is None else num_slots
    max_pages = page_table.shape[1]
    ptr = _ptr
    args = (ptr(out), ptr(workspace.part_m), ptr(workspace.part_l), ptr(workspace.part_acc), ptr(workspace.lse),
            ptr(pool_pages), ptr(page_table), ptr(tier_tokens), ptr(row_ids), ptr(workspace.page_probs),
            ptr(workspace.page_max), np.int32(num_kv_heads), np.int32(num_slots), np.int32(max_pages))
    z = -(-max_pages // merge_pages) if merge_pages else 1
    with _stream(torch.cuda.current_stream(out.device).cuda_stream, device):
        fn((num_seqs, num_kv_heads, z), (32 * MERGE_WARPS, 1, 1), args)


def _launch_merge(out, pool_pages, page_format, page_table, tier_tokens, row_ids, workspace, group, scores,
                  device) -> None:
    """The merge of one call (resolved for it)."""
    fn, merge_pages = _resolve_merge(page_format, group, workspace.part_m.shape[-1], workspace.part_acc.shape[-1],
                                     2 * workspace.num_partitions, out.dtype, scores, device)
    _run_merge(fn, merge_pages, out, pool_pages, page_table, tier_tokens, row_ids, workspace, device)


SCORE_WARPS = 4
"""Warps of ``diffkv_decode_scores`` (4: 18.7 us against 19.7 at 8 and 21.1 at 16, H200, Llama-3-8B 64 x 4096)."""


def _launch_scores(score_fn, q, pool_pages, page_table, tier_tokens, row_ids, workspace, num_seqs, num_kv_heads,
                   device) -> None:
    """The separate score update after a merge has written ``workspace.lse``: the TensorRT AOT path's launch
    (``export/cuda_aot.py`` builds ``diffkv_decode_scores`` with this grid); the NVRTC path folds it into the merge."""
    import numpy as np

    ptr = _ptr
    max_pages = page_table.shape[1]
    args = (ptr(pool_pages), ptr(page_table), ptr(tier_tokens), ptr(row_ids), ptr(workspace.page_probs),
            ptr(workspace.page_max), ptr(workspace.lse), np.int32(num_kv_heads), np.int32(max_pages))
    with _stream(torch.cuda.current_stream(q.device).cuda_stream, device):
        score_fn((num_seqs, num_kv_heads, -(-max_pages // (2 * SCORE_WARPS))), (32 * SCORE_WARPS, 1, 1), args)


__all__ = ["unsupported_reason", "runtime_reason", "resolve_backend", "choose_backend", "configured_backend", "launch_partial", "compile_defines",
           "CudaDecodeKernels",
           "partial_shared_bytes", "stage_copy_bytes", "STAGES", "device_shared_limits",
           "register_min_blocks", "staged_min_blocks", "SM90_SHARED_LIMITS", "SHARED_RESERVED_BYTES",
           "merge_defines", "merge_source", "SOURCE_PATH", "MERGE_SOURCE_PATH", "BACKEND_ENV", "BACKENDS",
           "cuda_num_slots", "SLOT_WAVE_FILL", "FUSED_MERGE", "fused_source", "fused_defines", "tail_pages_per_warp"]
