"""CLI: prompt files, per-request errors, JSON keys, on the real default model."""
import json
import subprocess
import sys

import pytest

from trtllm_diffkv import __version__
from trtllm_diffkv.cli import build_parser
from trtllm_diffkv.commands.common import default_cpu_threads
from trtllm_diffkv.commands.generate import read_prompts
from trtllm_diffkv.config import get_preset


def test_read_prompts_plain_lines(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("first prompt\n\n  second prompt \n", encoding="utf-8")
    assert read_prompts(f) == ["first prompt", "  second prompt "]


def test_read_prompts_json_lines_with_bad_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"text": "no prompt"}\n{"prompt": "unclosed\n{"prompt": "b", "id": 3}\n', encoding="utf-8")
    prompts = read_prompts(f)
    assert prompts[0] == "a" and prompts[3] == "b"
    assert isinstance(prompts[1], ValueError) and "line 2" in str(prompts[1])
    assert isinstance(prompts[2], ValueError) and "line 3" in str(prompts[2])


def test_unknown_preset_and_bad_alpha_are_usage_errors():
    run = subprocess.run([sys.executable, "-m", "trtllm_diffkv", "generate", "--kv-config", "nope"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "nope" in run.stderr
    run = subprocess.run([sys.executable, "-m", "trtllm_diffkv", "generate", "--kv-config", "diffkv", "--alpha-low", "5",
                          "--alpha-high", "1", "--model", "/nonexistent"], capture_output=True, text=True)
    assert run.returncode == 2 and "alpha_low" in run.stderr


@pytest.mark.slow
def _assert_default_preset_memory(row: dict) -> None:
    """A long prompt's ``kv_memory_fraction`` under the ``default`` preset (what generate runs without
    --kv-config), whatever configuration that is: at most its high tier's bytes per token over FP16's (the default
    model's head_dim 64: 2 x 2 x 64 bytes), plus the key centring's 128 bytes a row; a tiered default sends part of
    the prompt to the low tier (or prunes it), so strictly less."""
    default = get_preset("default")
    high = default.token_bytes("high", 64) / 256
    assert 0 < row["kv_memory_fraction"] <= high + 128 / 256 / row["prompt_tokens"]
    if default.tiered:
        assert row["kv_memory_fraction"] < high


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
    _assert_default_preset_memory(long_row)
    assert long_row["high_fraction"] + long_row["low_fraction"] + long_row["pruned_fraction"] == pytest.approx(1.0)
    assert empty_row["error"] and "empty" in empty_row["error"]
    assert short_row["error"] is None and short_row["text"].strip()
    # a short prompt fits in the recent window: nothing is compressed but quantization
    assert short_row["pruned_fraction"] == 0.0 and short_row["low_fraction"] == 0.0


def test_read_prompts_counts_every_line_and_keeps_unicode_separators(tmp_path):
    f = tmp_path / "p.jsonl"
    body = '\ufeff{"prompt": "a\u2028b"}\n\n{"text": 1}\n{not json\n'
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
    # `default` is uniform K8V4 since issue 41: thresholds there would tier K8V4 into K8V4 (or be out of range)
    (["--alpha-low", "0.02"], "--kv-config default is uniform (K8V4, no tiers); name a tiered preset"),
    (["--kv-config", "k8v8", "--alpha-high", "1"], "--kv-config k8v8 is uniform (K8V8, no tiers)"),
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


@pytest.mark.parametrize("body, plain, json_line", [
    ("plain first\n{\"prompt\": \"json second\"}\n", 1, 2),  # today: line 2 is fed to the model braces and all
    ("{\"prompt\": \"json first\"}\n\nplain third\n", 3, 1),
])
def test_read_prompts_refuses_a_file_mixing_plain_and_json_lines(tmp_path, body, plain, json_line):
    f = tmp_path / "p.txt"
    f.write_text(body, encoding="utf-8")
    with pytest.raises(ValueError, match=f"line {plain} is plain text but line {json_line} is a JSON object"):
        read_prompts(f)


def test_read_prompts_plain_lines_may_start_with_a_brace_or_be_numbers(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("{x} is a set\n42\n", encoding="utf-8")
    assert read_prompts(f) == ["{x} is a set", "42"]


def test_read_prompts_json_errors_in_words(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "b",}\n[1, 2]\n{"prompt": 3}\n{"text": "c"}\n', encoding="utf-8")
    prompts = read_prompts(f)
    assert prompts[0] == "a"
    assert [str(p).split(": ", 1)[1] for p in prompts[1:]] == [
        "line 2: invalid JSON at column 16: expecting property name enclosed in double quotes",
        "line 3: expected a JSON object with a string 'prompt', got an array",
        "line 4: 'prompt' is a number, expected a string",
        "line 5: the JSON object has no 'prompt' field (keys: ['text'])",
    ]


def test_version_flag():
    run = subprocess.run([sys.executable, "-m", "trtllm_diffkv", "--version"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == f"trtllm-diffkv {__version__}"


def test_every_generate_flag_states_its_default():
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    flags = [a for a in generate._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 12
    assert [a.option_strings[0] for a in flags if "default" not in (a.help or "")] == []


def test_default_cpu_threads_follow_env_then_idle_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_cpu_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    for load, threads in [(0.2, 4), (5.4, 3), (7.6, 1), (30.0, 1)]:
        monkeypatch.setattr("os.getloadavg", lambda load=load: (load, load, load))
        assert default_cpu_threads() == threads


@pytest.mark.slow
def test_generate_paged_engine_static_batch_on_default_model(default_model, long_prompt, tmp_path):
    """`--engine paged` (the `--device cuda` default) runs the prompts as one static batch on the unified pages."""
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p}) for p in [long_prompt, "", "Name one planet."]) + "\n",
                 encoding="utf-8")
    rows = {}
    for engine in ("paged", "reference"):
        run = subprocess.run([sys.executable, "-m", "trtllm_diffkv", "generate", "--json", "--prompts-file", str(f),
                              "--max-new-tokens", "6", "--device", "cpu", "--engine", engine, "--threads", "1"],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 1, run.stderr  # the empty prompt fails, alone
        rows[engine] = [json.loads(line) for line in run.stdout.splitlines()]
    paged, reference = rows["paged"], rows["reference"]
    assert [r["error"] is None for r in paged] == [True, False, True]
    assert "empty" in paged[1]["error"] and paged[1]["pool_used_bytes"] is None
    for p, r in zip(paged[::2], reference[::2]):
        # The paged cache stores the reference's tokens bit for bit (tests/paged/test_paged_cache.py); the first
        # token comes from the same prefill, so it must agree; the memory accounting agrees while tiers do.
        assert p["token_ids"][0] == r["token_ids"][0]
        assert p["prompt_tokens"] == r["prompt_tokens"]
        assert p["pool_used_bytes"] >= p["kv_cache_bytes"] > 0
        assert p["pool_pages"] > 0
    _assert_default_preset_memory(paged[0])


def test_read_prompts_a_huge_integer_or_deep_nesting_fails_its_line_alone(tmp_path):
    """json.loads raises ValueError (integer digit limit) or RecursionError, not JSONDecodeError, on these lines."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "n": 1' + "0" * 5000 + '}\n{"prompt": "b"}\n' + "[" * 100000 + "\n",
                 encoding="utf-8")
    first, second, third = read_prompts(f)
    assert isinstance(first, ValueError) and "line 1" in str(first)
    assert second == "b"
    assert isinstance(third, ValueError) and "line 3" in str(third) and "nested too deeply" in str(third)


_NO_TORCH = """
import sys
from trtllm_diffkv.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("torch imported" if "torch" in sys.modules else "no torch", code)
"""


@pytest.mark.parametrize("args, words", [
    (["--engine", "reference", "--temperature", "0.5"], "need --engine executor (the reference engine"),
    (["--engine", "paged", "--kv-memory-bytes", "1000"], "--kv-memory-bytes needs --engine executor"),
    (["--temperature", "-1"], "argument --temperature: must be a finite number >= 0 (0 = greedy), got -1.0"),
    (["--top-p", "1.5"], "argument --top-p: must be a finite number in [0, 1]"),
    (["--top-k", "-2"], "argument --top-k: must be >= 0 (0 = off), got -2"),
    (["--logprobs", "21"], "argument --logprobs: must be an int in [0, 20]"),
    (["--presence-penalty", "3"], "argument --presence-penalty: must be a finite number in [-2, 2]"),
    (["--n", "0"], "argument --n: must be an int >= 1"),
    (["--seed", "-1"], "argument --seed: must be an int in [0, 2**64)"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1"),
    (["--threads", "0"], "argument --threads: must be >= 1, got 0"),
    (["--max-batch-size", "0"], "argument --max-batch-size: must be >= 1, got 0"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "--prompts-file /nonexistent/prompts.txt: no such file"),
])
def test_bad_flags_are_refused_before_torch_is_imported(args, words):
    """Issue 44: bad values were refused only after 5-15 s of imports or a model load (``--engine reference
    --temperature 0.5`` loaded the model first), messages said "or None" to a CLI user, and a missing prompts file
    printed a raw ``[Errno 2]``. Now each is one line, exit code 2, and torch (10 s to import on a loaded machine)
    was never imported."""
    run = subprocess.run([sys.executable, "-c", _NO_TORCH, "generate", *args], capture_output=True, text=True,
                         timeout=120)
    assert run.stdout.split() == ["no", "torch", "2"], (run.stdout, run.stderr)
    assert words in run.stderr and "None" not in run.stderr and "Errno" not in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
