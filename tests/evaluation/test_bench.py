"""The throughput benchmark's smoke configuration on the CPU: JSON schema, numbers that agree with
each other, the budget sizing against the executor's real pool, Poisson arrivals, the PNG, errors."""
import argparse
import json
import math

import pytest
import torch

from trtllm_diffkv.commands import bench
from trtllm_diffkv.evaluation.throughput import ROW_FIELDS, Workload, budget_bytes, default_workloads, poisson_arrivals


def _run_cli(argv):
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench"] + argv)
    args.command_line = "trtllm-diffkv bench " + " ".join(argv)
    return args.run(args)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "throughput.json"
    assert _run_cli(["--smoke", "--device", "cpu", "--output", str(out)]) == 0
    details = json.loads(out.with_name("throughput_details.json").read_text())
    return json.loads(out.read_text()), details, out


def test_json_schema(smoke):
    result, details, _ = smoke
    assert list(result) == ["gpu", "date", "commit", "command", "rows"]
    assert result["command"].startswith("trtllm-diffkv bench --smoke")
    assert result["gpu"].startswith("none (CPU") and result["commit"]
    workloads = default_workloads(smoke=True)
    expected = [(w.name, preset, rate) for w in workloads.values() for preset in w.presets
                for rate in (w.request_rates or (None,))]
    assert [(r["workload"], r["preset"], r["request_rate"]) for r in result["rows"]] == expected
    for row in result["rows"]:
        assert tuple(row) == ROW_FIELDS
        assert isinstance(row["kv_memory_bytes"], int) and isinstance(row["num_requests"], int)
        for key in ("output_tokens_per_s", "mean_batch_size", "kv_memory_fraction", "bookkeeping_fraction",
                    "mean_latency_s"):
            assert isinstance(row[key], float) and math.isfinite(row[key]), (key, row)
    assert len(details) == len(result["rows"])


def test_numbers_are_consistent(smoke):
    result, details, _ = smoke
    workloads = default_workloads(smoke=True)
    for row, extra in zip(result["rows"], details):
        w = workloads[row["workload"]]
        assert (extra["workload"], extra["preset"], extra["request_rate"]) == (row["workload"], row["preset"],
                                                                               row["request_rate"])
        assert row["num_requests"] == w.num_requests
        assert extra["output_tokens"] == w.num_requests * w.output_tokens        # every token counted once
        assert row["output_tokens_per_s"] * extra["wall_s"] == pytest.approx(extra["output_tokens"], rel=1e-9)
        assert 1.0 <= row["mean_batch_size"] <= w.max_batch_size
        assert extra["steps"] >= w.output_tokens                                 # one token per request per step
        assert 0 < row["kv_memory_fraction"] <= 1 and 0 < row["bookkeeping_fraction"] <= 1
        assert 0 < row["mean_latency_s"] <= extra["max_latency_s"] <= extra["wall_s"]
        assert row["kv_memory_bytes"] == budget_bytes(w, _tiny_config())
        if row["preset"] == "fp16":
            assert row["kv_memory_fraction"] == 1.0 and extra["high_fraction"] is None
            assert extra["preemptions"] == 0 or row["workload"] == "c"
        else:
            assert row["kv_memory_fraction"] < 0.6                                # K8V4 at most, pages included
            assert extra["high_fraction"] + extra["low_fraction"] + extra["pruned_fraction"] == pytest.approx(1)
        assert (row["request_rate"] is None) == (row["workload"] != "c")


def test_uniform_formats_run_beside_the_preset_by_default(smoke):
    """Workloads a and b run the DiffKV preset, uniform K8V4 and K8V8, then fp16, side by side at one budget
    (issue 41); c runs the preset and fp16. Each uniform format holds its preset's bytes per token and KV head
    (``token_bytes``: 64 + 64 or 64 + 32 codes, scales and zeros, the token metadata where counted) over FP16's 256,
    plus the key centring's 128 bytes of offsets per row over >= 40 tokens."""
    from trtllm_diffkv.config import get_preset

    result, _, _ = smoke
    closed = [r for r in result["rows"] if r["request_rate"] is None]
    assert [(r["workload"], r["preset"]) for r in closed] == [
        ("a", "diffkv"), ("a", "k8v4"), ("a", "k8v8"), ("a", "fp16"),
        ("b", "llama3-8b"), ("b", "k8v4"), ("b", "k8v8"), ("b", "fp16")]
    for workload in ("a", "b"):
        mine = {r["preset"]: r for r in closed if r["workload"] == workload}
        assert len({r["kv_memory_bytes"] for r in mine.values()}) == 1
        for preset in ("k8v8", "k8v4"):
            token_bytes = get_preset(preset).token_bytes("high", 64)
            assert token_bytes / 256 < mine[preset]["kv_memory_fraction"] < (token_bytes + 128 / 40) / 256
        assert mine["k8v8"]["kv_memory_fraction"] > mine["k8v4"]["kv_memory_fraction"]
    assert {r["preset"] for r in result["rows"] if r["workload"] == "c"} == {"diffkv", "fp16"}
    table = bench.format_table(result["rows"]).splitlines()
    k8v8 = next(line for line in table if line.startswith("| a | k8v8 |")).split(" | ")
    a = {r["preset"]: r for r in closed if r["workload"] == "a"}
    assert float(k8v8[6]) == pytest.approx(a["k8v8"]["output_tokens_per_s"] / a["fp16"]["output_tokens_per_s"], abs=0.006)
    assert float(k8v8[7]) == pytest.approx(a["k8v8"]["output_tokens_per_s"] / a["k8v4"]["output_tokens_per_s"], abs=0.006)


