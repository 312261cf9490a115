"""Put this checkout first on ``sys.path`` for a script run from it: the repository root (the package as checked out)
and ``tests/`` (the tests' helpers: ``tests/support``, ``tiny_checkpoint``; they ship in no wheel).

The one place a benchmark or a tool adds ``tests/`` to the path: benchmarks ``import repo_paths`` (their own folder is
on the path), tools add ``benchmarks/`` first.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root."""


def use_checkout() -> Path:
    """Put the repository root, then ``tests/``, first on ``sys.path`` (each once); returns the root."""
    for path in (str(ROOT / "tests"), str(ROOT)):
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
    return ROOT
