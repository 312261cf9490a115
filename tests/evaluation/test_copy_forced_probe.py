"""``tools/copy_forced_probe.py``: the copy task teacher-forced (a CPU screen of low-memory points). Its cases are
the generation-level copy cases with the passage as the forced span, and its fp16 log-probabilities equal
transformers' on the same tokens."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_checkpoint import write_tiny_text_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _probe():
    spec = importlib.util.spec_from_file_location("copy_forced_probe", ROOT / "tools" / "copy_forced_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_text_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.mark.parametrize("spec, expected", [
    ("k8v4;diffkv,low=K8V2", ["k8v4", "diffkv,low=K8V2"]),
    ("k8v4,diffkv,low=K8V2,alpha_high=0.5", ["k8v4", "diffkv,low=K8V2,alpha_high=0.5"]),
    (" diffkv ; ", ["diffkv"])])
def test_point_specs_split_where_a_new_point_starts(spec, expected):
    assert _probe().split_points(spec) == expected


def test_no_point_is_refused():
    with pytest.raises(ValueError, match="no point"):
        _probe().split_points(" ; ")


def test_the_forced_span_is_the_passage_after_the_prompt(tiny):
    from trtllm_diffkv.evaluation.generation_tasks import copy_cases
    from trtllm_diffkv.model.loader import load_tokenizer

    tokenizer = load_tokenizer(tiny)
    forced = _probe().forced_cases(tokenizer, 3, 256, seed=0)
    generated = copy_cases(tokenizer, 3, 256, seed=0)
    assert [c.case_id for c in forced] == [c.case_id for c in generated]
    for f, g in zip(forced, generated):
        assert f.prompt_ids == list(g.prompt_ids) and f.span_ids
        text = tokenizer.decode(f.prompt_ids + f.span_ids, skip_special_tokens=True)
        assert text == tokenizer.decode(g.prompt_ids, skip_special_tokens=True) + g.expected


def test_fp16_log_probabilities_equal_transformers(tiny, tmp_path):
    """The run's fp16 ``span_logprob`` (the reference path, unquantized) is transformers' mean log-probability of
    the same span after the same prompt; a quantized point differs from fp16 and carries its paired delta."""
    from transformers import AutoModelForCausalLM

    from trtllm_diffkv.model.loader import load_tokenizer

    out = tmp_path / "probe.json"
    assert _probe().main(["--model", str(tiny), "--num-cases", "2", "--context-tokens", "256",
                          "--points", "k8v4;diffkv,low=K4V4", "--threads", "1", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    records = result["records"]
    assert sorted({r["config"] for r in records}) == ["diffkv,low=K4V4", "fp16", "k8v4"] and len(records) == 6
    model = AutoModelForCausalLM.from_pretrained(str(tiny), torch_dtype=torch.float32).eval()
    for case in _probe().forced_cases(load_tokenizer(tiny), 2, 256, seed=0):
        ids = torch.tensor([case.prompt_ids + case.span_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)
        n = len(case.prompt_ids)
        gold = torch.tensor(case.span_ids)
        expected = float(logp[n - 1:n - 1 + len(gold)].gather(1, gold[:, None]).mean())
        fp16 = next(r for r in records if r["case_id"] == case.case_id and r["config"] == "fp16")
        assert fp16["span_logprob"] == pytest.approx(expected, abs=2e-4)
        assert fp16["mean_kl_nats"] == 0.0
        low = next(r for r in records if r["case_id"] == case.case_id and r["config"] == "diffkv,low=K4V4")
        assert low["kv_memory_fraction"] < 1.0 and low["mean_kl_nats"] > 0.0
    deltas = {r["config"] for r in result["rows"] if r["metric"] == "span_logprob_delta_vs_fp16"}
    assert deltas == {"k8v4", "diffkv,low=K4V4"}
