"""The flag rules every subcommand shares (commands/common.py): float flags refuse non-finite numbers through one
argparse type, ``--threads`` has one default and one help text, and result files are written atomically
(config.replaced_atomically). Parser-level only: nothing loads a model (seconds)."""
import argparse
from pathlib import Path

import pytest

from trtllm_diffkv.cli import build_parser
from trtllm_diffkv.commands.common import THREADS_HELP, cpu_threads, default_cpu_threads, finite_float, positive_int
from trtllm_diffkv.config import replaced_atomically, write_text_atomic

PACKAGE = Path(__file__).resolve().parents[2] / "trtllm_diffkv"


def _subcommands():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def _float_flags():
    for name, sub in _subcommands().items():
        for action in sub._actions:
            if action.type is float or action.type is finite_float or getattr(action.type, "reads_finite_float", False):
                yield name, action


def test_every_float_flag_refuses_non_finite_numbers(capsys):
    flags = list(_float_flags())
    assert len(flags) >= 10, flags  # calibrate, bench, eval, generate, serve, triton-repo
    for name, action in flags:
        assert action.type is not float, f"{name} {action.option_strings[0]} uses type=float"
        with pytest.raises(argparse.ArgumentTypeError, match="not a finite number"):  # through finite_float
            action.type("nan")
    for text in ("nan", "NaN", "inf", "-inf", "1e400"):  # 1e400 reads as inf
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["calibrate", "--output", "k.json", f"--max-kl={text}"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "--max-kl" in err and "not a finite number" in err, err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--shutdown-timeout-s", "soon"])
    assert "--shutdown-timeout-s: 'soon' is not a number" in capsys.readouterr().err
    assert build_parser().parse_args(["calibrate", "--output", "k.json", "--max-kl", "0.05"]).max_kl == 0.05


def test_finite_float_reads_what_float_reads():
    for text, value in (("0.5", 0.5), ("-3", -3.0), ("1e-3", 1e-3), (" 2 ", 2.0)):
        assert finite_float(text) == value
    with pytest.raises(argparse.ArgumentTypeError):
        finite_float("")


def test_threads_has_one_default_and_one_help_text(monkeypatch):
    having = {name: next(a for a in sub._actions if "--threads" in a.option_strings)
              for name, sub in _subcommands().items() if any("--threads" in a.option_strings for a in sub._actions)}
    assert {"generate", "eval", "calibrate", "serve", "triton-repo"} <= set(having)
    for name, action in having.items():
        assert action.default is None and action.type is positive_int, name
        assert action.help == THREADS_HELP, name
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_cpu_threads() == 3
    assert cpu_threads(None, "cpu") == 3 and cpu_threads(None, "cuda") is None and cpu_threads(None, "cuda:1") is None
    assert cpu_threads(2, "cpu") == 2 and cpu_threads(2, "cuda") == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert 1 <= cpu_threads(None, "cpu") <= 4
    for bad in (0, -1):
        with pytest.raises(ValueError, match="--threads"):
            cpu_threads(bad, "cpu")


def test_replaced_atomically_leaves_the_old_file_when_the_write_fails(tmp_path):
    path = tmp_path / "results.json"
    write_text_atomic(path, '{"old": 1}\n')
    assert path.read_text() == '{"old": 1}\n'
    with pytest.raises(RuntimeError):
        with replaced_atomically(path) as tmp:
            tmp.write_text('{"new": ')  # half written, then the run dies
            raise RuntimeError("killed mid-write")
    assert path.read_text() == '{"old": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # no temporary file left
    write_text_atomic(path, '{"new": 2}\n')
    assert path.read_text() == '{"new": 2}\n' and len(list(tmp_path.iterdir())) == 1


def test_replaced_atomically_keeps_the_suffix_for_matplotlib(tmp_path):
    with replaced_atomically(tmp_path / "plot.png") as tmp:
        assert tmp.suffix == ".png" and tmp.parent == tmp_path and tmp != tmp_path / "plot.png"
        tmp.write_bytes(b"png")
    assert (tmp_path / "plot.png").read_bytes() == b"png"


def test_result_files_are_written_through_the_atomic_helper():
    """bench, eval and calibrate write no result file directly (a killed run must not leave half of one)."""
    for rel in ("commands/bench.py", "commands/eval.py", "commands/calibrate.py", "evaluation/quality.py",
                "evaluation/serving_client.py", "config.py"):
        text = (PACKAGE / rel).read_text()
        direct = [line.strip() for line in text.splitlines()
                  if (".write_text(" in line and "tmp.write_text(" not in line) or
                  ("savefig(" in line and "savefig(tmp" not in line)]
        assert not direct, f"{rel}: {direct}"
