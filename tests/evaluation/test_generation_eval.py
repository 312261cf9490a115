"""The generation-level harness (``eval --tasks copy,recall``): the copy task's construction (the passage once,
renamed consistently, seeded and stable, graded exactly), the paired bootstrap bands against an independent
resampling, the executor path against ``LLM.generate``, and shards that merge to the unsharded run."""
from __future__ import annotations

import ast
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_checkpoint import write_tiny_text_checkpoint  # noqa: E402
from trtllm_diffkv.evaluation import generation_tasks as G  # noqa: E402
from trtllm_diffkv.evaluation.generation_eval import (aggregate_generation, format_tables, merge_records,  # noqa: E402
                                                     parse_point, resolve_points)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_text_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from trtllm_diffkv.model.loader import load_tokenizer

    return load_tokenizer(tiny)


# --------------------------------------------------------------------------------------- copy task
def _bound_names(code: str) -> set[str]:
    tree = ast.parse(code)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            out.add(node.name)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
    return out


def _regex_rename(code: str, mapping: dict[str, str]) -> str:
    """An independent rename: every whole word of ``mapping`` outside strings, except after a ``.`` (attributes)
    and keyword arguments (``name=`` inside parentheses)."""
    import re

    out = []
    for line in code.splitlines(keepends=True):
        pieces, depth, last, quote = [], 0, 0, None
        for m in re.finditer(r"[A-Za-z_]\w*|[()\[\]'\"]", line):
            tok = m.group()
            if quote:
                quote = None if tok == quote else quote
                continue
            if tok in "'\"":
                quote = tok
            elif tok in "([":
                depth += 1
            elif tok in ")]":
                depth -= 1
            elif tok in mapping and line[m.start() - 1:m.start()] != "." and not (
                    depth and re.match(r"=(?!=)", line[m.end():])):
                pieces += [line[last:m.start()], mapping[tok]]
                last = m.end()
        out.append("".join(pieces) + line[last:])
    return "".join(out)


def test_copy_cases_hold_the_passage_once_far_back_and_are_stable(tokenizer):
    cases = G.copy_cases(tokenizer, 3, 400, seed=5)
    assert [c.index for c in cases] == [0, 1, 2] and len({c.case_id for c in cases}) == 3
    for case in cases:
        first = case.prompt[:case.prompt.rfind("\n# The function")]  # the context and the worked example
        context = first[:first.rfind(G.BLOCK_SEPARATOR + G.COPY_CUE[:15])]
        body = case.expected
        assert case.prompt.count(body) == 1 and context.count(body) == 1  # the passage once, in the context
        def_line = case.prompt[case.prompt.rfind("\n") + 1:]
        assert def_line.startswith("def ") and case.prompt.count(def_line + "\n") == 1  # the cue restates it
        assert G.COPY_LINES[0] <= len((def_line + body).splitlines()) <= G.COPY_LINES[1]
        assert not any(stop in body for stop in G.COPY_STOP)
        assert G.PASSAGE_DEPTH[0] <= case.depth <= G.PASSAGE_DEPTH[1] + 0.15  # a block's overshoot at 400 tokens
        assert len(case.prompt_ids) >= 400 and case.prompt_ids == list(tokenizer(case.prompt)["input_ids"])
        assert case.max_tokens == G.answer_budget(len(tokenizer(body, add_special_tokens=False)["input_ids"]))
    again = G.copy_cases(tokenizer, 2, 400, seed=5)
    assert again == cases[:2]  # seeded: case i depends on (seed, i) alone, so shards build the same cases
    other = G.copy_cases(tokenizer, 2, 400, seed=6)
    assert [c.prompt for c in other] != [c.prompt for c in cases[:2]]


