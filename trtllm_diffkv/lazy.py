"""Lazy package exports: names imported on first use, so importing a package stays light."""
from __future__ import annotations

import importlib


def lazy_exports(package: str, table: dict[str, str]):
    """A module ``__getattr__`` for ``package`` (PEP 562) that imports ``table[name]`` on first use.

    Args:
        package: the package's ``__name__`` (relative module paths in ``table`` resolve against it).
        table: exported name -> module that defines it (``".llm"``, ``"..runtime.sampling"``).

    Returns:
        ``__getattr__(name)``; it raises ``AttributeError`` for a name not in ``table``.
    """
    def __getattr__(name: str):
        if name in table:
            return getattr(importlib.import_module(table[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
