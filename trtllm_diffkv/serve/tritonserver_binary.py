"""Run the ``tritonserver`` binary shipped in ``nvidia-pytriton==0.7.0`` (Triton 2.51) on a model repository.

What the binary needs, found on these machines (2026-11-30):

- ``LD_LIBRARY_PATH``: ``site-packages/nvidia_pytriton.libs`` (cudart, libtritonserver; PyTriton
  sets it the same way) and the directory of the running Python's shared ``libpython3.X.so.1.0``:
  the Python backend stub (``python_backend_stubs/3.X/triton_python_backend_stub``) links it.
  Without a shared libpython the stub cannot start (:class:`TritonUnavailable`).
- A private backend directory: ``backends/python/`` holding links to the wheel's
  ``libtriton_python.so`` and ``triton_python_backend_utils.py`` and to the stub built for this
  Python's minor version (the wheel keeps the stubs apart; PyTriton copies one in the same way).
- A Python environment for the stub. The stub embeds Python in isolated mode: it ignores
  ``PYTHONPATH`` and finds its prefix from the first ``python3`` on ``PATH``. So the launcher puts
  a small virtual environment (:func:`stub_env`) first on ``PATH``: ``--system-site-packages``
  over this interpreter, plus a ``.pth`` that adds this process's ``sys.path`` (a venv's packages,
  editable installs), plus ``numpy<2`` when this process runs NumPy 2. The stub's pybind11
  predates NumPy 2's ABI: under NumPy 2 it builds arrays with zero strides (a BYTES input
  ``b"hello"`` arrives as ``b"\\x05\\x05..."``, the crash ``unpack_from requires a buffer of at least
  ...`` in ``deserialize_bytes_tensor``) and sends every output with 0 bytes. PyTriton pins
  ``numpy<2`` for the same reason. ``trtllm-diffkv triton-repo --setup-stub-env`` (or
  :func:`stub_env` with ``install=True``) installs it once with pip into the cache.
- ``--backend-config=python,shm-region-prefix-name=...``: a unique prefix per run, so that the
  shared-memory regions of a killed server can be removed from ``/dev/shm`` (:meth:`TritonServer.stop`).
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path

from .process import ServerProcess, free_port

__all__ = ["TritonServer", "TritonUnavailable", "TritonInstall", "find_triton", "stub_env", "stub_env_dir"]

DRAINED_EXIT_S = 5.0
"""Seconds :meth:`TritonServer.stop` lets tritonserver exit by itself after every DiffKV model drained, before it
kills the process group (a client's open gRPC stream keeps Triton 2.51 up: :meth:`TritonServer.stop`)."""

STUB_NUMPY = "numpy>=1.26,<2"
"""What the stub environment installs when this process runs NumPy 2 (the stub's pybind11 needs NumPy 1)."""


class TritonUnavailable(RuntimeError):
    """The bundled ``tritonserver`` cannot run here (not installed, no stub for this Python, no shared libpython,
    no stub environment); the message says what is missing and how to get it."""


class TritonInstall:
    """Paths of the ``tritonserver`` install inside ``nvidia-pytriton`` (see :func:`find_triton`).

    Attributes:
        binary: ``.../pytriton/tritonserver/bin/tritonserver``.
        libs: ``.../nvidia_pytriton.libs``.
        python_backend: ``.../tritonserver/backends/python`` (``libtriton_python.so``, utils).
        stub: ``.../python_backend_stubs/3.X/triton_python_backend_stub`` for this Python.
        libpython_dir: the directory holding this Python's ``libpython3.X.so.1.0``.
    """

    def __init__(self, binary: Path, libs: Path, python_backend: Path, stub: Path, libpython_dir: Path):
        self.binary, self.libs, self.python_backend, self.stub = binary, libs, python_backend, stub
        self.libpython_dir = libpython_dir


def find_triton() -> TritonInstall:
    """Locate the bundled ``tritonserver``, its libraries, Python backend and stub.

    Raises:
        TritonUnavailable: ``nvidia-pytriton`` is not installed, has no stub for this Python, or
            this Python has no shared ``libpython`` for the stub.
    """
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonUnavailable("nvidia-pytriton is not installed: pip install --no-deps nvidia-pytriton==0.7.0")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    install = TritonInstall(root / "bin" / "tritonserver", root.parent.parent / "nvidia_pytriton.libs",
                            root / "backends" / "python",
                            root / "python_backend_stubs" / version / "triton_python_backend_stub", _libpython_dir())
    for path in (install.binary, install.libs, install.python_backend / "libtriton_python.so"):
        if not path.exists():
            raise TritonUnavailable(f"incomplete nvidia-pytriton install: {path} is missing")
    if not install.stub.exists():
        raise TritonUnavailable(f"nvidia-pytriton has no Python backend stub for Python {version} ({install.stub})")
    return install


def _libpython_dir() -> Path:
    name = sysconfig.get_config_var("INSTSONAME") or f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0"
    for directory in (sysconfig.get_config_var("LIBDIR"), os.path.join(sys.base_prefix, "lib"),
                      "/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        if directory and (Path(directory) / name).is_file():
            return Path(directory)
    raise TritonUnavailable(f"no shared {name} for the Triton Python backend stub (this Python is statically linked; "
                            "install the distribution's libpython3.X package or use a Python built with --enable-shared)")


def stub_env_dir() -> Path:
    """Where :func:`stub_env` keeps the stub's environment: ``$TRTLLM_DIFFKV_TRITON_STUB_ENV``, else
    :func:`~trtllm_diffkv.user_cache.cache_root` ``/triton-stub-env/<python tag>``."""
    if os.environ.get("TRTLLM_DIFFKV_TRITON_STUB_ENV"):
        return Path(os.environ["TRTLLM_DIFFKV_TRITON_STUB_ENV"])
    from ..user_cache import cache_root

    cache = cache_root()
    tag = f"{sys.implementation.cache_tag}-{hashlib.sha1(sys.executable.encode()).hexdigest()[:8]}"
    return cache / "triton-stub-env" / tag


def _numpy_major() -> int:
    import numpy

    return int(numpy.__version__.split(".")[0])


def stub_env(install: bool = False) -> Path:
    """The virtual environment the Python backend stub runs in (created on first use; see the module doc).

    Args:
        install: when this process runs NumPy 2 and the environment has no NumPy 1 yet, install
            ``numpy>=1.26,<2`` into it with pip (needs the package index once).

    Returns:
        the environment's root; its ``bin`` goes first on the server's ``PATH``.

    Raises:
        TritonUnavailable: NumPy 1 is needed, missing, and ``install`` is False or pip failed.
        ValueError, OSError: the cache root is relative, or cannot be made or written
            (:func:`~trtllm_diffkv.user_cache.cache_folder`, naming the variable to change).
    """
    root = stub_env_dir()
    site = root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    if not (root / "pyvenv.cfg").is_file():
        if os.environ.get("TRTLLM_DIFFKV_TRITON_STUB_ENV"):
            root.parent.mkdir(parents=True, exist_ok=True)
        else:  # below the cache root: one that cannot be made or written names the variable to change
            from ..user_cache import cache_folder

            cache_folder("triton-stub-env")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(root)],
                       check=True, capture_output=True)
    paths = [p for p in sys.path if p and Path(p).is_dir() and not str(p).startswith(str(root))]
    lines = [f"import site; site.addsitedir({p!r})" for p in paths]
    (site / "trtllm_diffkv_parent_paths.pth").write_text("\n".join(lines) + "\n")
    if _numpy_major() >= 2 and not any(site.glob("numpy-1.*.dist-info")):
        if not install:
            raise TritonUnavailable(
                f"the Triton Python backend stub needs NumPy 1 (this process runs NumPy {_numpy_version()}; the stub's "
                f"pybind11 corrupts tensors under NumPy 2); run `trtllm-diffkv triton-repo --setup-stub-env` once to "
                f"install {STUB_NUMPY} into {root}")
        result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                                 STUB_NUMPY], capture_output=True, text=True)
        if result.returncode != 0:
            raise TritonUnavailable(f"pip could not install {STUB_NUMPY} into {site}:\n{result.stderr[-2000:]}")
    return root


