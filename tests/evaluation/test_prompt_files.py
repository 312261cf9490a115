"""``bench --prompts-file``: the JSONL reader (vLLM / trtllm-bench / genai-perf / Mooncake line shapes), one-line
errors naming the line and the field, and the prompts made from it (exact lengths, tokenized texts), checked
against the tokenizer and the workloads' own filler (make_prompts)."""
import json
from types import SimpleNamespace

import pytest

from trtllm_diffkv.evaluation.prompt_files import FILLER_ID_RANGE, BenchPrompt, materialize, read_prompts_file
from trtllm_diffkv.evaluation.throughput import make_prompts


def _write(tmp_path, lines, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_every_line_shape_is_read(tmp_path):
    path = _write(tmp_path, [
        {"prompt": "Hello", "output_tokens": 4},                    # vLLM custom / trtllm-bench
        "",                                                          # blank lines are skipped
        {"text": "genai-perf input", "extra": {"ignored": True}},    # genai-perf --input-file
        {"task_id": 3, "input_ids": [5, 6, 7], "output_tokens": 2},  # trtllm-bench tokenized
        {"timestamp": 27, "input_length": 40, "output_length": 9, "hash_ids": [0, 1]},  # Mooncake trace
    ])
    assert read_prompts_file(path) == [
        BenchPrompt(text="Hello", output_tokens=4, line=1), BenchPrompt(text="genai-perf input", line=3),
        BenchPrompt(token_ids=(5, 6, 7), output_tokens=2, line=4),
        BenchPrompt(input_tokens=40, output_tokens=9, line=5)]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "caf\u00e9"}).encode() + b"\n")
    assert read_prompts_file(bom) == [BenchPrompt(text="caf\u00e9", line=1)]


@pytest.mark.parametrize("lines, message", [
    ([{"prompt": "ok"}, "not json"], "line 2: not JSON"),
    ([["prompt", "x"]], "line 1: a JSON object is needed, got list"),
    ([{"prompt": "a"}, {}, {"prompt": "b"}], "line 2: needs exactly one of 'prompt', 'text', 'input_ids', 'input_length'"),
    ([{"prompt": "a", "input_length": 4}], "line 1: needs exactly one of 'prompt', 'text', 'input_ids', 'input_length', "
                                           "got 'prompt', 'input_length'"),
    ([{"prompt": ""}], "line 1: field 'prompt' must be a non-empty string"),
    ([{"text": 5}], "line 1: field 'text' must be a non-empty string, got 5"),
    ([{"input_ids": []}], "line 1: field 'input_ids' must be a non-empty list"),
    ([{"input_ids": [1, -2]}], "line 1: field 'input_ids' holds -2"),
    ([{"input_ids": [1, True]}], "line 1: field 'input_ids' holds True"),
    ([{"input_length": 0}], "line 1: field 'input_length' must be a positive integer, got 0"),
    ([{"input_length": "12"}], "line 1: field 'input_length' must be a positive integer, got '12'"),
    ([{"input_length": 3, "output_length": 2.5}], "line 1: field 'output_length' must be a positive integer, got 2.5"),
    ([{"prompt": "a", "output_tokens": True}], "line 1: field 'output_tokens' must be a positive integer, got True"),
    ([{"prompt": "a", "output_tokens": 3, "output_length": 3}], "line 1: give one of 'output_tokens' and"),
    (["", "  "], "holds no request"),
    ([{"input_length": 100000000000}], "line 1: field 'input_length' = 100000000000 exceeds 1048576 tokens"),
    ([{"prompt": "a", "output_tokens": 2000000}], "line 1: field 'output_tokens' = 2000000 exceeds 1048576 tokens"),
])
def test_a_bad_file_is_refused_in_one_line_naming_the_line_and_field(tmp_path, lines, message):
    path = _write(tmp_path, lines)
    with pytest.raises(ValueError) as info:
        read_prompts_file(path)
    text = str(info.value)
    assert text.startswith(f"--prompts-file {path}") and message in text and "\n" not in text, text


def test_unreadable_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read it"):
        read_prompts_file(tmp_path / "missing.jsonl")
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="line 2: not UTF-8"):
        read_prompts_file(bad)


class WordTokenizer:
    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        return [1 + len(word) for word in text.split()]


def test_materialize_for_the_executor_gives_ids_of_the_right_lengths():
    lines = [BenchPrompt(text="one two three", output_tokens=3, line=1), BenchPrompt(input_tokens=6, line=2),
             BenchPrompt(token_ids=(4, 5), output_tokens=1, line=3), BenchPrompt(input_tokens=3, output_tokens=8, line=4)]
    prompts, outputs = materialize(lines[1:], default_output_tokens=5, tokenizer=None, vocab_size=50, seed=1)
    filler, _ = make_prompts(SimpleNamespace(num_requests=2, prompt_tokens=6), None, 50, 1)  # the workloads' filler
    assert prompts[0] == filler[0][:6] and prompts[2] == filler[1][:3]
    assert prompts[1] == [4, 5] and outputs == [5, 1, 8]
    with pytest.raises(ValueError, match="line 1: a text prompt, and the model has no tokenizer"):
        materialize(lines, default_output_tokens=5, tokenizer=None, vocab_size=50)
    prompts, outputs = materialize(lines[:1], default_output_tokens=5, tokenizer=WordTokenizer(), vocab_size=50)
    assert prompts == [[4, 4, 6]] and outputs == [3]
    with pytest.raises(ValueError, match="line 3: 'input_ids' holds 5, outside the model's vocabulary"):
        materialize(lines[2:3], default_output_tokens=5, vocab_size=5)


def test_materialize_for_a_client_keeps_text_and_makes_id_prompts():
    lines = [BenchPrompt(text="hi", line=1), BenchPrompt(input_tokens=20, output_tokens=2, line=2),
             BenchPrompt(token_ids=(9,), line=3)]
    prompts, outputs = materialize(lines, default_output_tokens=7, seed=3)
    again, _ = materialize(lines, default_output_tokens=7, seed=3)
    assert prompts[0] == "hi" and prompts[2] == [9] and outputs == [7, 2, 7]
    assert len(prompts[1]) == 20 and all(FILLER_ID_RANGE[0] <= t < FILLER_ID_RANGE[1] for t in prompts[1])
    assert prompts == again  # seeded
