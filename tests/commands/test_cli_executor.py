"""`trtllm-diffkv generate --engine executor` (the in-flight batching executor) on the CPU with a tiny
model that has a real tokenizer; the reference engine's output is the expectation."""
import json
import subprocess
import sys

import pytest
import torch

from tiny_checkpoint import write_tiny_text_checkpoint
from trtllm_diffkv.cli import main
from trtllm_diffkv.commands.generate import pick_engine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_text_checkpoint(tmp_path_factory.mktemp("tiny_cli"))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"prompt": "Write a haiku about memory."}, {"prompt": ""}, {"prompt": "Name one planet, please."},
            {"text": "no prompt field"}, {"prompt": "naïve café 日本語"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return f


def _run(capsys, *args) -> tuple[int, list[dict], str]:
    """``generate`` in-process: (exit code, --json rows, stderr + stdout); argparse's usage errors exit 2."""
    try:
        code = main(["generate", "--device", "cpu", "--threads", "1", *args])
    except SystemExit as exc:  # a flag refused by its argparse type
        code = exc.code
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()] if "--json" in args else []
    return code, rows, captured.err + captured.out


def test_executor_engine_matches_the_reference_engine_in_order(capsys, checkpoint, prompts_file):
    common = ["--model", str(checkpoint), "--json", "--prompts-file", str(prompts_file), "--max-new-tokens", "6"]
    code, executor, _ = _run(capsys, *common, "--engine", "executor", "--max-batch-size", "4")
    assert code == 1  # the empty prompt and the line without 'prompt' fail, alone
    ref_code, reference, _ = _run(capsys, *common, "--engine", "reference")
    assert ref_code == 1
    assert [r["request"] for r in executor] == [0, 1, 2, 3, 4]
    assert [r["error"] is None for r in executor] == [True, False, True, False, True]
    assert "empty prompt" in executor[1]["error"] and "line 4" in executor[3]["error"]
    for e, r in zip(executor, reference):
        assert set(r) <= set(e) and {"pool_pages", "pool_used_bytes"} <= set(e)  # the README's keys, + pool
        if r["error"] is None:
            # greedy in-flight batching on the CPU stores the reference cache's tokens bit for bit
            assert e["token_ids"] == r["token_ids"] and e["text"] == r["text"]
            assert e["prompt_tokens"] == r["prompt_tokens"] and e["generated_tokens"] == r["generated_tokens"]
            assert e["kv_cache_bytes"] == r["kv_cache_bytes"] and e["finish_reason"] == r["finish_reason"]
            assert e["pool_used_bytes"] >= e["kv_cache_bytes"] > 0
        else:
            assert e["kv_memory_fraction"] is None and e["pool_pages"] is None