def test_diffkv_runs_more_requests_per_step_at_equal_budget(smoke):
    result, _, _ = smoke
    by = {(r["workload"], r["preset"]): r for r in result["rows"] if r["request_rate"] is None}
    for workload, preset in (("a", "diffkv"), ("b", "llama3-8b")):
        assert by[(workload, preset)]["kv_memory_bytes"] == by[(workload, "fp16")]["kv_memory_bytes"]
        assert by[(workload, preset)]["mean_batch_size"] > by[(workload, "fp16")]["mean_batch_size"]


def test_png_and_table(smoke, tmp_path, capsys):
    result, _, out = smoke
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = bench.format_table(result["rows"]).splitlines()
    assert len(table) == 2 + len(result["rows"]) and table[2].startswith("| a | diffkv |")
    again = tmp_path / "replot.json"
    assert _run_cli(["--plot-from", str(out), "--output", str(again)]) == 0
    assert again.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not again.exists()
    assert capsys.readouterr().out.splitlines()[:len(table)] == table
    assert _run_cli(["--plot-from", str(tmp_path / "missing.json")]) == 2
    for i, text in enumerate(('{"rows": [{"workload": "a"}]}', '{"rows": "x"}', '{"rows": [], "gpu": null}')):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(text)
        assert _run_cli(["--plot-from", str(bad), "--output", str(tmp_path / f"o{i}.json")]) == 2  # not 1, no traceback


def _tiny_config():
    from trtllm_diffkv.model import ModelConfig
    from trtllm_diffkv.evaluation.throughput import TINY_SHAPE

    return ModelConfig(**TINY_SHAPE)


