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


class LazyModule:
    """A module imported on first attribute access: ``torch = LazyModule("torch")`` at the top of a module whose
    torch use is all inside functions lets the module import without torch (the command line checks its flags with
    it before the ~10 s torch import). Later accesses read ``sys.modules``."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"
