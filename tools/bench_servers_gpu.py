"""Both servers on the default model, many concurrent streaming clients: throughput, TTFT, TPOT, ITL, latency.

Run on the GPU machine (the lead runs it on the H200, all legs in one device call through
``tools/gpu_servers.sh``)::

    python3 tools/bench_servers_gpu.py --out servers_gpu.json                       # triton, openai, openai-unchunked
    python3 tools/bench_servers_gpu.py --servers openai --out o.json                # one leg
    python3 tools/bench_servers_gpu.py --smoke --out /tmp/s.json                    # CPU dry run: tiny model, 2 clients
    python3 tools/bench_servers_gpu.py --merge a.json b.json --out servers_gpu.json # join legs run apart

Legs (``--servers``): ``triton`` (the bundled ``tritonserver`` on a repository written by ``trtllm-diffkv
triton-repo``), ``openai`` (``trtllm-diffkv serve`` with its defaults), ``openai-chunked`` (``serve
--max-num-tokens N --enable-chunked-prefill``: chunked prefill at ``--max-num-tokens``) and ``openai-unchunked``
(``serve --no-enable-chunked-prefill``); a leg whose flag ``serve --help`` does not list (chunked prefill is
another change's) is skipped and recorded as skipped. ``--serve-args`` adds flags to every OpenAI leg.
Each leg starts its server, sends ``--warmup`` requests, then ``--num-requests`` streaming requests from
``--concurrency`` clients (each client sends its next request when the previous one ends:
:func:`trtllm_diffkv.evaluation.serving_client.load`, the client of ``trtllm-diffkv bench --server-url``),
and stops the server. Greedy decoding, no end token, fixed ``--max-tokens`` (or a ``--prompts-file``, the
format of ``bench --prompts-file``). ``--time-limit-s`` skips the legs that would start after that many seconds.

Writes ``--out`` (JSON, rewritten after every leg): ``{"gpu", "date", "commit", "command", "results":
[{"server", "serve_flags", "chunked_prefill" (true, false, null: serve's default), "concurrency", "max_tokens", "requests", "completed",
"wall_s", "requests_per_s", "output_tokens_per_s", "ttft_/tpot_/itl_/e2e_" mean, p50, p90, p99 in ms,
"errors"} or {"server", "skipped"} or {"server", "error"}]}``, and ``--markdown`` (default: ``--out`` with
``.md``): a table fragment for docs/SERVING.md with the GPU, date, commit and command under it.

The Triton stub needs NumPy 1 (see trtllm_diffkv/serve/tritonserver_binary.py): on a machine without the
package index, download the wheel beforehand (``pip download "numpy>=1.26,<2" -d wheels``, the
device's Python version) and run with ``PIP_NO_INDEX=1 PIP_FIND_LINKS=wheels``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trtllm_diffkv.commands.common import finite_float  # noqa: E402 (after the path)
from trtllm_diffkv.config import write_text_atomic  # noqa: E402
from trtllm_diffkv.evaluation.serving_client import load  # noqa: E402

LEGS = ("triton", "openai", "openai-chunked", "openai-unchunked")
PROMPTS = ["Explain in two sentences why a KV cache grows with context length.", "A haiku about memory:",
           "List three uses of a hash map.", "What is the capital of Australia, and why is it not Sydney?",
           "Summarize the plot of a detective story in one paragraph.", "Describe a sunrise over the sea.",
           "Give a short recipe for pancakes.", "Why do computers use binary numbers?"]
SMOKE = {"num_requests": 4, "concurrency": 2, "max_tokens": 4, "warmup": 1, "max_batch_size": 8, "device": "cpu",
         "kv_memory_bytes": 1 << 23}
"""The sizes of ``--smoke`` (a CPU dry run of every leg on the tiny checkpoint of tests/tiny_checkpoint.py)."""


def serve_help() -> str:
    """``trtllm-diffkv serve --help`` of this checkout (which flags the OpenAI legs can pass)."""
    result = subprocess.run([sys.executable, "-m", "trtllm_diffkv", "serve", "--help"], capture_output=True,
                            text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    return result.stdout


def leg_serve_flags(name: str, args, help_text: str) -> tuple[list[str], bool | None, str | None]:
    """``(serve flags, chunked_prefill, why skipped or None)`` of an OpenAI leg; ``chunked_prefill`` is ``None`` where
    the leg runs serve's default. A leg needing a flag that ``help_text`` lacks is skipped."""
    extra = shlex.split(args.serve_args or "")
    if name == "openai":
        return extra, None, None
    if name == "openai-chunked":
        if "--max-num-tokens" not in help_text:
            return [], True, "trtllm-diffkv serve has no --max-num-tokens (chunked prefill) here"
        flags = ["--max-num-tokens", str(args.max_num_tokens)]
        flags += ["--enable-chunked-prefill"] if "--enable-chunked-prefill" in help_text else []
        return flags + extra, True, None
    if "--no-enable-chunked-prefill" not in help_text:
        return [], False, "trtllm-diffkv serve has no --no-enable-chunked-prefill here (no chunked prefill to turn off)"
    return ["--no-enable-chunked-prefill"] + extra, False, None