def test_renaming_is_consistent_and_keeps_the_function_working(tokenizer):
    """Every bound name is replaced, the same way at each use (the renamed function still passes its unit
    tests), attribute and keyword-argument names keep their spelling, and nothing else changes."""
    problems = G.humaneval_problems()
    code = "def f(xs, key):\n    out = sorted(xs, key=key)\n    out.sort()\n    return [v for v in out if v.real]\n"
    renamed, mapping = G.rename_identifiers(code, random.Random(0))
    assert set(mapping) == {"f", "xs", "key", "out", "v"}
    assert "key=" + mapping["key"] in renamed and ".sort()" in renamed and ".real" in renamed
    assert not _bound_names(renamed) & set(mapping) and len(set(mapping.values())) == len(mapping)
    for case in G.copy_cases(tokenizer, 3, 300, seed=1):
        problem = next(p for p in problems if f"/{p['task_id']}/" in case.case_id)
        original = G.function_code(problem)
        passage = case.prompt[case.prompt.rfind("\ndef ") + 1:] + case.expected
        assert set(case.renamed) == _bound_names(original)
        assert not _bound_names(passage) & set(case.renamed)
        want = _regex_rename(original, case.renamed)
        assert ast.dump(ast.parse(passage)) == ast.dump(ast.parse(want))
        imports = "".join(line + "\n" for line in problem["prompt"].splitlines() if line.startswith(("from ", "import ")))
        program = imports + passage + "\n\n" + problem["test"] + f"\ncheck({case.renamed[problem['entry_point']]})\n"
        assert subprocess.run([sys.executable, "-I", "-c", program], capture_output=True, timeout=30).returncode == 0


def test_copy_grading_is_exact():
    expected = "\n    x = 1\n    return x"
    assert G.grade_copy(expected, expected)
    assert G.grade_copy(expected + "\n", expected) and G.grade_copy(expected + "\n\n\ndef next_one():", expected)
    for wrong in ("\n    x = 1\n    return y", "\n    x = 1\n    return x ", "\n    x = 1\n    return", "\n   x = 1\n    return x",
                  expected + "\n    more = 2", expected[1:], expected + "x"):
        assert not G.grade_copy(wrong, expected), wrong
        assert G.copied_lines(wrong, expected) < 1.0, wrong
    assert G.copied_lines(expected + "\n\n\n", expected) == 1.0
    # lines copied before the first wrong one, of the passage's two (the cue's line not counted)
    assert [G.copied_lines(t, expected) for t in ("\n    x = 1\n    return y", "\n    x = 2\n    return x", "",
                                                   expected + "\n    more = 2", "    x = 1\n    return x")] == \
        [0.5, 0.0, 0.0, 0.5, 0.0]


def test_recall_cases_end_at_the_docstring_and_grade_by_the_unit_tests(tokenizer):
    cases = G.recall_cases(tokenizer, 2, 400, seed=0)
    for case in cases:
        assert case.prompt.endswith(case.problem["prompt"].rstrip("\n"))
        solution = case.problem["canonical_solution"]
        assert case.prompt.count(solution.rstrip()) == 1  # the solution once, in the context (the example is another)
        assert case.grade("\n" + solution) and not case.grade("\n    return None\n")
    assert G.recall_cases(tokenizer, 1, 400, seed=0) == cases[:1]


# --------------------------------------------------------------------------------------- points
def test_point_specs():
    assert [p.name for p in resolve_points(["diffkv", "k8v4"])] == ["fp16", "diffkv", "k8v4"]
    point = parse_point("diffkv,alpha_low=0.005,low=K8V2,key_rotation=none,center_keys=false")
    cfg = point.kv_config
    assert (point.method, cfg.alpha_low, cfg.low.name, cfg.key_rotation, cfg.center_keys) == \
        ("diffkv", 0.005, "K8V2", "none", False)
    assert parse_point("diffkv,low=K4V2-1-4").kv_config.low.value_groups == 4
    assert parse_point("k8v8").kv_config.high.value_bits == 8 and parse_point("k8v8").method == "k8v8"
    assert parse_point("kivi-4").path == "reference"
    for bad, match in (("default,alpha_low", "not FIELD=VALUE"), ("default,nope=1", "unknown key 'nope'"),
                       ("default,alpha_low=x", "must be a number"), ("default,low=K3V2", "key_bits=3"),
                       ("nope", "unknown kv-config preset")):
        with pytest.raises(ValueError, match=match):
            parse_point(bad)
    with pytest.raises(ValueError, match="given twice"):
        resolve_points(["k8v4", "k8v4"])


# --------------------------------------------------------------------------------------- bootstrap
def _records(scores: dict[str, list[float]], task="copy", model="m") -> list[dict]:
    """Records of a run: fp16 at 1.0 of FP16, the others at 0.4, each with a pool fraction that varies by case."""
    return [{"model": model, "task": task, "case_id": f"c{i}", "index": i, "point": point, "method": point,
             "score": value, "partial": 0.5 * value, "kv_memory_fraction": 1.0 if point == "fp16" else 0.4,
             "pool_fraction": (1.0 if point == "fp16" else 0.4) + 0.01 * ((7 * i) % 13), "high_fraction": None,
             "low_fraction": None, "pruned_fraction": None}
            for point, values in scores.items() for i, value in enumerate(values)]


