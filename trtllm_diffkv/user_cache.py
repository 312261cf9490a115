"""Where trtllm-diffkv keeps files between runs: converted models, the Triton stub's environment, the TensorRT
ABI wrappers, and the results of ``bench`` and ``eval`` run without ``--output``.

One root for all of them (:func:`cache_root`): ``$TRTLLM_DIFFKV_CACHE_DIR`` if set, else
``$XDG_CACHE_HOME/trtllm-diffkv`` (the XDG base-directory rule), else ``~/.cache/trtllm-diffkv``. Below it:
``models/`` (:mod:`trtllm_diffkv.model.loader`, :mod:`trtllm_diffkv.model.gguf_convert`),
``triton-stub-env/`` (:mod:`trtllm_diffkv.serve.tritonserver_binary`), ``trt_abi/``
(:mod:`trtllm_diffkv.export.trt_abi`) and one folder per command
(:func:`trtllm_diffkv.commands.common.default_results_path`). Folders are made through :func:`cache_folder`, whose
errors name the variable that chose the root.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "XDG_ENV", "cache_folder", "cache_root"]

CACHE_ENV = "TRTLLM_DIFFKV_CACHE_DIR"
"""The environment variable that moves every file trtllm-diffkv keeps between runs."""
XDG_ENV = "XDG_CACHE_HOME"
"""The XDG base-directory variable, used when :data:`CACHE_ENV` is not set."""


def _variable(name: str) -> Path | None:
    """``$name`` as a path with ``~`` expanded; None when unset, empty or only whitespace."""
    value = os.environ.get(name, "")
    return Path(value).expanduser() if value.strip() else None


def _root_and_source() -> tuple[Path, str]:
    """The cache root and what chose it: :data:`CACHE_ENV`, :data:`XDG_ENV` or ``"the default"``."""
    mine = _variable(CACHE_ENV)
    if mine is not None:
        if not mine.is_absolute():
            raise ValueError(f"{CACHE_ENV}={os.environ[CACHE_ENV]!r} is a relative path: give an absolute one (or "
                             f"one starting with ~), so that every run and subprocess finds the same folder")
        return mine, CACHE_ENV
    xdg = _variable(XDG_ENV)
    if xdg is not None and xdg.is_absolute():  # the XDG rule: a relative path is invalid and ignored
        return xdg / "trtllm-diffkv", XDG_ENV
    return Path.home() / ".cache" / "trtllm-diffkv", "the default"


def cache_root() -> Path:
    """The folder trtllm-diffkv keeps its files in (not made here; :func:`cache_folder` makes its subfolders).

    Returns:
        An absolute path: ``$TRTLLM_DIFFKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/trtllm-diffkv``, else
        ``~/.cache/trtllm-diffkv``. ``~`` is expanded in both variables; an empty or whitespace-only variable counts
        as unset; a relative ``$XDG_CACHE_HOME`` is ignored (the XDG Base Directory Specification: "If an
        implementation encounters a relative path in any of these variables it should consider the path invalid
        and ignore it").

    Raises:
        ValueError: ``$TRTLLM_DIFFKV_CACHE_DIR`` is a relative path (it would name another folder after a change of
            the current folder, or in a subprocess started elsewhere); the message names the variable.
    """
    return _root_and_source()[0]


def cache_folder(*parts: str) -> Path:
    """``cache_root() / parts``, made if missing and checked writable.

    Args:
        parts: the subfolder's names below the root, e.g. ``("models", "gguf")``.

    Returns:
        The folder (absolute).

    Raises:
        ValueError: as :func:`cache_root`.
        OSError: the folder cannot be made (a file in the way, a read-only parent: the subclass of the failure, e.g.
            ``NotADirectoryError``, ``PermissionError``) or is not writable (``PermissionError``); the message names
            the folder and the variable that chose the root (or that ``$TRTLLM_DIFFKV_CACHE_DIR`` moves it).
    """
    root, source = _root_and_source()
    folder = root.joinpath(*parts)
    if source == "the default":
        fix = f"the default cache root {root} ({CACHE_ENV} and {XDG_ENV} unset): set {CACHE_ENV} to a writable folder"
    else:
        fix = f"the cache root {root} comes from {source}: point {CACHE_ENV} at a writable folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise type(exc)(f"cannot make the folder {folder} ({exc.strerror or exc}); {fix}") from exc
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"the folder {folder} is not writable; {fix}")
    return folder
