"""The ``fp16`` preset's preemption guarantee as documented in docs/RUNTIME.md (issue 21, item 4).

What holds: a preempted request's tokens up to its first preemption are those of the request run
alone, nothing is lost or repeated after it, and the recompute's prefill is the prompt plus every
token streamed. What does not: "the same output as without preemption" (6 of 20 requests of a
preemption storm on the default model in fp32 differed from their solo runs): the re-prefill attends
over K/V freshly computed in the model's dtype, while decode read them rounded to FP16 in the pool.
"""
from test_executor import FP16, _greedy, _prompts, make, model, preemption_storm, solo  # noqa: F401 (fixture)


def test_fp16_preemption_keeps_the_prefix_and_loses_or_repeats_no_token(model):
    prompts = _prompts((10, 13, 11, 9, 12, 8), seed=5)
    keys, streamed, before, finals = preemption_storm(make(model, FP16, num_pages=110), prompts, _greedy(16))
    assert len(before) >= 2, "the storm preempted fewer than two requests"
    for key, prompt in zip(keys, prompts):
        update = finals[key]
        assert update.finish_reason == "length" and len(streamed[key]) == 16
        assert update.result.token_ids == streamed[key] and update.result.kv_memory_fraction == 1.0
        alone = solo(model, FP16, prompt, _greedy(16))[0]
        n = len(before.get(key, streamed[key]))  # an unpreempted request: all of it
        assert streamed[key][:n] == alone[:n], key
