"""Log-probabilities, prompt log-probabilities (echo), n > 1 / best_of and the presence/frequency penalties
through the LLM API and the in-flight executor, on a tiny random model on the CPU.

References are independent of the sampler: ``torch.log_softmax`` of the logits of a loop that runs the
model token by token over its own :class:`DiffKVReferenceCache` (the DiffKV rules of the paper, one
request at a time), teacher-forced with the tokens the LLM returned; prompt log-probabilities against
``log_softmax`` of one dense forward over the prompt."""
import pytest
import torch

from conftest import peaked_tiny_llama
from trtllm_diffkv.config import get_preset
from trtllm_diffkv.generation.reference import ReferenceGenerator
from trtllm_diffkv.llmapi.llm import LLM, RequestGroup
from trtllm_diffkv.runtime.sampling import SamplingParams

TOL = 5e-3
"""Absolute log-probability tolerance: the paged cache (its kernels, its fp16 / quantized pages) and the reference
cache round differently; measured differences reach 1.2e-3 on this model (fp32 logits, 10 tokens)."""
COMPRESSED_TOL = 1e-2
"""The same for sampled (low-probability) tokens under the ``diffkv`` preset: the paged low tier's rounding
differs from the reference cache's and grows along the sequence (1.7e-3 at the 12th token here)."""
PROMPTS = [[5, 9, 33, 7, 101, 64, 2, 90, 17], list(range(40, 110))]  # the second past the 64-token recent window


def _free(llm) -> bool:
    stats = llm.stats()
    return stats["free_pages"] == stats["pool_pages"] and stats["running"] == 0 and stats["waiting"] == 0


@pytest.fixture(scope="module", params=["diffkv", "fp16"])
def setup(request):
    model = peaked_tiny_llama()
    kv = get_preset(request.param)
    with LLM.from_model(model, None, model.config, kv, kv_memory_bytes=16 << 20, max_batch_size=8) as llm:
        yield model, kv, llm


def _rank_range(row: torch.Tensor, token: int, tol: float = TOL) -> tuple[int, int]:
    """The ranks ``token`` may have in ``row`` within ``tol`` (near ties may swap; the sampler's rank
    rule is checked exactly in tests/runtime/test_sampling.py)."""
    return int((row > row[token] + tol).sum()) + 1, int((row > row[token] - tol).sum()) + 1


def reference_logits(model, kv, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] float32: the next-token logits before each of ``tokens`` (teacher-forced), from a
    prefill then one decode step per token over a fresh reference cache (ReferenceGenerator's loop)."""
    gen = ReferenceGenerator(model, None, model.config, kv)
    cache = gen.new_cache(len(prompt) + len(tokens))
    rows = []
    with torch.inference_mode():
        logits = gen.model(torch.tensor(prompt), torch.arange(len(prompt)), cache,
                           logits_indices=torch.tensor([len(prompt) - 1]))
        rows.append(logits[-1].float())
        for i, token in enumerate(tokens[:-1]):
            logits = gen.model(torch.tensor([token]), torch.tensor([len(prompt) + i]), cache)
            rows.append(logits[-1].float())
    return torch.stack(rows)


def test_logprobs_of_greedy_tokens_are_log_softmax_of_the_reference_logits(setup):
    model, kv, llm = setup
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, logprobs=4))  # batched together
    for prompt, out in zip(PROMPTS, outs):
        completion = out.outputs[0]
        ref = torch.log_softmax(reference_logits(model, kv, prompt, completion.token_ids), dim=-1)
        assert completion.token_ids == ref.argmax(-1).tolist()
        assert len(completion.logprobs) == len(completion.token_ids)
        for row, token, entry in zip(ref, completion.token_ids, completion.logprobs):
            assert list(entry)[0] == token and entry[token].rank == 1
            top = torch.topk(row, 4)
            assert [t for t, lp in entry.items()] == top.indices.tolist()  # the greedy token is the top one
            for t, value in zip(top.indices.tolist(), top.values.tolist()):
                assert entry[t].logprob == pytest.approx(value, abs=TOL)
        assert completion.cumulative_logprob == pytest.approx(
            sum(float(r[t]) for r, t in zip(ref, completion.token_ids)), abs=TOL * len(ref))
    assert _free(llm)


def test_sampled_logprobs_follow_the_penalties_and_temperature(setup):
    """Sampled with temperature 0.8, top_k 20, presence and frequency penalties: each token's
    log-probability is log_softmax((reference logits - OpenAI's penalties over the tokens generated
    before it) / 0.8), before top-k."""
    model, kv, llm = setup
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, presence_penalty=0.6, frequency_penalty=1.1,
                            seed=11, logprobs=2)
    completion = llm.generate(PROMPTS[0], params).outputs[0]
    logits = reference_logits(model, kv, PROMPTS[0], completion.token_ids)
    tol = COMPRESSED_TOL if kv.compress else TOL
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        counts = torch.bincount(torch.tensor(completion.token_ids[:i], dtype=torch.long),
                                minlength=logits.shape[1]).float()
        row = torch.log_softmax((logits[i] - 1.1 * counts - 0.6 * (counts > 0).float()) / 0.8, dim=-1)
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=tol)
        assert _rank_range(row, token, tol)[0] <= entry[token].rank <= _rank_range(row, token, tol)[1]
    again = llm.generate(PROMPTS[0], params).outputs[0]
    assert again.token_ids == completion.token_ids  # seeded: reproducible


