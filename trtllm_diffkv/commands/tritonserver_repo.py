"""``trtllm-diffkv triton-repo``: write a Triton Inference Server model repository (Python backend, DiffKV).

``--out REPO`` gets ``REPO/<name>/config.pbtxt`` (TensorRT-LLM's tensor names, decoupled for
streaming) and ``REPO/<name>/1/model.py`` (one ``LLM`` per model instance). ``--serve`` then runs
the ``tritonserver`` bundled in ``nvidia-pytriton`` on it until SIGINT/SIGTERM.
``--setup-stub-env`` prepares the Python environment of Triton's backend stub (NumPy 1, see
``trtllm_diffkv.serve.tritonserver_binary``) and exits.
"""
from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time

from .common import add_threads_argument, cpu_threads, finite_float, refuse_tp


def add_parser(subparsers) -> None:
    """Register ``triton-repo`` on the ``trtllm-diffkv`` subparsers."""
    p = subparsers.add_parser("triton-repo", help="write (and optionally serve) a Triton model repository",
                              description=__doc__.split("\n\n")[0])
    _arguments(p)
    p.set_defaults(run=run)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint folder, .gguf or engine dir (default: the default model)")
    p.add_argument("--out", help="the repository directory (required unless --setup-stub-env)")
    p.add_argument("--name", default="trtllm_diffkv", help="Triton model name (default: trtllm_diffkv)")
    p.add_argument("--kv-config", metavar="PRESET|FILE",
                   help="DiffKV preset (default: an engine dir's own, else default) or a kv-config JSON file written "
                        "by `trtllm-diffkv calibrate`")
    p.add_argument("--max-batch-size", type=int, default=64, help="executor batch and Triton max_batch_size "
                                                                  "(default: 64)")
    p.add_argument("--kv-memory-bytes", type=int, help="KV pool bytes (default: the LLM's)")
    p.add_argument("--max-seq-len", type=int, help="prompt + new tokens per request at most (default: the model's)")
    p.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: only 1 (not wired into the Triton "
                   "model; use serve --tp)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), help="model dtype")
    add_threads_argument(p)
    p.add_argument("--shutdown-timeout-s", type=finite_float, help="at SIGTERM, requests in flight get this long, then "
                                                            "are aborted (default: 5; below --exit-timeout-secs)")
    p.add_argument("--no-decoupled", action="store_true", help="one response per request (tritonclient.http "
                                                               "infer); no streaming, requests run one at a time")
    p.add_argument("--overwrite", action="store_true", help="replace an existing REPO/<name>")
    p.add_argument("--serve", action="store_true", help="then run the bundled tritonserver on the repository")
    p.add_argument("--host", default="127.0.0.1", help="--serve: address to bind (default: 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=8000, help="--serve: HTTP port (default: 8000)")
    p.add_argument("--grpc-port", type=int, default=8001, help="--serve: gRPC port (default: 8001)")
    p.add_argument("--metrics-port", type=int, default=8002, help="--serve: metrics port (default: 8002)")
    p.add_argument("--setup-stub-env", action="store_true", help="install the Triton stub's environment "
                                                                 "(numpy<2, with pip) and exit")


def run(args) -> int:
    """Write the repository (and serve it). Returns 0, 1 if the server failed, 2 on a usage or setup error."""
    from ..serve.tritonserver_binary import TritonUnavailable, stub_env

    if args.setup_stub_env:
        try:
            print(f"Triton stub environment ready: {stub_env(install=True)}")
            return 0
        except TritonUnavailable as exc:
            print(f"trtllm-diffkv triton-repo: {exc}", file=sys.stderr)
            return 2
    if not args.out:
        print("trtllm-diffkv triton-repo: --out is required", file=sys.stderr)
        return 2
    try:
        refuse_tp(args.tp, "triton-repo")
    except ValueError as exc:
        print(f"trtllm-diffkv triton-repo: {exc}", file=sys.stderr)
        return 2
    from ..serve.tritonserver_repo import write_repository

    if args.serve:
        try:
            _check_serve_flags(args)
        except ValueError as exc:
            print(f"trtllm-diffkv triton-repo: {exc}", file=sys.stderr)
            return 2
    try:
        model_dir = write_repository(args.out, model=args.model, name=args.name, kv_config=args.kv_config,
                                     max_batch_size=args.max_batch_size, kv_memory_bytes=args.kv_memory_bytes,
                                     max_seq_len=args.max_seq_len, device=args.device, dtype=args.dtype,
                                     decoupled=not args.no_decoupled, overwrite=args.overwrite,
                                     num_threads=cpu_threads(args.threads, _device_name(args.device)),
                                     shutdown_timeout_s=args.shutdown_timeout_s)
    except (OSError, ValueError) as exc:
        print(f"trtllm-diffkv triton-repo: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {model_dir}/config.pbtxt and {model_dir}/1/model.py")
    return _serve(args) if args.serve else 0


def _device_name(device: str | None) -> str:
    """``--device``, else the device the model will take (cuda when this machine has one): picks --threads' default."""
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_serve_flags(args) -> None:
    """``--serve``: refuse, before anything is written or started, ports outside 1-65535, the same port
    twice, a port that cannot be bound (in use) and a ``--device`` this machine lacks (``ValueError``)."""
    from .common import resolve_device
    from .serve import bind_socket, check_port

    ports = {"--http-port": args.http_port, "--grpc-port": args.grpc_port, "--metrics-port": args.metrics_port}
    for flag, port in ports.items():
        check_port(port, flag)
    if len(set(ports.values())) < len(ports):
        raise ValueError("--http-port, --grpc-port and --metrics-port must differ, got "
                         + ", ".join(f"{flag} {port}" for flag, port in ports.items()))
    resolve_device(args.device)
    for flag, port in ports.items():
        bind_socket(args.host, port, flag).close()  # tritonserver binds it itself, a moment later


def _serve(args) -> int:
    from ..serve.tritonserver_binary import TritonServer, TritonUnavailable

    workspace = tempfile.mkdtemp(prefix="trtllm-diffkv-triton-")
    try:
        exit_timeout_s = max(10, int((args.shutdown_timeout_s or 5.0) + 10))  # Triton waits beyond the model's drain
        server = TritonServer(args.out, workspace, http_port=args.http_port, grpc_port=args.grpc_port,
                              exit_timeout_s=exit_timeout_s,
                              metrics_port=args.metrics_port, host=args.host, install_stub_numpy=True)
    except TritonUnavailable as exc:
        print(f"trtllm-diffkv triton-repo: {exc}", file=sys.stderr)
        return 2
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    server.start()
    try:
        server.wait_ready(timeout_s=1800)
        print(f"tritonserver ready: HTTP {server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url} "
              f"(log {server.log_path}); Ctrl-C stops it", flush=True)
        while not stop and server.proc.poll() is None:
            time.sleep(0.5)
        crashed = server.proc.poll() is not None
    except KeyboardInterrupt:
        crashed = False
        pass
    except (RuntimeError, TimeoutError) as exc:
        print(f"trtllm-diffkv triton-repo: {exc}", file=sys.stderr)
        return 1
    finally:
        code = server.stop()
    if crashed:
        print(f"trtllm-diffkv triton-repo: tritonserver exited with code {server.proc.returncode}; log "
              f"{server.log_path}:\n{server.log_tail()}", file=sys.stderr)
        return 1
    if server.killed_after_drain:  # Triton 2.51 waits for every open gRPC stream (TritonServer.stop)
        print("trtllm-diffkv triton-repo: every request drained (KV pool pages held: 0), but tritonserver waited "
              "for client gRPC streams still open; stopped it", file=sys.stderr, flush=True)
    elif code != 0:
        print(f"trtllm-diffkv triton-repo: tritonserver exited with code {code} at shutdown; log {server.log_path}:\n"
              f"{server.log_tail()}", file=sys.stderr)
        return 1
    shutil.rmtree(workspace, ignore_errors=True)  # backend links and the log of a clean run
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m trtllm_diffkv.commands.tritonserver_repo [flags]``."""
    parser = argparse.ArgumentParser(prog="trtllm-diffkv triton-repo", description=__doc__.split("\n\n")[0])
    _arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
