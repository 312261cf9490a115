"""``RequestGroup``'s merge of its children (``llmapi/outputs.py``), on stand-in children with chosen outputs (issue 43).

The children's final outputs (token ids, cumulative log-probability, metrics) are set here, so the merged
output is worked out from TensorRT-LLM's / vLLM's rules independently of the merge: with ``best_of > n`` the
``n`` most likely children, best first, re-indexed 0 .. n - 1, ties to the earlier child; without, the
children in order; the group's ``metrics`` are those of the best sequence it returns, never of a dropped one;
a failed child fails the group with its error.
"""
import pytest

from trtllm_diffkv.llmapi.outputs import CompletionOutput, RequestGroup, RequestOutput
from trtllm_diffkv.runtime.sampling import SamplingParams


class Child:
    """What ``RequestGroup`` reads of an ``AsyncRequest``: ids, prompt and its final output."""

    def __init__(self, request_id, cumulative, error=None):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, "p", [1, 2]
        self.output = RequestOutput(request_id, "p", [1, 2], [CompletionOutput(
            token_ids=[request_id] * 3, finish_reason="error" if error else "length", cumulative_logprob=cumulative)],
            True, error, {"child": request_id, "kv_cache_bytes": 100 * (request_id + 1)})
        self.finished = True

    def result(self, timeout=None):
        return self.output


def _group(scores, n, best_of, errors=None):
    errors = errors or {}
    children = [Child(i, s, errors.get(i)) for i, s in enumerate(scores)]
    return RequestGroup(children, SamplingParams(n=n, best_of=best_of, temperature=1.0))


@pytest.mark.parametrize("scores,n,want", [([-4.0, -1.0, -3.0, -2.0], 1, [1]),
                                           ([-4.0, -1.0, -3.0, -2.0], 2, [1, 3]),
                                           ([-2.0, -1.0, -1.0], 2, [1, 2]),     # a tie: the earlier child first
                                           ([-1.0, -5.0, -2.0], 2, [0, 2])])
def test_best_of_returns_the_most_likely_children_and_the_best_ones_metrics(scores, n, want):
    out = _group(scores, n, len(scores)).result()
    assert [c.token_ids[0] for c in out.outputs] == want
    assert [c.index for c in out.outputs] == list(range(n))
    assert out.metrics == {"child": want[0], "kv_cache_bytes": 100 * (want[0] + 1)}  # not child 0's if dropped
    assert out.error is None and out.finished


@pytest.mark.parametrize("best_of", [None, 3])
def test_n_without_best_of_or_best_of_equal_to_n_keeps_the_children_in_order(best_of):
    """Nothing to choose (``best_of`` unset or ``== n``): the children in seed order, not sorted by likelihood."""
    out = _group([-3.0, -1.0, -2.0], 3, best_of).result()
    assert [c.token_ids[0] for c in out.outputs] == [0, 1, 2] and [c.index for c in out.outputs] == [0, 1, 2]
    assert out.metrics["child"] == 0


def test_a_failed_child_fails_the_group_with_its_error():
    out = _group([-3.0, -1.0, -2.0], 1, 3, errors={2: "the step failed"}).result()
    assert out.error == "the step failed" and out.metrics["child"] == 2
