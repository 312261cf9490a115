"""The key/value rotation option (``DiffKVConfig.key_rotation="hadamard"``, ``model/rotation.py``).

Checked against independent computations: the unrotated model's q/k/v times the rotation
(q.k and the layer output unchanged), dense float64 attention over the rotated q/k
(``tests/oracle``), the prompt scores of the unrotated cache (rotation leaves attention
probabilities unchanged), and the unrotated model's outputs through every path (reference
generator, paged cache, executor) under the ``fp16`` preset.
"""
import math

import pytest
import torch

from conftest import Recorder, peaked_tiny_llama, random_llama
from oracle import attention as dense
from oracle.quant import quantize_row
from trtllm_diffkv.engine_config import EngineConfig
from trtllm_diffkv.evaluation.accuracy import teacher_forced_logits
from trtllm_diffkv.cache import DiffKVReferenceCache
from trtllm_diffkv.config import DiffKVConfig, TierConfig, get_preset
from trtllm_diffkv.generation.reference import ReferenceGenerator
from trtllm_diffkv.model.rotation import hadamard_matrix, key_rotation_matrices, model_for_kv_config, rotate_model
from trtllm_diffkv.generation.static_batch import PagedGenerator
from trtllm_diffkv.runtime.executor import Executor
from trtllm_diffkv.runtime.sampling import SamplingParams

ROT = dict(key_rotation="hadamard")


@pytest.fixture(scope="module")
def model():
    return peaked_tiny_llama()


def _prompt(n, seed=0):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_rotations_are_seeded_orthogonal_hadamards():
    h = hadamard_matrix(8)
    assert torch.equal(h @ h.T, 8 * torch.eye(8)) and set(h.unique().tolist()) == {-1.0, 1.0}
    r = key_rotation_matrices(2, 3, 64, seed=5)
    eye = torch.eye(64).expand(2, 3, 64, 64)
    torch.testing.assert_close(r @ r.transpose(-1, -2), eye, atol=1e-6, rtol=0)
    assert torch.equal(r, key_rotation_matrices(2, 3, 64, seed=5))  # deterministic
    assert not torch.equal(r[0, 0], r[0, 1]) and not torch.equal(r[0, 0], r[1, 0])  # per (layer, KV head)
    assert not torch.equal(r, key_rotation_matrices(2, 3, 64, seed=6))
    # Each column is a Hadamard column with signs flipped per row: |entries| = 1/sqrt(64).
    torch.testing.assert_close(r.abs(), torch.full_like(r, 1 / 8), atol=1e-7, rtol=0)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_non_power_of_two_head_dims_get_exact_hadamard_rotations(head_dim):
    """80 and 96 (Paley's construction): entries +-1/sqrt(head_dim), orthogonal to fp32 rounding, seeded."""
    h = hadamard_matrix(head_dim)
    assert torch.equal(h @ h.T, head_dim * torch.eye(head_dim)) and set(h.unique().tolist()) == {-1.0, 1.0}
    DiffKVConfig(**ROT).validate_for_model(head_dim, 8, 2)  # no refusal
    r = key_rotation_matrices(2, 2, head_dim, seed=3)
    eye = torch.eye(head_dim).expand(2, 2, head_dim, head_dim)
    torch.testing.assert_close(r @ r.transpose(-1, -2), eye, atol=1e-6, rtol=0)
    torch.testing.assert_close(r.abs(), torch.full_like(r, head_dim ** -0.5), atol=1e-7, rtol=0)
    assert torch.equal(r, key_rotation_matrices(2, 2, head_dim, seed=3)) and not torch.equal(r[0, 0], r[0, 1])


def test_head_dims_without_a_rotation_are_refused_by_name():
    with pytest.raises(ValueError, match="head_dim=72"):  # not a supported head_dim: the config names it
        DiffKVConfig(**ROT).validate_for_model(72, 8, 2)
    with pytest.raises(ValueError, match="head_dim=100: no Hadamard"):
        hadamard_matrix(100)


