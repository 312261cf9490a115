"""The TensorRT-LLM PyTorch-backend adapter (``trtllm_diffkv.trtllm_backend``) driven through the stand-in.

TensorRT-LLM cannot be installed here: ``tests/trtllm_backend/trtllm_standin.py`` reproduces, from the facts of
``tests/trtllm_backend/trtllm_manifest.py``, its base classes, the compression factory and its caller (estimation
build, teardown, final build), the attention-backend lookup (bound by ``model_engine`` at import), the warm-up and
PyExecutor's call order. The reference for every generated token is our own ``LLM`` (the in-flight executor over the
same DiffKV cache), run on the same prompts.
"""
from __future__ import annotations

import json
import sys
import types

import pytest
import torch

pytest.importorskip("pydantic", reason="TensorRT-LLM's config classes (and the stand-in's) are pydantic models")
import trtllm_standin as sti  # noqa: E402
from conftest import Recorder, peaked_tiny_llama  # noqa: E402
from trtllm_diffkv import LLM, SamplingParams  # noqa: E402

KV_BYTES = 16 << 20
hf_dict = sti.pretrained_config_of  # what TensorRT-LLM's factory reads as the pretrained config


@pytest.fixture(scope="module")
def model():
    return peaked_tiny_llama()


@pytest.fixture()
def trt():
    """The stand-in installed, the adapter imported against it and registered; yields the adapter package."""
    with sti.adapter_installed() as adapter:
        yield adapter