def test_paired_band_matches_an_independent_resampling_and_is_paired():
    """The delta row's band is the percentile band of the mean per-case difference (the same cases drawn for
    both points), computed here with numpy's generator; unpaired (each point's cases drawn apart) it would be
    several times wider on these correlated outcomes."""
    import numpy as np

    gen = np.random.default_rng(0)
    n = 160
    fp16 = (gen.random(n) < 0.7).astype(float)
    flips = gen.random(n) < 0.08
    other = np.where(flips, 0.0, fp16)  # loses 8 % of fp16's successes, never gains: strongly paired
    rows = aggregate_generation(_records({"fp16": fp16.tolist(), "x": other.tolist()}))
    delta = next(r for r in rows if r["point"] == "x" and r["metric"] == "exact_delta_vs_fp16")
    idx = gen.integers(0, n, (20000, n))
    diffs = (other[idx] - fp16[idx]).mean(1)
    low, high = np.quantile(diffs, [0.025, 0.975])
    assert delta["n"] == n and delta["value"] == pytest.approx(float((other - fp16).mean()))
    assert delta["ci_low"] == pytest.approx(low, abs=0.006) and delta["ci_high"] == pytest.approx(high, abs=0.006)
    unpaired = other[gen.integers(0, n, (20000, n))].mean(1) - fp16[gen.integers(0, n, (20000, n))].mean(1)
    u_low, u_high = np.quantile(unpaired, [0.025, 0.975])
    assert (delta["ci_high"] - delta["ci_low"]) < 0.5 * (u_high - u_low)
    assert delta["ci_high"] < 0  # the paired band sees the loss; the unpaired one cannot
    assert u_high > 0


def test_deltas_pair_by_case_and_ignore_record_order():
    scores = {"fp16": [1, 1, 0, 1], "k8v4": [1, 0, 0, 1], "x": [0, 1, 0, 1]}
    records = _records(scores)
    rows = aggregate_generation(records)
    many = _records({"fp16": [i % 3 > 0 for i in range(40)], "x": [i % 5 > 1 for i in range(40)]})
    shuffled = many[:]
    random.Random(3).shuffle(shuffled)
    assert aggregate_generation(shuffled) == aggregate_generation(many)  # the bands too: cases sorted first
    by = {(r["point"], r["metric"]): r for r in rows}
    assert by[("x", "exact_delta_vs_fp16")]["value"] == pytest.approx(-0.25)
    assert by[("x", "exact_delta_vs_k8v4")]["value"] == pytest.approx(0.0)
    assert by[("x", "copied_lines_delta_vs_fp16")]["value"] == pytest.approx(-0.125)
    assert ("fp16", "exact_delta_vs_fp16") not in by and ("k8v4", "exact_delta_vs_k8v4") not in by
    missing = [r for r in records if not (r["point"] == "x" and r["case_id"] == "c0")]
    assert {(r["point"], r["metric"]): r for r in aggregate_generation(missing)}[("x", "exact_delta_vs_fp16")]["n"] == 3
    table = format_tables(rows)
    assert "| x | 0.400 | 2/4 | -0.250 [" in table and "| fp16 | 1.000 | 3/4 | — |" in table
    pool = next(r for r in rows if r["point"] == "x" and r["metric"] == "pool_fraction")
    assert pool["ci_low"] < pool["value"] < pool["ci_high"]


def test_default_points_show_the_tiered_point_and_default_once(monkeypatch):
    """A run naming no points shows fp16, the uniform formats and the tiered ``diffkv`` whatever ``default`` is;
    ``default`` joins only when it is none of them, and a ``default`` that is a uniform format is on that curve."""
    from trtllm_diffkv.config import PRESETS
    from trtllm_diffkv.evaluation import generation_eval as E

    assert E.DEFAULT_POINTS == ("fp16", "k8v8", "k8v4", "diffkv")
    assert E.default_points() == list(E.DEFAULT_POINTS)  # default is k8v4 today
    monkeypatch.setitem(PRESETS, "default", PRESETS["k8v4"].replace(name="default"))
    assert E.default_points() == list(E.DEFAULT_POINTS) and parse_point("default").method == "k8v4"
    monkeypatch.setitem(PRESETS, "default", PRESETS["default-k8v2"].replace(name="default"))
    assert E.default_points() == list(E.DEFAULT_POINTS) + ["default"] and parse_point("default").method == "diffkv"
    assert parse_point("diffkv").method == "diffkv" and parse_point("k8v4,alpha_low=0.0").method == "k8v4"


