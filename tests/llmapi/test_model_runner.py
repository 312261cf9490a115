"""ModelRunner (trtllm_diffkv.llmapi.model_runner): TensorRT-LLM runner-style calls on a tiny model on the CPU.

The expected tensors are built independently from per-request ReferenceGenerator greedy outputs:
row b = prompt_b + generated_b (cut at end_id / after a stop word) + pad_id up to
max_input_len + max_new_tokens, sequence_lengths = len(prompt_b) + len(generated_b).
"""
import time

import numpy as np
import pytest
import torch

from conftest import tiny_llama
from tiny_checkpoint import write_tiny_text_checkpoint
from trtllm_diffkv.config import get_preset
from trtllm_diffkv.generation.reference import ReferenceGenerator
from trtllm_diffkv.llmapi.llm import LLM
from trtllm_diffkv.llmapi.model_runner import ModelRunner

PAD = 0
MAX_NEW = 7


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama(seed=3)
    llm = LLM.from_model(model, None, model.config, "default", kv_memory_bytes=16 << 20)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g, dtype=torch.int32) for n in (5, 1, 12, 33)]
    ref = ReferenceGenerator(model, None, model.config, get_preset("default"))
    generated = [ref.generate_ids(p.tolist(), MAX_NEW).token_ids for p in prompts]
    yield ModelRunner(llm, max_batch_size=8), prompts, generated
    llm.shutdown()


def _expected(prompts, generated, width):
    ids = torch.full((len(prompts), 1, width), PAD, dtype=torch.int32)
    lengths = torch.zeros((len(prompts), 1), dtype=torch.int32)
    for b, (p, g) in enumerate(zip(prompts, generated)):
        row = p.tolist() + list(g)
        ids[b, 0, :len(row)] = torch.tensor(row)
        lengths[b, 0] = len(row)
    return ids, lengths


def test_output_ids_layout_and_padding(setup):
    runner, prompts, generated = setup
    out = runner.generate(prompts, max_new_tokens=MAX_NEW, pad_id=PAD, end_id=None, output_sequence_lengths=True,
                          return_dict=True)
    ids, lengths = _expected(prompts, generated, 33 + MAX_NEW)
    assert out["output_ids"].dtype == torch.int32 and out["output_ids"].shape == (4, 1, 33 + MAX_NEW)
    assert torch.equal(out["output_ids"], ids)
    assert torch.equal(out["sequence_lengths"], lengths)
    plain = runner.generate(prompts, max_new_tokens=MAX_NEW, pad_id=PAD)  # return_dict=False: the tensor
    assert torch.equal(plain, ids)


def test_end_id_stops_each_request_and_is_not_counted(setup):
    runner, prompts, generated = setup
    at = next(i for i, t in enumerate(generated[2]) if i >= 2 and t not in generated[2][:i])
    end_id = generated[2][at]  # request 2 stops there; the others wherever they meet it
    cut = [g[:g.index(end_id)] if end_id in g else g for g in generated]
    assert len(cut[2]) == at >= 2
    out = runner.generate(prompts, max_new_tokens=MAX_NEW, end_id=end_id, pad_id=PAD, output_sequence_lengths=True,
                          return_dict=True)
    ids, lengths = _expected(prompts, cut, 33 + MAX_NEW)
    assert torch.equal(out["output_ids"], ids) and torch.equal(out["sequence_lengths"], lengths)
    # pad_id defaults to end_id (TensorRT-LLM's C++ runner pads with end_id)
    default_pad = runner.generate(prompts, max_new_tokens=MAX_NEW, end_id=end_id)
    row = default_pad[2, 0].tolist()
    assert row[len(prompts[2]) + at:] == [end_id] * (len(row) - len(prompts[2]) - at)


