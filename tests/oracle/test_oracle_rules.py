"""The oracle's rules on examples worked out by hand from the rule text, and the library on the same examples.

Thresholds below: N = 10, alpha_high = 1.0, alpha_low = 0.2, so ``alpha_high / N`` = 0.1 and
``alpha_low / N`` = 0.02.
"""
import pytest
import torch

from oracle import rules
from oracle.rules import HIGH, LOW, PRUNED
from trtllm_diffkv import policy

H, L, P = HIGH, LOW, PRUNED
HAND_DECISIONS = [
    # (tiers, importance, expected tiers after, victim)
    # candidate 0.3 > 0.1: high; least important high token is position 2 (0.05): demoted to low
    ([H, L, H, H], [0.5, 0.1, 0.05, 0.3], [H, L, L, H], 2),
    # candidate 0.08 in [0.02, 0.1]: low; least important low token is position 0 (0.01 < 0.02): pruned
    ([L, H, L, H], [0.01, 0.9, 0.05, 0.08], [P, H, L, L], 0),
    # candidate 0.001 < 0.02: pruned, no victim
    ([H, L, H], [0.5, 0.03, 0.001], [H, L, P], -1),
    # candidate high, least important high is the candidate itself (0.2 > 0.1): stays
    ([L, P, H], [0.01, 0.0, 0.2], [L, P, H], 2),
    # a tie between two high tokens: the lower position is the victim; 0.005 < 0.02: pruned
    ([H, H, H], [0.005, 0.005, 0.5], [P, H, H], 0),
    # candidate low and itself the least important low token, above alpha_low: stays low
    ([H, P, H], [0.5, 0.0, 0.05], [H, P, L], 2),
]


@pytest.mark.parametrize("tiers,importance,after,victim", HAND_DECISIONS)
def test_decode_rule_on_hand_examples(tiers, importance, after, victim):
    outcome = rules.decide(tiers, importance, len(tiers) - 1, 10, 1.0, 0.2)
    assert outcome.tiers == after and outcome.victim == victim
    d = policy.decode_step(torch.tensor([tiers], dtype=torch.int8), torch.tensor([importance]), 10, 1.0, 0.2)
    got = list(tiers)
    got[-1] = int(d.candidate_tier[0])
    if int(d.victim_pos[0]) >= 0:
        got[int(d.victim_pos[0])] = int(d.victim_tier[0])
    assert got == after and int(d.victim_pos[0]) == victim


def test_prompt_rule_on_a_hand_example():
    """prompt_len 5, S = 2 (queries 3 and 4 score), W = 1, alpha_high = 1, alpha_low = 0.5, L = 5.

    counts: tokens 0-3 seen by both scoring queries (2), token 4 by one; thresholds 0.2 and 0.1.
    sums [0.6, 0.3, 0.1, 0.5, 0.0] -> importance [0.3, 0.15, 0.05, 0.25, -]: H, L, P, H, and the window's H.
    """
    sums = [0.6, 0.3, 0.1, 0.5, 0.0]
    assert [rules.prompt_query_count(t, 5, 2) for t in range(5)] == [2, 2, 2, 2, 1]
    assert rules.prompt_tiers(sums, 1.0, 0.5, 1, 2) == [H, L, P, H, H]
    assert policy.prompt_tiers(torch.tensor([sums]), 1.0, 0.5, 1, 2).tolist() == [[H, L, P, H, H]]


def test_decode_counts_on_a_hand_example():
    """prompt_len 4, S = 2, before the step writing pos 7 (decode queries 4, 5, 6 have run)."""
    assert [rules.decode_query_count(t, 7, 4, 2) for t in range(7)] == [2 + 3, 2 + 3, 2 + 3, 1 + 3, 3, 2, 1]


def test_ambiguous_comparisons_are_refused():
    with pytest.raises(rules.AmbiguousDecision):
        rules.classify(0.1 * (1 + 1e-8), 1.0, 0.2, 10)
    assert rules.classify(0.0, 1.0, 0.0, 10) == LOW  # exact equality is no ambiguity: >= keeps it