def _numpy_version() -> str:
    import numpy

    return numpy.__version__


def _backend_dir(install: TritonInstall, workspace: Path) -> Path:
    """``workspace/backends`` with ``python/`` linking the wheel's backend files and this Python's stub."""
    python = workspace / "backends" / "python"
    python.mkdir(parents=True, exist_ok=True)
    for source in (install.python_backend / "libtriton_python.so",
                   install.python_backend / "triton_python_backend_utils.py", install.stub):
        link = python / source.name
        if not link.exists():
            link.symlink_to(source)
    return workspace / "backends"


class TritonServer(ServerProcess):
    """The bundled ``tritonserver`` serving ``repository`` (HTTP, gRPC and metrics on free ports by default).

    Args:
        repository: a model repository (``trtllm-diffkv triton-repo`` writes one).
        workspace: a directory for the backend links, the log and nothing else.
        http_port, grpc_port, metrics_port: ``None`` = a free port each.
        host: the address the three services bind to.
        exit_timeout_s: Triton's ``--exit-timeout-secs`` (waiting for in-flight requests at shutdown).
        extra_args: more ``tritonserver`` flags.
        install_stub_numpy: passed to :func:`stub_env` as ``install``.
        env: the server's environment before the additions above (``None``: this process's);
            ``OMP_NUM_THREADS`` defaults to 1 (one torch thread per stub).

    ``start()`` launches it; ``wait_ready(timeout_s)`` waits for ``/v2/health/ready`` (all models
    loaded, ``--strict-readiness``); ``stop()`` shuts it down (SIGTERM to the group, SIGKILL after
    the grace period) and removes the run's shared-memory regions.

    Raises:
        TritonUnavailable: from :func:`find_triton` / :func:`stub_env`.
    """

    def __init__(self, repository: str | Path, workspace: str | Path, *, http_port: int | None = None,
                 grpc_port: int | None = None, metrics_port: int | None = None, host: str = "127.0.0.1",
                 exit_timeout_s: int = 10, extra_args: tuple[str, ...] = (), install_stub_numpy: bool = False,
                 env: dict | None = None):
        install = find_triton()
        venv = stub_env(install=install_stub_numpy)
        workspace = Path(workspace)
        self.http_port, self.grpc_port, self.metrics_port = (p or free_port(host) for p in
                                                             (http_port, grpc_port, metrics_port))
        self.host = host
        self.shm_prefix = f"trtllm_diffkv_{uuid.uuid4().hex[:12]}_"
        command = [str(install.binary), f"--model-repository={Path(repository).resolve()}",
                   f"--backend-directory={_backend_dir(install, workspace)}",
                   f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
                   f"--http-address={host}", f"--http-port={self.http_port}",
                   f"--grpc-address={host}", f"--grpc-port={self.grpc_port}",
                   f"--metrics-address={host}", f"--metrics-port={self.metrics_port}",
                   "--allow-gpu-metrics=false", "--disable-auto-complete-config", "--strict-readiness=true",
                   f"--exit-timeout-secs={exit_timeout_s}", *extra_args]
        env = dict(os.environ if env is None else env)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(install.libpython_dir), str(install.libs)] + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH")
                                                              else []))
        env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "/usr/bin:/bin")])
        env.setdefault("OMP_NUM_THREADS", "1")
        super().__init__(command, f"http://{host}:{self.http_port}/v2/health/ready", workspace / "tritonserver.log",
                         env=env)
        self.killed_after_drain = False

    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP service (tritonclient.http's ``url``)."""
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the gRPC service (tritonclient.grpc's ``url``)."""
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """The Prometheus metrics URL (Triton's own metrics and the model's ``trtllm_diffkv_*`` gauges)."""
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def stop(self, grace_s: float = 20.0, drained_exit_s: float = DRAINED_EXIT_S) -> int | None:
        """Stop the server and its stubs (see :meth:`ServerProcess.stop`), then remove this run's
        ``/dev/shm`` regions that a killed stub may have left.

        At SIGTERM each DiffKV model drains (its ``shutdown_timeout_s``) and logs
        :data:`~trtllm_diffkv.serve.DRAINED_MESSAGE` with the KV pages it still holds. Triton 2.51 then
        exits, unless a client keeps a gRPC stream open (with no request in it, too): its gRPC server waits
        for every open stream, until ``--exit-timeout-secs`` and then for ever (Triton added a shutdown
        timer to its gRPC frontend later, server PR #7969). So once every model that started draining has
        drained and the server is still up ``drained_exit_s`` seconds later, the group is killed at once
        instead of after ``grace_s``; :attr:`drained` then tells whether the drain itself was clean.

        Returns:
            tritonserver's exit code (``-9`` when it was killed), ``None`` if never started.
        """
        since = []

        def stuck_after_drain() -> bool:
            if not self.drained:
                return False
            since.append(time.monotonic())
            self.killed_after_drain = since[-1] - since[0] >= drained_exit_s
            return self.killed_after_drain

        self.killed_after_drain = False
        code = super().stop(grace_s, give_up=stuck_after_drain)
        for region in Path("/dev/shm").glob(self.shm_prefix + "*"):
            region.unlink(missing_ok=True)
        return code

    @property
    def drained(self) -> bool:
        """Whether every DiffKV model that began its shutdown drain logged that it drained with no KV page held
        (read from the server's log; ``False`` before any drain began)."""
        from . import DRAINED_MESSAGE, DRAINING_MESSAGE

        log = self.log_tail(1 << 22)
        began = log.count(DRAINING_MESSAGE + ":")
        ends = re.findall(re.escape(DRAINED_MESSAGE) + r"; KV pool pages held: (\d+)", log)
        return began > 0 and len(ends) >= began and all(int(pages) == 0 for pages in ends)