@pytest.mark.parametrize("capacity, tokens", [(2, 64), (3, 100), (16, 2560)])
def test_default_budget_holds_exactly_the_fp16_capacity(capacity, tokens):
    """The executor's fp16 pool built from the budget has the capacity's pages, and one byte less has fewer."""
    from trtllm_diffkv.config import get_preset
    from trtllm_diffkv.engine_config import EngineConfig
    from trtllm_diffkv.runtime.resource_manager import DiffKVResourceManager

    config = _tiny_config()
    w = Workload("a", "tiny-random", ("diffkv", "fp16"), tokens // 2, tokens - tokens // 2, num_requests=4,
                 fp16_capacity=capacity, max_batch_size=8)
    budget = budget_bytes(w, config)
    rows, pages_per_row = config.num_layers * config.num_kv_heads, -(-tokens // 32) + 2
    sizes = dict(max_batch_size=8, max_seq_len=tokens, max_num_tokens=tokens, device="cpu", use_triton=False)
    pool = DiffKVResourceManager(config, get_preset("fp16"), EngineConfig(kv_memory_bytes=budget, **sizes))
    assert pool.get_max_resource_count() == capacity * rows * pages_per_row
    smaller = DiffKVResourceManager(config, get_preset("fp16"), EngineConfig(kv_memory_bytes=budget - 1, **sizes))
    assert smaller.get_max_resource_count() == capacity * rows * pages_per_row - 1
    fixed = Workload("a", "tiny-random", ("diffkv", "fp16"), 8, 8, 1, 1, kv_memory_bytes=12345)
    assert budget_bytes(fixed, config) == 12345


def test_poisson_arrivals():
    times = poisson_arrivals(20000, rate=4.0, seed=1)
    gaps = torch.diff(torch.tensor([0.0] + times, dtype=torch.float64))
    assert (gaps > 0).all()
    assert gaps.mean().item() == pytest.approx(0.25, rel=0.03)                  # mean gap 1 / rate
    assert gaps.std().item() == pytest.approx(0.25, rel=0.05)                   # exponential: std = mean
    assert times == poisson_arrivals(20000, rate=4.0, seed=1) != poisson_arrivals(20000, rate=4.0, seed=2)


def test_usage_errors(tmp_path, capsys):
    out = str(tmp_path / "x.json")
    assert _run_cli(["--smoke", "--workloads", "a,d", "--output", out]) == 2
    assert "choose among a, b, c" in capsys.readouterr().err
    assert _run_cli(["--smoke", "--a-num-requests", "0", "--output", out]) == 2
    assert "num_requests=0 must be a positive integer" in capsys.readouterr().err
    assert _run_cli(["--smoke", "--workloads", "c", "--request-rates", "0", "--output", out]) == 2
    assert "positive, finite request rates" in capsys.readouterr().err
    for rate in ("inf", "nan"):  # argparse's usage error (commands.common.finite_float), exit code 2
        with pytest.raises(SystemExit) as exit_info:
            _run_cli(["--smoke", "--workloads", "c", "--request-rates", rate, "--output", out])
        assert exit_info.value.code == 2
        assert f"--request-rates: '{rate}' is not a finite number" in capsys.readouterr().err
    assert _run_cli(["--smoke", "--preset", "nope", "--output", out]) == 2
    assert "unknown kv-config preset 'nope'" in capsys.readouterr().err
    # --smoke runs its tiny random model: a --model beside it (even one that does not exist) was ignored, exit 0
    assert _run_cli(["--smoke", "--model", str(tmp_path / "missing"), "--output", out]) == 2
    assert "--model is not used with --smoke" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_flags_override_the_defaults():
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--workloads", "c,a", "--kv-memory-bytes", "1000000", "--a-output-tokens",
                              "1024", "--request-rates", "1", "3", "--preset", "k8v4", "--c-num-requests", "10"])
    c, a = bench.workloads_from_args(args)
    assert (c.name, c.request_rates, c.num_requests, c.presets) == ("c", (1.0, 3.0), 10, ("k8v4", "fp16"))
    assert a.presets == ("k8v4", "k8v8", "fp16")  # the preset is a baseline too: run once
    assert (a.name, a.kv_memory_bytes, a.output_tokens, a.prompt_tokens) == ("a", 1000000, 1024, 512)
    b = bench.workloads_from_args(parser.parse_args(["bench", "--workloads", "b"]))[0]
    assert (b.model, b.presets, b.output_tokens) == ("llama3-8b-random", ("llama3-8b", "k8v4", "k8v8", "fp16"), 512)
    only = bench.workloads_from_args(parser.parse_args(["bench", "--workloads", "a", "--baselines", "none"]))[0]
    assert only.presets == ("diffkv", "fp16")
    with pytest.raises(ValueError, match="--baselines: unknown kv-config preset 'k9v9'"):
        bench.workloads_from_args(parser.parse_args(["bench", "--workloads", "a", "--baselines", "k9v9"]))


def test_a_configuration_is_measured_once_whatever_its_names(tmp_path):
    """``--preset default`` (uniform K8V4 since issue 41) beside the default baselines k8v4, k8v8 measures K8V4
    once, under the name the user gave; so does a kv-config file holding K8V4, and a baseline list naming one
    configuration twice. Workload c and ``--baselines none`` are unchanged."""
    from trtllm_diffkv.config import get_preset, save_kv_config_file
    from trtllm_diffkv.evaluation.throughput import presets_with_baselines

    assert get_preset("default").same_configuration(get_preset("k8v4"))  # the premise (docs/QUALITY.md)
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))

    def presets(*argv):
        return {w.name: w.presets for w in bench.workloads_from_args(parser.parse_args(["bench", *argv]))}

    assert presets("--workloads", "a,c", "--preset", "default") == {"a": ("default", "k8v8", "fp16"),
                                                                    "c": ("default", "fp16")}
    assert presets("--workloads", "a", "--preset", "default", "--baselines", "none") == {"a": ("default", "fp16")}
    assert presets("--workloads", "a", "--baselines", "k8v4,default,k8v8") == {"a": ("diffkv", "k8v4", "k8v8", "fp16")}
    assert presets("--smoke", "--workloads", "a", "--preset", "default") == {"a": ("default", "k8v8", "fp16")}
    file = tmp_path / "k8v4.json"
    save_kv_config_file(file, get_preset("k8v4"))
    assert presets_with_baselines(str(file)) == (str(file), "k8v8", "fp16")
    assert presets_with_baselines("diffkv") == ("diffkv", "k8v4", "k8v8", "fp16")