def _check_prompt_entries(model, kv, prompt: list[int], entries, top: int) -> None:
    """``entries`` (one per prompt token) against log_softmax of one dense forward over the prompt."""
    with torch.inference_mode():
        cache = ReferenceGenerator(model, None, model.config, kv).new_cache(len(prompt))
        dense = torch.log_softmax(model(torch.tensor(prompt), torch.arange(len(prompt)), cache,
                                        logits_indices=torch.arange(len(prompt))).float(), dim=-1)
    assert len(entries) == len(prompt) and entries[0] is None
    for i, token in enumerate(prompt[1:]):
        entry = entries[i + 1]
        assert list(entry)[0] == token
        assert entry[token].logprob == pytest.approx(float(dense[i, token]), abs=TOL)
        assert _rank_range(dense[i], token)[0] <= entry[token].rank <= _rank_range(dense[i], token)[1]
        top_k = torch.topk(dense[i], top)
        for t, value in zip(top_k.indices.tolist(), top_k.values.tolist()):
            assert entry[t].logprob == pytest.approx(value, abs=TOL)


def test_prompt_logprobs_equal_a_dense_forward(setup):
    model, kv, llm = setup
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3, logprobs=0))
    for prompt, out in zip(PROMPTS, outs):
        _check_prompt_entries(model, kv, prompt, out.outputs[0].prompt_logprobs, 3)
        # the generated tokens are those of a request without prompt logprobs
        plain = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert _free(llm)


@pytest.mark.parametrize("max_num_tokens", [4, 9, 64])
def test_chunked_prefill_gives_the_prompt_logprobs_of_a_dense_forward(max_num_tokens):
    """Prompts split over steps (chunks of 4 and 9 tokens, and the 70-token prompt in a 64-token chunk then
    a 6-token one): each chunk adds its positions' entries; all of them equal the dense forward's."""
    model, kv = peaked_tiny_llama(), get_preset("diffkv")
    with LLM.from_model(model, None, model.config, kv, kv_memory_bytes=16 << 20, max_batch_size=2,
                        max_num_tokens=max_num_tokens) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2))
        assert _free(llm)
    for prompt, out in zip(PROMPTS, outs):
        assert out.error is None
        _check_prompt_entries(model, kv, prompt, out.outputs[0].prompt_logprobs, 2)


def test_n_sequences_are_reproducible_distinct_and_seeded_by_the_rule(setup):
    _, _, llm = setup
    params = SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=1234)
    group = llm.generate_async(PROMPTS[0], params)
    assert isinstance(group, RequestGroup) and len(group.children) == 3
    first = group.result()
    second = llm.generate(PROMPTS[0], params)
    ids = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert ids == [c.token_ids for c in second.outputs]       # reproducible
    assert len({tuple(t) for t in ids}) == 3                    # distinct
    stride = 0x9E3779B97F4A7C15
    alone = [llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=1.0, seed=(1234 + i * stride) % 2 ** 64))
             for i in range(3)]
    assert [a.outputs[0].token_ids for a in alone] == ids     # child i = the documented seed, alone
    assert _free(llm)


def test_best_of_keeps_the_highest_cumulative_logprobs(setup):
    _, _, llm = setup
    stride = 0x9E3779B97F4A7C15
    alone = [llm.generate(PROMPTS[1], SamplingParams(max_tokens=6, temperature=1.5, seed=(7 + i * stride) % 2 ** 64,
                                                     logprobs=0)).outputs[0] for i in range(5)]
    best = llm.generate(PROMPTS[1], SamplingParams(max_tokens=6, temperature=1.5, seed=7, n=2, best_of=5))
    scores = [a.cumulative_logprob for a in alone]
    order = sorted(range(5), key=lambda i: -scores[i])[:2]
    assert [c.token_ids for c in best.outputs] == [alone[i].token_ids for i in order]
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob
    assert _free(llm)


def test_aborting_a_group_aborts_every_child_and_frees_the_pages(setup):
    _, _, llm = setup
    group = llm.generate_async(PROMPTS[1], SamplingParams(max_tokens=400, temperature=1.0, n=4, ignore_eos=True))
    group.abort()
    final = group.result(timeout=120)
    assert [c.finish_reason for c in final.outputs] == ["cancelled"] * 4
    assert _free(llm)
    streamed = llm.generate_async(PROMPTS[0], SamplingParams(max_tokens=4, n=2, best_of=3),
                                  streaming=True).result(timeout=60)
    assert streamed.error.startswith("n=2 / best_of=3: best_of > n cannot stream")


