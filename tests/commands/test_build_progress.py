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


def test_off_a_terminal_a_line_per_stage_and_while_a_stage_runs(checkpoint, tmp_path, monkeypatch, cheap_build):
    """Issue 44: with stderr not a terminal the build sat on one line for minutes. Now each stage prints a line
    and a long stage a line every HEARTBEAT_S seconds (0.05 s here, against a TensorRT stage of 0.5 s)."""
    import time

    from trtllm_diffkv import progress

    def slow_tensorrt(folder, onnx, graph="composite"):
        time.sleep(0.5)
        return None, "no TensorRT (stub)"

    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(build_cmd, "_tensorrt_engine", slow_tensorrt)
    plain = io.StringIO()
    assert _build(checkpoint, tmp_path / "a", monkeypatch, plain) == 0
    text = plain.getvalue()
    expected = [s for s in build_cmd.STAGES if "ONNX" not in s]
    shown = re.findall(r"\[trtllm-diffkv build\] stage (\d+)/(\d+): (.+)", text)
    assert [name for _, _, name in shown] == expected, text
    assert [int(k) for k, _, _ in shown] == list(range(1, len(expected) + 1)) and {t for _, t, _ in shown} == {
        str(len(expected))}
    beats = re.findall(r"\[trtllm-diffkv build\] \.\.\. still (.+) \((\d+) s\)", text)
    assert len(beats) >= 3 and {name for name, _ in beats} <= set(expected), text
    assert "stages |" not in text and "[trtllm-diffkv build] no CUDA kernels (stub)" in text  # no bar
    time.sleep(0.2)
    assert plain.getvalue() == text  # the lines stop with the build


def test_nothing_with_quiet(checkpoint, tmp_path, monkeypatch, cheap_build):
    for name, quiet in (("b", Terminal()), ("c", io.StringIO())):
        assert _build(checkpoint, tmp_path / name, monkeypatch, quiet, "--quiet") == 0
        assert quiet.getvalue() == ""
