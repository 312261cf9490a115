"""Issue 22's generation features on the GPU at real shapes: logprobs, echo's prompt logprobs, the presence /
frequency penalties, n > 1, and chunked prefill against the one-step prefill.

Run on the device: ``python3 -m pytest -q -s -m gpu tests/llmapi/test_generation_features_gpu.py``.

Models: random weights (no checkpoint to carry) at the default model's shape (SmolLM2-135M: 30 layers, 9/3
heads, d64, vocab 49152) and a Llama-3-8B-wide model cut to 4 layers (32/8 heads, d128, vocab 128256), fp32,
q/k projections scaled so that attention is peaked (the tiers change) and the embedding scaled so that the
next-token distributions are not flat. The executor runs the Triton kernels, the TritonPageManager and
CUDA-graph decode steps. References are independent of the sampler and of the paged cache: ``log_softmax`` of
the logits of a token-by-token loop over :class:`DiffKVReferenceCache` (the paper's rules, one request),
teacher-forced with the tokens the LLM returned; prompt log-probabilities against one dense forward.
"""
import pytest
import torch

from trtllm_diffkv.config import get_preset
from trtllm_diffkv.evaluation.throughput import random_llama
from trtllm_diffkv.generation.reference import ReferenceGenerator
from trtllm_diffkv.llmapi.llm import LLM
from trtllm_diffkv.model import ModelConfig
from trtllm_diffkv.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
               head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
               tie_word_embeddings=True)
LLAMA_WIDE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=4, num_heads=32,
                  num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192)
TOL = {"fp16": 2e-2, "diffkv": 1e-3}
"""Absolute log-probability tolerance. ``fp16``: against the reference loop, whose cache rounds differently from
the paged kernels (fp16 pages; 1.6e-2 measured on the H200 at fca190a). ``diffkv``: against the logits the
sampler saw (only the log-softmax's own rounding). The test prints the largest difference it saw."""
CHUNK_ATOL = 5e-2
"""Logits of chunked vs one-step prefill (docs/RUNTIME.md, "Exactness"): the chunks' attention runs on other
shapes, and 30 peaked layers amplify its last-bit differences: ``fp16`` preset measured on the H200 at fca190a
3.2e-3 (SmolLM2 shape, 300 tokens in chunks of 100) and 2.2e-2 (Llama-wide, 200 in 64), 1.4e-3 on the CPU torch
path. With a compressing preset this holds for the first token only (the prompt's own forward): later tokens read
the tiered cache, and a last-bit difference can flip a token's tier. On this model that moves logits by several
units: on the CPU, 1e-4 relative noise on the first layer's input of an unchunked run flipped 0.04 % of the tier
entries (high 0.6862 -> 0.6859) and moved the decode logits by 4.2; the H200 run at fca190a measured 4.38 between
chunked and one-step prefill. So ``diffkv`` checks the first token's logits and the tier fractions within
:data:`TIER_ATOL`."""
TIER_ATOL = 2e-3
"""Tier fractions of chunked vs one-step prefill with a compressing preset: a few flipped (layer, head, token)
entries of ~8k (above)."""


