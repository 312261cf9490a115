"""Both servers on the default model, many concurrent streaming clients: requests/s and time to first token.

Run on the GPU machine (the lead runs it on the H200)::

    python3 scripts/bench_servers_gpu.py --out servers_gpu.json          # both servers
    python3 scripts/bench_servers_gpu.py --servers openai --out o.json   # one of them

For each server (``openai``: ``trtllm-diffkv serve``; ``triton``: the bundled ``tritonserver`` on a
repository written by ``trtllm-diffkv triton-repo``) it starts the server, sends ``--warmup``
requests, then ``--num-requests`` streaming requests from ``--concurrency`` clients (each client
sends its next request when the previous one ends; asyncio + httpx, server-sent events: OpenAI's
``/v1/completions`` with ``"stream": true`` and Triton's ``/v2/models/<m>/generate_stream``), and
stops the server. Greedy decoding, ``ignore_eos`` where the API has it (OpenAI), fixed
``--max-tokens``. It prints one line per server and writes JSON to ``--out``: ``{"gpu", "date",
"commit", "command", "results": [{"server", "requests", "concurrency", "max_tokens", "wall_s",
"requests_per_s", "output_tokens_per_s", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s",
"latency_mean_s", "errors"}]}``. Time to first token: request sent -> first chunk with text.

The Triton stub needs NumPy 1 (see trtllm_diffkv/serve/triton_server.py): on a machine without the
package index, download the wheel beforehand (``pip download "numpy>=1.26,<2" -d wheels``, the
device's Python version) and run with ``PIP_NO_INDEX=1 PIP_FIND_LINKS=wheels``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["Explain in two sentences why a KV cache grows with context length.", "Write a haiku about memory.",
           "List three uses of a hash map.", "What is the capital of Australia, and why is it not Sydney?",
           "Summarize the plot of a detective story in one paragraph.", "Describe a sunrise over the sea.",
           "Give a short recipe for pancakes.", "Why do computers use binary numbers?"]


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) with linear interpolation between closest ranks."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = int(position), min(int(position) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def one_request(client, server: str, url: str, index: int, max_tokens: int, model: str) -> dict:
    prompt = PROMPTS[index % len(PROMPTS)]
    if server == "openai":
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
    else:  # end_id -1: no end token (TensorRT-LLM's convention), so every request makes max_tokens tokens
        body = {"text_input": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0, "end_id": -1}
    start = time.perf_counter()
    first, tokens, error = None, 0, None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return {"error": (await response.aread()).decode()[:200]}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[len("data: "):])
            if "error" in payload:
                error = str(payload["error"])[:200]
                break
            if server == "openai":
                text = payload["choices"][0]["text"] if payload["choices"] else ""
                tokens = payload["usage"]["completion_tokens"] if payload.get("usage") else tokens
            else:
                text, tokens = payload.get("text_output", ""), payload.get("num_output_tokens", tokens)
            if text and first is None:
                first = time.perf_counter() - start
    return {"ttft_s": first, "latency_s": time.perf_counter() - start, "tokens": tokens, "error": error}


async def load(server: str, url: str, *, num_requests: int, concurrency: int, max_tokens: int, model: str) -> dict:
    import httpx

    results, counter = [], iter(range(num_requests))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker():
            for index in counter:
                results.append(await one_request(client, server, url, index, max_tokens, model))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    good = [r for r in results if not r.get("error") and r.get("ttft_s") is not None]
    ttft = [r["ttft_s"] for r in good]
    return {"server": server, "requests": len(results), "concurrency": concurrency, "max_tokens": max_tokens,
            "wall_s": wall, "requests_per_s": len(good) / wall, "output_tokens_per_s": sum(r["tokens"] for r in good) / wall,
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "ttft_p50_s": percentile(ttft, 0.5) if ttft else None, "ttft_p99_s": percentile(ttft, 0.99) if ttft else None,
            "latency_mean_s": statistics.fmean(r["latency_s"] for r in good) if good else None,
            "errors": [r["error"] for r in results if r.get("error")][:5]}


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
        url = f"http://127.0.0.1:{port}/v1/completions"
    else:
        write_repository(workdir / "repo", model=args.model, name="diffkv", kv_config=args.kv_config,
                         max_batch_size=args.max_batch_size, device=args.device, overwrite=True)
        server = TritonServer(workdir / "repo", workdir / "triton", install_stub_numpy=True)
        url = f"http://{server.http_url}/v2/models/diffkv/generate_stream"
    server.start()
    try:
        server.wait_ready(timeout_s=900)
        kwargs = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "model": "default"}
        asyncio.run(load(name, url, num_requests=args.warmup, **kwargs))
        result = asyncio.run(load(name, url, num_requests=args.num_requests, **kwargs))
    finally:
        server.stop()
    result["kv_config"] = args.kv_config
    return result


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
