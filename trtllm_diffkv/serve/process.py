"""Server processes started in their own process group, waited for, and stopped with nothing left behind.

Both servers (``tritonserver`` with its Python backend stubs, and ``trtllm-diffkv serve``) run as
child processes of the caller in a new session (``start_new_session=True``), so that the server and
everything it forks (Triton forks one ``triton_python_backend_stub`` per model instance) share one
process group id equal to the server's pid. :meth:`ServerProcess.stop` signals the whole group:
SIGTERM (the servers shut down gracefully: unload models, finish or cancel requests), then SIGKILL
for whatever is still there after the grace period, then reaps the child.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["ServerProcess", "free_port", "group_pids"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def group_pids(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group ``pgid``, read from ``/proc``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


class ServerProcess:
    """One server command run in its own process group, its output in ``log_path``.

    Args:
        command: the argv to run.
        ready_url: an HTTP URL that answers 200 once the server is ready (polled by :meth:`wait_ready`).
        log_path: file receiving the server's stdout and stderr.
        env: the environment (``None``: this process's).
        cwd: working directory.

    Use as a context manager (``with ServerProcess(...).start() as server``) or call :meth:`stop`.
    """

    def __init__(self, command: list[str], ready_url: str, log_path: str | Path, *, env: dict | None = None,
                 cwd: str | Path | None = None):
        self.command, self.ready_url, self.log_path = list(command), ready_url, Path(log_path)
        self.env, self.cwd = env, cwd
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        """The server's pid, which is also its process group id."""
        if self.proc is None:
            raise RuntimeError("the server was not started")
        return self.proc.pid

    def start(self) -> "ServerProcess":
        """Launch the command (returns at once; see :meth:`wait_ready`)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, cwd=self.cwd, start_new_session=True)
        return self

    def log_tail(self, chars: int = 4000) -> str:
        """The last ``chars`` characters of the server's log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        """Poll ``ready_url`` until it answers 200.

        Raises:
            RuntimeError: the server exited first (its log tail in the message).
            TimeoutError: not ready within ``timeout_s`` seconds (the server is stopped).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{Path(self.command[0]).name} exited with code {self.proc.returncode} before it "
                                   f"was ready; log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.ready_url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.2)
        tail = self.log_tail()
        self.stop()
        raise TimeoutError(f"{Path(self.command[0]).name} not ready at {self.ready_url} after {timeout_s:.0f} s; "
                           f"log {self.log_path}:\n{tail}")

    def stop(self, grace_s: float = 20.0, give_up=None) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace_s`` seconds if anything is left, reap.

        Args:
            grace_s: seconds between SIGTERM and SIGKILL at most.
            give_up: called about every 0.1 s while the group lives; ``True`` sends SIGKILL at once (the
                server has done all it will do; :meth:`TritonServer.stop` uses it).

        Returns:
            the server's exit code (negative: the signal that ended it), or ``None`` if never started.
        """
        if self.proc is None:
            return None
        pgid = self.proc.pid
        self._signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (self.proc.poll() is None or group_pids(pgid)):
            if give_up is not None and give_up():
                break
            time.sleep(0.1)
        if self.proc.poll() is None or group_pids(pgid):
            self._signal_group(pgid, signal.SIGKILL)
        code = self.proc.wait()
        deadline = time.monotonic() + 5.0  # orphans killed above are reaped by init
        while group_pids(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        return code

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