def test_a_kv_config_file_is_placed_on_its_configurations_curve(tmp_path):
    """A kv-config file is drawn on the curve of the configuration it holds: one holding K8V4 written for a model
    shape (``calibrated_for``, which only restricts the model it may run on) is on the k8v4 curve, as the same file
    written for any model is; a tiered file is on the diffkv curve."""
    from trtllm_diffkv.config import PRESETS, save_kv_config_file

    for name, shape, method in (("k8v4", (9, 3, 64), "k8v4"), ("k8v4", None, "k8v4"), ("k8v8", (9, 3, 64), "k8v8"),
                                ("diffkv", (9, 3, 64), "diffkv")):
        path = tmp_path / f"{name}-{shape is not None}.json"
        save_kv_config_file(path, PRESETS[name], model_shape=shape)
        point = parse_point(str(path))
        assert point.method == method, (name, shape)
        assert point.kv_config.calibrated_for == shape  # the file's model check is kept


def _write_run(stem: Path, points: dict[str, tuple[str, object]], scores: dict[str, list[float]],
               cases: range, with_runs: bool = True) -> str:
    """A generation details JSON (and its results JSON) of model ``m``: ``points`` maps a point name to its
    (method, DiffKVConfig), as ``eval`` records them; the records are :func:`_records`' at ``cases``."""
    from trtllm_diffkv.config import kv_config_to_dict

    records = [dict(r, method=points[r["point"]][0]) for r in _records(scores) if r["index"] in cases]
    run = {"model": "m", "points": [{"name": name, "method": method, "path": "executor",
                                     "kv_config": kv_config_to_dict(cfg.replace(name=name))}
                                    for name, (method, cfg) in points.items()]}
    details = {"runs": [run], "records": records} if with_runs else {"records": records}
    Path(f"{stem}_details.json").write_text(json.dumps(details))
    Path(f"{stem}.json").write_text(json.dumps({"models": ["m"], "date": "d", "commit": "c", "command": "x",
                                                "rows": aggregate_generation(records)}))
    return f"{stem}_details.json"


