"""The package layout's rules (docs/ARCHITECTURE.md): imports run one way, the public names live where the docs say.

The import graph is read from the source (an AST scan, nothing imported), so a new arrow from the core into an
adapter fails here before anyone runs it.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "trtllm_diffkv"

CORE = ("config", "quant", "policy", "cache", "model", "memory", "kernels", "paged", "runtime", "parallel")
"""The core: rules, formats, the caches, kernels and the executor."""
ABOVE_CORE = ("trt", "serve", "llmapi", "commands", "evaluation", "testing", "cli")
"""What the core must never import: adapters, servers, the API shapes, the command line, benchmarks, test helpers."""
NEVER_IMPORTED_BY = {
    # layer -> layers it must not import
    **{core: ABOVE_CORE for core in CORE},
    "generation": ("trt", "serve", "llmapi", "commands", "evaluation", "testing", "cli"),
    "llmapi": ("serve", "commands", "cli", "testing"),
    "trt": ("serve", "commands", "cli", "testing"),
    "serve": ("commands", "cli", "testing"),
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "trtllm_diffkv" else None


def _module_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, relative ones resolved; lazy imports included."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]  # "from . import x"
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def _absolute_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute ``import x`` / ``from x import ...`` in ``path`` (in functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module))
    return found


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = _layer(_module_of(path)) or "__init__"
        forbidden = NEVER_IMPORTED_BY.get(layer, ())
        for line, target in _imports(path):
            if _layer(target) in forbidden:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {layer} imports {target}")
    return bad


def test_imports_run_one_way():
    assert _violations() == []


def test_the_scan_sees_a_planted_arrow(tmp_path, monkeypatch):
    """The scan is not vacuous: a core module importing an adapter (absolute, relative, lazy) is reported."""
    fake = tmp_path / "trtllm_diffkv"
    (fake / "paged").mkdir(parents=True)
    (fake / "paged" / "x.py").write_text("from ..export import aot\n\ndef f():\n    import trtllm_diffkv.serve.metrics\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert [v.split(": ", 1)[1] for v in _violations()] == [
        "paged imports trtllm_diffkv.export", "paged imports trtllm_diffkv.export.aot", "paged imports trtllm_diffkv.serve.metrics"]


def test_no_package_is_named_build():
    """Packaging and code tools treat folders named ``build`` as output; the package has none."""
    assert not [p for p in PACKAGE.rglob("build") if p.is_dir()]
    assert not (PACKAGE.parent / "plugins").exists()


@pytest.mark.parametrize("module, names", [
    ("trtllm_diffkv", ["LLM", "SamplingParams", "ModelRunner", "DiffKVConfig", "TierConfig", "PRESETS", "get_preset"]),
    ("trtllm_diffkv.llmapi", ["LLM", "SamplingParams", "ModelRunner", "RequestOutput", "CompletionOutput"]),
    ("trtllm_diffkv.generation", ["ReferenceGenerator", "PagedGenerator", "GenerationResult",
                                  "PagedGenerationResult", "result_fields", "check_prompt_ids", "position_limit"]),
    ("trtllm_diffkv.runtime", ["Executor", "DiffKVResourceManager", "SamplingParams", "StopChecker"]),
    ("trtllm_diffkv.paged", ["PagedDiffKVCache", "OutOfPagesError"]),
    ("trtllm_diffkv.parallel", ["TensorParallelExecutor", "TensorParallelHook", "WeightShard", "check_tensor_parallel"]),
    ("trtllm_diffkv.memory", ["PageManager", "PageFormat", "KVCachePool"]),
    ("trtllm_diffkv_plugins", []),
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


def test_test_modules_import_helpers_of_their_own_folder_or_the_root():
    """A test importing another folder's test module works only when pytest happened to put that folder on
    ``sys.path`` first; shared helpers live at ``tests/`` (conftest, tiny_checkpoint, oracle)."""
    tests = PACKAGE.parent / "tests"
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


def test_every_imported_package_module_exists():
    """Tests, scripts, benchmarks and examples import package modules that exist (also inside functions, which
    collection never runs: a test skipped here can still import an old path on the GPU machine)."""
    modules = {_module_of(p) for p in PACKAGE.rglob("*.py")}
    bad = []
    for folder in ("tests", "scripts", "benchmarks", "examples"):
        for path in sorted((PACKAGE.parent / folder).rglob("*.py")):
            bad += [f"{path.relative_to(PACKAGE.parent)}:{line}: {name}" for line, name in _absolute_imports(path)
                    if name.split(".")[0] == "trtllm_diffkv" and name not in modules]
    assert bad == []