@pytest.mark.parametrize("disable, launched_early", [(False, True), (True, False)])
def test_the_overlap_setting_reaches_the_measured_executor(disable, launched_early):
    """``--disable-overlap-scheduler`` (``disable_overlap_scheduler``) reaches the executor a run measures; the
    details record whether it overlapped. ``False`` forces the overlap on the CPU, where it is otherwise off.
    (``diffkv``: the smoke budget leaves its last decodes room for two worst-case steps; ``fp16``'s does not.)"""
    from trtllm_diffkv.evaluation.throughput import load_bench_model, make_prompts, measure

    workload = default_workloads(smoke=True)["a"]
    model, tokenizer = load_bench_model(workload.model, torch.device("cpu"))
    prompts, _ = make_prompts(workload, tokenizer, model.config.vocab_size)
    result = measure(model, tokenizer, workload, "diffkv", prompts, profile=False, cuda_graphs=False,
                     disable_overlap_scheduler=disable)
    assert result.details["overlap"] is launched_early
    assert (result.details["overlapped_steps"] > 0) is launched_early
    assert result.details["output_tokens"] == workload.num_requests * workload.output_tokens


def test_overlap_and_profile_flags_default_to_the_overlapped_unsynchronized_run():
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    plain = parser.parse_args(["bench"])
    assert plain.disable_overlap_scheduler is False and plain.profile is False
    assert parser.parse_args(["bench", "--disable-overlap-scheduler"]).disable_overlap_scheduler is True
    assert parser.parse_args(["bench", "--profile"]).profile is True
    assert parser.parse_args(["bench", "--no-profile"]).profile is False


def test_the_profile_flag_reaches_the_details(tmp_path):
    out = tmp_path / "t.json"
    assert _run_cli(["--smoke", "--device", "cpu", "--workloads", "a", "--preset", "fp16", "--baselines", "none",
                     "--profile", "--no-plot", "--output", str(out)]) == 0
    details = json.loads(out.with_name("t_details.json").read_text())
    assert [d["profile"] for d in details] == [True]
    assert [d["cuda_graphs"] for d in details] == [False]  # what ran: the CPU is always eager


def test_the_warm_up_pass_runs_every_request_of_the_measured_run(monkeypatch):
    """The warm-up pass submits the measured run's requests with the same sampling parameters, on an executor of
    its own, so that every kernel shape the run meets is compiled before the clock starts (a 2-request, 4-token
    warm-up left a cold Triton cache compiling inside the run: 8,595 vs 17,231 tok/s, H100)."""
    from trtllm_diffkv.evaluation import throughput

    workload = default_workloads(smoke=True)["a"]
    model, tokenizer = throughput.load_bench_model(workload.model, torch.device("cpu"))
    prompts, _ = throughput.make_prompts(workload, tokenizer, model.config.vocab_size)
    passes, real_drive = [], throughput._drive

    def recording_drive(executor, prompts_, params, arrivals, on_finish):
        passes.append((executor, list(prompts_), params))
        return real_drive(executor, prompts_, params, arrivals, on_finish)

    monkeypatch.setattr(throughput, "_drive", recording_drive)
    output_tokens = [workload.output_tokens - (i % 3) for i in range(len(prompts))]
    result = throughput.measure(model, tokenizer, workload, "fp16", prompts, cuda_graphs=False,
                                output_tokens=output_tokens)
    assert len(passes) == 2 and passes[0][0] is not passes[1][0]  # warm-up, then the measured run, two executors
    (_, warm_prompts, warm_params), (_, run_prompts, run_params) = passes
    assert warm_prompts == run_prompts == prompts
    assert [p.max_tokens for p in warm_params] == [p.max_tokens for p in run_params] == output_tokens
    assert result.details["output_tokens"] == sum(output_tokens)


@pytest.mark.parametrize("rate", [None, 200.0])
def test_the_warm_up_executor_is_gone_before_the_measured_one_is_built(monkeypatch, rate):
    """The warm-up executor (and with it its page pool) is freed by reference counting alone before the measured
    run's executor is built, with Poisson arrivals (workload c) too: a reference cycle through it, or a reference kept
    anywhere, would hold a second pool of the whole KV budget on the GPU through the measured run. Checked with the
    cyclic garbage collector off, on the executor and on its cache."""
    import gc
    import weakref

    from trtllm_diffkv.evaluation import throughput

    workload = default_workloads(smoke=True)["c" if rate else "a"]
    model, tokenizer = throughput.load_bench_model(workload.model, torch.device("cpu"))
    prompts, _ = throughput.make_prompts(workload, tokenizer, model.config.vocab_size)
    built, alive_at_build, real_executor = [], [], throughput._executor

    def recording_executor(*args, **kwargs):
        alive_at_build.append([ref() is not None for ref in built])
        executor = real_executor(*args, **kwargs)
        built.extend([weakref.ref(executor), weakref.ref(executor.cache)])
        return executor

    monkeypatch.setattr(throughput, "_executor", recording_executor)
    gc.collect()
    gc.disable()
    try:
        result = throughput.measure(model, tokenizer, workload, "diffkv", prompts, rate=rate, cuda_graphs=False)
    finally:
        gc.enable()
    assert alive_at_build == [[], [False, False]]  # warm-up executor and its cache dead when the second is built
    assert result.details["output_tokens"] == len(prompts) * workload.output_tokens
