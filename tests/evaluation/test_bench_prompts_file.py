"""``trtllm-diffkv bench --model CKPT --prompts-file FILE`` on the CPU (tiny random Llama with the default model's
tokenizer; seconds): every request runs with its own prompt and token count, the sizes come from the file (checked
against the tokenizer), and a run without ``--output`` writes nothing into the current folder."""
import json
import os

import pytest

from tiny_checkpoint import write_tiny_text_checkpoint
from trtllm_diffkv.cli import main

LINES = [{"prompt": "The capital of France is", "output_tokens": 3},
         {"text": "Once upon a time there was a cache"},            # --max-tokens 4
         {"input_ids": [5, 6, 7, 8, 9], "output_length": 2},
         {"input_length": 21, "output_tokens": 6}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_text_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def test_bench_runs_the_file_on_the_model_into_the_default_folder(checkpoint, tmp_path, monkeypatch, capsys):
    from transformers import AutoTokenizer

    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    cwd, cache = tmp_path / "cwd", tmp_path / "cache"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("TRTLLM_DIFFKV_CACHE_DIR", raising=False)  # it would move the results (user_cache)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    code = main(["bench", "--model", str(checkpoint), "--prompts-file", str(prompts), "--device", "cpu",
                 "--max-tokens", "4", "--no-plot", "--no-profile"])
    assert code == 0, capsys.readouterr().err
    assert list(cwd.iterdir()) == []                         # nothing in the current folder
    out = cache / "trtllm-diffkv" / "bench" / "throughput.json"
    result, details = json.loads(out.read_text()), json.loads(out.with_name("throughput_details.json").read_text())
    assert [(r["workload"], r["preset"], r["num_requests"]) for r in result["rows"]] == [
        ("file", "diffkv", 4), ("file", "k8v4", 4), ("file", "k8v8", 4), ("file", "fp16", 4)]  # --baselines
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    lengths = [len(tokenizer.encode(LINES[0]["prompt"], add_special_tokens=False)),
               len(tokenizer.encode(LINES[1]["text"], add_special_tokens=False)), 5, 21]
    for d in details:
        assert d["output_tokens"] == 3 + 4 + 2 + 6           # each request made its own count (checked per request)
        assert d["prompt_tokens"] == max(lengths) and d["output_tokens_per_request"] == 6
        assert d["prompt_source"] == f"--prompts-file {prompts}: 4 requests (2 text, 1 input_ids, 1 input_length)"
    assert str(out) in capsys.readouterr().out


def test_a_bad_prompts_file_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"input_length": -4}\n')
    assert main(["bench", "--smoke", "--device", "cpu", "--prompts-file", str(bad),
                 "--output", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"trtllm-diffkv bench: error: --prompts-file {bad} line 2: field 'input_length' must be a "
                   "positive integer, got -4")
    assert not (tmp_path / "t.json").exists()
    assert main(["bench", "--smoke", "--workloads", "file", "--output", str(tmp_path / "t.json")]) == 2
    assert "file needs --prompts-file" in capsys.readouterr().err
