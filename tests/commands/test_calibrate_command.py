"""``trtllm-diffkv calibrate`` on a tiny random checkpoint with the default model's tokenizer (CPU, seconds).

The measurements are checked against an independent computation (the fp16 and candidate caches'
teacher-forced logits compared here with plain torch), the choice rule against hand-made rows, and
the written file by loading it back and running a generator with it.
"""
import json

import pytest
import torch

from tiny_checkpoint import write_tiny_text_checkpoint
from trtllm_diffkv.cli import main
from trtllm_diffkv.config import DiffKVConfig, get_preset, load_kv_config_file
from trtllm_diffkv.generation.reference import ReferenceGenerator
from trtllm_diffkv.evaluation import calibration as cal
from trtllm_diffkv.model.loader import load_model


def _row(name, top1, kl, mem):
    return {"setting": name, "teacher_forced_top1": top1, "mean_kl_nats": kl, "kv_memory_fraction": mem}


def test_choose_takes_the_lowest_memory_within_the_tolerances():
    rows = [_row("k8v4", 0.99, 0.002, 0.45), _row("a", 0.985, 0.01, 0.30), _row("b", 0.97, 0.01, 0.20),
            _row("c", 0.99, 0.05, 0.10), _row("d", 0.99, 0.01, 0.30)]
    assert cal.choose(rows)["setting"] == "d"  # a and d tie on memory: the higher top-1
    assert cal.choose(rows, max_top1_drop=0.03)["setting"] == "b"
    assert cal.choose(rows, max_top1_drop=0.0, max_kl_nats=0.001)["setting"] == "k8v4"
    with pytest.raises(ValueError, match="k8v4"):
        cal.choose(rows[1:])


def test_sweep_settings_grid_and_errors():
    s = cal.sweep_settings([1.0, 2.0], [0.0, 1.5], ["k8v2", "rotated-k4v2"], [1, 5])
    assert len(s) == 1 + 3 * 2 * 2  # al 1.5 > ah 1 is skipped
    cfg = s["ah=2 al=1.5 low=rotated-k4v2 pool=5"]
    assert (cfg.alpha_high, cfg.alpha_low, cfg.low.name, cfg.key_rotation, cfg.score_pool_tokens) == \
        (2.0, 1.5, "K4V2", "hadamard", 5)
    # every other field is the tiered point's (diffkv), whatever the default preset is
    assert cfg.same_configuration(get_preset("diffkv").replace(alpha_high=2.0, alpha_low=1.5, score_pool_tokens=5))
    with pytest.raises(ValueError, match="--low-tier 'k2v2'"):
        cal.sweep_settings([1.0], [0.0], ["k2v2"], [1])
    assert cal.sweep_settings([1.0], [0.0], ["k4v2"], [1], presets=("paper",))["preset:paper"] is get_preset("paper")


def test_choose_keeps_a_setting_exactly_at_each_tolerance():
    """Both tolerances are inclusive: top-1 exactly ``max_top1_drop`` below the yardstick's and mean KL exactly
    ``max_kl_nats`` qualify (binary fractions: the differences are exact); a hair beyond either does not."""
    yard = _row("k8v4", 0.75, 0.0, 0.5)
    edge = _row("edge", 0.5, 0.03125, 0.25)
    assert cal.choose([yard, edge], max_top1_drop=0.25, max_kl_nats=0.03125)["setting"] == "edge"
    below = _row("below", 0.5 - 2 ** -20, 0.03125, 0.125)
    above = _row("above", 0.5, 0.03125 + 2 ** -20, 0.125)
    assert cal.choose([yard, edge, below, above], max_top1_drop=0.25, max_kl_nats=0.03125)["setting"] == "edge"


def test_sweep_grid_keeps_alpha_low_equal_to_alpha_high():
    """``alpha_low <= alpha_high`` includes equality (no low tier band: every token is high or pruned); only
    ``alpha_low > alpha_high`` is skipped."""
    s = cal.sweep_settings([0.5, 1.0], [0.5, 1.0], ["k8v2"], [1])
    grid = sorted((c.alpha_high, c.alpha_low) for name, c in s.items() if name.startswith("ah="))
    assert grid == [(0.5, 0.5), (1.0, 0.5), (1.0, 1.0)]
    assert s["ah=1 al=1 low=k8v2 pool=1"].alpha_low == s["ah=1 al=1 low=k8v2 pool=1"].alpha_high == 1.0


