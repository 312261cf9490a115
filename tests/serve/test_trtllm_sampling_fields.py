"""TensorRT-LLM's ``SamplingParams`` fields on the ``LLM`` API (issue 21, item 9): accepted at their neutral
values with the same output as without them, refused by name otherwise (booleans are never counts);
``end_id`` stops at that token, ``end_id=-1`` runs to ``max_tokens``. Tiny random Llama, CPU."""
import pytest

from serve_fixtures import KV_BYTES, checkpoint  # noqa: F401 (fixture)
from trtllm_diffkv.runtime.sampling import TRTLLM_NEUTRAL, SamplingParams

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(checkpoint):
    from trtllm_diffkv.llmapi.llm import LLM

    with LLM(str(checkpoint), device="cpu", kv_memory_bytes=KV_BYTES, max_batch_size=4) as llm:
        yield llm


def test_neutral_values_give_the_plain_output(llm):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))
    neutral = {name: values[-1] for name, values in TRTLLM_NEUTRAL.items()}  # the non-None neutral where one exists
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, pad_id=0, **neutral))
    assert out.error is None and out.outputs[0].token_ids == plain.outputs[0].token_ids


@pytest.mark.parametrize("field, value", [("use_beam_search", True), ("length_penalty", 2.0), ("length_penalty", True),
                                          ("exclude_input_from_output", False),
                                          ("guided_decoding", {"json": {}})])
def test_other_values_fail_the_request_naming_the_field(llm, field, value):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.0, **{field: value}))
    assert out.outputs[0].finish_reason == "error" and out.error.startswith(f"{field}={value!r} is not supported")
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0)).error is None  # the next one runs


def test_end_id_stops_at_that_token_and_minus_one_runs_to_max_tokens(llm):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0)).outputs[0].token_ids
    end = plain[3]
    first = plain.index(end)  # the first time the end token comes
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, end_id=end)).outputs[0]
    assert out.token_ids == plain[:first + 1] and out.finish_reason == "stop"
    run = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, end_id=-1)).outputs[0]
    assert len(run.token_ids) == 8 and run.finish_reason == "length"
    bad = llm.generate(PROMPT, SamplingParams(max_tokens=2, end_id=llm.model_config.vocab_size))
    assert bad.error.startswith("end_id must be None, -1 (no end token) or a token id")