def prompts_of(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def llm_tokens(model, prompts, max_new_tokens, preset) -> list[list[int]]:
    with LLM.from_model(model, None, model.config, preset, kv_memory_bytes=KV_BYTES, max_batch_size=4) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_new_tokens, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


SERVING = dict(attn_backend="DIFFKV", disable_overlap_scheduler=True, cuda_graph_config=None)
"""The LLM settings a real install needs with DiffKV (examples/trtllm_llm_api.py); ``kv_cache_config`` too."""


def serving_args(config, **changes):
    """``TorchLlmArgs`` with :data:`SERVING`, V2 and no block reuse, ``config`` as the compression config."""
    fields = {**SERVING, "kv_cache_config": sti.kv_cache_config(enable_block_reuse=False, use_kv_cache_manager_v2=True),
              "kv_cache_compression_config": config, **changes}
    return sti.llm_args(**fields)


def executor(adapter, model, *, preset="llama3-8b", kv_memory_bytes=KV_BYTES, max_batch_size=3, hf=None,
             max_seq_len=512, **args):
    config = adapter.DiffKVCompressionConfig(preset=preset, kv_memory_bytes=kv_memory_bytes)
    return sti.create_executor(model, serving_args(config, **args), hf or hf_dict(model.config),
                               max_batch_size=max_batch_size, max_seq_len=max_seq_len, max_num_tokens=512)


def assert_all_pages_back(ex) -> None:
    rm = ex.compression_manager.rm
    assert rm.free_pages() == rm.get_max_resource_count()
    assert rm.num_free_slots == rm.max_batch_size
    assert ex.kv_cache_manager.blocks == {}
    assert ex.compression_manager._requests == {}


# ---------------------------------------------------------------- generation through the stand-in loop
def test_greedy_tokens_equal_llm_and_pages_return(trt, model):
    prompts = prompts_of([1, 17, 40, 70, 100])
    ex = executor(trt, model)  # 3 slots: two requests wait, then join mid-flight
    ids = [ex.add_request(p, 10) for p in prompts]
    done = ex.run_until_done()
    assert ex.errors == {}
    assert [done[i].output_token_ids for i in ids] == llm_tokens(model, prompts, 10, "llama3-8b")
    assert_all_pages_back(ex)


def test_hook_order_per_iteration(trt, model):
    ex = executor(trt, model)
    manager = ex.compression_manager
    for hook in ("on_request_init", "on_context_step_end", "on_generation_step_begin", "on_generation_step_end",
                 "on_request_finish"):
        real = getattr(manager, hook)

        def spy(arg, _real=real, _hook=hook):
            ids = [r.py_request_id for r in (arg if isinstance(arg, list) else arg.all_requests())] \
                if isinstance(arg, (list, sti.ScheduledRequests)) else arg.py_request_id
            ex.calls.append((_hook, ids))
            return _real(arg)

        setattr(manager, hook, spy)
    rid = ex.add_request(prompts_of([20])[0], 3)
    ex.run_until_done()
    decode = [("prepare_resources", [rid]), ("on_generation_step_begin", [rid]), ("forward", [rid]),
              ("update_resources", [rid]), ("on_generation_step_end", [rid])]
    last = [("prepare_resources", [rid]), ("on_generation_step_begin", [rid]), ("forward", [rid]),
            ("free_resources", rid), ("on_request_finish", rid), ("update_resources", [rid]),
            ("on_generation_step_end", [rid])]  # PyExecutor frees a finished request before update_resources
    assert ex.calls == [
        ("prepare_resources", [rid]), ("on_request_init", rid), ("on_generation_step_begin", [rid]),
        ("forward", [rid]), ("update_resources", [rid]), ("on_context_step_end", [rid]),
        ("on_generation_step_end", [rid]), *decode, *last]


def test_prompt_is_compacted_by_the_context_step(trt, model):
    ex = executor(trt, model)
    n = 100
    rid = ex.add_request(prompts_of([n])[0], 4)
    ex.step()  # the prefill: scored, tiered and pruned inside the layers, committed by the last one
    stats = ex.compression_manager.request_stats(rid)
    rows = model.config.num_layers * model.config.num_kv_heads
    assert stats.high_tokens + stats.low_tokens + stats.pruned_tokens == rows * n
    assert stats.low_tokens + stats.pruned_tokens > 0  # tiered: llama3-8b thresholds on a peaked model
    ex.run_until_done()
    assert_all_pages_back(ex)


@pytest.mark.parametrize("max_tokens", [(3, 8), (1, 8)])
def test_a_request_finishing_before_update_resources_leaves_the_others_decoding(trt, model, max_tokens):
    """Breaker finding: PyExecutor answers and frees finished requests before ``update_resources``; the adapter
    took a step still being tracked for a failed forward and discarded it, so the request left running kept a
    stale length and failed its next step, and one finishing at its context step (``max_tokens=1``) raised "reached
    DiffKV without on_request_init" from ``update_resources``. The finished request is now left out of the step's
    bookkeeping."""
    prompts = prompts_of([20, 30])
    ex = executor(trt, model)
    ids = [ex.add_request(p, n) for p, n in zip(prompts, max_tokens)]
    done = ex.run_until_done()
    assert not ex.errors, ex.errors
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        assert done[ids[i]].finish_reason == "length"
        assert done[ids[i]].output_token_ids == llm_tokens(model, [p], n, "llama3-8b")[0]
    assert_all_pages_back(ex)


def test_a_freed_slots_non_finite_flag_never_reaches_its_next_request(trt):
    """Review finding: a request finishing at its context step (freed before ``update_resources``, which reads and
    clears the step's error flags) left its non-finite-K/V flag on the slot, and the next request there was failed
    as NaN/Inf. ``PagedDiffKVCache.release`` clears the slot's flag."""
    from conftest import tiny_llama

    poisoned, poison = tiny_llama(), 7
    with torch.no_grad():
        poisoned.model.embed_tokens.weight[poison] = float("nan")
    clean = [p for p in prompts_of([12], seed=9) if poison not in p]
    ex = executor(trt, poisoned)
    ex.add_request([1, 2, poison], 1)  # alone; its one token comes from the context step
    ex.run_until_done()
    good = ex.add_request(clean[0], 3)
    ex.run_until_done()
    assert good not in ex.compression_manager.request_errors, ex.compression_manager.request_errors
    assert_all_pages_back(ex)


def test_a_request_finishing_before_update_resources_keeps_its_non_finite_error(trt):
    """A request whose one step (its context step, ``max_tokens=1``) stored a NaN key is answered and freed before
    ``update_resources`` (PyExecutor's order); the release clears the slot's flag, so the adapter reads it at the
    finish: the error is reported, not lost."""
    from conftest import tiny_llama

    poisoned, poison = tiny_llama(), 7
    with torch.no_grad():
        poisoned.model.embed_tokens.weight[poison] = float("nan")
    ex = executor(trt, poisoned)
    bad = ex.add_request([1, 2, poison], 1)
    clean = ex.add_request([p for p in prompts_of([12], seed=9) if poison not in p][0], 1)
    ex.run_until_done()
    errors = ex.compression_manager.request_errors
    assert list(errors) == [bad] and "NaN/Inf" in errors[bad], errors
    assert_all_pages_back(ex)
    assert clean not in errors


def test_a_failed_update_resources_before_ours_leaves_no_step_behind(trt, model):
    """Review finding: when another manager's ``update_resources`` raised before ours, the step's last request was
    freed by ``_handle_errors`` and an empty batch stayed planned: the next iteration was refused as an overlap
    scheduler's. The adapter forgets a step whose every request is freed."""
    ex = executor(trt, model)
    real, calls = ex.kv_cache_manager.update_resources, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("planted: the KV cache manager's update failed")
        return real(*args, **kwargs)

    ex.kv_cache_manager.update_resources = fails_once
    first = ex.add_request(prompts_of([20])[0], 4)
    ex.run_until_done()
    assert "planted" in ex.errors[first]
    prompt = prompts_of([25], seed=3)[0]
    second = ex.add_request(prompt, 4)
    done = ex.run_until_done()
    assert second not in ex.errors, ex.errors[second]
    assert done[second].output_token_ids == llm_tokens(model, [prompt], 4, "llama3-8b")[0]
    assert_all_pages_back(ex)


def test_abort_while_waiting_after_prefill_and_mid_decode(trt, model):
    prompts = prompts_of([30, 45, 33, 64], seed=1)
    ex = executor(trt, model, max_batch_size=3)
    ids = [ex.add_request(p, 12) for p in prompts]
    ex.cancel(ids[3])  # waiting: never reached the manager
    ex.step()  # prefill of 0, 1, 2
    ex.cancel(ids[1])  # right after its prefill
    ex.step()
    ex.step()
    ex.cancel(ids[2])  # mid decode
    done = ex.run_until_done()
    assert done[ids[1]].finish_reason == done[ids[2]].finish_reason == "cancelled" and ids[3] not in done
    assert done[ids[0]].output_token_ids == llm_tokens(model, prompts[:1], 12, "llama3-8b")[0]
    assert ex.errors == {}
    assert_all_pages_back(ex)


def test_non_finite_keys_are_reported_per_request(trt):
    from conftest import tiny_llama

    poisoned, poison = tiny_llama(), 7
    with torch.no_grad():
        poisoned.model.embed_tokens.weight[poison] = float("nan")
    clean = [p for p in prompts_of([12, 30], seed=9) if poison not in p]
    ex = executor(trt, poisoned)
    ids = [ex.add_request(p, 5) for p in clean]
    bad = ex.add_request(clean[0][:5] + [poison], 5)
    done = ex.run_until_done()
    errors = ex.compression_manager.request_errors
    assert list(errors) == [bad] and "NaN/Inf" in errors[bad]
    assert [done[i].output_token_ids for i in ids] == llm_tokens(poisoned, clean, 5, "llama3-8b")
    assert_all_pages_back(ex)


def test_core_never_imports_the_adapter():
    import subprocess

    code = ("import sys, trtllm_diffkv, trtllm_diffkv.runtime.executor, trtllm_diffkv.llmapi.llm, trtllm_diffkv.paged.cache; "
            "bad = [m for m in sys.modules if m.startswith(('trtllm_diffkv.trtllm_backend', 'trtllm_diffkv.export', "
            "'tensorrt_llm'))]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=__import__("pathlib").Path(__file__).parents[2])
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


# ---------------------------------------------------------------- admission refusals
V1 = {"kv_cache_config": {"enable_block_reuse": False, "use_kv_cache_manager_v2": "auto"}}


@pytest.mark.parametrize("args, error, match", [
    # TensorRT-LLM's own compatibility check, run by the DiffKV factory branch, from the config's predicates
    ({"kv_cache_config": {"use_kv_cache_manager_v2": True}}, ValueError,
     "'diffkv' does not support KV-cache block reuse"),  # reuse is on by default
    ({"speculative_config": object()}, ValueError, "'diffkv' does not support speculative decoding"),
    # the settings DiffKV cannot serve, refused by name before any pool (their defaults are all wrong for DiffKV)
    ({"cuda_graph_config": {}}, ValueError, r"cuda_graph_config=None"),
    ({"disable_overlap_scheduler": False}, ValueError, "disable_overlap_scheduler=True"),
    ({"enable_chunked_prefill": True}, ValueError, "enable_chunked_prefill=False"),
    ({"kv_cache_config": {"enable_block_reuse": False, "use_kv_cache_manager_v2": False}}, ValueError,
     r"use_kv_cache_manager_v2=True"),
    (V1, TypeError, r"requires KVCacheManagerV2.*use_kv_cache_manager_v2=True"),  # "auto" picks V1: refused at bind
    ({"tensor_parallel_size": 2}, ValueError, r"tensor parallelism \(tp_size=2\)"),
    ({"pipeline_parallel_size": 2}, ValueError, r"pipeline parallelism \(pp_size=2\)"),
    ({"context_parallel_size": 2}, ValueError, r"context parallelism \(cp_size=2\)"),
    ({"enable_attention_dp": True}, ValueError, "attention data parallelism"),
])
def test_refused_at_admission(trt, model, args, error, match):
    if "kv_cache_config" in args:
        args = {**args, "kv_cache_config": sti.kv_cache_config(**args["kv_cache_config"])}
    with pytest.raises(error, match=match):
        executor(trt, model, **args)


def test_only_the_unsupported_parallel_size_is_refused(trt, model):
    """Each parallel size is checked on its own (a refusal for one size must not come from another)."""
    from trtllm_diffkv.trtllm_backend.manager import _check_mapping

    _check_mapping(sti.Mapping())
    for name in ("tp_size", "pp_size", "cp_size"):
        with pytest.raises(ValueError, match=rf"\({name}=4\)"):
            _check_mapping(sti.Mapping(**{name: 4}))


@pytest.mark.parametrize("changes, match", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "does not serve this model"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64}, "sliding-window"),
    # a Gemma 3 config parses (as a Gemma3Config), but not even one without sliding layers is served inside TensorRT-LLM
    ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
      "layer_types": None, "sliding_window_pattern": 1, "sliding_window": None}, "Gemma3ForCausalLM"),
])
def test_unsupported_models_refused(trt, model, changes, match):
    with pytest.raises(ValueError, match=match):
        executor(trt, model, hf=hf_dict(model.config, **changes))


