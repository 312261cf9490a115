"""The CUDA decode kernel's register caps as the GPU's NVRTC settles them, on a machine without a GPU.

For every distinct page format of the compressing presets at head_dim 64 and 128, groups 1-8 and fp16 / bf16
queries: the blocks per multiprocessor, local memory and merge-prefetch form ``_spill_free_kernel`` settles on
(``support.nvrtc``), for this tree's kernel and, with ``--against COMMIT``, that commit's
``decode_partial.cu`` under this tree's rule (the step-down and macros; its text ignores macros it does not know).
Needs the ``nvidia-cuda-nvrtc`` 13.0 wheel (``build_scripts/setup_env.sh`` installs it without CUDA).

    python3 tools/nvrtc_caps.py --against 62a57b4 --out benchmarks/results/nvrtc_caps.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import repo_paths  # noqa: E402

repo_paths.use_checkout()  # the package and tests/support

from trtllm_diffkv.config import PRESETS  # noqa: E402
from trtllm_diffkv.kernels import cuda_decode as cd  # noqa: E402
from support.nvrtc import load_nvrtc, partial_defines, settled_cap  # noqa: E402

GROUPS = (1, 2, 3, 4, 5, 6, 7, 8)


def _formats() -> list[tuple[str, int]]:
    """One preset per distinct set of macros (presets sharing a page format compile the same kernel)."""
    seen, out = set(), []
    for name, cfg in PRESETS.items():
        if not cfg.compress:
            continue
        for head_dim in (64, 128):
            key = json.dumps(partial_defines(name, head_dim, 4), sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append((name, head_dim))
    return out


def _job(args):
    (preset, head_dim, group, q_bf16, sources) = args
    nvrtc, why = load_nvrtc()
    if nvrtc is None:
        raise SystemExit(why)
    defines = partial_defines(preset, head_dim, group, q_bf16)
    row = {"preset": preset, "head_dim": head_dim, "group": group, "q_dtype": "bf16" if q_bf16 else "fp16"}
    for label, source in sources.items():
        blocks, local_bytes, chosen = settled_cap(nvrtc, defines, source)
        row[label] = {"min_blocks": blocks, "local_bytes": local_bytes,
                      "prefetch_reload": chosen.get("PREFETCH_RELOAD")}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", help="a commit whose decode_partial.cu to settle beside this tree's")
    ap.add_argument("--out", help="JSON path (default: print only)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    nvrtc, why = load_nvrtc()
    if nvrtc is None:
        raise SystemExit(why)
    sources = {"this_tree": cd.SOURCE_PATH.read_text()}
    if args.against:
        sources[args.against] = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{args.against}:trtllm_diffkv/kernels/cuda/decode_partial.cu"],
            capture_output=True, text=True, check=True).stdout
    jobs = [(p, hd, g, bf, sources) for p, hd in _formats() for g in GROUPS for bf in (0, 1)]
    with multiprocessing.Pool(args.jobs) as pool:
        rows = pool.map(_job, jobs)
    for row in rows:
        cells = [f"{k}: {v['min_blocks']} CTAs {v['local_bytes']} B form {v['prefetch_reload']}"
                 for k, v in row.items() if isinstance(v, dict)]
        print(row["preset"], row["head_dim"], row["group"], row["q_dtype"], " | ".join(cells))
    if args.out:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "trtllm_diffkv", "tools"],
                               capture_output=True, text=True).stdout.strip()
        Path(args.out).write_text(json.dumps({
            "compiler": "NVRTC 13.0 (pip nvidia-cuda-nvrtc), CuPy's sm_90 options", "date":
            datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            "commit": commit + ("-dirty" if dirty else ""), "command": "python3 " + " ".join(sys.argv),
            "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