def run_leg(name: str, args, workdir: Path, prompts, max_tokens, serve_flags=(), chunked=None) -> dict:
    from trtllm_diffkv.serve.process import ServerProcess, free_port
    from trtllm_diffkv.serve.tritonserver_repo import write_repository
    from trtllm_diffkv.serve.tritonserver_binary import TritonServer

    extra = {"serve_flags": list(serve_flags), "chunked_prefill": chunked}
    if name.startswith("openai"):
        port = free_port()
        command = [sys.executable, "-m", "trtllm_diffkv.commands.serve", "--port", str(port), "--kv-config",
                   args.kv_config, "--max-batch-size", str(args.max_batch_size), "--served-model-name", "default"]
        command += (["--model", args.model] if args.model else []) + (["--device", args.device] if args.device else [])
        command += ["--kv-memory-bytes", str(args.kv_memory_bytes)] if args.kv_memory_bytes else []
        command += ["--threads", str(args.threads)] if args.threads else []
        command += list(serve_flags)
        server = ServerProcess(command, f"http://127.0.0.1:{port}/health", workdir / "serve.log")
        url, model = f"http://127.0.0.1:{port}", "default"
    else:
        write_repository(workdir / "repo", model=args.model, name="diffkv", kv_config=args.kv_config,
                         max_batch_size=args.max_batch_size, device=args.device, overwrite=True,
                         kv_memory_bytes=args.kv_memory_bytes, num_threads=args.threads)
        server = TritonServer(workdir / "repo", workdir / "triton", install_stub_numpy=True)
        url, model = None, "diffkv"
    started = time.perf_counter()
    server.start()
    try:
        server.wait_ready(timeout_s=900)
        url = url or f"http://{server.http_url}"
        ready_s = time.perf_counter() - started
        kwargs = {"api": "openai" if name.startswith("openai") else "triton", "concurrency": args.concurrency,
                  "max_tokens": max_tokens, "model": model, "prompts": prompts}
        if args.warmup:
            asyncio.run(load(url, num_requests=args.warmup, **kwargs))
        result, _ = asyncio.run(load(url, num_requests=args.num_requests, **kwargs))
    finally:
        server.stop()
    return {"server": name, **extra, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "kv_config": args.kv_config, "server_ready_s": round(ready_s, 1), **result}