def test_llm_abort_of_the_group_request_id_aborts_every_child(setup):
    """Issue 44: ``llm.abort(group.request_id)`` cancelled child 0 only (the id is child 0's); the other
    children ran to ``max_tokens``. Now it cancels every child, as ``group.abort()``."""
    _, _, llm = setup
    group = llm.generate_async(PROMPTS[1], SamplingParams(max_tokens=400, temperature=1.0, n=4, ignore_eos=True))
    llm.abort(group.request_id)
    final = group.result(timeout=120)
    assert [c.finish_reason for c in final.outputs] == ["cancelled"] * 4
    assert all(len(c.token_ids) < 400 for c in final.outputs)
    assert _free(llm)


@pytest.mark.parametrize("streaming", [False, True])
def test_iterating_a_group_after_result_yields_nothing(setup, streaming):
    """Issue 44: a group whose ``result()`` was taken yielded its final output once more when iterated; an
    AsyncRequest yields nothing then, and so does a group now."""
    _, _, llm = setup
    group = llm.generate_async(PROMPTS[0], SamplingParams(max_tokens=4, temperature=1.0, n=2, seed=3),
                               streaming=streaming)
    final = group.result(timeout=60)
    assert final.finished and list(group) == []
    single = llm.generate_async(PROMPTS[0], SamplingParams(max_tokens=4), streaming=streaming)
    single.result(timeout=60)
    assert list(single) == []  # the same rule


def test_a_streamed_group_concatenates_to_the_unstreamed_one(setup):
    """n = 3 streamed: every update holds the 3 sequences (index 0..2); each index's token and text diffs
    concatenate to its final ids and text, which equal the unstreamed group's with the same seed."""
    _, _, llm = setup
    params = SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=99, logprobs=1)
    want = llm.generate(PROMPTS[1], params)
    group = llm.generate_async(PROMPTS[1], params, streaming=True)
    assert isinstance(group, RequestGroup) and group.streaming
    ids, logprobs, updates = [[] for _ in range(3)], [[] for _ in range(3)], list(group)
    assert len(updates) > 1 and updates[-1].finished and not any(u.finished for u in updates[:-1])
    for update in updates:
        assert [c.index for c in update.outputs] == [0, 1, 2]
        for c in update.outputs:
            ids[c.index] += c.token_ids_diff
            logprobs[c.index] += c.logprobs_diff or []
    final = updates[-1]
    assert ids == [c.token_ids for c in final.outputs] == [c.token_ids for c in want.outputs]
    assert logprobs == [c.logprobs for c in want.outputs]
    assert [c.cumulative_logprob for c in final.outputs] == [c.cumulative_logprob for c in want.outputs]
    assert group.result() is final and _free(llm)


def test_a_streamed_group_reports_a_finished_sequence_once(setup):
    """Sequences of one streamed group that end at different steps (stop ids: every third id): a sequence that
    ended in an earlier update has empty diffs in every later one, so each index's diffs still concatenate to its
    final ids and logprobs (a finished child's last diffs were repeated in every later update)."""
    model, _, llm = setup
    params = SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=99, logprobs=1,
                            stop_token_ids=list(range(0, model.config.vocab_size, 3)))
    want = llm.generate(PROMPTS[0], params)
    assert len({len(c.token_ids) for c in want.outputs}) > 1  # they do end at different steps
    ids, logprobs = [[] for _ in range(3)], [[] for _ in range(3)]
    for update in llm.generate_async(PROMPTS[0], params, streaming=True):
        for c in update.outputs:
            ids[c.index] += c.token_ids_diff
            logprobs[c.index] += c.logprobs_diff or []
    assert ids == [c.token_ids for c in update.outputs] == [c.token_ids for c in want.outputs]
    assert logprobs == [c.logprobs for c in want.outputs]
    assert [c.finish_reason for c in update.outputs] == [c.finish_reason for c in want.outputs]
    assert _free(llm)


def test_a_bad_streamed_group_fails_with_its_own_error(setup):
    """streaming=True with n > 1 and a bad value fails naming that value, not "best_of > n cannot stream" (the
    streaming check ran before validation and named the wrong cause once n > 1 could stream)."""
    _, _, llm = setup
    for params, want in ((SamplingParams(max_tokens=4, n=2, temperature=-1.0), "temperature must be"),
                         (SamplingParams(max_tokens=4, n=300), "n must be an int >= 1, at most 256"),
                         (SamplingParams(max_tokens=4, n=2, best_of=3), "n=2 / best_of=3: best_of > n cannot stream")):
        out = llm.generate_async(PROMPTS[0], params, streaming=True).result(timeout=60)
        assert out.error.startswith(want), out.error
    assert _free(llm)
