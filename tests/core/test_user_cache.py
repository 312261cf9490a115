"""The one cache root (trtllm_diffkv.user_cache): which variable chooses it, the values it refuses or ignores, and the
errors a root that cannot be written gives in the loader's callers, ``bench`` and ``eval``."""
from __future__ import annotations

import os

import pytest

from trtllm_diffkv.user_cache import CACHE_ENV, XDG_ENV, cache_folder, cache_root


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fake home with neither variable set; the current folder is ``tmp_path/cwd``."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv(XDG_ENV, raising=False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path / "home"


@pytest.mark.parametrize("mine, xdg, expected", [
    (None, "~/xdg", "xdg/trtllm-diffkv"),  # "~" expanded in either variable (no shell expands it in a .env file)
    ("~/mine", "~/xdg", "mine"),
    ("  ", "\t", ".cache/trtllm-diffkv"),  # whitespace only: unset, as empty is (not a folder named "  " here)
    (None, "relative/xdg", ".cache/trtllm-diffkv"),  # the XDG rule: a relative path is invalid and ignored
    ("", "relative/xdg", ".cache/trtllm-diffkv"),
])
def test_the_variables_choose_one_absolute_root(home, monkeypatch, tmp_path, mine, xdg, expected):
    """Every accepted setting gives an absolute root, the same after a change of the current folder (a relative
    root would move with it: models converted twice, a subprocess started elsewhere looking in another folder)."""
    for name, value in ((CACHE_ENV, mine), (XDG_ENV, xdg)):
        if value is not None:
            monkeypatch.setenv(name, value)
    root = cache_root()
    assert root == home / expected
    monkeypatch.chdir(tmp_path)
    assert cache_root() == root
    assert not (tmp_path / "cwd" / "  ").exists() and not (tmp_path / "cwd" / "relative").exists()


@pytest.mark.parametrize("value", ["relative/cache", ".", "  cache"])
def test_a_relative_project_variable_is_refused_naming_it(home, monkeypatch, value):
    """The project's own variable set to a relative path is a mistake to report, not to guess at (the XDG variable's
    is ignored by its spec; ours was set on purpose)."""
    monkeypatch.setenv(CACHE_ENV, value)
    with pytest.raises(ValueError, match=f"{CACHE_ENV}=.*relative path"):
        cache_root()


@pytest.mark.parametrize("variable", [CACHE_ENV, XDG_ENV, None])
def test_a_root_that_is_a_file_names_the_variable_to_change(home, monkeypatch, tmp_path, variable):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    if variable is None:  # the default root: ~/.cache is the file
        home.mkdir()
        (home / ".cache").write_text("")
    else:
        monkeypatch.setenv(variable, str(blocker))
    with pytest.raises(OSError, match=f"cannot make the folder .*{variable or 'the default'}.*{CACHE_ENV}") as info:
        cache_folder("models", "gguf")
    assert isinstance(info.value, (NotADirectoryError, FileExistsError))


def test_a_read_only_root_names_the_variable(home, monkeypatch, tmp_path):
    """An existing read-only folder is made without error (``exist_ok``): the writability check is what reports it,
    before a benchmark runs for minutes and then cannot write its results."""
    root = tmp_path / "read_only"
    (root / "bench").mkdir(parents=True)
    monkeypatch.setenv(CACHE_ENV, str(root))
    os.chmod(root / "bench", 0o555)
    try:
        if os.access(root / "bench", os.W_OK):
            pytest.skip("this user writes into read-only folders (root)")
        with pytest.raises(PermissionError, match=f"not writable.*{CACHE_ENV}"):
            cache_folder("bench")
    finally:
        os.chmod(root / "bench", 0o755)


@pytest.mark.parametrize("argv", [["bench", "--smoke", "--device", "cpu", "--no-plot"],
                                  ["eval", "--tasks", "kv_lookup", "--no-plot"]])
def test_bench_and_eval_report_an_unusable_cache_root_in_one_line(home, monkeypatch, tmp_path, capsys, argv):
    """Without ``--output`` the results go below the cache root: one that cannot be made is a usage error naming the
    variable, before any work (``eval`` raised a traceback; ``bench`` printed the bare ``Not a directory``)."""
    from trtllm_diffkv.cli import main

    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv(XDG_ENV, str(tmp_path / "a_file"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"trtllm-diffkv {argv[0]}: error:" in err and XDG_ENV in err and CACHE_ENV in err
    assert "Traceback" not in err and "[Errno" not in err



def test_the_triton_stub_env_reports_an_unusable_cache_root(home, monkeypatch, tmp_path):
    """The stub's environment lives below the cache root too: one that cannot be made names the variable, as for the
    models and results (it made the folder itself and raised the bare ``Not a directory``)."""
    from trtllm_diffkv.serve.tritonserver_binary import stub_env

    (tmp_path / "a_file").write_text("")
    monkeypatch.delenv("TRTLLM_DIFFKV_TRITON_STUB_ENV", raising=False)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "a_file"))
    with pytest.raises(OSError, match=f"cannot make the folder .*triton-stub-env.*{CACHE_ENV}"):
        stub_env()
