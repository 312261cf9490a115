"""The package layout's rules (docs/ARCHITECTURE.md): imports run one way, no circles, no private reaches, the public
names live where the docs say.

The import graph is read from the source (an AST scan, nothing imported): ``import`` and ``from ... import``
statements anywhere in a file (inside functions and ``TYPE_CHECKING`` blocks too, relative ones resolved) and
``import_module("...")`` strings. So a new arrow from the core into an adapter, or from ``trtllm_diffkv`` into the
plugin package, fails here before anyone runs it. Each rule's test has a twin that plants a violation in a made-up
tree and checks that the scan reports it.
"""
from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"trtllm_diffkv": ROOT / "trtllm_diffkv", "trtllm_diffkv_plugins": ROOT / "plugins"}
"""Import name -> folder: the product (``trtllm_diffkv``) and the TensorRT plugin layer, installed from the top-level
folder ``plugins/`` as ``trtllm_diffkv_plugins`` (pyproject.toml)."""

CORE = ("validators", "user_cache", "config", "engine_config", "quant", "policy", "cache", "model", "memory",
        "kernels", "paged", "runtime", "parallel")
"""The core: the settings' checks, rules, the engine's settings, formats, the caches, kernels and the executor."""
ADAPTERS = ("export", "trtllm_backend", "serve")
"""The adapters around the core: engine export (ONNX, AOT, TensorRT ABI), the TensorRT-LLM backend, the servers."""
ABOVE_CORE = (*ADAPTERS, "llmapi", "commands", "evaluation", "cli")
"""What the core must never import: the adapters, the API shapes, the command line, benchmarks."""
NEVER_IMPORTED_BY = {
    # layer -> layers it must not import ("plugins": the package trtllm_diffkv_plugins)
    **{core: ABOVE_CORE for core in CORE},
    "generation": ABOVE_CORE,
    "llmapi": ("serve", "trtllm_backend", "evaluation", "commands", "cli"),
    "export": ("serve", "trtllm_backend", "llmapi", "evaluation", "commands", "cli"),
    "trtllm_backend": ("serve", "export", "llmapi", "evaluation", "commands", "cli"),
    "serve": ("export", "trtllm_backend", "evaluation", "commands", "cli"),
    "evaluation": ("serve", "export", "trtllm_backend", "commands", "cli"),
    "plugins": ("serve", "trtllm_backend", "llmapi", "evaluation", "commands", "cli"),
}
"""Every layer of ``trtllm_diffkv`` also never imports the plugin package (:func:`test_the_package_never_imports_the
plugins`) nor the tests' helpers (:func:`test_the_package_never_imports_test_helpers`)."""