def _model(shape: dict, seed: int = 0):
    config = ModelConfig(**shape)
    model = random_llama(config, device=torch.device("cuda"), dtype=torch.float32, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
        model.model.embed_tokens.weight.mul_(2.0)
        if not shape.get("tie_word_embeddings"):
            model.lm_head.weight.mul_(2.0)
    return model


def _prompts(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def smollm2():
    return _model(SMOLLM2)


def _llm(model, kv, **kw):
    kw.setdefault("max_batch_size", 8)
    llm = LLM.from_model(model, None, model.config, kv, kv_memory_bytes=256 << 20, max_seq_len=1024, **kw)
    ex = llm.executor
    assert ex.cache.use_triton and type(ex.cache.manager).__name__ == "TritonPageManager" and ex.use_cuda_graphs
    return llm


def _free(llm) -> bool:
    stats = llm.stats()
    return stats["free_pages"] == stats["pool_pages"] and stats["running"] == 0 and stats["waiting"] == 0


def reference_logits(model, kv, prompt, tokens) -> torch.Tensor:
    """[len(tokens), V] fp32 next-token logits before each of ``tokens`` (teacher-forced) over a fresh reference
    cache on the GPU: a prefill, then one decode step per token."""
    gen = ReferenceGenerator(model, None, model.config, kv)
    cache, dev = gen.new_cache(len(prompt) + len(tokens)), torch.device("cuda")
    rows = []
    with torch.inference_mode():
        logits = gen.model(torch.tensor(prompt, device=dev), torch.arange(len(prompt), device=dev), cache,
                           logits_indices=torch.tensor([len(prompt) - 1], device=dev))
        rows.append(logits[-1].float())
        for i, token in enumerate(tokens[:-1]):
            logits = gen.model(torch.tensor([token], device=dev), torch.tensor([len(prompt) + i], device=dev), cache)
            rows.append(logits[-1].float())
    return torch.stack(rows).cpu()


def _rank_range(row, token, tol):
    return int((row > row[token] + tol).sum()) + 1, int((row > row[token] - tol).sum()) + 1


def _check_entry(row, entry, token, tol, top):
    """One position's entry (sampled/prompt token first, then the top ones) against log-probabilities ``row``."""
    assert list(entry)[0] == token
    worst = 0.0
    for t, lp in entry.items():
        assert lp.logprob == pytest.approx(float(row[t]), abs=tol), (t, lp, float(row[t]))
        lo, hi = _rank_range(row, t, tol)
        assert lo <= lp.rank <= hi, (t, lp.rank, lo, hi)
        worst = max(worst, abs(lp.logprob - float(row[t])))
    ranks = {lp.rank for lp in entry.values()}
    assert set(range(1, top + 1)) <= ranks  # the top-k alternatives: ranks 1..k, each checked above
    return worst


def _recording_sampler(llm) -> dict:
    """{request id: [fp32 logits row the sampler saw, one per token]} of every later ``sample_with_logprobs``."""
    seen, sampler = {}, llm.executor.sampler
    inner = sampler.sample_with_logprobs

    def recording(logits, request_ids, histories, *args, **kwargs):
        for row, rid in zip(logits.float().cpu(), request_ids):
            seen.setdefault(rid, []).append(row)
        return inner(logits, request_ids, histories, *args, **kwargs)

    sampler.sample_with_logprobs = recording
    return seen


@pytest.mark.parametrize("name", ["fp16", "diffkv"])
def test_logprobs_equal_log_softmax_of_the_reference_logits_gpu(smollm2, name):
    """Greedy and sampled (temperature 0.8, top_k 40, presence 0.6, frequency 1.1) tokens with their top-5: the
    log-probabilities the LLM returns equal log_softmax((logits - penalties) / temperature). ``fp16``: the logits
    of the reference-cache loop (the whole pipeline); ``diffkv``: the logits the sampler saw, since the paged and
    the reference cache may tier a token differently after a last-bit difference (see :data:`CHUNK_ATOL`) and
    the decode logits then differ by more than any logprob tolerance."""
    kv, tol = get_preset(name), TOL[name]
    prompts = _prompts((9, 100, 300), SMOLLM2["vocab_size"])
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_k=40, presence_penalty=0.6, frequency_penalty=1.1,
                             seed=11, logprobs=5)
    with _llm(smollm2, kv) as llm:
        seen = _recording_sampler(llm)
        greedy = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, logprobs=5))  # one batch
        drawn_out = llm.generate(prompts[1], sampled)
        again = llm.generate(prompts[1], sampled).outputs[0]
        assert _free(llm)
    drawn = drawn_out.outputs[0]

    def logits_of(out, prompt):
        if kv.compress:
            return torch.stack(seen[out.request_id])
        return reference_logits(smollm2, kv, prompt, out.outputs[0].token_ids)

    worst = 0.0
    for prompt, out in zip(prompts, greedy):
        c = out.outputs[0]
        ref = torch.log_softmax(logits_of(out, prompt), dim=-1)
        assert len(c.logprobs) == len(c.token_ids) == 12 == ref.shape[0]
        for row, token, entry in zip(ref, c.token_ids, c.logprobs):
            assert entry[token].rank == 1 and _rank_range(row, token, tol)[0] == 1  # greedy = the reference's top
            worst = max(worst, _check_entry(row, entry, token, tol, 5))
        assert c.cumulative_logprob == pytest.approx(sum(float(r[t]) for r, t in zip(ref, c.token_ids)),
                                                     abs=tol * len(ref))
    logits = logits_of(drawn_out, prompts[1])
    for i, (token, entry) in enumerate(zip(drawn.token_ids, drawn.logprobs)):
        counts = torch.bincount(torch.tensor(drawn.token_ids[:i], dtype=torch.long), minlength=logits.shape[1]).float()
        row = torch.log_softmax((logits[i] - 1.1 * counts - 0.6 * (counts > 0).float()) / 0.8, dim=-1)
        worst = max(worst, _check_entry(row, entry, token, tol, 5))
    assert again.token_ids == drawn.token_ids  # seeded: reproducible
    assert len(set(drawn.token_ids)) == len(drawn.token_ids) or max(
        drawn.token_ids.count(t) for t in drawn.token_ids) <= 2  # the penalties keep repeats rare
    print(f"{name}: largest |logprob - reference| {worst:.3g} (tolerance {tol})")


