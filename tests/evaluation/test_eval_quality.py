"""The quality harness (``trtllm-diffkv eval``): metrics against hand-computed values, the noise band,
the HumanEval grader, the tasks' recall property, and a CPU smoke run of the command on the tiny
random checkpoint whose fp16 figures are checked against one dense causal forward of prompt + span."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_checkpoint import write_tiny_text_checkpoint  # noqa: E402
from trtllm_diffkv.evaluation.quality import aggregate, bootstrap_ci, case_metrics  # noqa: E402
from trtllm_diffkv.evaluation.tasks import run_humaneval_tests  # noqa: E402

ROW_KEYS = {"method", "config", "task", "kv_memory_fraction", "metric", "value", "ci_low", "ci_high", "n"}


def test_case_metrics_match_hand_computed_values():
    ref = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    cand = torch.tensor([[2.0, 0.0, 0.0], [1.5, 0.0, 0.3]])
    m = case_metrics(ref, cand, [0, 1])
    assert m["top1_agreement"] == 0.5  # step 1: argmax 0 vs fp16's 1
    assert m["span_top1"] == 0.5 and m["span_exact"] == 0.0  # gold 0 hit, gold 1 missed
    lq = torch.log_softmax(cand, -1)
    assert m["span_logprob"] == pytest.approx(float((lq[0, 0] + lq[1, 1]) / 2))
    p = torch.softmax(ref[1], -1)
    kl1 = float((p * (torch.log_softmax(ref[1], -1) - lq[1])).sum())
    assert m["mean_kl_nats"] == pytest.approx(kl1 / 2)
    with pytest.raises(ValueError, match="span"):
        case_metrics(ref, cand, [0])


def test_bootstrap_band_and_paired_deltas():
    assert bootstrap_ci([0.5, 0.5, 0.5]) == (0.5, 0.5, 0.5)
    mean, low, high = bootstrap_ci([0.0, 1.0] * 10)
    half = 1.96 * math.sqrt(0.25 / 20)  # normal approximation: binomial sd of the mean of 20 coin flips
    assert mean == 0.5 and abs((high - low) / 2 - half) < 0.04
    records = [{"task": "t", "case_id": str(i), "method": m, "config": m, "kv_memory_fraction": f,
                "span_top1": v, "span_exact": 0.0, "span_logprob": -1.0, "top1_agreement": 1.0, "mean_kl_nats": 0.0}
               for i in range(4) for m, f, v in (("fp16", 1.0, 0.5 + 0.1 * i), ("x", 0.3, 0.4 + 0.1 * i))]
    rows = {(r["method"], r["metric"]): r for r in aggregate(records)}
    assert all(set(r) == ROW_KEYS for r in rows.values())
    delta = rows[("x", "span_top1_delta_vs_fp16")]
    assert delta["value"] == pytest.approx(-0.1) and delta["ci_low"] == pytest.approx(-0.1)  # paired: no spread
    assert rows[("x", "span_top1")]["ci_high"] - rows[("x", "span_top1")]["ci_low"] > 0.1  # unpaired: spread
    assert ("fp16", "span_top1_delta_vs_fp16") not in rows


def test_humaneval_grader_runs_unit_tests_in_a_subprocess_with_timeout():
    problem = {"prompt": "def add(a, b):\n", "entry_point": "add",
               "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}
    assert run_humaneval_tests(problem, "    return a + b\n")
    assert not run_humaneval_tests(problem, "    return a - b\n")
    assert run_humaneval_tests(problem, "    return a + b\n\ndef unrelated():\n    raise SystemExit(1)\n")  # cut at \ndef
    assert not run_humaneval_tests(problem, "    while True:\n        pass\n", timeout_s=2.0)


def test_long_context_spans_appear_earlier_in_the_prompt(tmp_path):
    from trtllm_diffkv.evaluation.tasks import TASKS, build_cases
    from trtllm_diffkv.model.loader import load_tokenizer

    tokenizer = load_tokenizer(write_tiny_text_checkpoint(tmp_path / "tiny"))
    for task, spec in TASKS.items():
        if not spec.long_context:
            continue
        for case in build_cases(task, tokenizer, 2, 400, 6, seed=3):
            assert len(case.prompt_ids) >= 400
            span = tokenizer.decode(case.span_ids).strip(' .)"')
            context = tokenizer.decode(case.prompt_ids)
            cut = context.rfind("\n", 0, len(context) - 1)  # the question's own line does not count
            assert span and span in context[:cut], (task, case.case_id, span)


def test_eval_command_smoke_on_the_tiny_model(tmp_path):
    from trtllm_diffkv.cli import main
    from trtllm_diffkv.model import load_model
    from trtllm_diffkv.model.attention_api import DenseCausalAttention

    folder = write_tiny_text_checkpoint(tmp_path / "tiny")
    out = tmp_path / "quality.json"
    rc = main(["eval", "--model", str(folder), "--tasks", "code_recall,passkey,humaneval", "--methods",
               "diffkv,k8v8,snapkv", "--num-cases", "1", "--context-tokens", "150", "--span-tokens", "4",
               "--humaneval-new-tokens", "4", "--kv-config", "qwen2.5-7b", "--output", str(out), "--no-progress",
               "--threads", "1"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert set(result) == {"model", "date", "commit", "command", "rows"}
    rows = result["rows"]
    assert rows and all(set(r) == ROW_KEYS for r in rows)
    assert out.with_suffix(".png").stat().st_size > 10_000
    by = {(r["method"], r["config"], r["task"], r["metric"]): r for r in rows}
    for task in ("code_recall", "passkey", "humaneval"):
        assert by[("fp16", "fp16", task, "top1_agreement")]["value"] == 1.0
        assert by[("fp16", "fp16", task, "mean_kl_nats")]["value"] == 0.0
        assert by[("fp16", "fp16", task, "span_top1")]["kv_memory_fraction"] == 1.0
        # K8V8, one group, nothing evicted: (64 + 64 + 8) / (2 x 2 x 64) bytes per token per KV head
        assert by[("k8v8", "K8V8 per token", task, "span_top1")]["kv_memory_fraction"] == round(136 / 256, 4)
    assert ("diffkv", "default-unrotated (ah=1, al=0)", "humaneval", "pass_at_1") in by
    assert ("custom", "qwen2.5-7b (qwen2.5-7b)", "passkey", "span_top1") in by  # --kv-config adds a point
    # SnapKV at a 0.2 budget drops most of a 150-token prompt: its distributions differ from fp16's
    assert max(by[("snapkv", "budget=0.2", task, "mean_kl_nats")]["value"] for task in ("code_recall", "passkey")) > 1e-3
    # the fp16 span log-likelihood equals one dense causal forward over prompt + span (independent path)
    details = json.loads(out.with_name("quality_details.json").read_text())
    model, _, _ = load_model(folder, dtype=torch.float32)
    from trtllm_diffkv.evaluation.tasks import build_cases
    from trtllm_diffkv.model.loader import load_tokenizer

    case = build_cases("passkey", load_tokenizer(folder), 1, 150, 4, seed=0)[0]
    ids = torch.tensor(case.prompt_ids + case.span_ids)
    with torch.inference_mode():
        logits = model(ids, torch.arange(len(ids)), DenseCausalAttention())
    rows_pred = torch.log_softmax(logits[len(case.prompt_ids) - 1:-1].double(), -1)
    want = float(rows_pred.gather(1, torch.tensor(case.span_ids)[:, None]).mean())
    got = next(r["span_logprob"] for r in details["records"] if r["method"] == "fp16" and r["task"] == "passkey")
    assert math.isclose(got, want, abs_tol=1e-4)
    assert details["tasks"]["passkey"]["source"].startswith("filler: HumanEval docstrings")


def test_eval_command_refuses_bad_input_in_one_line(tmp_path, capsys):
    from trtllm_diffkv.cli import main

    assert main(["eval", "--tasks", "nope", "--output", str(tmp_path / "q.json")]) == 2
    assert "--tasks: unknown task(s) ['nope']" in capsys.readouterr().err
    assert main(["eval", "--tasks", "passkey", "--methods", "quest", "--output", str(tmp_path / "q.json")]) == 2
    assert "unknown method(s) ['quest']" in capsys.readouterr().err
    assert main(["eval", "--kv-config", "nope", "--output", str(tmp_path / "q.json")]) == 2
    assert "unknown kv-config preset 'nope'" in capsys.readouterr().err


def test_greedy_completion_is_the_reference_generation_cut_at_the_first_stop_sequence(tmp_path):
    from trtllm_diffkv.evaluation.quality import PointGenerator, greedy_completion, method_points
    from trtllm_diffkv.evaluation.tasks import truncate_completion
    from trtllm_diffkv.model import load_model

    folder = write_tiny_text_checkpoint(tmp_path / "tiny")
    model, tokenizer, config = load_model(folder, dtype=torch.float32)
    points = {p.config: p for p in method_points()}
    for name in ("fp16", "default-unrotated (ah=1, al=0)", "budget=0.2"):
        gen = PointGenerator(model, tokenizer, config, points[name])
        for prompt in ("def add(a, b):\n", "# sort a list\ndef f(xs):\n    \"\"\"Sort.\"\"\"\n"):
            ids = tokenizer(prompt)["input_ids"]
            full = gen.generate_ids(ids, 12)  # the reference loop, no stop strings
            assert greedy_completion(gen, ids, 12) == truncate_completion(full.text)


def test_merge_details_unions_two_runs(tmp_path):
    from trtllm_diffkv.cli import main

    def run_file(name, methods, value):
        records = [{"task": "t", "case_id": str(i), "method": m, "config": m, "kv_memory_fraction": 0.5,
                    "span_top1": value, "span_exact": 0.0, "span_logprob": -1.0, "top1_agreement": 1.0,
                    "mean_kl_nats": 0.0} for i in range(2) for m in methods]
        (tmp_path / f"{name}.json").write_text(json.dumps({"model": "m", "date": name, "commit": name,
                                                           "command": name, "rows": []}))
        (tmp_path / f"{name}_details.json").write_text(json.dumps({"device": "d", "records": records, "points": [
            {"method": m, "config": m} for m in methods]}))
        return str(tmp_path / f"{name}_details.json")

    a, b = run_file("a", ["fp16", "x"], 0.5), run_file("b", ["fp16", "y"], 0.25)
    out = tmp_path / "merged.json"
    assert main(["eval", "--merge-details", a, b, "--output", str(out), "--no-plot"]) == 0
    result = json.loads(out.read_text())
    assert result["date"] == "a + b" and result["commit"] == "a + b"
    rows = {(r["method"], r["metric"]): r for r in result["rows"]}
    assert rows[("fp16", "span_top1")]["value"] == 0.5 and rows[("fp16", "span_top1")]["n"] == 2  # first run wins
    assert rows[("y", "span_top1_delta_vs_fp16")]["value"] == pytest.approx(-0.25)  # paired with run a's fp16


def test_without_output_the_results_go_to_the_cache_not_the_current_folder(tmp_path, monkeypatch):
    """A plain ``eval`` never writes over ``benchmarks/results/quality.json`` (the committed run): without
    ``--output`` it writes under ``$XDG_CACHE_HOME/trtllm-diffkv/eval/``, as ``bench`` does."""
    from trtllm_diffkv.cli import main

    records = [{"task": "t", "case_id": "0", "method": m, "config": m, "kv_memory_fraction": 0.5, "span_top1": 1.0,
                "span_exact": 0.0, "span_logprob": -1.0, "top1_agreement": 1.0, "mean_kl_nats": 0.0}
               for m in ("fp16", "x")]
    details = tmp_path / "run_details.json"
    (tmp_path / "run.json").write_text(json.dumps({"model": "m", "date": "d", "commit": "c", "command": "c", "rows": []}))
    details.write_text(json.dumps({"device": "d", "records": records, "points": [{"method": m, "config": m}
                                                                                 for m in ("fp16", "x")]}))
    cwd, cache = tmp_path / "cwd", tmp_path / "cache"
    (cwd / "benchmarks" / "results").mkdir(parents=True)
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("TRTLLM_DIFFKV_CACHE_DIR", raising=False)  # it would move the results (user_cache)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    assert main(["eval", "--merge-details", str(details), "--no-plot"]) == 0
    assert list((cwd / "benchmarks" / "results").iterdir()) == []
    result = json.loads((cache / "trtllm-diffkv" / "eval" / "quality.json").read_text())
    assert {r["method"] for r in result["rows"]} == {"fp16", "x"}


def test_points_a_model_cannot_take_are_dropped_or_refused():
    """Every point runs at head_dim 80 (key rotation is defined there); at an unsupported head_dim (72) the
    built-in compressed points are dropped (with a notice), and a --kv-config point the model refuses (another
    model's calibration) fails the run with its field named."""
    import dataclasses

    from trtllm_diffkv.commands.eval import _points_for_model
    from trtllm_diffkv.evaluation.quality import custom_point, method_points
    from trtllm_diffkv.model import ModelConfig

    mc = ModelConfig(vocab_size=512, hidden_size=640, intermediate_size=512, num_layers=2, num_heads=8,
                     num_kv_heads=2, head_dim=80, max_position_embeddings=4096)
    points = method_points()
    assert [p for p in points if p.kv_config is not None and p.kv_config.key_rotation != "none"]
    assert _points_for_model(points, mc) == points
    kept = _points_for_model(points, dataclasses.replace(mc, head_dim=72))
    assert all(p.kv_config is None or not p.kv_config.compress for p in kept) and len(kept) < len(points)
    other = custom_point("default")
    other = dataclasses.replace(other, kv_config=other.kv_config.replace(calibrated_for=(8, 2, 64)))
    with pytest.raises(ValueError, match="--kv-config default.*calibrated for head_dim=64"):
        _points_for_model([other], mc)
    windowed = type("Windowed", (ModelConfig,), {"sliding_windows": property(lambda self: (16, None))})(
        **{f.name: getattr(mc, f.name) for f in dataclasses.fields(mc)})  # a Gemma-like layer pattern
    assert _points_for_model(points, windowed) == [p for p in points if p.kv_config is not None]  # no baselines


def test_fast_path_equals_the_per_point_path(tmp_path):
    """One prefill per model (``fast``) against every point on its own: every logit bit-identical (the prefill
    attends over the full-precision prompt for every method), every cache's tiers and bytes the same; the
    batched decode rows (``batch_decode``) to fp32 reassociation on this CPU model."""
    from trtllm_diffkv.evaluation.quality import PointGenerator, forced_logits_of_points, method_points
    from trtllm_diffkv.evaluation.tasks import build_cases
    from trtllm_diffkv.model import load_model

    folder = write_tiny_text_checkpoint(tmp_path / "tiny")
    model, tokenizer, config = load_model(folder, dtype=torch.float32)
    gens = [PointGenerator(model, tokenizer, config, p) for p in method_points()]
    assert len({id(g.model) for g in gens}) == 2  # the rotated points run their own model
    case = build_cases("code_recall", tokenizer, 1, 200, 6, seed=1)[0]
    total = len(case.prompt_ids) + len(case.span_ids)
    runs = {}
    for name, kw in (("slow", dict(fast=False)), ("fast", dict(fast=True)), ("batched", dict(batch_decode=True))):
        caches = [g.new_cache(total) for g in gens]
        runs[name] = (forced_logits_of_points(gens, caches, case.prompt_ids, case.span_ids, **kw), caches)
    (slow, slow_caches), (fast, fast_caches), (batched, _) = runs["slow"], runs["fast"], runs["batched"]
    assert torch.equal(batched[0], slow[0])
    for gen, a, b, c, ca, cb in zip(gens, fast, slow, batched, fast_caches, slow_caches):
        label = (gen.point.method, gen.point.config)
        assert a.shape == b.shape == (len(case.span_ids), config.vocab_size), label
        assert torch.equal(a, b), label
        assert ca.stats() == cb.stats(), label
        assert torch.equal(c[0], b[0]) and torch.allclose(c, b, rtol=1e-4, atol=1e-4), label


def test_shard_spec_is_checked():
    from trtllm_diffkv.commands.eval import parse_shard

    assert parse_shard("0/4") == (0, 4) and parse_shard("3/4") == (3, 4)
    for bad in ("4/4", "-1/2", "1", "a/b", "0/0"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)


def test_points_and_case_counts_are_selected_as_named():
    """``--point METHOD=CONFIG`` adds single points to the ``--methods`` curves (fp16 always, a wrong label
    refused with the known ones listed); ``--short-cases`` sizes the short tasks only."""
    from trtllm_diffkv.commands.eval import case_count
    from trtllm_diffkv.evaluation.quality import method_points, select_points

    points = method_points()
    got = select_points(points, ["kivi"], ["snapkv=budget=0.35", "diffkv=default-unrotated (ah=1, al=0)"])
    assert [(p.method, p.config) for p in got] == [
        ("fp16", "fp16"), ("diffkv", "default-unrotated (ah=1, al=0)"), ("kivi", "KIVI-4 (G=32, R=128)"),
        ("kivi", "KIVI-2 (G=32, R=128)"), ("snapkv", "budget=0.35")]
    assert [p.config for p in select_points(points, None, ["h2o=budget=0.2"])] == ["fp16", "budget=0.2"]
    assert select_points(points, None, None) == points
    with pytest.raises(ValueError, match="--point 'snapkv=budget=0.3' names no point; known points: .*snapkv=budget=0.35"):
        select_points(points, None, ["snapkv=budget=0.3"])
    rot_pool = [p.kv_config for p in points if p.method == "diffkv-rotated-pool"]
    assert [(c.key_rotation, c.score_pool_tokens, c.alpha_low) for c in rot_pool] == [("hadamard", 5, 0.01),
                                                                                      ("hadamard", 5, 0.02)]
    assert [case_count(t, 16, 4, None) for t in ("passkey", "kv_lookup", "fewshot_reasoning", "humaneval")] == [16, 16, 4, 4]
    assert case_count("humaneval", 16, 4, 2) == 2 and case_count("fewshot_reasoning", 16, None, 2) == 16


@pytest.mark.parametrize("fast", [True, False])
def test_teacher_forced_points_apply_a_models_sliding_windows(tmp_path, fast):
    """On a model with sliding-window layers (tiny Gemma 3, window 8) the teacher-forced harness used to stop
    with "attention backend _FanOut applies None": its caches were built without the model's windows. Now the
    fp16 point's forced logits equal transformers' over prompt + span (windows applied at prefill and at every
    decode step past them), on the shared-prefill and the per-point path, and a baseline that knows no windows
    is refused instead of attending past them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_gemma import SLIDING_WINDOW, save_tiny_gemma3
    from trtllm_diffkv.config import get_preset
    from trtllm_diffkv.evaluation.accuracy import teacher_forced_logits
    from trtllm_diffkv.evaluation.quality import PointGenerator, forced_logits_of_points, method_points
    from trtllm_diffkv.generation.reference import ReferenceGenerator
    from trtllm_diffkv.model.loader import load_model

    hf = save_tiny_gemma3(tmp_path, seed=1)
    model, _, config = load_model(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    prompt, span = ids[:18], ids[18:]
    assert len(prompt) > 2 * SLIDING_WINDOW
    points = [next(p for p in method_points() if p.method == m) for m in ("fp16", "k8v4")]
    gens = [PointGenerator(model, None, config, p) for p in points]
    caches = [g.new_cache(len(ids)) for g in gens]
    fp16, k8v4 = forced_logits_of_points(gens, caches, prompt, span, fast=fast)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, len(prompt) - 1:-1]
    assert (fp16 - ref).abs().max() <= 1e-4 * ref.abs().max()
    own = teacher_forced_logits(ReferenceGenerator(model, None, config, get_preset("k8v4")), prompt, span)
    assert torch.allclose(k8v4, own, atol=1e-5) and (k8v4 - fp16).abs().max() > 1e-3  # its own windowed run
    kivi = next(p for p in method_points() if p.method == "kivi")
    baseline = PointGenerator(model, None, config, kivi)
    with pytest.raises(ValueError, match="sliding-window"):
        forced_logits_of_points([gens[0], baseline], [gens[0].new_cache(len(ids)), baseline.new_cache(len(ids))],
                                prompt, span, fast=fast)
