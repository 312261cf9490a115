"""Where trtllm-diffkv keeps files between runs: converted models, the Triton stub's environment, and the results
of ``bench`` and ``eval`` run without ``--output``.

One root for all of them (:func:`cache_root`): ``$TRTLLM_DIFFKV_CACHE_DIR`` if set, else
``$XDG_CACHE_HOME/trtllm-diffkv`` (the XDG base-directory rule), else ``~/.cache/trtllm-diffkv``. Below it:
``models/`` (:mod:`trtllm_diffkv.model.loader`, :mod:`trtllm_diffkv.model.gguf_convert`),
``triton-stub-env/`` (:mod:`trtllm_diffkv.serve.tritonserver_binary`) and one folder per command
(:func:`trtllm_diffkv.commands.common.default_results_path`).
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_root"]

CACHE_ENV = "TRTLLM_DIFFKV_CACHE_DIR"
"""The environment variable that moves every file trtllm-diffkv keeps between runs."""


def cache_root() -> Path:
    """The folder trtllm-diffkv keeps its files in (not made here).

    Returns:
        ``$TRTLLM_DIFFKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/trtllm-diffkv``, else ``~/.cache/trtllm-diffkv``
        (``~`` expanded; an empty variable counts as unset, as the XDG rule says).
    """
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "trtllm-diffkv"