def test_greedy_penalties_match_the_reference_loop_gpu(smollm2):
    """Greedy with repetition 1.3, presence 0.5 and frequency 2.0 penalties: each token is the argmax of the
    reference logits minus the penalties over prompt (repetition) and generated (presence, frequency) tokens."""
    kv = get_preset("fp16")
    prompt = _prompts((40,), SMOLLM2["vocab_size"], seed=4)[0]
    params = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=2.0, logprobs=1)
    with _llm(smollm2, kv) as llm:
        c = llm.generate(prompt, params).outputs[0]
    logits = reference_logits(smollm2, kv, prompt, c.token_ids)
    for i, token in enumerate(c.token_ids):
        x = logits[i].double().clone()
        for t in set(prompt + c.token_ids[:i]):
            x[t] = x[t] * 1.3 if x[t] < 0 else x[t] / 1.3
        for t in set(c.token_ids[:i]):
            x[t] -= 2.0 * c.token_ids[:i].count(t) + 0.5
        lo, _ = _rank_range(x, token, TOL["fp16"])
        assert lo == 1, (i, token, int(x.argmax()))
        assert c.logprobs[i][token].logprob == pytest.approx(float(torch.log_softmax(x, -1)[token]), abs=TOL["fp16"])


def _dense_logprobs(model, kv, prompt):
    dev = torch.device("cuda")
    with torch.inference_mode():
        cache = ReferenceGenerator(model, None, model.config, kv).new_cache(len(prompt))
        logits = model(torch.tensor(prompt, device=dev), torch.arange(len(prompt), device=dev), cache,
                       logits_indices=torch.arange(len(prompt), device=dev))
    return torch.log_softmax(logits.float(), dim=-1).cpu()


@pytest.mark.parametrize("max_num_tokens", [None, 64, 100])
def test_echo_prompt_logprobs_equal_a_dense_forward_gpu(smollm2, max_num_tokens):
    """Prompt log-probabilities (echo) of a 9-, 100- and 300-token prompt, one-step and chunked (64 = the score
    window; 100: the 300-token prompt ends in a 100-token chunk), against log_softmax of a dense forward."""
    kv = get_preset("diffkv")
    prompts = _prompts((9, 100, 300), SMOLLM2["vocab_size"], seed=2)
    kw = {} if max_num_tokens is None else dict(max_num_tokens=max_num_tokens)
    with _llm(smollm2, kv, **kw) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))
        assert _free(llm)
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        assert out.error is None
        entries, dense = out.outputs[0].prompt_logprobs, _dense_logprobs(smollm2, kv, prompt)
        assert len(entries) == len(prompt) and entries[0] is None
        for i, token in enumerate(prompt[1:]):
            worst = max(worst, _check_entry(dense[i], entries[i + 1], token, TOL["fp16"], 3))
    print(f"max_num_tokens {max_num_tokens}: largest |prompt logprob - dense| {worst:.3g}")


