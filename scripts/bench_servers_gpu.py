"""Both servers on the default model, many concurrent streaming clients: requests/s and time to first token.

Run on the GPU machine (the lead runs it on the H200)::

    python3 scripts/bench_servers_gpu.py --out servers_gpu.json          # both servers
    python3 scripts/bench_servers_gpu.py --servers openai --out o.json   # one of them

For each server (``openai``: ``trtllm-diffkv serve``; ``triton``: the bundled ``tritonserver`` on a
repository written by ``trtllm-diffkv triton-repo``) it starts the server, sends ``--warmup``
requests, then ``--num-requests`` streaming requests from ``--concurrency`` clients (each client
sends its next request when the previous one ends: :func:`trtllm_diffkv.evaluation.serving_client.load`,
the client of ``trtllm-diffkv bench --server-url``), and stops the server. Greedy decoding, no end
token, fixed ``--max-tokens``. It prints one line per server and writes JSON to ``--out``: ``{"gpu",
"date", "commit", "command", "results": [{"server", "concurrency", "max_tokens", "requests",
"completed", "wall_s", "requests_per_s", "output_tokens_per_s", "ttft_/tpot_/itl_/e2e_" mean, p50,
p90, p99 in ms, "errors"}]}``.

The Triton stub needs NumPy 1 (see trtllm_diffkv/serve/triton_server.py): on a machine without the
package index, download the wheel beforehand (``pip download "numpy>=1.26,<2" -d wheels``, the
device's Python version) and run with ``PIP_NO_INDEX=1 PIP_FIND_LINKS=wheels``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trtllm_diffkv.evaluation.serving_client import load  # noqa: E402 (after the path)

PROMPTS = ["Explain in two sentences why a KV cache grows with context length.", "A haiku about memory:",
           "List three uses of a hash map.", "What is the capital of Australia, and why is it not Sydney?",
           "Summarize the plot of a detective story in one paragraph.", "Describe a sunrise over the sea.",
           "Give a short recipe for pancakes.", "Why do computers use binary numbers?"]


def run_server(name: str, args, workdir: Path) -> dict:
    from trtllm_diffkv.serve.process import ServerProcess, free_port
    from trtllm_diffkv.serve.triton_repo import write_repository
    from trtllm_diffkv.serve.triton_server import TritonServer

    if name == "openai":
        port = free_port()
        command = [sys.executable, "-m", "trtllm_diffkv.commands.serve", "--port", str(port), "--kv-config",
                   args.kv_config, "--max-batch-size", str(args.max_batch_size), "--served-model-name", "default"]
        command += (["--model", args.model] if args.model else []) + (["--device", args.device] if args.device else [])
        server = ServerProcess(command, f"http://127.0.0.1:{port}/health", workdir / "serve.log")
        url = f"http://127.0.0.1:{port}"
    else:
        write_repository(workdir / "repo", model=args.model, name="diffkv", kv_config=args.kv_config,
                         max_batch_size=args.max_batch_size, device=args.device, overwrite=True)
        server = TritonServer(workdir / "repo", workdir / "triton", install_stub_numpy=True)
        url = f"http://{server.http_url}"
    server.start()
    try:
        server.wait_ready(timeout_s=900)
        kwargs = {"api": name, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                  "model": "default" if name == "openai" else "diffkv", "prompts": PROMPTS}
        if args.warmup:
            asyncio.run(load(url, num_requests=args.warmup, **kwargs))
        result, _ = asyncio.run(load(url, num_requests=args.num_requests, **kwargs))
    finally:
        server.stop()
    return {"server": name, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "kv_config": args.kv_config, **result}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="openai,triton", help="comma-separated: openai, triton")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--kv-config", default="default")
    parser.add_argument("--model", help="checkpoint folder (default: the default model)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--out", required=True, help="JSON results path")
    args = parser.parse_args(argv)
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or None
    record = {"gpu": gpu, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
              "command": shlex.join([sys.executable, *sys.argv]), "results": []}
    for name in [s.strip() for s in args.servers.split(",") if s.strip()]:
        with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as workdir:
            try:
                result = run_server(name, args, Path(workdir))
            except Exception as exc:  # noqa: BLE001 - record the failure, go on with the other server
                result = {"server": name, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        record["results"].append(result)
        print(json.dumps(result), flush=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0 if all("error" not in r for r in record["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
