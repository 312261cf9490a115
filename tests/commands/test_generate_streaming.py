"""``trtllm-diffkv generate --engine executor`` on a terminal streams each request's text as it comes
(issue 21, item 7); piped or with ``--json`` the output is unchanged. Tiny model with a real tokenizer."""
import json
import sys

import pytest

from tiny_checkpoint import write_tiny_text_checkpoint
from trtllm_diffkv.cli import main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_text_checkpoint(tmp_path_factory.mktemp("tiny_stream"))


def test_terminal_output_streams_the_same_text(capsys, monkeypatch, checkpoint):
    common = ["generate", "--device", "cpu", "--threads", "1", "--model", str(checkpoint), "--engine", "executor",
              "--max-new-tokens", "12", "--prompt", "Tell me about the sea."]
    assert main([*common, "--json"]) == 0
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    chunks = []
    real_print = print

    def recording_print(*args, end="\n", **kwargs):  # what each print call wrote to stdout, in order
        if kwargs.get("file") is None:
            chunks.append("".join(map(str, args)) + end)
        real_print(*args, end=end, **kwargs)

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr("builtins.print", recording_print)
    assert main(common) == 0
    out = capsys.readouterr().out
    assert out.startswith("=== request 0:\n" + row["text"] + "\n--- request 0: ")
    assert f"{row['generated_tokens']} generated" in out
    start, stop = chunks.index("=== request 0:\n"), chunks.index(next(c for c in chunks if c.startswith("\n--- ")))
    streamed = chunks[start + 1:stop]
    assert len(streamed) > 1 and "".join(streamed) == row["text"]  # several pieces, as they came
