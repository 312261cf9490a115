"""``--tp`` on the subcommands: ``serve`` passes it to ``LLM(tensor_parallel_size=...)``; ``triton-repo`` and
``build`` refuse any value but 1 with one line naming the flag (docs/RUNTIME.md "Tensor parallelism")."""
import pytest

from trtllm_diffkv.cli import main


@pytest.mark.parametrize("argv", [
    ["triton-repo", "--out", "{tmp}/repo", "--tp", "2"],
    ["build", "--checkpoint", "{tmp}/none", "--output", "{tmp}/engine", "--plugin", "diffkv", "--tp", "2"],
])
def test_triton_repo_and_build_refuse_tp(argv, tmp_path, capsys):
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "--tp 2:" in err and "does not run tensor parallelism" in err and "serve --tp 2" in err
    assert "Traceback" not in err and not (tmp_path / "repo").exists() and not (tmp_path / "engine").exists()


def test_serve_tp_reaches_the_llm(tmp_path, capsys):
    """A checkpoint with one KV head cannot split over 2 ranks: ``serve --tp 2`` stops with the LLM's refusal
    (before any rank starts); ``--tp 0`` is a usage error."""
    from conftest import random_llama
    from support.tensor_parallel import write_checkpoint

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    folder = write_checkpoint(tmp_path / "kv1", random_llama(0, vocab_size=64, hidden_size=64, intermediate_size=128,
                                                             num_layers=1, num_heads=4, num_kv_heads=1, head_dim=16))
    assert main(["serve", "--model", str(folder), "--port", port, "--device", "cpu", "--tp", "2"]) == 2
    assert "num_kv_heads=1 is not divisible by tensor_parallel_size=2" in capsys.readouterr().err
    assert main(["serve", "--model", str(folder), "--port", port, "--device", "cpu", "--tp", "0"]) == 2
    assert "--tp 0 must be >= 1" in capsys.readouterr().err