def test_rotations_of_a_rank_are_the_global_heads_rows():
    full = key_rotation_matrices(2, 4, 64, seed=7)
    assert torch.equal(key_rotation_matrices(2, 2, 64, seed=7, first_kv_head=2), full[:, 2:])


def test_fp16_at_head_dim_80_with_rotation_equals_without():
    """The default (rotated) runs at head_dim 80: under ``fp16`` rotated attention equals unrotated."""
    model = random_llama(4, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=80, hidden_size=96,
                         intermediate_size=128, vocab_size=128).to(torch.float16)
    fp16 = get_preset("fp16")
    prompt, forced = [t % 128 for t in _prompt(24, 7)], [t % 128 for t in _prompt(6, 8)]
    want = teacher_forced_logits(ReferenceGenerator(model, None, model.config, fp16), prompt, forced)
    got = teacher_forced_logits(ReferenceGenerator(model, None, model.config, fp16.replace(**ROT)), prompt, forced)
    assert model_for_kv_config(model, fp16.replace(**ROT)).model.layers[0].self_attn.key_rotation.shape == (2, 80, 80)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)
    assert _executor_tokens(model, get_preset("diffkv"), prompt, 4)  # the tiered preset runs there


def test_backend_sees_rotated_q_k_v_and_the_output_is_unchanged():
    model = random_llama(3, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=128,
                         intermediate_size=256, vocab_size=128, qkv_bias=True, architecture="Qwen2ForCausalLM")
    with torch.no_grad():  # a non-zero v bias, so the bias fold is exercised
        for layer in model.model.layers:
            layer.self_attn.v_proj.bias.normal_(0, 0.1)
    rotated = rotate_model(model, seed=1)
    r = key_rotation_matrices(2, 2, 64, seed=1)
    ids, pos = torch.tensor(_prompt(9, 1)) % 128, torch.arange(9)
    plain, turned = Recorder(), Recorder()
    with torch.inference_mode():
        want = model(ids, pos, plain)
        got = rotated(ids, pos, turned)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for layer in range(2):
        (q, k, v), (qr, kr, vr) = plain.seen[layer], turned.seen[layer]
        rq = r[layer].repeat_interleave(2, 0)  # query head h reads KV head h // 2
        torch.testing.assert_close(kr, torch.einsum("nhd,hde->nhe", k, r[layer]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(vr, torch.einsum("nhd,hde->nhe", v, r[layer]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(qr, torch.einsum("nhd,hde->nhe", q, rq), atol=1e-4, rtol=1e-4)
    assert model.model.layers[0].self_attn.key_rotation is None  # the source model is untouched
    shared = (rotated.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
    assert shared[0].data_ptr() == shared[1].data_ptr()  # only v_proj / o_proj are new tensors
    half = rotated.to(torch.float16)
    assert half.model.layers[0].self_attn.key_rotation.dtype == torch.float32


def test_fp16_preset_with_rotation_equals_without(model):
    """Reference generator, paged cache and executor: rotation changes nothing beyond fp32 rounding."""
    fp16 = get_preset("fp16")
    prompt, forced = _prompt(40, 2), _prompt(8, 3)
    want = teacher_forced_logits(ReferenceGenerator(model, None, model.config, fp16), prompt, forced)
    got = teacher_forced_logits(ReferenceGenerator(model, None, model.config, fp16.replace(**ROT)), prompt, forced)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    paged = PagedGenerator(model, None, model.config, fp16.replace(**ROT), num_pages=64)
    assert paged.model is not model and paged.model.model.layers[0].self_attn.key_rotation is not None
    plain = PagedGenerator(model, None, model.config, fp16, num_pages=64).generate_ids(prompt, 6).token_ids
    assert paged.generate_ids(prompt, 6).token_ids == plain
    assert _executor_tokens(model, fp16, prompt, 6) == _executor_tokens(model, fp16.replace(**ROT), prompt, 6) == plain


def _executor_tokens(model, cfg, prompt, n):
    ex = Executor(model, model.config, cfg, EngineConfig(max_batch_size=2, max_seq_len=64, kv_memory_bytes=1 << 22,
                                                         high_tokens_per_page=4, use_triton=False))
    assert (ex.model.model.layers[0].self_attn.key_rotation is not None) == (cfg.key_rotation == "hadamard")
    ex.add_request(prompt, SamplingParams.greedy_params(n))
    tokens = []
    while ex.has_unfinished():
        tokens += [t for u in ex.step() for t in u.new_token_ids]
    return tokens


def test_tier_scores_are_unchanged_by_rotation(model):
    """Prompt scores are attention probabilities: the rotated cache stores the unrotated cache's."""
    cfg = DiffKVConfig(recent_window_tokens=4, prompt_score_window_tokens=16, alpha_high=1.0, alpha_low=0.3)
    prompt, mc = _prompt(48, 4), model.config
    caches = []
    for c in (cfg, cfg.replace(**ROT)):
        cache = DiffKVReferenceCache(c, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim, 64)
        with torch.inference_mode():
            model_for_kv_config(model, c)(torch.tensor(prompt), torch.arange(48), cache)
        caches.append(cache)
    torch.testing.assert_close(caches[1].scores, caches[0].scores, atol=1e-5, rtol=1e-4)
    assert torch.equal(caches[1].tiers, caches[0].tiers)
    assert {1, 2, 0} <= set(caches[0].tiers[:, :, :48].unique().tolist())  # every tier occurs


def test_rotated_k8v4_attention_equals_dense_reference_of_rotated_q_k(model):
    """A K8V4 decode step over rotated q/k/v equals float64 attention over the oracle's quantization of them."""
    k8v4 = get_preset("k8v4").replace(**ROT)
    rotated, mc = model_for_kv_config(model, k8v4), model.config
    rec = Recorder()
    prompt = _prompt(21, 5)
    with torch.inference_mode():
        rotated(torch.tensor(prompt), torch.arange(21), rec)
    q, k, v = rec.seen[0]  # layer 0's rotated q [21, 8, 64], k/v [21, 2, 64]
    cache = DiffKVReferenceCache(k8v4, 1, mc.num_heads, mc.num_kv_heads, mc.head_dim, 21)
    cache.forward(0, q[:20], k[:20], v[:20])
    out = cache.forward(0, q[20:], k[20:], v[20:])[0]
    offset = k[:20].transpose(0, 1).mean(1).to(torch.float16).float()  # center_keys: fp16 prompt-key mean
    keys = torch.zeros(mc.num_kv_heads, 21, mc.head_dim)
    values = torch.zeros_like(keys)
    for h in range(mc.num_kv_heads):
        for t in range(21):
            keys[h, t] = torch.from_numpy(quantize_row((k[t, h] - offset[h]).numpy(), 8, 1)[3]) + offset[h]
            values[h, t] = torch.from_numpy(quantize_row(v[t, h].numpy(), 4, 2)[3])
    want, _ = dense.decode_attention(q[20], keys, values, torch.ones(mc.num_kv_heads, 21, dtype=torch.bool))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    # And the rotated keys really differ from the unrotated ones (the test would pass on a no-op otherwise).
    plain = Recorder()
    with torch.inference_mode():
        model(torch.tensor(prompt), torch.arange(21), plain)
    assert (plain.seen[0][1] - k).abs().max() > 0.1
    assert math.isclose(float((q[20, 0] * k[3, 0]).sum()), float((plain.seen[0][0][20, 0] * plain.seen[0][1][3, 0]).sum()),
                        rel_tol=1e-4, abs_tol=1e-4)


def test_k8v2_and_rotated_k4v2_low_tiers_run_the_paged_path(model):
    """The page format and kernels take K8V2 in the low tier; paged == executor == reference tokens."""
    base = DiffKVConfig(recent_window_tokens=4, prompt_score_window_tokens=8, alpha_high=1.0, alpha_low=0.3)
    for cfg in (base.replace(low=TierConfig(8, 2)), base.replace(**ROT)):
        prompt = _prompt(30, 6)
        ref = ReferenceGenerator(model, None, model.config, cfg).generate_ids(prompt, 8)
        got = PagedGenerator(model, None, model.config, cfg, num_pages=200, high_tokens_per_page=4).generate_ids(prompt, 8)
        assert got.error is None and got.token_ids == ref.token_ids == _executor_tokens(model, cfg, prompt, 8)
        assert 0 < got.low_fraction and got.kv_memory_fraction == pytest.approx(ref.kv_memory_fraction, abs=0.02)


def test_onnx_graphs_refuse_pooling_by_name(model):
    """Score pooling is not in the graphs yet (refused by name); rotation is (tests/export/test_onnx_export.py)."""
    pytest.importorskip("onnx")
    from trtllm_diffkv.export.onnx_export import export_onnx

    cfg = get_preset("diffkv").replace(score_pool_tokens=5)
    for graph, phase in (("composite", None), ("per-op", "decode")):
        with pytest.raises(ValueError, match="score_pool_tokens=5"):
            export_onnx(model, cfg, max_positions=32, graph=graph, phase=phase)


def test_in_place_rotation_equals_the_copy_and_keeps_one_set_of_weights():
    """``rotate_model_`` (the product's own model) computes what ``rotate_model`` does, without a second copy."""
    from trtllm_diffkv.model.rotation import rotate_model_

    src = random_llama(5, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=128,
                       intermediate_size=256, vocab_size=128, qkv_bias=True, architecture="Qwen2ForCausalLM")
    copy = rotate_model(src, seed=2)
    ids, pos = torch.tensor(_prompt(9, 9)) % 128, torch.arange(9)
    with torch.inference_mode():
        want = copy(ids, pos, Recorder())
    attn = src.model.layers[0].self_attn
    ptrs = (attn.v_proj.weight.data_ptr(), attn.o_proj.weight.data_ptr(), attn._qkv_weight.data_ptr())
    assert rotate_model_(src, seed=2) is src
    assert (attn.v_proj.weight.data_ptr(), attn.o_proj.weight.data_ptr(), attn._qkv_weight.data_ptr()) == ptrs
    torch.testing.assert_close(attn._qkv_weight[-128:], attn.v_proj.weight, rtol=0, atol=0)  # fused rows rotated too
    with torch.inference_mode():
        torch.testing.assert_close(src(ids, pos, Recorder()), want, rtol=0, atol=1e-6)
    assert model_for_kv_config(src, get_preset("diffkv").replace(rotation_seed=2)) is src  # rotated already
    with pytest.raises(ValueError, match="rotated with rotation_seed=2; the kv_config asks for rotation_seed=0"):
        model_for_kv_config(src, get_preset("diffkv"))
    with pytest.raises(ValueError, match="key_rotation='none' needs the unrotated model"):
        model_for_kv_config(src, get_preset("default-unrotated"))


def test_llm_loading_its_model_keeps_one_copy_of_the_weights(tmp_path):
    """LLM(path) with the (rotated) default: one model object alive, the executor's, rotated in place."""
    import gc

    from trtllm_diffkv import LLM
    from trtllm_diffkv.model import LlamaForCausalLM
    from support.tensor_parallel import write_checkpoint

    folder = write_checkpoint(tmp_path / "m", peaked_tiny_llama())
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, LlamaForCausalLM)}  # other tests' models
    with LLM(str(folder), "diffkv", num_threads=1, kv_memory_bytes=1 << 22, max_batch_size=2) as llm:
        gc.collect()
        alive = [o for o in gc.get_objects() if isinstance(o, LlamaForCausalLM) and id(o) not in before]
        attn = llm.executor.model.model.layers[0].self_attn
        assert alive == [llm.executor.model] and attn.key_rotation is not None
        assert attn._qkv_weight is not None  # rotated in place (a copy drops the shared fused q/k/v buffer)
        got = llm.generate(_prompt(12, 10), SamplingParams.greedy_params(5)).outputs[0].token_ids
    ref = ReferenceGenerator(peaked_tiny_llama(), None, peaked_tiny_llama().config, get_preset("diffkv"))
    assert got == ref.generate_ids(_prompt(12, 10), 5).token_ids
