"""What several subcommands share: the ``--device`` and ``--threads`` rules, finite float flags, output paths."""
from __future__ import annotations

import os


def default_cpu_threads() -> int:
    """CPU threads used unless ``--threads`` is given.

    ``$OMP_NUM_THREADS`` when set; else the cores this process may use that
    are not already busy (usable cores minus the 1-minute load average,
    rounded), capped at 4 and at least 1. Decoding token by token gains little
    past ~4 threads, and more threads than free cores collapse throughput: on
    a 2-core machine at load 6.5, decode ran at 10.3 tok/s with 1 thread and
    1.1 tok/s with 2 (a 25x spread across thread counts was reported under load).
    """
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, min(4, cores - busy))


def resolve_device(name: str | None):
    """The torch device for a ``--device`` value (``None``: cuda when available, else cpu).

    Raises:
        ValueError: not a device name, a device type other than cpu/cuda, or cuda without a CUDA GPU; the
            message names the flag.
    """
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; use cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: only cpu and cuda are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch build sees no CUDA GPU")
    return device


def check_output_path(path, flag: str) -> None:
    """Refuse, before any work, an output file that could not be written at the end.

    Raises:
        ValueError: ``path`` is a directory, or its folder does not exist; the message names ``flag``.
    """
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {path}: the folder {path.parent} does not exist")


def refuse_tp(tp: int, command: str) -> None:
    """``--tp`` of a subcommand that does not run tensor parallelism (``triton-repo``, ``build``): only 1.

    Raises:
        ValueError: ``tp != 1``, naming the flag and what runs tensor parallelism instead.
    """
    if tp != 1:
        raise ValueError(f"--tp {tp}: {command} does not run tensor parallelism (not wired); serve the checkpoint "
                         f"with `trtllm-diffkv serve --tp {tp} --model CHECKPOINT` or "
                         f"LLM(CHECKPOINT, tensor_parallel_size={tp})")


THREADS_HELP = ("torch CPU threads (default on the CPU: $OMP_NUM_THREADS if set, else the idle cores, 1 to 4; "
                "on a GPU: torch's); on the CPU the speed changes up to 10x with it")
"""The one help text of ``--threads`` (every subcommand that runs a model takes the flag, with this default)."""


def add_threads_argument(parser) -> None:
    """Add ``--threads N`` (:data:`THREADS_HELP`; an integer >= 1, checked by argparse) to an argparse parser or
    group; read it with :func:`cpu_threads`."""
    parser.add_argument("--threads", type=positive_int, metavar="N", help=THREADS_HELP)


def cpu_threads(flag: int | None, device) -> int | None:
    """The torch thread count for a ``--threads`` value on ``device`` (a ``torch.device`` or its name).

    ``flag`` when given; else, on the CPU, :func:`default_cpu_threads`; else (a GPU) ``None``: leave torch's.

    Raises:
        ValueError: ``flag`` below 1; the message names ``--threads``.
    """
    if flag is not None and (isinstance(flag, bool) or flag < 1):
        raise ValueError(f"--threads {flag} must be >= 1")
    if flag is not None:
        return flag
    kind = device if isinstance(device, str) else getattr(device, "type", "cpu")
    return default_cpu_threads() if str(kind).split(":")[0] == "cpu" else None


def finite_float(text: str) -> float:
    """argparse ``type`` of every float flag: a finite number (``nan``, ``inf`` and ``-inf`` refused, as is
    anything ``float()`` cannot read), so that a bad value is argparse's one-line usage error naming the flag
    (exit code 2) instead of a comparison that is silently false (``x <= nan``) deep in a run.

    Raises:
        argparse.ArgumentTypeError: not a number, or not finite.
    """
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_int(text: str) -> int:
    """argparse ``type`` of a count or size flag: an integer >= 1 (else argparse's usage error naming the flag).

    Raises:
        argparse.ArgumentTypeError: not an integer, or below 1.
    """
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def sampling_flag(field: str, kind=float):
    """argparse ``type`` of a sampling flag (``--temperature``, ``--top-k``, ...): the value read as ``kind`` (a
    finite float or an int) and checked by :meth:`~trtllm_diffkv.runtime.sampling.SamplingParams.validate` for
    ``field`` alone (the one home of the ranges; it needs no torch), so a bad value is argparse's one-line usage
    error, exit code 2, before torch and the model load (10 s or more), and says nothing of ``None`` (a Python
    caller's value, not a flag's).

    Returns:
        the ``type`` callable.
    """
    import argparse

    def parse(text: str):
        from ..runtime.sampling import SamplingParams

        if kind is int:
            try:
                value = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        else:
            value = finite_float(text)
        try:
            SamplingParams(**{field: value}).validate()
        except ValueError as exc:
            message = str(exc).replace(" or None", "").replace("None or ", "")
            raise argparse.ArgumentTypeError(message.removeprefix(f"{field} ")) from None
        return value

    parse.__name__ = field  # argparse names the type in "invalid <name> value"
    parse.reads_finite_float = kind is not int  # a float flag read by finite_float (tests/commands)
    return parse


def default_results_path(command: str, file_name: str):
    """Where a command writes its results without ``--output``: ``<cache_root()>/<command>/<file_name>``
    (:func:`trtllm_diffkv.user_cache.cache_root`: ``~/.cache/trtllm-diffkv`` unless an environment variable moves
    it), outside the current folder and the repository, so that a plain run never replaces committed results
    (``benchmarks/results/``). Used by ``bench`` and ``eval``.

    Returns:
        a ``pathlib.Path`` whose folder exists and is writable (made here: it is ours, unlike an ``--output``'s,
        which :func:`check_output_path` requires to exist), checked before any work.

    Raises:
        ValueError: ``$TRTLLM_DIFFKV_CACHE_DIR`` is a relative path. OSError: the folder cannot be made or written;
        both name the variable to change (:func:`trtllm_diffkv.user_cache.cache_folder`).
    """
    from ..user_cache import cache_folder

    return cache_folder(command) / file_name
