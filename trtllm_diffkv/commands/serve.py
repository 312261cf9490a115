"""``trtllm-diffkv serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one ``LLM``.

``/v1/completions`` and ``/v1/chat/completions`` (``"stream": true`` for server-sent events),
``/v1/models``, ``/health`` and ``/metrics`` (Prometheus). Runs until SIGINT/SIGTERM, then drains:
new requests get a 503, requests in flight get ``--shutdown-timeout-s`` to finish, then are aborted
through the LLM (pages freed; a stream ends with an error event and ``[DONE]``); exits 0. ``python -m
trtllm_diffkv.commands.serve ...`` runs the same command.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys

from .common import add_threads_argument, cpu_threads, finite_float, positive_int


def add_parser(subparsers) -> None:
    """Register ``serve`` on the ``trtllm-diffkv`` subparsers."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, SSE streaming)",
                              description=__doc__.split("\n\n")[0])
    _arguments(p)
    p.set_defaults(run=run)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint folder, .gguf or engine dir (default: the default model)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the --model folder's or "
                                               "file's name, or 'trtllm-diffkv-default' without --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    p.add_argument("--kv-config", metavar="PRESET|FILE",
                   help="DiffKV preset (default: an engine dir's own, else default; fp16 = no compression) or a "
                        "kv-config JSON file written by `trtllm-diffkv calibrate`")
    p.add_argument("--max-batch-size", type=int, default=64, help="requests per executor step at most (default: 64)")
    p.add_argument("--max-num-tokens", type=int, help="tokens per executor step at most: running decodes first, then "
                   "prompt chunks (TensorRT-LLM's name; default: 8192 with chunked prefill)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts over steps so decodes keep running (default: on; DiffKV compacts a "
                   "prompt after its final chunk)")
    p.add_argument("--disable-overlap-scheduler", action="store_true",
                   help="read every decode step's tokens before launching the next (default: on a GPU in one process, "
                        "not with --tp, the next decode step is launched before the last one's tokens are read; "
                        "TensorRT-LLM's name)")
    p.add_argument("--kv-memory-bytes", type=int, help="KV pool bytes (default: 0.9 of free GPU memory; 256 MiB on CPU)")
    p.add_argument("--max-seq-len", type=int, help="prompt + new tokens per request at most (default: the model's)")
    p.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: N processes, one GPU each on CUDA "
                   "(gloo on the CPU); --kv-memory-bytes is then per rank (default: 1)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), help="model dtype (default: float32 on "
                                                                               "CPU, bfloat16 on GPU)")
    add_threads_argument(p)
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="request bodies above this get a 413 "
                                                                       "(default: 8 MiB)")
    p.add_argument("--shutdown-timeout-s", type=finite_float, default=5.0, help="at SIGINT/SIGTERM, wait this long for "
                                                                         "requests in flight, then cancel them "
                                                                         "(default: 5)")
    p.add_argument("--log-level", default="info", help="log level of uvicorn and of the access log, one line per "
                                                       "request at info (default: info)")
    p.add_argument("--allowed-hosts", type=_host_list, metavar="HOST[,HOST...]",
                   help="Host header values answered (names, IP addresses, networks such as 10.0.0.0/8, any port; "
                        "'*' = any); others get a 400 (default: loopback names only on a loopback --host, else any)")
    p.add_argument("--receive-timeout-s", type=_positive_seconds, default=30.0,
                   help="a request's head, then its body, must arrive within this many seconds each, else the "
                        "connection is closed (head) or answered 408 (body) (default: 30)")
    p.add_argument("--timeout-keep-alive-s", type=_positive_seconds, default=5.0,
                   help="close a keep-alive connection idle this long after a response (uvicorn's; default: 5)")
    p.add_argument("--max-connections", type=positive_int, default=1024,
                   help="open connections at most; one more is closed as soon as it is accepted (default: 1024)")