def test_streaming_yields_growing_outputs_ending_with_the_full_result(setup, monkeypatch):
    runner, prompts, generated = setup
    step = runner.llm.executor.step
    monkeypatch.setattr(runner.llm.executor, "step", lambda: (time.sleep(0.03), step())[1])  # let the reader keep up
    outs = list(runner.generate(prompts, max_new_tokens=MAX_NEW, pad_id=PAD, streaming=True,
                                output_sequence_lengths=True, return_dict=True))
    assert len(outs) >= 3  # several steps seen (a slow reader gets the updates of several steps at once)
    ids, lengths = _expected(prompts, generated, 33 + MAX_NEW)
    assert torch.equal(outs[-1]["output_ids"], ids) and torch.equal(outs[-1]["sequence_lengths"], lengths)
    for before, after in zip(outs, outs[1:]):
        assert (after["sequence_lengths"] >= before["sequence_lengths"]).all()
        for b in range(len(prompts)):
            n = int(before["sequence_lengths"][b, 0])
            assert torch.equal(after["output_ids"][b, 0, :n], before["output_ids"][b, 0, :n])


def test_stop_words_end_requests_after_the_word(setup):
    runner, prompts, generated = setup
    word = generated[0][2:4]  # two tokens of request 0's output
    expected = []
    for g in generated:
        ends = [i + 2 for i in range(len(g) - 1) if g[i:i + 2] == word]
        expected.append(g[:ends[0]] if ends else g)
    ids, lengths = _expected(prompts, expected, 33 + MAX_NEW)
    as_lists = runner.generate(prompts, max_new_tokens=MAX_NEW, pad_id=PAD, stop_words_list=[[word]] * 4,
                               output_sequence_lengths=True, return_dict=True)
    assert torch.equal(as_lists["output_ids"], ids) and torch.equal(as_lists["sequence_lengths"], lengths)
    # TensorRT-LLM's word-list array ([batch, 2, len]: flattened ids, then end offsets padded with -1)
    word_list = np.array([[word + [0], [2, -1, -1]]] * 4, dtype=np.int32)
    as_array = runner.generate(prompts, max_new_tokens=MAX_NEW, pad_id=PAD, stop_words_list=word_list)
    assert torch.equal(as_array, ids)


def test_bad_inputs_and_unsupported_options_are_clear_errors(setup):
    runner, prompts, _ = setup
    with pytest.raises(ValueError, match=r"batch_input_ids\[1\] is empty"):
        runner.generate([prompts[0], torch.tensor([], dtype=torch.int32)], max_new_tokens=2)
    with pytest.raises(ValueError, match="not an int in"):
        runner.generate([torch.tensor([1, 99999])], max_new_tokens=2)
    with pytest.raises(ValueError, match="num_beams=2 is not supported"):
        runner.generate(prompts, max_new_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match="temperature"):
        runner.generate(prompts, max_new_tokens=2, top_k=0, top_p=0.9, temperature=-1.0)
    with pytest.raises(ValueError, match=r"batch_input_ids\[1\]: 4096 tokens \+ max_new_tokens 2 exceeds max_seq_len"):
        runner.generate([prompts[0], torch.ones(4096, dtype=torch.int32)], max_new_tokens=2)  # before anything runs
    with pytest.raises(ValueError, match="num_beams=True is not supported"):  # a bool is not num_beams=1
        runner.generate(prompts, max_new_tokens=2, num_beams=True)
    stats = runner.llm.stats()
    assert stats["free_pages"] == stats["pool_pages"]
    # the defaults TensorRT-LLM scripts pass are accepted
    out = runner.generate(prompts[:1], max_new_tokens=2, num_beams=1, length_penalty=1.0, bad_words_list=None)
    assert out.shape == (1, 1, len(prompts[0]) + 2)


def test_seeded_sampling_repeats(setup):
    runner, prompts, _ = setup
    a = runner.generate(prompts, max_new_tokens=MAX_NEW, top_k=0, top_p=0.9, temperature=1.0, random_seed=5)
    b = runner.generate(prompts, max_new_tokens=MAX_NEW, top_k=0, top_p=0.9, temperature=1.0, random_seed=5)
    assert torch.equal(a, b)