@pytest.mark.parametrize("with_runs", [True, False])
def test_merging_runs_where_one_point_name_is_two_configurations_is_refused(tmp_path, capsys, with_runs):
    """Runs from before issue 41 name the tiered point ``default``; merged with a run in which ``default`` is uniform
    K8V4, the ``default`` rows would pool two configurations' cases under one name (the first run's records win
    each case): refused, naming the point, the model and both files. Told by the runs' recorded configurations,
    or, in files without them, by the records' methods. Shards of one configuration still merge."""
    from trtllm_diffkv.cli import main
    from trtllm_diffkv.config import PRESETS

    scores = {"fp16": [1, 1, 0, 1], "default": [1, 0, 0, 1]}
    fp16 = ("fp16", PRESETS["fp16"])
    old = _write_run(tmp_path / "old", {"fp16": fp16, "default": ("diffkv", PRESETS["diffkv"])}, scores, range(0, 2),
                     with_runs)
    new = _write_run(tmp_path / "new", {"fp16": fp16, "default": ("k8v4", PRESETS["k8v4"])}, scores, range(2, 4),
                     with_runs)
    merged = tmp_path / "merged.json"
    assert main(["eval", "--merge-details", old, new, "--output", str(merged), "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "point 'default' of model 'm'" in err and "old_details.json" in err and "new_details.json" in err
    assert not merged.exists()
    shard = _write_run(tmp_path / "shard", {"fp16": fp16, "default": ("k8v4", PRESETS["k8v4"])}, scores, range(0, 2),
                       with_runs)
    assert main(["eval", "--merge-details", shard, new, "--output", str(merged), "--no-plot"]) == 0
    rows = json.loads(merged.read_text())["rows"]
    assert {r["method"] for r in rows if r["point"] == "default"} == {"k8v4"}
    assert next(r for r in rows if r["point"] == "default" and r["metric"] == "exact")["n"] == 4


def test_merging_one_method_under_two_recorded_configurations_is_refused(tmp_path, capsys):
    """Two DiffKV configurations (same method, ``diffkv``) under one point name are told apart by the runs'
    recorded configurations; the same configuration from another preset name still merges."""
    from trtllm_diffkv.cli import main
    from trtllm_diffkv.config import PRESETS

    scores = {"fp16": [1, 1, 0, 1], "tiers": [1, 0, 0, 1]}
    fp16 = ("fp16", PRESETS["fp16"])
    a = _write_run(tmp_path / "a", {"fp16": fp16, "tiers": ("diffkv", PRESETS["diffkv"])}, scores, range(0, 2))
    b = _write_run(tmp_path / "b", {"fp16": fp16, "tiers": ("diffkv", PRESETS["default-k8v2"])}, scores, range(2, 4))
    merged = tmp_path / "merged.json"
    assert main(["eval", "--merge-details", a, b, "--output", str(merged), "--no-plot"]) == 2
    assert "two configurations of method diffkv" in capsys.readouterr().err and not merged.exists()
    c = _write_run(tmp_path / "c", {"fp16": fp16, "tiers": ("diffkv", PRESETS["default-rotated"])}, scores,
                   range(2, 4))
    assert main(["eval", "--merge-details", a, c, "--output", str(merged), "--no-plot"]) == 0


# --------------------------------------------------------------------------------------- the executor path
POINTS = ("fp16", "k8v8", "k8v4", "diffkv")


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    """One CLI run of the tiny model: 2 cases per task, ~200-token contexts, four points."""
    from trtllm_diffkv.cli import main

    out = tmp_path_factory.mktemp("gen") / "quality.json"
    assert main(["eval", "--model", str(tiny), "--num-cases", "2", "--context-tokens", "200", "--points",
                 ",".join(POINTS[1:]) + ",kivi-4", "--output", str(out), "--no-progress", "--threads", "1"]) == 0
    return out, json.loads(out.read_text()), json.loads(out.with_name("quality_details.json").read_text())


def test_every_point_is_what_llm_generate_gives(run, tiny, tokenizer):
    """The harness's records (one LLM per point over one loaded model, budget sized for the batch) equal a fresh
    ``LLM(model, kv_config=point)`` fed the same prompts: text, grade and the executor's memory figures."""
    from trtllm_diffkv.llmapi import LLM
    from trtllm_diffkv.runtime.sampling import SamplingParams

    _, result, details = run
    cases = G.copy_cases(tokenizer, 2, 200) + G.recall_cases(tokenizer, 2, 200)
    assert result["models"] == ["tiny"] and {r["point"] for r in details["records"]} == set(POINTS) | {"kivi-4"}
    for point in POINTS:  # kivi-4 has no executor: test_kivi_runs_on_the_reference_path_at_the_same_cases
        with LLM(str(tiny), kv_config=point, num_threads=1) as llm:
            outs = llm.generate([c.prompt_ids for c in cases], [SamplingParams(
                max_tokens=c.max_tokens, temperature=0.0, stop=list(c.stop)) for c in cases])
        for case, out in zip(cases, outs):
            rec = next(r for r in details["records"] if r["point"] == point and r["case_id"] == case.case_id)
            assert rec["text"] == out.outputs[0].text, (point, case.case_id)
            assert rec["score"] == float(case.grade(out.outputs[0].text))
            assert rec["kv_memory_fraction"] == pytest.approx(out.metrics["kv_memory_fraction"])
            assert rec["pool_fraction"] == pytest.approx(out.metrics["pool_used_bytes"] / out.metrics["fp16_kv_cache_bytes"])
            if point == "fp16":
                assert rec["kv_memory_fraction"] == 1.0 and rec["high_fraction"] is None
            else:
                assert rec["high_fraction"] + rec["low_fraction"] + rec["pruned_fraction"] == pytest.approx(1.0)
    by = {(r["point"], r["task"], r["metric"]): r for r in result["rows"]}
    # K8V8, nothing evicted: the preset's bytes per token and KV head (64 + 64 codes, a scale and zero per side, and
    # the token metadata where the config counts it) over FP16's 2 x 2 x 64, plus the key centring's 64 fp16
    # offsets per row (128 bytes over the >= 200 tokens of a request)
    from trtllm_diffkv.config import get_preset

    token_bytes = get_preset("k8v8").token_bytes("high", 64)
    assert token_bytes / 256 < by[("k8v8", "copy", "kv_memory_fraction")]["value"] < (token_bytes + 128 / 200) / 256
    assert ("diffkv", "recall", "pass_at_1_delta_vs_k8v4") in by and ("k8v4", "copy", "exact_delta_vs_fp16") in by


def test_kivi_runs_on_the_reference_path_at_the_same_cases(run, tiny, tokenizer):
    """``kivi-4`` (reference path, one request at a time): each record is the reference loop's greedy text (no
    stop strings there) cut at the case's stops, with KIVI's own byte count."""
    from trtllm_diffkv.evaluation.quality import PointGenerator, method_points
    from trtllm_diffkv.evaluation.tasks import truncate_completion
    from trtllm_diffkv.model import load_model

    _, _, details = run
    model, _, config = load_model(tiny, dtype=torch.float32)
    gen = PointGenerator(model, tokenizer, config, next(p for p in method_points() if p.config == "KIVI-4 (G=32, R=128)"))
    for case in G.copy_cases(tokenizer, 2, 200) + G.recall_cases(tokenizer, 2, 200):
        rec = next(r for r in details["records"] if r["point"] == "kivi-4" and r["case_id"] == case.case_id)
        full = gen.generate_ids(case.prompt_ids, case.max_tokens)
        assert rec["text"] == truncate_completion(full.text, case.stop), case.case_id
        assert rec["path"] == "reference" and rec["method"] == "kivi" and rec["pool_fraction"] is None
        assert 0.2 < rec["kv_memory_fraction"] < 1.0  # 4-bit codes beyond the 128-token full-precision residual


def test_shards_merge_to_the_unsharded_run(run, tiny, tmp_path):
    from trtllm_diffkv.cli import main

    out, result, details = run
    shard_files = []
    for i in range(2):
        shard = tmp_path / f"shard{i}.json"
        assert main(["eval", "--model", str(tiny), "--num-cases", "2", "--context-tokens", "200", "--points",
                     ",".join(POINTS[1:]) + ",kivi-4", "--shard", f"{i}/2", "--output", str(shard), "--no-progress", "--no-plot",
                     "--threads", "1"]) == 0
        shard_files.append(str(tmp_path / f"shard{i}_details.json"))
    merged = tmp_path / "merged.json"
    assert main(["eval", "--merge-details", *shard_files, "--output", str(merged), "--no-plot"]) == 0
    got = json.loads(merged.read_text())
    assert got["rows"] == result["rows"]
    mine = {(r["point"], r["case_id"]): r["text"] for r in json.loads(
        merged.with_name("merged_details.json").read_text())["records"]}
    assert mine == {(r["point"], r["case_id"]): r["text"] for r in details["records"]}
    assert merge_records([details["records"], details["records"]]) == details["records"]


def test_usage_errors(tiny, tmp_path, capsys):
    from trtllm_diffkv.cli import main

    out = str(tmp_path / "q.json")
    assert main(["eval", "--tasks", "copy,passkey", "--output", out]) == 2
    assert "separate runs" in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny), "--methods", "kivi", "--output", out]) == 2
    assert "--methods names the teacher-forced tasks' curves" in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny), "--point", "default,alpha_low=2", "--output", out]) == 2
    assert "alpha_low=2.0 is out of range" in capsys.readouterr().err
    assert not Path(out).exists()