def test_n_sequences_are_seeded_reproducible_and_best_of_ranks_gpu(smollm2):
    kv = get_preset("diffkv")
    prompt = _prompts((100,), SMOLLM2["vocab_size"], seed=5)[0]
    stride = 0x9E3779B97F4A7C15
    params = SamplingParams(max_tokens=10, temperature=1.0, n=4, seed=1234, logprobs=0)
    with _llm(smollm2, kv) as llm:
        first = llm.generate(prompt, params)
        second = llm.generate(prompt, params)
        alone = [llm.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, logprobs=0,
                                                     seed=(1234 + i * stride) % 2 ** 64)).outputs[0] for i in range(4)]
        best = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=1234, n=2, best_of=4))
        assert _free(llm)
    ids = [c.token_ids for c in first.outputs]
    assert ids == [c.token_ids for c in second.outputs] == [a.token_ids for a in alone]  # reproducible, seed rule
    assert len({tuple(t) for t in ids}) == 4
    order = sorted(range(4), key=lambda i: -alone[i].cumulative_logprob)[:2]
    assert [c.token_ids for c in best.outputs] == [alone[i].token_ids for i in order]


def _greedy_run(model, kv, prompt, max_tokens, **kw):
    """(tokens, [max_tokens, V] logits the sampler saw, result) of ``prompt`` alone."""
    with _llm(model, kv, max_batch_size=1, **kw) as llm:
        ex, seen = llm.executor, []
        sample = ex.sampler.sample

        def recording(logits, ids, histories):
            seen.append(logits.float().cpu())
            return sample(logits, ids, histories)

        ex.sampler.sample = recording
        out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        assert _free(llm) and ex.cache.staging == {}
    return out.outputs[0].token_ids, torch.cat(seen), out


@pytest.mark.parametrize("shape,name,length,chunk", [
    ("smollm2", "diffkv", 70, 1), ("smollm2", "diffkv", 300, 64), ("smollm2", "diffkv", 300, 128),
    ("smollm2", "fp16", 300, 100), ("llama", "diffkv", 300, 90), ("llama", "fp16", 200, 64)])
def test_chunked_prefill_equals_the_one_step_prefill_at_real_shapes_gpu(smollm2, shape, name, length, chunk):
    """The first token's logits within :data:`CHUNK_ATOL`; ``fp16``: every token, the tokens and the bytes;
    ``diffkv``: the tier fractions within :data:`TIER_ATOL` (see there). Chunks of 1, of the score window (64),
    and 300 = 128 + 128 + 44 (a final chunk shorter than the window)."""
    model = smollm2 if shape == "smollm2" else _model(LLAMA_WIDE)
    kv = get_preset(name)
    prompt = _prompts((length,), model.config.vocab_size, seed=7)[0]
    want, want_logits, want_out = _greedy_run(model, kv, prompt, 6, enable_chunked_prefill=False)
    got, logits, out = _greedy_run(model, kv, prompt, 6, max_num_tokens=chunk)
    diff, first = float((logits - want_logits).abs().max()), float((logits[0] - want_logits[0]).abs().max())
    fields = ("high_fraction", "low_fraction", "pruned_fraction")
    fractions = [(want_out.metrics[f], out.metrics[f]) for f in fields]
    print(f"{shape} {name} {length} tokens in chunks of {chunk}: max |logit diff| {diff:.3g}; first token {first:.3g}; "
          f"tokens equal {got == want}; tier fractions (one step, chunked) {fractions}")
    assert bool(torch.isfinite(logits).all()) and first <= CHUNK_ATOL and got[0] == want[0]
    if kv.compress:
        assert all(abs(a - b) <= TIER_ATOL for a, b in fractions), fractions
    else:  # no tiers: every token's logits, the tokens and the bytes
        assert got == want and diff <= CHUNK_ATOL
        assert out.metrics["kv_cache_bytes"] == want_out.metrics["kv_cache_bytes"]