def test_from_dir_loads_a_checkpoint_folder(tmp_path):
    folder = write_tiny_text_checkpoint(tmp_path / "tiny")
    runner = ModelRunner.from_dir(folder, kv_config="fp16", device="cpu", kv_memory_bytes=16 << 20)
    try:
        ids = runner.tokenizer("Hello", return_tensors="pt")["input_ids"][0]
        out = runner.generate([ids], max_new_tokens=4, end_id=runner.tokenizer.eos_token_id,
                              output_sequence_lengths=True, return_dict=True)
        model = runner.llm.executor.model
        ref = ReferenceGenerator(model, None, runner.llm.model_config, get_preset("fp16"),
                                 stop_token_ids={runner.tokenizer.eos_token_id}).generate_ids(ids.tolist(), 4)
        gen = [t for t in ref.token_ids if t != runner.tokenizer.eos_token_id]
        n = len(ids) + len(gen)
        assert int(out["sequence_lengths"][0, 0]) == n
        assert out["output_ids"][0, 0, :n].tolist() == ids.tolist() + gen
        assert runner.vocab_size == 49152 and runner.num_layers == 2 and runner.max_sequence_length == 2048
    finally:
        runner.shutdown()


def test_from_dir_reads_an_engine_dir_written_by_build(tmp_path):
    """An engine dir (config.json with the diffkv section + model/): its preset, limits and model are used."""
    import json

    engine, config = _tiny_engine_config(tmp_path)
    (engine / "config.json").write_text(json.dumps(config))
    runner = ModelRunner.from_dir(engine, device="cpu", kv_memory_bytes=16 << 20)
    try:
        assert runner.llm.kv_config == get_preset("k8v4")
        assert runner.max_batch_size == 3 and runner.max_sequence_length == 96
        assert runner.llm.executor.max_batch_size == 3
        assert runner.dtype == torch.float32  # the engine's float16 is for the GPU; the CPU runs float32
        prompt = torch.tensor([1, 2, 3, 4])
        out = runner.generate([prompt], max_new_tokens=5, pad_id=PAD)
        ref = ReferenceGenerator(runner.llm.executor.model, None, runner.llm.model_config,
                                 get_preset("k8v4")).generate_ids([1, 2, 3, 4], 5)
        assert out[0, 0].tolist() == [1, 2, 3, 4] + ref.token_ids
        with pytest.raises(ValueError, match=r"95 tokens \+ max_new_tokens 5 exceeds max_seq_len 96"):
            runner.generate([torch.ones(95, dtype=torch.int32)], max_new_tokens=5)
    finally:
        runner.shutdown()


def test_numpy_rows_and_ids_are_accepted_like_lists(setup):
    import numpy as np

    runner, prompts, generated = setup
    rows = [np.asarray(p.tolist(), dtype=np.int64) for p in prompts[:2]]
    mixed = [rows[0], [np.int32(t) for t in prompts[1].tolist()]]
    want = runner.generate(prompts[:2], max_new_tokens=MAX_NEW, pad_id=PAD)
    assert torch.equal(runner.generate(rows, max_new_tokens=MAX_NEW, pad_id=PAD), want)
    assert torch.equal(runner.generate(mixed, max_new_tokens=MAX_NEW, pad_id=PAD), want)
    with pytest.raises(ValueError, match="integer array"):
        runner.generate([np.asarray([1.0, 2.0])], max_new_tokens=2)


@pytest.mark.parametrize("kwargs, field", [
    (dict(top_p=1.5), "top_p"), (dict(top_p=-1.0), "top_p"), (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(pad_id=-5), "pad_id"), (dict(end_id=-2), "end_id"),
])
def test_bad_values_are_refused_even_when_decoding_is_greedy(setup, kwargs, field):
    """top_k=1 (the default) decodes greedily, but a bad value given beside it is still an error, before any run."""
    runner, prompts, _ = setup
    with pytest.raises(ValueError, match=field):
        runner.generate(prompts[:1], max_new_tokens=2, **kwargs)


def test_end_id_minus_one_runs_to_max_new_tokens(setup):
    """TensorRT-LLM's end_id=-1: no end token; every row gets exactly max_new_tokens."""
    runner, prompts, _ = setup
    out = runner.generate(prompts[:2], max_new_tokens=5, end_id=-1, pad_id=0, output_sequence_lengths=True,
                          return_dict=True)
    assert out["sequence_lengths"][:, 0].tolist() == [len(p) + 5 for p in prompts[:2]]