def test_chunked_prefill_and_oversized_prompt_fail_with_clear_errors(trt, model):
    ex = executor(trt, model)
    ex.add_request(prompts_of([40])[0], 4, context_chunk_size=16)
    ex.run_until_done()
    assert "enable_chunked_prefill=False" in ex.errors[0]
    assert_all_pages_back(ex)
    # a pool that cannot hold one prefill of max_seq_len is refused when bound: a prompt TensorRT-LLM admits could
    # otherwise only fail every request of its iteration (a hook cannot fail one request alone)
    with pytest.raises(ValueError, match=r"cannot hold one prefill of max_seq_len=\d+ tokens"):
        executor(trt, model, kv_memory_bytes=256 << 10, preset="fp16")


def test_a_pool_that_exactly_fits_one_max_seq_len_prefill_is_accepted(trt, model):
    """The refusal is ``need > total``: the smallest budget DiffKV accepts holds exactly one prefill of
    ``max_seq_len`` tokens (a refusal at ``need == total`` would turn away a pool that serves every admitted
    prompt), and a page less is refused."""
    max_seq_len = 512
    kv = sti.KVCacheManagerV2(sti.kv_cache_config(enable_block_reuse=False), num_layers=3, num_kv_heads=2,
                              head_dim=64, tokens_per_block=32, max_seq_len=max_seq_len, max_batch_size=2,
                              mapping=sti.Mapping(), max_num_tokens=512)

    def bind(budget_bytes):
        config = trt.DiffKVCompressionConfig(preset="fp16", kv_memory_bytes=budget_bytes)
        manager = trt.DiffKVCompressionManager(config, pretrained_config=hf_dict(model.config))
        try:
            manager.bind_kv_cache_managers(kv)
        except ValueError as exc:
            assert "cannot hold one prefill" in str(exc)
            return None
        return manager.rm

    lo, hi = 1, 8 << 20  # refused, accepted
    assert bind(hi) is not None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if bind(mid) is not None else (mid, hi)
    rm = bind(hi)
    assert rm.get_max_resource_count() == rm.prefill_pages_needed(max_seq_len)  # exactly one prefill, accepted
    assert bind(lo) is None


