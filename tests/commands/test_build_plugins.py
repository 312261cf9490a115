"""How ``trtllm-diffkv build`` finds the TensorRT plugin package: an entry point, never an import.

``trtllm_diffkv`` never imports ``trtllm_diffkv_plugins`` (tests/layout); the build loads the entry point ``diffkv``
of the group ``trtllm_diffkv.plugins``, which pyproject.toml declares for the package installed from ``plugins/``.
The tests pass their own entry points (no install needed) and check that the declared one resolves to the plugin
package's ``register`` (imported from this checkout's ``plugins/`` by the tests' conftest). TensorRT itself cannot be
installed here: the engine step is reached with a stand-in ``tensorrt`` module that carries only a version.
"""
import sys
import types
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from trtllm_diffkv.commands import build as build_cmd

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _entry_points(*entries):
    """``importlib.metadata.entry_points`` over ``entries`` (``(name, "module:attr")``) of the build's group."""
    def find(*, group):
        return [EntryPoint(name, value, group) for name, value in entries if group == build_cmd.PLUGIN_ENTRY_POINTS]
    return find


def test_pyproject_declares_the_entry_point_the_build_loads():
    """The group and name the build reads are the ones pyproject.toml installs, and its value is the plugin
    package's ``register``."""
    import trtllm_diffkv_plugins

    declared = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"]
    assert declared[build_cmd.PLUGIN_ENTRY_POINTS] == {"diffkv": "trtllm_diffkv_plugins:register"}
    found = _entry_points(*declared[build_cmd.PLUGIN_ENTRY_POINTS].items())
    assert build_cmd.plugin_register("diffkv", find=found) is trtllm_diffkv_plugins.register


def test_the_plugin_package_installs_from_plugins():
    """pyproject.toml installs the folder ``plugins/`` as ``trtllm_diffkv_plugins`` (the name the entry point names)."""
    setuptools = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"trtllm_diffkv_plugins": "plugins"}
    assert "trtllm_diffkv_plugins" in setuptools["packages"]


def test_only_the_named_entry_point_is_loaded():
    find = _entry_points(("other", "json:dumps"), ("diffkv", "json:loads"))
    assert build_cmd.plugin_register("diffkv", find=find) is __import__("json").loads


def test_no_plugin_package_is_one_clear_error():
    with pytest.raises(RuntimeError) as err:
        build_cmd.plugin_register("diffkv", find=_entry_points(("other", "json:dumps")))
    message = str(err.value)
    assert "\n" not in message
    assert "--plugin diffkv" in message and "'trtllm_diffkv.plugins'" in message and "pip install -e ." in message


def test_the_engine_step_registers_the_plugins_through_the_entry_point(monkeypatch, tmp_path):
    """Where TensorRT imports, the composite graph's engine step calls the ``register`` of the installed plugin
    package before parsing (a stand-in ``register`` stops it there), and without one it fails with the clear error
    (before touching TensorRT's builder)."""
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.9.0"))
    called = []

    class Registered(Exception):
        pass

    def register():
        called.append(True)
        raise Registered

    stand_in = types.ModuleType("stand_in_plugins")
    stand_in.register = register
    monkeypatch.setitem(sys.modules, "stand_in_plugins", stand_in)
    monkeypatch.setattr(build_cmd, "entry_points", _entry_points(("diffkv", "stand_in_plugins:register")))
    with pytest.raises(Registered):
        build_cmd._tensorrt_engine(tmp_path, "model.onnx")
    assert called == [True]
    monkeypatch.setattr(build_cmd, "entry_points", _entry_points())
    with pytest.raises(RuntimeError, match="no plugin package for --plugin diffkv"):
        build_cmd._tensorrt_engine(tmp_path, "model.onnx")