@pytest.mark.parametrize("edit, key", [
    (lambda c: c["pretrained_config"].update(architecture="GPT2LMHeadModel"), "architecture"),
    (lambda c: c["pretrained_config"].update(num_hidden_layers=7), "num_hidden_layers"),
    (lambda c: c["pretrained_config"].update(num_key_value_heads=5), "num_key_value_heads"),
    (lambda c: c["pretrained_config"].update(dtype="int3"), "dtype"),
    (lambda c: c["diffkv"]["kv_config"].update(head_dim=128), "head_dim"),
    (lambda c: c["build_config"].update(max_seq_len=10 ** 12), "max_seq_len"),
])
def test_an_engine_dir_that_disagrees_with_its_model_is_refused(tmp_path, edit, key):
    import json

    engine, config = _tiny_engine_config(tmp_path)
    edit(config)
    (engine / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=key):
        ModelRunner.from_dir(engine, device="cpu", kv_memory_bytes=16 << 20)


def _tiny_engine_config(tmp_path):
    """A tiny checkpoint in ``tmp_path/engine/model`` and the engine config.json dict ``build`` would write for it
    (k8v4, float16, 3 requests, 96 tokens); returns ``(engine_dir, config)``."""
    from trtllm_diffkv.export.engine_dir import engine_config
    from trtllm_diffkv.export.fields import EngineShape
    from trtllm_diffkv.model.loader import load_model

    engine = tmp_path / "engine"
    write_tiny_text_checkpoint(engine / "model")
    _, _, mc = load_model(engine / "model")
    shape = EngineShape(mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim, get_preset("k8v4"),
                        dtype="float16", max_batch_size=3, max_seq_len=96)
    return engine, engine_config(mc, shape, onnx_file=None, engine_file=None, targets=[],
                                 tensorrt_note="not built here")


def test_penalties_and_log_probs_follow_the_reference_logits(setup):
    """presence / frequency penalties and output_log_probs / output_cum_log_probs (TensorRT-LLM's generate
    arguments): each greedy token is the argmax of the reference logits minus OpenAI's penalties over the tokens
    generated before it, and its log-probability is log_softmax of those penalized logits."""
    from test_llm_logprobs import TOL, reference_logits

    runner, prompts, _ = setup
    out = runner.generate(prompts, max_new_tokens=MAX_NEW, pad_id=PAD, presence_penalty=0.5, frequency_penalty=0.7,
                          output_log_probs=True, output_cum_log_probs=True, output_sequence_lengths=True,
                          return_dict=True)
    assert out["log_probs"].shape == (4, 1, MAX_NEW) and out["cum_log_probs"].shape == (4, 1)
    model = runner.llm.executor.model
    for b, prompt in enumerate(prompts):
        n = int(out["sequence_lengths"][b, 0]) - len(prompt)
        tokens = out["output_ids"][b, 0, len(prompt):len(prompt) + n].tolist()
        logits = reference_logits(model, get_preset("default"), prompt.tolist(), tokens)
        for i, token in enumerate(tokens):
            counts = torch.bincount(torch.tensor(tokens[:i], dtype=torch.long), minlength=logits.shape[1]).float()
            row = torch.log_softmax(logits[i] - 0.7 * counts - 0.5 * (counts > 0).float(), dim=-1)
            assert float(row[token]) >= float(row.max()) - TOL  # greedy over the penalized logits
            assert float(out["log_probs"][b, 0, i]) == pytest.approx(float(row[token]), abs=TOL)
        assert torch.all(out["log_probs"][b, 0, n:] == 0)
        assert float(out["cum_log_probs"][b, 0]) == pytest.approx(float(out["log_probs"][b, 0].sum()), abs=1e-4)
    with pytest.raises(ValueError, match="need return_dict=True"):
        runner.generate(prompts, max_new_tokens=2, output_log_probs=True)
    with pytest.raises(ValueError, match="presence_penalty"):
        runner.generate(prompts, max_new_tokens=2, presence_penalty=float("nan"))
