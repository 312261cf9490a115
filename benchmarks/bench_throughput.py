"""Serving throughput and latency of the in-flight executor: DiffKV preset against ``fp16`` at one KV budget.

The same benchmark as ``trtllm-diffkv bench`` (:mod:`trtllm_diffkv.commands.bench`, workloads in
:mod:`trtllm_diffkv.evaluation.throughput`), with the results written into the repository by default:
``benchmarks/results/throughput.json`` (``{"gpu", "date", "commit", "command", "rows"}``),
``throughput_details.json`` and ``throughput.png`` beside it.

    python benchmarks/bench_throughput.py                 # H200: workloads a, b, c (~4-5 min)
    python benchmarks/bench_throughput.py --smoke --device cpu --output /tmp/t.json   # CPU check, seconds

Every flag: ``python benchmarks/bench_throughput.py --help``.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trtllm_diffkv.commands import bench  # noqa: E402

DEFAULT_OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "throughput.json")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="bench_throughput.py")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    given = argv if any(a == "--output" or a.startswith("--output=") for a in argv) else argv + ["--output",
                                                                                               DEFAULT_OUTPUT]
    if any(a in ("-h", "--help") for a in argv):
        given = ["bench", "--help"]
    else:
        given = ["bench"] + given
    args = parser.parse_args(given)
    args.command_line = "python benchmarks/bench_throughput.py " + shlex.join(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