def _positive_seconds(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0 seconds")
    return value


_positive_seconds.reads_finite_float = True


def _host_list(text: str) -> list[str]:
    from ..serve.http_limits import check_allowed_hosts

    try:
        return check_allowed_hosts(part for part in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check_port(port: int, flag: str = "--port") -> None:
    """Refuse a TCP port outside 1-65535 (``ValueError`` naming ``flag``)."""
    if not 1 <= port <= 65535:
        raise ValueError(f"{flag} {port} is not a TCP port (1-65535)")


def bind_socket(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening; uvicorn listens on it), so that a port in use
    is found before the model loads.

    Raises:
        ValueError: ``port`` outside 1-65535, or ``host:port`` cannot be bound (in use, not an address here).
    """
    check_port(port, flag)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} is not an address: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no obstacle
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({flag} {port}): {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _draining_server(config, drain, shutdown_timeout_s: float):
    """A ``uvicorn.Server`` that, when it starts shutting down, first runs ``drain.drain(shutdown_timeout_s)``
    (refuse new requests with a 503, wait, abort the rest through the LLM) while it still listens, so a client
    connecting during the drain gets the 503 rather than a refused connection; then uvicorn closes the listener
    and waits for the connections (its own ``timeout_graceful_shutdown`` is the backstop, a few seconds later)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            await drain.drain(shutdown_timeout_s)
            await super().shutdown(sockets)

    return DrainingServer(config)


def uvicorn_config(app, host: str, port: int, *, log_level: str = "info", shutdown_timeout_s: float = 5.0,
                   receive_timeout_s: float | None = 30.0, timeout_keep_alive_s: float = 5.0,
                   max_connections: int | None = 1024):
    """``uvicorn.Config`` of ``serve``: our access log instead of uvicorn's, the graceful-shutdown backstop, and
    the connection limits (:func:`~trtllm_diffkv.serve.http_limits.http_protocol`: the request head's deadline, the
    connection cap; uvicorn's ``timeout_keep_alive`` for idle keep-alive connections)."""
    import uvicorn

    from ..serve.http_limits import http_protocol

    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          access_log=False,  # ours: one line per request with its tokens (serve.access)
                          timeout_graceful_shutdown=shutdown_timeout_s + 5.0,
                          timeout_keep_alive=timeout_keep_alive_s,
                          http=http_protocol(receive_timeout_s, max_connections))


def run(args) -> int:
    """Check the flags and bind the port, load the model, serve until interrupted, shut the LLM down.

    Returns 0, or 2 on a setup error (a bad port or one in use, a device this machine lacks, a model that
    cannot load), reported on one line before anything is loaded where it can be.
    """
    from pathlib import Path

    try:
        check_port(args.port)
        import torch

        from .common import resolve_device

        device = resolve_device(args.device)  # --device cuda without CUDA: one line, not an assertion from deep in torch
        if args.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes {args.max_body_bytes} must be >= 1")
        if args.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout-s {args.shutdown_timeout_s} must be >= 0")
        threads = cpu_threads(args.threads, device)
        if args.tp < 1:
            raise ValueError(f"--tp {args.tp} must be >= 1")
        if args.max_num_tokens is not None and args.max_num_tokens < 1:
            raise ValueError(f"--max-num-tokens {args.max_num_tokens} must be >= 1")
        sock = bind_socket(args.host, args.port)
    except (ImportError, ValueError) as exc:
        print(f"trtllm-diffkv serve: {exc}", file=sys.stderr)
        return 2
    if device.type == "cpu":
        print(f"trtllm-diffkv serve: CPU threads: {threads} (set with --threads or OMP_NUM_THREADS)", file=sys.stderr,
              flush=True)
    try:
        import uvicorn  # noqa: F401 - the server extra, checked before the model loads

        from ..llmapi.llm import LLM
        from ..serve.openai_server import create_app

        llm = LLM(args.model, kv_config=args.kv_config, device=args.device,
                  dtype=getattr(torch, args.dtype) if args.dtype else None, max_batch_size=args.max_batch_size,
                  kv_memory_bytes=args.kv_memory_bytes, max_seq_len=args.max_seq_len, num_threads=threads,
                  tensor_parallel_size=args.tp, max_num_tokens=args.max_num_tokens,
                  enable_chunked_prefill=args.enable_chunked_prefill,
                  disable_overlap_scheduler=True if args.disable_overlap_scheduler else None)
    except (ImportError, OSError, ValueError) as exc:
        sock.close()
        print(f"trtllm-diffkv serve: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or (Path(args.model).name if args.model else "trtllm-diffkv-default")
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal with the handler that was
    # installed before it: a no-op here, so that the LLM is shut down below and the exit code is 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(name)s: %(message)s"))
    serve_log = logging.getLogger("trtllm_diffkv.serve")
    serve_log.setLevel(level)
    serve_log.addHandler(handler)
    try:
        from ..serve.http_limits import LOOPBACK_HOSTS, is_loopback

        allowed = args.allowed_hosts or (list(LOOPBACK_HOSTS) if is_loopback(args.host) else None)
        app = create_app(llm, name, max_body_bytes=args.max_body_bytes, allowed_hosts=allowed,
                         receive_timeout_s=args.receive_timeout_s)
        config = uvicorn_config(app, args.host, args.port, log_level=args.log_level,
                                shutdown_timeout_s=args.shutdown_timeout_s, receive_timeout_s=args.receive_timeout_s,
                                timeout_keep_alive_s=args.timeout_keep_alive_s, max_connections=args.max_connections)
        print(f"serving {name!r} at http://{args.host}:{args.port}/v1 (kv_config {llm.kv_config.name})", file=sys.stderr,
              flush=True)  # the port is bound already: uvicorn listens on this socket
        _draining_server(config, app.state.drain, args.shutdown_timeout_s).run(sockets=[sock])
    finally:
        sock.close()
        llm.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m trtllm_diffkv.commands.serve [flags]``."""
    parser = argparse.ArgumentParser(prog="trtllm-diffkv serve", description=__doc__.split("\n\n")[0])
    _arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