def _cell(value, spec=".1f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(record: dict) -> str:
    """The results as a Markdown table fragment (the form docs/SERVING.md quotes), provenance underneath."""
    lines = ["| server | chunked prefill | requests/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
             "| ITL p99 ms | e2e p50 / p99 ms | errors |", "| --- | --- |" + " ---: |" * 6 + " --- |"]
    for r in record["results"]:
        flags = " ".join(r.get("serve_flags") or [])
        chunked = ("executor default" if r["server"] == "triton" else
                   {True: "on", False: "off", None: "serve's default"}[r.get("chunked_prefill")]
                   + (f" (`{flags}`)" if flags else ""))
        if "skipped" in r or "error" in r:
            chunked = {"openai-chunked": "on", "openai-unchunked": "off"}.get(r["server"], chunked)
            why = r.get("skipped") or r.get("error")
            lines.append(f"| {r['server']} | {chunked} | " + "- | " * 6 + f"{'skipped' if 'skipped' in r else 'failed'}"
                         f": {str(why)[:120]} |")
            continue
        lines.append(f"| {r['server']} | {chunked} | {_cell(r['requests_per_s'], '.2f')} | "
                     f"{_cell(r['output_tokens_per_s'])} | {_cell(r['ttft_p50_ms'])} / {_cell(r['ttft_p99_ms'])} | "
                     f"{_cell(r['tpot_p50_ms'], '.2f')} / {_cell(r['tpot_p99_ms'], '.2f')} | {_cell(r['itl_p99_ms'])} "
                     f"| {_cell(r['e2e_p50_ms'])} / {_cell(r['e2e_p99_ms'])} | {len(r['errors'])} of "
                     f"{r['requests']} |")
    first = next((r for r in record["results"] if "requests" in r), {})
    commands = record["command"] if isinstance(record["command"], list) else [record["command"]]
    lines += ["", f"{record['gpu']}, {record['date']}, commit `{record['commit']}`; {first.get('concurrency', '?')} "
                  f"concurrent streaming clients, {first.get('requests', '?')} requests, {first.get('max_tokens', '?')} "
                  f"new tokens each (greedy, no end token), preset `{first.get('kv_config', '?')}`. Command: "
                  + "; ".join(f"`{c}`" for c in commands if c)]
    return "\n".join(lines) + "\n"


def _write(record: dict, out: Path, md: Path) -> None:
    write_text_atomic(out, json.dumps(record, indent=2) + "\n")
    write_text_atomic(md, markdown(record))


def merge(parts: list[str], out: Path, md: Path) -> int:
    """Join the JSONs of legs run one by one (``tools/gpu_servers.sh``) into one record, in the order given; a
    missing or unreadable part becomes an ``error`` row naming it."""
    record = None
    for part in parts:
        try:
            data = json.loads(Path(part).read_text())
        except (OSError, ValueError) as exc:
            name = Path(part).stem
            data = {"command": None, "results": [{"server": name, "error": f"no result ({type(exc).__name__}; timed "
                                                                           f"out or crashed: see bench_{name}.log)"}]}
        if record is None:
            record = {k: v for k, v in data.items() if k != "results"}
            record["command"], record["results"] = [], []
        for key in ("gpu", "date", "commit"):
            if record.get(key) is None:
                record[key] = data.get(key)
        record["command"].append(data.get("command"))
        record["results"].extend(data["results"])
    _write(record, out, md)
    print(markdown(record), end="")
    return 0 if all("error" not in r for r in record["results"]) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default=",".join(LEGS), help=f"comma-separated legs: {', '.join(LEGS)} "
                                                                   f"(default: all)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-num-tokens", type=int, default=512, help="openai-chunked: serve's --max-num-tokens "
                                                                        "(default: 512)")
    parser.add_argument("--serve-args", help="more flags for every OpenAI leg's serve, one string (e.g. "
                                             "\"--max-seq-len 4096\")")
    parser.add_argument("--kv-config", default="default")
    parser.add_argument("--kv-memory-bytes", type=int, help="KV budget of both servers (default: theirs)")
    parser.add_argument("--threads", type=int, help="--threads of both servers (default: theirs)")
    parser.add_argument("--model", help="checkpoint folder (default: the default model)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--prompts-file", help="requests in bench --prompts-file's format (default: 8 built-in "
                                               "prompts, --max-tokens each)")
    parser.add_argument("--time-limit-s", type=finite_float, help="skip the legs that would start after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="CPU dry run: tiny random checkpoint, "
                                                             + ", ".join(f"{k} {v}" for k, v in SMOKE.items()))
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="run nothing: join these legs' JSONs into --out")
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--markdown", help="table fragment path (default: --out with .md)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    md = Path(args.markdown) if args.markdown else out.with_suffix(".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    md.parent.mkdir(parents=True, exist_ok=True)
    if args.merge:
        return merge(args.merge, out, md)
    legs = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [leg for leg in legs if leg not in LEGS]
    if unknown or not legs:
        parser.error(f"--servers {args.servers!r}: choose among {', '.join(LEGS)}")
    import torch

    scratch = tempfile.TemporaryDirectory(prefix="bench-servers-")
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import repo_paths

        repo_paths.use_checkout()  # tests/: tiny_checkpoint
        from tiny_checkpoint import write_tiny_text_checkpoint

        args.model = str(write_tiny_text_checkpoint(Path(scratch.name) / "tiny"))
        args.threads = args.threads or 1
    prompts, max_tokens = PROMPTS, args.max_tokens
    if args.prompts_file:
        from trtllm_diffkv.evaluation.prompt_files import materialize, read_prompts_file

        prompts, max_tokens = materialize(read_prompts_file(args.prompts_file), default_output_tokens=args.max_tokens)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)"
    commit = os.environ.get("DIFFKV_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or None
    record = {"gpu": gpu, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
              "command": shlex.join(["python3", "tools/bench_servers_gpu.py", *(argv if argv is not None
                                                                                  else sys.argv[1:])]),
              "results": []}
    start = time.perf_counter()
    help_text = serve_help() if any(leg.startswith("openai") for leg in legs) else ""
    for name in legs:
        flags, chunked, skipped = leg_serve_flags(name, args, help_text) if name != "triton" else ([], None, None)
        if args.time_limit_s is not None and time.perf_counter() - start > args.time_limit_s:
            result = {"server": name, "skipped": f"past --time-limit-s {args.time_limit_s:g}"}
        elif skipped:
            result = {"server": name, "skipped": skipped}
        else:
            with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as workdir:
                try:
                    result = run_leg(name, args, Path(workdir), prompts, max_tokens, flags, chunked)
                except Exception as exc:  # noqa: BLE001 - record the failure, go on with the other legs
                    result = {"server": name, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        record["results"].append(result)
        print(json.dumps(result), flush=True)
        _write(record, out, md)
    scratch.cleanup()
    print(markdown(record), end="")
    return 0 if all("error" not in r and not r.get("errors") for r in record["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
