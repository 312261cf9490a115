"""``trtllm-diffkv`` command line: the parser over the subcommands of :mod:`trtllm_diffkv.commands` and the
console-script entry point. Each subcommand's body lives in its own module there.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__

COMMAND_MODULES: tuple[str, ...] = ("generate", "bench", "build", "calibrate", "eval", "serve", "tritonserver_repo")
"""Subcommands: modules of :mod:`trtllm_diffkv.commands`, each with
``add_parser(subparsers)`` that registers its parser and ``set_defaults(run=fn)``, ``fn(args) -> int``."""


def build_parser() -> argparse.ArgumentParser:
    """The ``trtllm-diffkv`` parser: every subcommand of :data:`COMMAND_MODULES`."""
    parser = argparse.ArgumentParser(prog="trtllm-diffkv", description="DiffKV KV-cache compression for LLM serving")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__package__}.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point; returns the exit code (0 ok, 1 a request failed, 2 a usage or setup error)."""
    args = build_parser().parse_args(argv)
    return args.run(args)  # each command sets ``run`` with ``parser.set_defaults(run=...)``


if __name__ == "__main__":
    sys.exit(main())
