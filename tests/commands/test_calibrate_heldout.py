"""``calibrate``'s generation criterion and held-out check (issue 41: a teacher-forced choice lost on held-out tasks).

Tiny random checkpoint with the default model's tokenizer, CPU, seconds. The greedy agreement is checked
against each setting's own greedy generation (``ReferenceGenerator.generate_ids``), the split against its
stated properties, the choice rule against a planted lossy candidate (one that prunes every token outside the
recent window) whose teacher-forced figures pass, and the held-out flag against a case built to miss on the
held-out prompt only.
"""
import json

import pytest
import torch

from tiny_checkpoint import write_tiny_text_checkpoint
from trtllm_diffkv.cli import main
from trtllm_diffkv.config import get_preset
from trtllm_diffkv.evaluation import calibration as cal
from trtllm_diffkv.generation.reference import ReferenceGenerator
from trtllm_diffkv.model.loader import load_model

PRUNE_ALL = "ah=1000 al=1000 low=k4v2 pool=1"  # every prompt token outside the recent window scores below 1000/N
GENERATION_TOKENS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = write_tiny_text_checkpoint(tmp_path_factory.mktemp("calib") / "m")
    model, tokenizer, mc = load_model(folder)
    cases = cal.stdlib_recall_prompts(tokenizer, 2, prompt_tokens=160, span_tokens=6)
    settings = cal.sweep_settings([1000.0], [0.0, 1000.0], ["k4v2"], [1])
    with torch.inference_mode():
        rows = cal.measure(model, tokenizer, mc, settings, cases, generation_tokens=GENERATION_TOKENS)
    return folder, model, tokenizer, mc, cases, settings, {r["setting"]: r for r in rows}


def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_greedy_prefix_tokens_hand_computed():
    reference = [5, 3, 7, 1]
    logits = torch.zeros(4, 9)
    for row, token in enumerate([5, 3, 2, 1]):  # the candidate's argmax differs at step 2 only
        logits[row, token] = 1.0
    assert cal.greedy_prefix_tokens(reference, logits) == 2
    logits[2, 7] = 2.0
    assert cal.greedy_prefix_tokens(reference, logits) == 4  # identical throughout
    logits[0, 6] = 3.0
    assert cal.greedy_prefix_tokens(reference, logits) == 0
    with pytest.raises(ValueError, match=r"\[4, vocab\]"):
        cal.greedy_prefix_tokens(reference, logits[:3])


def test_greedy_prefix_equals_each_settings_own_greedy_generation(tiny):
    """The figure read from the forced run equals the common prefix of two real greedy generations."""
    _, model, tokenizer, mc, cases, settings, rows = tiny
    fp16 = ReferenceGenerator(model, tokenizer, mc, get_preset("fp16"))
    for name, cfg in settings.items():
        gen = ReferenceGenerator(model, tokenizer, mc, cfg)
        for i, case in enumerate(cases):
            want = fp16.generate_ids(case.prompt_ids, GENERATION_TOKENS).token_ids
            got = gen.generate_ids(case.prompt_ids, GENERATION_TOKENS).token_ids
            assert rows[name]["greedy_tokens"][i] == len(want)
            assert rows[name]["greedy_prefix_tokens"][i] == _common_prefix(want, got), (name, case.source)
    # The random model's near-tied logits: every setting leaves fp16's continuation early, so the figure is
    # checked at a divergence, not only at full agreement.
    assert all(p < GENERATION_TOKENS for r in rows.values() for p in r["greedy_prefix_tokens"])


def test_summarize_over_a_subset_hand_computed():
    row = {"top1": [1.0, 0.5, 0.75], "kl_nats": [0.0, 0.25, 0.5], "kv_memory_fractions": [0.5, 0.25, 0.25],
           "forced_steps": [4, 4, 8], "greedy_prefix_tokens": [16, 3, 4], "greedy_tokens": [16, 16, 8]}
    s = cal.summarize(row, [0, 2])
    assert s == {"teacher_forced_top1": 0.875, "mean_kl_nats": 0.25, "greedy_identical": 0.5,
                 "greedy_prefix_fraction": 0.75, "mean_greedy_prefix_tokens": 10.0, "kv_memory_fraction": 0.375,
                 "cases": 2, "steps": 12}
    with pytest.raises(ValueError):
        cal.summarize(row, [])


def test_split_cases_is_disjoint_complete_and_seeded():
    chosen, held = cal.split_cases(16, 0.25, 0)
    assert len(held) == 4 and len(chosen) == 12
    assert not set(chosen) & set(held) and sorted(chosen + held) == list(range(16))
    assert cal.split_cases(16, 0.25, 0) == (chosen, held)
    assert len({tuple(cal.split_cases(16, 0.25, seed)[1]) for seed in range(6)}) > 1  # the seed moves it
    assert cal.split_cases(3, 0.5, 0)[1] != [] and len(cal.split_cases(3, 0.5, 0)[0]) == 1  # 1.5 rounds up to 2
    assert cal.split_cases(1, 0.5, 0) == ([0], [])  # the chosen-on part is never empty
    assert cal.split_cases(5, 0.0, 3) == ([0, 1, 2, 3, 4], [])
    for bad in ((0, 0.25), (4, 1.0), (4, -0.1)):
        with pytest.raises(ValueError, match="fraction"):
            cal.split_cases(*bad, 0)


