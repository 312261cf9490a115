"""``trtllm-diffkv build``'s progress: one bar on a terminal that names every stage in order and ends at all of
them, nothing but the notes when stderr is not a terminal, nothing at all with ``--quiet``. The kernel
compilation and the TensorRT step are stubbed (their own tests are tests/export/); the rest runs for real on a tiny
checkpoint (seconds)."""
import io
import re

import pytest

from tiny_checkpoint import write_tiny_text_checkpoint
from trtllm_diffkv.commands import build as build_cmd
from trtllm_diffkv.cli import main


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_text_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture()
def cheap_build(monkeypatch):
    from trtllm_diffkv.export import aot

    monkeypatch.setattr(aot, "build_kernels", lambda shape, folder, targets: {"kernels": []})
    monkeypatch.setattr(build_cmd, "_cuda_kernels", lambda shape, folder, targets: (None, "no CUDA kernels (stub)"))
    monkeypatch.setattr(build_cmd, "_tensorrt_engine", lambda folder, onnx, graph="composite": (None, "no TensorRT (stub)"))


def _build(checkpoint, tmp_path, monkeypatch, stream, *flags):
    monkeypatch.setattr("sys.stderr", stream)
    return main(["build", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "engine"), "--plugin", "diffkv",
                 "--no-onnx", "--targets", "90", "--max-seq-len", "64", "--dtype", "float32", *flags])


def test_the_bar_names_every_stage_in_order_on_a_terminal(checkpoint, tmp_path, monkeypatch, cheap_build):
    stream = Terminal()
    assert _build(checkpoint, tmp_path, monkeypatch, stream) == 0
    text = stream.getvalue()
    expected = [s for s in build_cmd.STAGES if "ONNX" not in s]   # --no-onnx: no export stage
    shown = list(dict.fromkeys(re.findall(r"\[build\] ([a-zA-Z .]+?) \d+/\d+ stages", text)))
    assert shown == expected, text
    assert f"{len(expected)}/{len(expected)} stages" in text      # the bar ends full
    assert "[trtllm-diffkv build] no TensorRT (stub)" in text      # notes print above the bar
    assert (tmp_path / "engine" / "config.json").is_file()


def test_no_bar_off_a_terminal_and_nothing_with_quiet(checkpoint, tmp_path, monkeypatch, cheap_build):
    plain = io.StringIO()
    assert _build(checkpoint, tmp_path / "a", monkeypatch, plain) == 0
    assert "stages" not in plain.getvalue() and "[trtllm-diffkv build] no CUDA kernels (stub)" in plain.getvalue()
    quiet = Terminal()
    assert _build(checkpoint, tmp_path / "b", monkeypatch, quiet, "--quiet") == 0
    assert quiet.getvalue() == ""
