"""CLI: prompt files, per-request errors, JSON keys, on the real default model."""
import json
import subprocess
import sys

import pytest

from trtllm_diffkv.cli import read_prompts


def test_read_prompts_plain_lines(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("first prompt\n\n  second prompt \n", encoding="utf-8")
    assert read_prompts(f) == ["first prompt", "  second prompt "]


def test_read_prompts_json_lines_with_bad_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"text": "no prompt"}\nnot json\n{"prompt": "b", "id": 3}\n', encoding="utf-8")
    prompts = read_prompts(f)
    assert prompts[0] == "a" and prompts[3] == "b"
    assert isinstance(prompts[1], ValueError) and "line 2" in str(prompts[1])
    assert isinstance(prompts[2], ValueError) and "line 3" in str(prompts[2])


def test_unknown_preset_and_bad_alpha_are_usage_errors():
    run = subprocess.run([sys.executable, "-m", "trtllm_diffkv", "generate", "--kv-config", "nope"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "nope" in run.stderr
    run = subprocess.run([sys.executable, "-m", "trtllm_diffkv", "generate", "--alpha-low", "5", "--alpha-high", "1",
                          "--model", "/nonexistent"], capture_output=True, text=True)
    assert run.returncode == 2 and "alpha_low" in run.stderr


@pytest.mark.slow
def test_generate_json_on_default_model(default_model, long_prompt, tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p}) for p in [long_prompt, "", "Name one planet."]) + "\n",
                 encoding="utf-8")
    run = subprocess.run([sys.executable, "-m", "trtllm_diffkv", "generate", "--json", "--prompts-file", str(f),
                          "--max-new-tokens", "12", "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stderr  # the empty prompt fails, alone
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(rows) == 3
    keys = {"text", "kv_memory_fraction", "high_fraction", "low_fraction", "pruned_fraction", "prompt_tokens",
            "generated_tokens"}
    long_row, empty_row, short_row = rows
    assert keys <= long_row.keys()
    assert long_row["error"] is None and long_row["prompt_tokens"] >= 500 and long_row["generated_tokens"] >= 1
    assert 0 < long_row["kv_memory_fraction"] < 0.4
    assert long_row["high_fraction"] + long_row["low_fraction"] + long_row["pruned_fraction"] == pytest.approx(1.0)
    assert empty_row["error"] and "empty" in empty_row["error"]
    assert short_row["error"] is None and short_row["text"].strip()
    # a short prompt fits in the recent window: nothing is compressed but quantization
    assert short_row["pruned_fraction"] == 0.0 and short_row["low_fraction"] == 0.0


def test_read_prompts_counts_every_line_and_keeps_unicode_separators(tmp_path):
    f = tmp_path / "p.jsonl"
    body = '\ufeff{"prompt": "a\u2028b"}\n\n{"text": 1}\nnot json\n'
    f.write_text(body, encoding="utf-8")
    prompts = read_prompts(f)
    assert prompts[0] == "a\u2028b"
    assert "line 3" in str(prompts[1]) and "line 4" in str(prompts[2])


def test_read_prompts_refuses_empty_and_non_utf8(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts(empty)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_prompts(latin)


@pytest.mark.parametrize("args,words", [
    (["--device", "meta"], "only cpu and cuda"),
    (["--kv-config", "fp16", "--alpha-high", "5"], "no effect"),
    (["--prompts-file", "/"], "trtllm-diffkv: error"),
])
def test_bad_setup_is_a_clean_usage_error(args, words):
    run = subprocess.run([sys.executable, "-m", "trtllm_diffkv", "generate", "--model", "/nonexistent", *args],
                         capture_output=True, text=True)
    assert run.returncode == 2 and words in run.stderr and "Traceback" not in run.stderr


@pytest.mark.slow
def test_empty_prompt_argument_is_an_error_not_the_default_prompt(default_model):
    run = subprocess.run([sys.executable, "-m", "trtllm_diffkv", "generate", "--prompt", "", "--json",
                          "--max-new-tokens", "2", "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stderr
    row = json.loads(run.stdout)
    assert "empty prompt" in row["error"] and row["generated_tokens"] == 0