def _modules(packages: dict[str, Path] = PACKAGES) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file of ``packages`` (a package is its ``__init__.py``)."""
    found = {}
    for name, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _layer(module: str) -> str | None:
    """``"plugins"`` for the plugin package, the folder or module under ``trtllm_diffkv`` otherwise (``None``: not
    ours)."""
    parts = module.split(".")
    if parts[0] == "trtllm_diffkv_plugins":
        return "plugins"
    return parts[1] if len(parts) > 1 and parts[0] == "trtllm_diffkv" else ("__init__" if module == "trtllm_diffkv"
                                                                              else None)


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _from_target(package: str, node: ast.ImportFrom) -> str:
    """The absolute module of ``from ... import`` (relative levels resolved against ``package``)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path, modules: dict | None = None) -> list[tuple[int, str]]:
    """``(line, absolute target)`` of every import in ``path`` (relative ones resolved, lazy ones and
    ``import_module`` strings included). ``from x import y`` gives ``x`` and ``x.y``; with ``modules``, ``x.y`` when
    that is one of them (a submodule), else ``x``: an arrow to the package ``x`` only when a name is taken from it (a
    package's ``__init__`` importing its submodules is then no circle with them)."""
    package = _package_of(module, path)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(package, node)
            names = [f"{target}.{alias.name}" for alias in node.names]  # "from . import x": the module x
            if modules is None:
                found += [(node.lineno, name) for name in [target, *names]]
            else:
                found += [(node.lineno, name if name in modules else target) for name in names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                target = node.args[0].value
                if target.startswith(".") and len(node.args) > 1:  # import_module(".x", __name__ / __package__)
                    target = package + target
                found.append((node.lineno, target))
    return found


def _graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: first line}, every target resolved to the deepest module of ``modules`` it names
    (:func:`_imports` with ``modules``)."""
    graph = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for line, target in _imports(module, path, modules):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module:
                edges.setdefault(target, line)
    return graph


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(circles)


def _violations(packages: dict[str, Path] = PACKAGES) -> list[str]:
    """Arrows that run the wrong way (:data:`NEVER_IMPORTED_BY`)."""
    bad = []
    for module, path in _modules(packages).items():
        layer = _layer(module)
        forbidden = NEVER_IMPORTED_BY.get(layer, ())
        for line, target in _imports(module, path):
            if _layer(target) in forbidden:
                bad.append(f"{module}:{line}: {layer} imports {target}")
    return bad


def _arrows_into(prefixes: tuple[str, ...], packages: dict[str, Path]) -> list[str]:
    """Imports in ``trtllm_diffkv`` of a module whose top-level name is one of ``prefixes``."""
    bad = []
    for module, path in _modules({"trtllm_diffkv": packages["trtllm_diffkv"]}).items():
        for line, target in _imports(module, path):
            if target.split(".")[0] in prefixes:
                bad.append(f"{module}:{line}: imports {target}")
    return bad


def _is_triton_kernel(path: Path, name: str) -> bool:
    """Whether ``name`` is a ``@triton.jit`` function defined in ``path``."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return any(ast.unparse(d).split("(")[0] in ("triton.jit", "jit") for d in node.decorator_list)
    return False


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_reaches(packages: dict[str, Path] = PACKAGES) -> list[str]:
    """Private names (a leading underscore) of one module used by another: ``from m import _x``, ``import m._x``,
    ``m._x`` on an imported module of ours, and private modules (``from . import _m``).

    Allowed: a ``@triton.jit`` kernel imported by its launcher (Triton's naming: a kernel's name is recorded in the
    engine manifests and the PTX entries, so it keeps Triton's leading underscore)."""
    modules = _modules(packages)
    bad = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        bound = {}  # local name -> module of ours it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and any(_private(p) for p in alias.name.split(".")):
                        bad.append(f"{module}:{node.lineno}: import {alias.name}")
                    if alias.name in modules and alias.asname:
                        bound[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                source = _from_target(_package_of(module, path), node)
                if source not in modules:
                    continue
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    if target in modules:
                        bound[alias.asname or alias.name] = target
                    if _private(alias.name) and not (target not in modules
                                                     and _is_triton_kernel(modules[source], alias.name)):
                        bad.append(f"{module}:{node.lineno}: from {source} import {alias.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and _private(node.attr) and not _is_triton_kernel(modules[bound[node.value.id]], node.attr)):
                bad.append(f"{module}:{node.lineno}: {node.value.id}.{node.attr} ({bound[node.value.id]})")
    return sorted(set(bad))


def _test_helper_names(tests: Path) -> set[str]:
    """Top-level names the tests' folder provides on the pytest pythonpath (modules and packages of ``tests/``)."""
    return ({p.stem for p in tests.glob("*.py")} | {p.name for p in tests.iterdir() if (p / "__init__.py").is_file()}
            | {"support", "oracle", "conftest"})


# ------------------------------------------------------------------------------------------------ the rules


def test_imports_run_one_way():
    assert _violations() == []


def test_the_package_never_imports_the_plugins():
    """Plugins -> core, never back: ``trtllm_diffkv`` finds the plugin package through an entry point
    (``commands/build.py``), never by an import (an ``import_module`` string included)."""
    assert _arrows_into(("trtllm_diffkv_plugins", "plugins"), PACKAGES) == []


def test_the_package_never_imports_test_helpers():
    """The tests' helpers (``tests/support``, ``tests/oracle``, ...) are not part of the product."""
    assert _arrows_into(tuple(_test_helper_names(ROOT / "tests")), PACKAGES) == []


def test_no_import_circle():
    """No two modules import each other, directly or through others (lazy and type-checking imports count)."""
    assert _circles(_graph(_modules())) == []


def test_no_private_name_is_imported_across_modules():
    assert _private_reaches() == []


def test_no_package_is_named_build():
    """Packaging and code tools treat folders named ``build`` as output; the packages have none."""
    assert not [p for folder in PACKAGES.values() for p in folder.rglob("build") if p.is_dir()]


def test_pyproject_lists_every_package_folder():
    """pyproject.toml lists the packages it installs (the plugin folder needs its own name): every folder of them
    with an ``__init__.py``, and nothing else (no test helpers)."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert listed == folders


# ------------------------------------------------------------------------------ the scans see planted violations


def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    """A made-up tree: ``files`` maps ``"trtllm_diffkv/paged/x.py"``-style paths (``plugins/...`` for the plugin
    package) to source; every folder gets an ``__init__.py``."""
    for rel, text in files.items():
        path = tmp_path / rel
        for parent in list(path.relative_to(tmp_path).parents)[:-1]:
            (tmp_path / parent).mkdir(parents=True, exist_ok=True)
            (tmp_path / parent / "__init__.py").touch()
        path.write_text(text)
    return {"trtllm_diffkv": tmp_path / "trtllm_diffkv", "trtllm_diffkv_plugins": tmp_path / "plugins"}


def test_the_scan_sees_a_planted_arrow(tmp_path):
    """A core module importing an adapter (absolute, relative, lazy) is reported."""
    packages = _plant(tmp_path, {
        "trtllm_diffkv/paged/x.py": "from ..export import aot\n\ndef f():\n    import trtllm_diffkv.serve.metrics\n",
        "plugins/p.py": "from trtllm_diffkv.serve import metrics\n"})
    assert [v.split(": ", 1)[1] for v in _violations(packages)] == [
        "paged imports trtllm_diffkv.export", "paged imports trtllm_diffkv.export.aot",
        "paged imports trtllm_diffkv.serve.metrics", "plugins imports trtllm_diffkv.serve",
        "plugins imports trtllm_diffkv.serve.metrics"]


def test_the_scan_sees_the_package_importing_the_plugins(tmp_path):
    packages = _plant(tmp_path, {
        "trtllm_diffkv/commands/b.py": "import importlib\n\ndef f():\n    import trtllm_diffkv_plugins\n"
                                       "    importlib.import_module('trtllm_diffkv_plugins.trt_plugins')\n",
        "plugins/p.py": "from trtllm_diffkv.export import plugin_specs\n"})  # the allowed direction
    assert _arrows_into(("trtllm_diffkv_plugins", "plugins"), packages) == [
        "trtllm_diffkv.commands.b:4: imports trtllm_diffkv_plugins",
        "trtllm_diffkv.commands.b:5: imports trtllm_diffkv_plugins.trt_plugins"]


def test_the_scan_sees_a_test_helper_import(tmp_path):
    packages = _plant(tmp_path, {"trtllm_diffkv/kernels/k.py": "def f():\n    from support.attention import rel_err\n"})
    assert _arrows_into(("support",), packages) == ["trtllm_diffkv.kernels.k:2: imports support.attention",
                                                    "trtllm_diffkv.kernels.k:2: imports support.attention.rel_err"]


def test_the_scan_sees_a_planted_circle(tmp_path):
    """Two modules importing each other, one of them lazily and one only for type checking, are a circle; a third
    that only imports them is not in it."""
    packages = _plant(tmp_path, {
        "trtllm_diffkv/runtime/a.py": "def f():\n    from .b import g\n",
        "trtllm_diffkv/runtime/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
        "trtllm_diffkv/runtime/c.py": "from . import a, b\n"})
    assert _circles(_graph(_modules(packages))) == [["trtllm_diffkv.runtime.a", "trtllm_diffkv.runtime.b"]]


def test_the_scan_sees_planted_private_reaches(tmp_path):
    packages = _plant(tmp_path, {
        "trtllm_diffkv/export/low.py": "class _Recorder:\n    pass\n\ndef _spec():\n    pass\n",
        "trtllm_diffkv/export/_hidden.py": "X = 1\n",
        "trtllm_diffkv/export/high.py": "from .low import _Recorder\nfrom . import low, _hidden\n\ndef f():\n"
                                        "    return low._spec()\n",
        "trtllm_diffkv/kernels/body.py": "import triton\n\n@triton.jit\ndef _kernel(x):\n    pass\n\n"
                                         "def _helper():\n    pass\n",
        "trtllm_diffkv/kernels/launch.py": "from .body import _kernel\nfrom .body import _helper\n"})
    assert _private_reaches(packages) == [
        "trtllm_diffkv.export.high:1: from trtllm_diffkv.export.low import _Recorder",
        "trtllm_diffkv.export.high:2: from trtllm_diffkv.export import _hidden",
        "trtllm_diffkv.export.high:5: low._spec (trtllm_diffkv.export.low)",
        "trtllm_diffkv.kernels.launch:2: from trtllm_diffkv.kernels.body import _helper"]


def test_the_scan_sees_a_folder_named_build(tmp_path):
    packages = _plant(tmp_path, {"trtllm_diffkv/build/x.py": "", "plugins/p.py": ""})
    assert [p.name for folder in packages.values() for p in folder.rglob("build") if p.is_dir()] == ["build"]


# ------------------------------------------------------------------------------------------- public names


@pytest.mark.parametrize("module, names", [
    ("trtllm_diffkv", ["LLM", "SamplingParams", "ModelRunner", "DiffKVConfig", "TierConfig", "PRESETS", "get_preset"]),
    ("trtllm_diffkv.llmapi", ["LLM", "SamplingParams", "ModelRunner", "RequestOutput", "CompletionOutput"]),
    ("trtllm_diffkv.generation", ["ReferenceGenerator", "PagedGenerator", "GenerationResult",
                                  "PagedGenerationResult", "result_fields", "check_prompt_ids", "position_limit"]),
    ("trtllm_diffkv.runtime", ["Executor", "DiffKVResourceManager", "SamplingParams", "StopChecker"]),
    ("trtllm_diffkv.paged", ["PagedDiffKVCache", "OutOfPagesError"]),
    ("trtllm_diffkv.parallel", ["TensorParallelExecutor", "TensorParallelHook", "WeightShard", "check_tensor_parallel"]),
    ("trtllm_diffkv.memory", ["PageManager", "PageFormat", "KVCachePool"]),
    ("trtllm_diffkv.export", ["GRAPHS", "EXPORT_GRAPHS"]),
    ("trtllm_diffkv.trtllm_backend", []),  # its names need TensorRT-LLM (imported on first use)
    ("trtllm_diffkv_plugins", ["register"]),  # this checkout's plugins/ (tests/conftest.py)
])
def test_public_names_from_their_documented_place(module, names):
    mod = importlib.import_module(module)
    for name in names:
        assert getattr(mod, name) is not None, f"{module}.{name}"


def test_the_api_names_are_one_object_wherever_imported():
    import trtllm_diffkv
    from trtllm_diffkv.llmapi.llm import LLM
    from trtllm_diffkv.llmapi.model_runner import ModelRunner
    from trtllm_diffkv.runtime.sampling import SamplingParams

    assert (trtllm_diffkv.LLM, trtllm_diffkv.ModelRunner, trtllm_diffkv.SamplingParams) == (LLM, ModelRunner,
                                                                                            SamplingParams)


# --------------------------------------------------------------------------------------------------- tests/


def _absolute_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute ``import x`` / ``from x import ...`` in ``path`` (in functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module))
    return found


def test_test_modules_import_helpers_of_their_own_folder_or_the_root():
    """A test importing another folder's test module works only when pytest happened to put that folder on
    ``sys.path`` first; shared helpers live at ``tests/`` (conftest, tiny_checkpoint, oracle, support)."""
    tests = ROOT / "tests"
    homes = {}
    for path in tests.rglob("*.py"):
        homes.setdefault(path.stem, set()).add(path.parent)
    bad = []
    for path in sorted(tests.rglob("*.py")):
        for line, name in _absolute_imports(path):
            top = name.split(".")[0]
            where = homes.get(top)
            if where and top != "oracle" and path.parent not in where and tests not in where:
                bad.append(f"{path.relative_to(tests)}:{line}: imports {top} from {sorted(map(str, where))}")
    assert bad == []


def _names_of_package(path: Path) -> set[str]:
    """Every identifier and string constant of a package's ``__init__.py``: the names it defines, imports or lists
    for lazy import (``_LAZY`` keys, ``__all__``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


def test_every_imported_package_module_exists():
    """The packages, tests, tools, benchmarks and examples import package modules that exist (also inside functions,
    which collection never runs: a test skipped here can still import an old path on the GPU machine, and an editable
    install of another checkout can quietly supply a module this one no longer has); ``from pkg import name`` names
    a submodule of ``pkg`` or a name its ``__init__`` provides."""
    modules = _modules()
    bad = [f"{module}:{line}: {target}" for module, path in modules.items() for line, target in
           _imports(module, path, modules) if target.split(".")[0] in PACKAGES and target not in modules]
    for folder in ("tests", "tools", "benchmarks", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            bad += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in _absolute_imports(path)
                    if name.split(".")[0] in PACKAGES and name not in modules]
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.ImportFrom) and not node.level and node.module in modules
                        and modules[node.module].name == "__init__.py"):
                    provided = _names_of_package(modules[node.module])
                    bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}" for alias in node.names
                            if f"{node.module}.{alias.name}" not in modules and alias.name not in provided]
    assert bad == []