def test_a_grid_with_no_alpha_pair_is_refused_not_shrunk_to_k8v4(capsys):
    """``--alpha-high nan`` (``al <= nan`` is false), an empty list, or every alpha_low above every alpha_high left
    only the k8v4 yardstick: calibrate ran, chose k8v4 and exited 0. The flags and the grid refuse them by name."""
    from trtllm_diffkv.cli import build_parser

    for flag, text, words in (("--alpha-high", "1,nan", "not a finite number"), ("--alpha-low", "inf", "not a finite"),
                              ("--alpha-high", ",", "no value")):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["calibrate", "--output", "k.json", flag, text])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and words in err, err
    assert build_parser().parse_args(["calibrate", "--output", "k.json", "--alpha-high", "1, 2"]).alpha_high == [1, 2]
    with pytest.raises(ValueError, match="no setting: every --alpha-low .* is above every --alpha-high"):
        cal.sweep_settings([0.001], [0.005, 0.01], ["k4v2"], [1])
    with pytest.raises(ValueError, match="alpha_high=nan"):
        cal.sweep_settings([float("nan")], [0.0], ["k4v2"], [1])


def test_stdlib_recall_prompts_recall_an_earlier_span(tmp_path):
    _, tokenizer, _ = load_model(write_tiny_text_checkpoint(tmp_path / "m"))
    cases = cal.stdlib_recall_prompts(tokenizer, 2, prompt_tokens=200, span_tokens=8, cue_tokens=6)
    assert [c.source for c in cases] == ["stdlib:argparse", "stdlib:textwrap"]
    for c in cases:
        context = c.prompt_ids[:200]
        assert c.forced_ids == context[50:58] and c.prompt_ids[-6:] == context[44:50]
    with pytest.raises(ValueError, match="cue_tokens"):
        cal.stdlib_recall_prompts(tokenizer, 1, prompt_tokens=20, span_tokens=16, cue_tokens=6)


def test_calibrate_writes_a_file_that_generate_accepts(tmp_path, capsys):
    folder = write_tiny_text_checkpoint(tmp_path / "m")
    out, table = tmp_path / "kv.json", tmp_path / "table.json"
    rc = main(["calibrate", "--model", str(folder), "--output", str(out), "--table", str(table),
               "--alpha-low", "0,0.5", "--low-tier", "k4v2,rotated-k4v2", "--num-prompts", "1",
               "--prompt-tokens", "160", "--span-tokens", "6", "--max-top1-drop", "1", "--max-kl", "100",
               "--max-identical-drop", "1", "--max-prefix-drop", "1"])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = json.loads(table.read_text())["rows"]
    assert data["model"] == {"num_heads": 2, "num_kv_heads": 1, "head_dim": 64}
    assert len(rows) == 5 and data["calibration"]["chosen"] == min(rows, key=lambda r: r["kv_memory_fraction"])["setting"]
    # Every tolerance wide open: the chosen row is the lowest memory, and the file loads back to it.
    cfg = load_kv_config_file(out)
    best = next(r for r in rows if r["setting"] == data["calibration"]["chosen"])
    assert cfg.alpha_low == best["config"]["alpha_low"] and cfg.name == "calibrated"
    # The row's figures, recomputed here with plain torch from the two caches' logits.
    model, tokenizer, mc = load_model(folder)
    case = cal.stdlib_recall_prompts(tokenizer, 1, 160, 6)[0]
    logits = {}
    for name, kv in (("fp16", get_preset("fp16")), ("best", cfg)):
        gen = ReferenceGenerator(model, tokenizer, mc, kv)
        with torch.inference_mode():
            from trtllm_diffkv.evaluation.accuracy import teacher_forced_logits

            logits[name] = teacher_forced_logits(gen, case.prompt_ids, case.forced_ids).double()
    p, q = logits["fp16"].log_softmax(-1), logits["best"].log_softmax(-1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    top1 = float((logits["fp16"].argmax(-1) == logits["best"].argmax(-1)).double().mean())
    assert best["mean_kl_nats"] == pytest.approx(kl, rel=1e-6, abs=1e-9) and best["teacher_forced_top1"] == top1
    assert 0 < best["kv_memory_fraction"] < 1
    capsys.readouterr()
    assert main(["generate", "--model", str(folder), "--kv-config", str(out), "--prompt", "def f(x):",
                 "--max-new-tokens", "3", "--engine", "reference", "--threads", "1"]) == 0
    other = tmp_path / "other.json"
    data["model"]["num_kv_heads"] = 2
    other.write_text(json.dumps(data))
    assert main(["generate", "--model", str(folder), "--kv-config", str(other), "--prompt", "x",
                 "--max-new-tokens", "2", "--engine", "reference", "--threads", "1"]) == 2
    assert "calibrated for num_kv_heads=2; this model has num_kv_heads=1" in capsys.readouterr().err


def test_calibrate_usage_errors_are_one_line(tmp_path, capsys):
    folder = write_tiny_text_checkpoint(tmp_path / "m")
    assert main(["calibrate", "--model", str(folder), "--output", str(tmp_path / "x.json"),
                 "--low-tier", "k9v9"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--low-tier 'k9v9'" in err and "\n" not in err
    assert DiffKVConfig().score_pool_tokens == 1  # the default keeps pooling off