ROTATED = [("default-rotated", 0), ("calibrated", 7)]


@pytest.mark.parametrize("source, seed", ROTATED, ids=[f"{s}-seed{n}" for s, n in ROTATED])
def test_rotation_inside_tensorrt_llm_equals_the_folded_model(trt, model, monkeypatch, tmp_path, source, seed):
    """Key rotation: TensorRT-LLM's (unrotated) model, the backend rotating q, k, v and the output itself, gives our
    ``LLM``'s tokens (the rotated copy with v_proj / o_proj folded); the cache receives ``k @ R`` with ``R`` the
    matrices of ``model/rotation.py`` for the config's ``rotation_seed`` (7 from a calibration file: a backend that
    dropped the seed would rotate with seed 0), not the model's keys."""
    from trtllm_diffkv.config import get_preset, save_kv_config_file
    from trtllm_diffkv.model.rotation import key_rotation_matrices
    from trtllm_diffkv.paged.cache import PagedDiffKVCache

    mc = model.config
    kv_config = get_preset("default-rotated").replace(rotation_seed=seed)
    if source == "calibrated":
        path = tmp_path / "rotated.json"
        save_kv_config_file(path, kv_config, (mc.num_heads, mc.num_kv_heads, mc.head_dim))
        config = trt.DiffKVCompressionConfig(calibration_path=str(path), kv_memory_bytes=KV_BYTES)
    else:
        config = trt.DiffKVCompressionConfig(preset=source, kv_memory_bytes=KV_BYTES)
    seen, forward = {}, PagedDiffKVCache.forward

    def spy(self, layer_idx, q, k, v):
        seen.setdefault(layer_idx, (q.clone(), k.clone(), v.clone()))
        return forward(self, layer_idx, q, k, v)

    prompts = prompts_of([9, 33, 60], seed=3)
    ex = sti.create_executor(model, serving_args(config), hf_dict(mc), max_batch_size=3, max_seq_len=512,
                             max_num_tokens=512)
    monkeypatch.setattr(PagedDiffKVCache, "forward", spy)
    ids = [ex.add_request(p, 8) for p in prompts]
    done = ex.run_until_done()
    monkeypatch.undo()
    assert ex.errors == {}
    assert [done[i].output_token_ids for i in ids] == llm_tokens(model, prompts, 8, kv_config)
    assert_all_pages_back(ex)
    plain = Recorder()
    with torch.inference_mode():
        model(torch.tensor(prompts[0]), torch.arange(len(prompts[0])), plain)
    q0, k0, _ = plain.seen[1]
    r = key_rotation_matrices(mc.num_layers, mc.num_kv_heads, mc.head_dim, seed)[1]
    q, k = seen[1][0][:len(prompts[0])], seen[1][1][:len(prompts[0])]
    assert (k - k0).abs().max() > 0.1
    torch.testing.assert_close(k, torch.einsum("nhd,hde->nhe", k0, r), rtol=1e-4, atol=1e-4)
    g = mc.num_heads // mc.num_kv_heads
    torch.testing.assert_close(q, torch.einsum("nhgd,hde->nhge", q0.view(len(prompts[0]), -1, g, q0.shape[-1]), r)
                               .reshape(q0.shape), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kwargs, match", [
    ({"mla_params": object()}, "MLA"), ({"q_scaling": 2.0}, "q_scaling"),
    ({"attention_chunk_size": 128}, "chunked"), ({"sparse_params": object()}, "sparse"),
    ({"quant_config": types.SimpleNamespace(kv_cache_quant_algo="FP8")}, "kv_cache_quant_algo"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8'"),
])
def test_attention_layers_diffkv_cannot_serve_are_refused(trt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        trt.DiffKVAttention(0, 8, 64, 2, **kwargs)


def test_forward_takes_tensorrt_llms_forward_args(trt, model):
    """``forward(q, k, v, metadata, forward_args=AttentionForwardArgs(...))``: the mask is read from
    ``forward_args.attention_mask``; legacy keywords are merged by TensorRT-LLM's own helper (an unknown one and both
    forms at once are its ValueErrors); fused QKV is refused."""
    interface = sti.module(sti.ATTN_INTERFACE)
    args_cls, mask = interface.AttentionForwardArgs, interface.PredefinedAttentionMask
    backend = trt.DiffKVAttention(0, 8, 64, 2)
    md = trt.DiffKVAttentionMetadata(max_num_requests=1, max_num_tokens=8)
    q, kv = torch.zeros(2, 8 * 64), torch.zeros(2, 2 * 64)
    for call, match in [
        (dict(forward_args=args_cls(attention_mask=mask.FULL)), "causal attention only"),
        (dict(attention_mask=mask.FULL), "causal attention only"),  # legacy keyword, merged
        (dict(forward_args=args_cls(is_fused_qkv=True)), "separate q, k, v"),
        (dict(not_a_field=1), "Unknown attention forward arguments"),
        (dict(forward_args=args_cls(), attention_mask=mask.CAUSAL), "not both"),
    ]:
        with pytest.raises(ValueError, match=match):
            backend.forward(q, kv, kv, md, **call)
    with pytest.raises(RuntimeError, match=r"prepare\(\) must run"):  # a causal mask passes the checks
        backend.forward(q, kv, kv, md, forward_args=args_cls(attention_mask=mask.CAUSAL))


def test_overlap_scheduler_refused(trt, model):
    ex = executor(trt, model)
    manager = ex.compression_manager
    request = sti.LlmRequest(7, [1, 2, 3], 4)
    batch = sti.ScheduledRequests([request], [])
    manager.prepare_resources(batch)
    with pytest.raises(RuntimeError, match="disable_overlap_scheduler"):
        manager.on_generation_step_begin(sti.ScheduledRequests([], [request]))
    manager.free_resources(request)
    assert ex.compression_manager.rm.free_pages() == ex.compression_manager.rm.get_max_resource_count()


def test_restarted_prefill_gives_back_the_old_pages(trt, model):
    ex = executor(trt, model)
    manager, rm = ex.compression_manager, ex.compression_manager.rm
    request = sti.LlmRequest(5, prompts_of([60])[0], 4)
    for _ in range(2):  # the second init of the same id: its prefill restarts from scratch
        batch = sti.ScheduledRequests([request], [])
        ex.resource_manager.prepare_resources(batch)
        ex.model_engine.forward(batch, ex.resource_manager)
        ex.resource_manager.update_resources(batch, ex.metadata, 2)
        held = rm.get_max_resource_count() - rm.free_pages()
    assert held == manager.request_stats(5).pool_pages  # only the second prefill's pages are held
    ex.resource_manager.free_resources(request)
    assert_all_pages_back(ex)


def test_config_fields_and_calibration_file(trt, model, tmp_path):
    from trtllm_diffkv.config import get_preset, load_kv_config_file, save_kv_config_file

    cfg = trt.DiffKVCompressionConfig()
    assert cfg.algorithm == "diffkv" and type(cfg).changes_physical_kv_length is True
    assert cfg.supports_block_reuse() is False and cfg.supports_speculative_decoding() is False
    assert cfg.to_kv_config() == get_preset("default")
    with pytest.raises(ValueError, match="not both"):
        trt.DiffKVCompressionConfig(preset="default", calibration_path="x.json")
    with pytest.raises(ValueError, match="unknown kv-config preset"):
        trt.DiffKVCompressionConfig(preset="nope")
    calibrated = get_preset("llama3-8b").replace(alpha_high=0.5, alpha_low=0.05, name="mine")
    path = tmp_path / "diffkv.json"
    mc = model.config
    save_kv_config_file(path, calibrated, (mc.num_heads, mc.num_kv_heads, mc.head_dim))  # what calibrate writes
    from_file = trt.DiffKVCompressionConfig(calibration_path=str(path), kv_memory_bytes=KV_BYTES)
    assert from_file.to_kv_config() == load_kv_config_file(path)
    ex = sti.create_executor(model, serving_args(from_file), hf_dict(mc), max_num_tokens=512)
    assert ex.compression_manager.kv_config == load_kv_config_file(path)
    assert (ex.compression_manager.kv_config.alpha_high, ex.compression_manager.kv_config.alpha_low) == (0.5, 0.05)
    save_kv_config_file(path, calibrated, (mc.num_heads, mc.num_kv_heads, 128))  # another model's shape
    with pytest.raises(ValueError, match="head_dim"):
        trt.DiffKVCompressionManager(from_file, pretrained_config=hf_dict(mc))
    missing = trt.DiffKVCompressionConfig(calibration_path=str(tmp_path / "absent.json"))
    with pytest.raises(FileNotFoundError, match="absent.json"):
        trt.DiffKVCompressionManager(missing, pretrained_config=hf_dict(mc))


# ---------------------------------------------------------------- estimation, warm-up, teardown, CUDA graphs
def test_estimation_and_warmup_run_outside_the_pool(trt, model, monkeypatch):
    """TensorRT-LLM builds the manager for its memory estimation (``estimating_kv_cache=True``): no DiffKV pool then
    (one pool is ever built: the final one), the estimation's dummy requests pass every hook and are served by
    dense attention, teardown calls ``shutdown()`` before the final build; the model engine's warm-up forwards
    (dummies that bypass the hooks) leave the final pool untouched, and the first real request is still exact."""
    from trtllm_diffkv.runtime import resource_manager as runtime_rm

    pools, init = [], runtime_rm.DiffKVResourceManager.__init__

    def counting(self, *args, **kwargs):
        pools.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(runtime_rm.DiffKVResourceManager, "__init__", counting)
    ex = executor(trt, model)
    monkeypatch.undo()
    estimating = ex.estimation_managers[sti.ResourceManagerType.KV_CACHE_COMPRESSION_MANAGER]
    factory_calls = [c for c in ex.creator.calls if c[0] == "factory"]
    assert [c[2] for c in factory_calls] == [True, False]  # estimating_kv_cache, then the final build
    assert ex.creator.calls.index(("shutdown", "compression")) < ex.creator.calls.index(factory_calls[1])
    assert estimating.estimating and estimating.rm is None and estimating._requests == {}
    assert not hasattr(ex.estimation_managers[sti.ResourceManagerType.KV_CACHE_MANAGER], "diffkv_compression_manager")
    assert pools == [1]
    assert ex.model_engine.warmup_forwards >= 1  # the autotuner forward (on by default)
    assert_all_pages_back(ex)
    prompt = prompts_of([30])[0]
    rid = ex.add_request(prompt, 5)
    assert ex.run_until_done()[rid].output_token_ids == llm_tokens(model, [prompt], 5, "llama3-8b")[0]
    assert ex.errors == {}
    assert_all_pages_back(ex)


def test_an_unplanned_forward_of_a_known_request_is_refused(trt, model):
    """Only requests DiffKV never saw may run outside a plan (warm-up dummies); a registered request without its
    step planned is an error, not a silent dense forward."""
    ex = executor(trt, model)
    manager = ex.compression_manager
    request = sti.LlmRequest(3, prompts_of([12])[0], 2)
    manager.on_request_init(request)
    with pytest.raises(RuntimeError, match=r"no DiffKV step is planned for requests \[3\]"):
        ex.model_engine.forward(sti.ScheduledRequests([request], []), ex.resource_manager)
    manager.on_request_finish(request)
    assert_all_pages_back(ex)


def test_shutdown_releases_the_pool(trt, model):
    """``shutdown()`` (TensorRT-LLM's teardown) forgets the requests and the step, detaches from the KV cache manager
    and drops the pool: its buffer is freed; the hooks then refuse to run."""
    import gc
    import weakref

    ex = executor(trt, model)
    manager, kv = ex.compression_manager, ex.kv_cache_manager
    request = sti.LlmRequest(4, prompts_of([20])[0], 3)
    ex.resource_manager.prepare_resources(sti.ScheduledRequests([request], []))  # a request mid-flight
    buffer = weakref.ref(manager.rm.cache.pool.buffer)
    manager.shutdown()
    gc.collect()
    assert manager.rm is None and manager._requests == {} and manager._batch is None
    assert buffer() is None
    assert not hasattr(kv, "diffkv_compression_manager")
    with pytest.raises(RuntimeError, match="not bound"):
        manager.on_generation_step_begin(sti.ScheduledRequests([request], []))


def test_cuda_graph_capture_is_refused_by_name(trt, model):
    """The factory refuses ``cuda_graph_config`` (on by default) before any pool; if a graph capture is reached
    anyway, the metadata refuses it with the same name."""
    ex = executor(trt, model)
    with pytest.raises(RuntimeError, match=r"cuda_graph_config=None"):
        ex.metadata.create_cuda_graph_metadata(4, False, 0, None)


# ---------------------------------------------------------------- the stand-in fails where TensorRT-LLM would
def test_wrong_hook_signature_fails_the_iteration(trt, model, monkeypatch):
    from trtllm_diffkv.trtllm_backend import manager as manager_module

    class OldSignature(trt.DiffKVCompressionManager):
        def on_context_step_end(self, request, metadata):  # the framework's first draft; it passes one list now
            super().on_context_step_end([request])

    monkeypatch.setattr(manager_module, "DiffKVCompressionManager", OldSignature)
    ex = executor(trt, model)
    ex.add_request(prompts_of([20])[0], 3)
    ex.run_until_done()
    assert ex.errors[0].startswith("TypeError") and "metadata" in ex.errors[0]
    assert_all_pages_back(ex)  # _handle_errors terminated it: on_request_finish freed everything


def test_missing_finish_hook_leaks_pages(trt, model, monkeypatch):
    from trtllm_diffkv.trtllm_backend import manager as manager_module

    class NoFinish(trt.DiffKVCompressionManager):
        on_request_finish = sti.KVCacheCompressionManager.on_request_finish  # the base no-op

    monkeypatch.setattr(manager_module, "DiffKVCompressionManager", NoFinish)
    ex = executor(trt, model)
    ex.add_request(prompts_of([20])[0], 3)
    ex.run_until_done()
    rm = ex.compression_manager.rm
    assert rm.free_pages() < rm.get_max_resource_count()


def test_unregistered_method_and_backend_fail(model):
    with sti.installed():
        import trtllm_diffkv.trtllm_backend as adapter

        util, attn_utils = sti.module(sti.UTIL), sti.module(sti.ATTN_UTILS)
        engine_module = sti.module(sti.MODEL_ENGINE)
        adapter.DiffKVCompressionConfig  # importing the config registers both names ...
        assert util.create_kv_cache_compression_manager.__wrapped__ and attn_utils.get_attention_backend.__wrapped__
        assert engine_module.get_attention_backend is attn_utils.get_attention_backend  # the engine's name too
        util.create_kv_cache_compression_manager = util.create_kv_cache_compression_manager.__wrapped__
        original = attn_utils.get_attention_backend.__wrapped__  # ... undone: TensorRT-LLM alone
        attn_utils.get_attention_backend = engine_module.get_attention_backend = original
        # "DIFFKV" falls back to TensorRT-LLM's kernels, which the warm-up runs (NotImplementedError here)
        with pytest.raises(NotImplementedError, match="kernels do not run here"):
            executor(adapter, model)
        assert any("'diffkv' is not registered" in w for w in util.logger.warnings)
        assert any("Falling back to TRTLLM" in w for w in util.logger.warnings)
        adapter.register()
        # the method without its backend: the estimation's dummy requests meet TensorRT-LLM's kernels
        with pytest.raises(RuntimeError, match="kernels do not run here"):
            executor(adapter, model, attn_backend="TRTLLM")


@pytest.mark.parametrize("name", ["DIFFKV", "diffkv", "DiffKV"])
def test_the_engine_sees_the_backend_in_any_case_and_import_order(model, name):
    """``model_engine`` binds ``get_attention_backend`` when ``_util`` imports it: registering after that (here
    ``_util`` is imported before the adapter) must still reach the engine, or it builds ``TrtllmAttentionMetadata``;
    TensorRT-LLM upper-cases the name, so any case selects DiffKV."""
    with sti.installed():
        sti.module(sti.UTIL)  # TensorRT-LLM's executor modules first (model_engine binds the original lookup)
        import trtllm_diffkv.trtllm_backend as adapter

        ex = executor(adapter, model, attn_backend=name)
        assert ex.model_engine.attn_backend is adapter.DiffKVAttention
        assert type(ex.metadata) is adapter.DiffKVAttentionMetadata
        assert all(type(b) is adapter.DiffKVAttention for b in ex.backends)
        prompt = prompts_of([17])[0]
        rid = ex.add_request(prompt, 3)
        assert ex.run_until_done()[rid].output_token_ids == llm_tokens(model, [prompt], 3, "llama3-8b")[0]


def test_yaml_and_python_configs_parse_through_the_discriminated_union(trt, model):
    """TensorRT-LLM's ``KvCacheCompressionConfigType`` is a discriminated union on ``algorithm``: registration adds
    DiffKV to it, so the example YAML (``TorchLlmArgs.from_yaml``) and a Python instance both parse; the shipped
    methods still parse; an unknown algorithm is refused naming the tags, 'diffkv' among them."""
    import pathlib

    import yaml
    from pydantic import ValidationError

    path = pathlib.Path(__file__).parents[2] / "examples" / "trtllm_serve_diffkv.yaml"
    options = yaml.safe_load(path.read_text())  # trtllm-serve's --extra_llm_api_options: the LLM arguments
    args = sti.llm_args(**options)
    config = args.kv_cache_compression_config
    assert isinstance(config, trt.DiffKVCompressionConfig) and config.preset == "llama3-8b"
    assert args.cuda_graph_config is None and args.kv_cache_config.use_kv_cache_manager_v2 is True
    assert args.disable_overlap_scheduler and not args.kv_cache_config.enable_block_reuse
    instance = trt.DiffKVCompressionConfig(kv_memory_bytes=KV_BYTES)
    assert sti.llm_args(kv_cache_compression_config=instance).kv_cache_compression_config is instance
    tri = sti.llm_args(kv_cache_compression_config={"algorithm": "triattention", "calibration_path": "c.pt"})
    assert type(tri.kv_cache_compression_config).__name__ == "TriAttentionKvCacheCompressionConfig"
    with pytest.raises(ValidationError, match=r"'quantization_for_cold_page', 'triattention', 'diffkv'"):
        sti.llm_args(kv_cache_compression_config={"algorithm": "other"})
    options["kv_cache_compression_config"] = {"algorithm": "diffkv", "preset": "llama3-8b", "kv_memory_bytes": KV_BYTES}
    ex = sti.create_executor(model, sti.llm_args(**options), hf_dict(model.config), max_num_tokens=512)
    prompt = prompts_of([25])[0]
    rid = ex.add_request(prompt, 6)  # the example's settings serve (on the CPU: a byte budget)
    assert ex.run_until_done()[rid].output_token_ids == llm_tokens(model, [prompt], 6, "llama3-8b")[0]


def test_the_union_refuses_diffkv_without_registration():
    """Without the adapter, TensorRT-LLM's union refuses ``algorithm: diffkv`` (why registration widens it)."""
    from pydantic import ValidationError

    with sti.installed():
        with pytest.raises(ValidationError, match="does not match any of the expected tags"):
            sti.llm_args(kv_cache_compression_config={"algorithm": "diffkv"})


def test_backend_signature_and_binding_checked(trt, model, monkeypatch):
    class NoKwargs(trt.DiffKVAttention):  # TensorRT-LLM's create_attention passes quant_config=..., q_scaling=...
        def __init__(self, layer_idx, num_heads, head_dim, num_kv_heads=None):
            super().__init__(layer_idx, num_heads, head_dim, num_kv_heads)

    attn_utils = sti.module(sti.ATTN_UTILS)
    monkeypatch.setattr(attn_utils, "get_attention_backend", lambda name, sparse_params=None: NoKwargs)
    with pytest.raises(TypeError, match="quant_config"):
        attn_utils.create_attention("DIFFKV", 0, 8, 64, 2)
    manager = trt.DiffKVCompressionManager(trt.DiffKVCompressionConfig(kv_memory_bytes=KV_BYTES),
                                           pretrained_config=hf_dict(model.config))
    v1 = sti.KVCacheManager(sti.kv_cache_config(), num_layers=3, num_kv_heads=2, head_dim=64, tokens_per_block=32,
                            max_seq_len=512, max_batch_size=2, mapping=sti.Mapping())
    with pytest.raises(TypeError, match="requires KVCacheManagerV2.*use_kv_cache_manager_v2=True"):
        manager.bind_kv_cache_managers(v1)


def test_import_without_tensorrt_llm_says_how_to_install(monkeypatch):
    for name in [n for n in sys.modules if n.startswith(sti.ADAPTER)]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    import trtllm_diffkv.trtllm_backend as adapter  # the package itself imports lazily

    with pytest.raises(ImportError, match=r"needs TensorRT-LLM 1\.4\.0rc or later.*pypi\.nvidia\.com"):
        adapter.DiffKVCompressionConfig
    for name in [n for n in sys.modules if n.startswith(sti.ADAPTER)]:
        monkeypatch.delitem(sys.modules, name)


# ---------------------------------------------------------------- the default model
@pytest.mark.slow
def test_default_model_through_the_standin(trt, default_model):
    net, tokenizer, model_config = default_model
    prompts = [tokenizer(t)["input_ids"] for t in ("The capital of France is", "def fibonacci(n):\n    ")]
    from trtllm_diffkv.model.loader import default_model_path

    hf = json.loads((default_model_path() / "config.json").read_text())  # what TensorRT-LLM's factory is given
    # Bit-equal tokens need the same arithmetic: the unrotated tiers. With the rotated diffkv the adapter's backend
    # rotates q, k, v and the output at run time while our LLM folds the rotation into v_proj / o_proj, so the
    # fp32 roundings differ and a 4-bit code can round the other way later on (the rotation's exactness is
    # tested on the tiny model above); the first token, from the full-precision prompt, must still agree.
    for preset, steps in (("default-unrotated", 8), ("diffkv", 1)):
        config = trt.DiffKVCompressionConfig(preset=preset, kv_memory_bytes=64 << 20)
        ex = sti.create_executor(net, serving_args(config), hf, max_seq_len=64, max_num_tokens=128)
        ids = [ex.add_request(p, 8) for p in prompts]
        done = ex.run_until_done()
        with LLM.from_model(net, None, model_config, preset, kv_memory_bytes=64 << 20, max_batch_size=4) as llm:
            want = [o.outputs[0].token_ids for o in llm.generate(
                prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
        assert [done[i].output_token_ids[:steps] for i in ids] == [w[:steps] for w in want], preset
        assert all(len(done[i].output_token_ids) == 8 for i in ids)
        assert_all_pages_back(ex)


def test_no_preset_serves_the_uniform_default_through_the_standin(trt, model):
    """``DiffKVCompressionConfig`` with no preset serves ``default`` (uniform K8V4 since issue 41, no tiers): the
    same greedy tokens as our ``LLM`` under ``k8v4``, every token kept in the high tier, all pages back."""
    from trtllm_diffkv.config import get_preset

    config = trt.DiffKVCompressionConfig(kv_memory_bytes=KV_BYTES)
    assert config.to_kv_config().same_configuration(get_preset("k8v4")) and not config.to_kv_config().tiered
    prompts = prompts_of([1, 17, 70, 100])
    ex = sti.create_executor(model, serving_args(config), hf_dict(model.config), max_batch_size=3, max_seq_len=512,
                             max_num_tokens=512)
    ids = [ex.add_request(p, 10) for p in prompts]
    done = ex.run_until_done()
    assert ex.errors == {}
    assert [done[i].output_token_ids for i in ids] == llm_tokens(model, prompts, 10, "k8v4")
    assert_all_pages_back(ex)