def test_a_run_without_output_makes_its_default_folder(tiny, tmp_path, monkeypatch, capsys):
    """The README's `eval` line (no --output) wrote into ~/.cache/trtllm-diffkv/eval/ and stopped at once when the
    folder did not exist yet: the default folder is made; a later usage error (the shard) is what is reported."""
    from trtllm_diffkv.cli import main

    monkeypatch.delenv("TRTLLM_DIFFKV_CACHE_DIR", raising=False)  # it would move the results (user_cache)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["eval", "--model", str(tiny), "--shard", "3/2"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" not in err and "shard" in err
    assert (tmp_path / "cache" / "trtllm-diffkv" / "eval").is_dir()


def test_a_point_longer_than_a_heartbeat_is_not_silent(tiny, tokenizer, monkeypatch, capsys):
    """Every case of a point is submitted at once, so the progress bar moves only at the end; a point that runs
    longer than a heartbeat prints a line meanwhile (issue 44: no silence over ~10 s)."""
    import functools
    import time

    from trtllm_diffkv import progress
    from trtllm_diffkv.evaluation import generation_eval as E

    monkeypatch.setattr(E, "heartbeat", functools.partial(progress.heartbeat, every_s=0.05))
    monkeypatch.setattr(E, "run_executor_point", lambda *a, **k: time.sleep(0.3) or [])
    monkeypatch.setattr(E, "grade_records", lambda cases, got, workers: got)
    cases = G.build_generation_cases("copy", tokenizer, 1, 200)
    E.evaluate_generation(None, tokenizer, None, cases, [E.parse_point("k8v4")], model_name="tiny")
    assert "[eval] ... still running point k8v4 (1 cases)" in capsys.readouterr().err