def test_generation_criterion_rejects_a_planted_lossy_candidate(tiny):
    """Pruning every token outside the recent window: teacher-forced tolerances set to let it pass, it is the
    lowest memory and chosen; the greedy criterion at the same tolerances rejects it for k8v4."""
    rows = tiny[-1]
    yard, prune = rows["k8v4"], rows[PRUNE_ALL]
    assert prune["kv_memory_fraction"] < rows["ah=1000 al=0 low=k4v2 pool=1"]["kv_memory_fraction"] < \
        yard["kv_memory_fraction"]
    assert prune["greedy_prefix_fraction"] < yard["greedy_prefix_fraction"]  # the planted loss, measured
    forced_ok = dict(max_top1_drop=max(0.0, yard["teacher_forced_top1"] - prune["teacher_forced_top1"]) + 1e-9,
                     max_kl_nats=max(r["mean_kl_nats"] for r in rows.values()))
    table = list(rows.values())
    assert cal.choose(table, **forced_ok)["setting"] == PRUNE_ALL
    assert cal.failed_criteria(prune, yard, **forced_ok, max_identical_drop=0.0, max_prefix_drop=0.0) == \
        ["greedy_prefix_fraction"]
    assert cal.choose(table, **forced_ok, max_identical_drop=0.0, max_prefix_drop=0.0)["setting"] != PRUNE_ALL


def test_held_out_check_flags_a_choice_that_misses_on_held_out_prompts(tiny, tmp_path, capsys):
    """Two prompts, one held out. ``--max-kl`` between the pruning candidate's KL on the chosen-on prompt and on
    the held-out one: it is chosen, and flagged; above both, it is not."""
    folder, *_, rows = tiny
    kl = rows[PRUNE_ALL]["kl_nats"]
    assert kl[0] != kl[1]
    seed = next(s for s in range(100) if kl[cal.split_cases(2, 0.5, s)[1][0]] > kl[cal.split_cases(2, 0.5, s)[0][0]])
    chosen_on, held = cal.split_cases(2, 0.5, seed)
    between = (kl[chosen_on[0]] + kl[held[0]]) / 2

    def calibrate(max_kl, *extra):
        table = tmp_path / f"table{max_kl}.json"
        assert main(["calibrate", "--model", str(folder), "--output", str(tmp_path / "kv.json"), "--table",
                     str(table), "--alpha-high", "1000", "--alpha-low", "1000", "--low-tier", "k4v2",
                     "--num-prompts", "2", "--prompt-tokens", "160", "--span-tokens", "6", "--held-out-fraction",
                     "0.5", "--split-seed", str(seed), "--generation-tokens", str(GENERATION_TOKENS),
                     "--max-top1-drop", "1", "--max-identical-drop", "1", "--max-prefix-drop", "1",
                     "--max-kl", repr(max_kl), "--threads", "1", *extra]) == 0
        return json.loads(table.read_text()), capsys.readouterr()

    record, out = calibrate(between)
    assert record["chosen"] == PRUNE_ALL
    assert record["split"]["held_out"] == [record["prompts"][held[0]]]
    check = record["held_out"]
    assert check["pass"] is False and check["failed"] == ["mean_kl_nats"]
    assert check["chosen"]["mean_kl_nats"] == pytest.approx(kl[held[0]], rel=1e-9)
    assert check["chosen"]["greedy_prefix_fraction"] == \
        rows[PRUNE_ALL]["greedy_prefix_tokens"][held[0]] / rows[PRUNE_ALL]["greedy_tokens"][held[0]]
    flagged = [line for line in out.out.splitlines() if "HELD-OUT LOSS" in line]
    assert len(flagged) == 1 and PRUNE_ALL in flagged[0] and "mean_kl_nats" in flagged[0]
    assert "HELD-OUT LOSS" in out.err
    record, out = calibrate(max(kl) + 1.0)
    assert record["chosen"] == PRUNE_ALL and record["held_out"]["pass"] is True
    assert "HELD-OUT LOSS" not in out.out + out.err
    # The greedy tolerances reach the choice: at 0, the candidate's shorter greedy prefix rejects it.
    lossy, yard = rows[PRUNE_ALL]["greedy_prefix_tokens"], rows["k8v4"]["greedy_prefix_tokens"]
    assert lossy[chosen_on[0]] < yard[chosen_on[0]]
    record, _ = calibrate(max(kl) + 1.0, "--max-prefix-drop", "0")
    assert record["chosen"] == "k8v4"