def test_sampling_flags_seed_repeats_and_stop_cuts(capsys, checkpoint):
    common = ["--model", str(checkpoint), "--json", "--prompt", "Tell me about the sea.", "--max-new-tokens", "12",
              "--engine", "executor"]
    _, [greedy], _ = _run(capsys, *common)
    _, [first], _ = _run(capsys, *common, "--temperature", "0.9", "--top-p", "0.95", "--seed", "7")
    _, [second], _ = _run(capsys, *common, "--temperature", "0.9", "--top-p", "0.95", "--seed", "7")
    assert first["token_ids"] == second["token_ids"] and first["error"] is None
    assert first["token_ids"] != greedy["token_ids"]  # 12 sampled tokens from a flat random model
    stop = greedy["text"].split()[len(greedy["text"].split()) // 2][:3]
    _, [stopped], _ = _run(capsys, *common, "--stop", stop, "--stop", "never-there")
    assert stopped["finish_reason"] == "stop" and stopped["stop_token_id"] is None
    assert stopped["text"] == greedy["text"][:greedy["text"].index(stop)]


@pytest.mark.parametrize("args, words", [
    (["--engine", "reference", "--temperature", "0.5"], "need --engine executor"),
    (["--engine", "paged", "--stop", "x"], "need --engine executor"),
    (["--engine", "executor", "--top-k", "-1"], "--top-k"),
    (["--engine", "executor", "--repetition-penalty", "0"], "--repetition-penalty"),
    (["--engine", "reference", "--kv-memory-bytes", "1000"], "--kv-memory-bytes needs --engine executor"),
])
def test_bad_sampling_flags_are_usage_errors(capsys, checkpoint, args, words):
    code, _, out = _run(capsys, "--model", str(checkpoint), "--prompt", "hi", *args)
    assert code == 2 and words in out


def test_auto_picks_the_executor_on_cuda_and_the_reference_on_cpu():
    assert pick_engine("auto", torch.device("cuda")) == "executor"
    assert pick_engine("auto", torch.device("cpu")) == "reference"
    assert pick_engine("executor", torch.device("cpu")) == "executor"
    assert pick_engine("auto", torch.device("cpu"), executor_flags=True) == "executor"
    assert pick_engine("reference", torch.device("cpu"), executor_flags=True) == "reference"


def test_auto_on_cpu_runs_sampling_flags_on_the_executor(capsys, checkpoint):
    """`generate --n 2 --logprobs 3 --presence-penalty 0.5` without --engine: on the CPU auto takes the executor."""
    code, rows, out = _run(capsys, "--model", str(checkpoint), "--json", "--prompt", "hi", "--max-new-tokens", "3",
                           "--n", "2", "--logprobs", "3", "--presence-penalty", "0.5")
    assert code == 0 and "engine: executor" in out
    assert [r["sequence"] for r in rows] == [0, 1] and all(len(r["logprobs"]) == 3 for r in rows)


def test_console_entry_runs_the_executor_engine(checkpoint):
    run = subprocess.run([sys.executable, "-m", "trtllm_diffkv", "generate", "--model", str(checkpoint), "--engine",
                          "executor", "--device", "cpu", "--threads", "1", "--prompt", "Hello", "--max-new-tokens",
                          "3", "--kv-memory-bytes", str(8 << 20)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "=== request 0:" in run.stdout and "3 generated (length)" in run.stdout
    assert "pool really used" in run.stdout and "Traceback" not in run.stderr
    assert "[trtllm-diffkv] engine: executor" in run.stderr


def test_n_logprobs_and_penalty_flags(capsys, checkpoint):
    """--n 3: three rows of request 0 (sequence 0..2), each the single run seeded by SamplingParams' child rule;
    --logprobs 2: per generated token its logprob and the 2 most likely alternatives, summing to the cumulative."""
    common = ["--model", str(checkpoint), "--json", "--prompt", "Tell me about the sea.", "--max-new-tokens", "6",
              "--engine", "executor", "--temperature", "1.0", "--presence-penalty", "0.5", "--frequency-penalty", "0.3"]
    code, rows, _ = _run(capsys, *common, "--n", "3", "--seed", "5", "--logprobs", "2")
    assert code == 0 and [(r["request"], r["sequence"]) for r in rows] == [(0, 0), (0, 1), (0, 2)]
    for i, row in enumerate(rows):
        assert [e["token"] for e in row["logprobs"]] == row["token_ids"]
        for e in row["logprobs"]:
            assert len(e["top"]) == 2 and e["top"][0][1] >= e["top"][1][1] and e["logprob"] <= e["top"][0][1] + 1e-6
        assert row["cumulative_logprob"] == pytest.approx(sum(e["logprob"] for e in row["logprobs"]), abs=1e-4)
        seed = (5 + i * 0x9E3779B97F4A7C15) % 2 ** 64
        _, [alone], _ = _run(capsys, *common, "--seed", str(seed))
        assert alone["token_ids"] == row["token_ids"] and "sequence" not in alone
    code, _, out = _run(capsys, "--model", str(checkpoint), "--prompt", "hi", "--engine", "executor",
                        "--presence-penalty", "3")
    assert code == 2 and "--presence-penalty" in out
    code, _, out = _run(capsys, "--model", str(checkpoint), "--prompt", "hi", "--engine", "executor",
                        "--n", "100000000")  # refused at once (it hung building 10**8 child requests)
    assert code == 2 and "--n: must be an int >= 1, at most 256" in out
