"""The TensorRT-LLM manifest holds the stand-in and the adapter to TensorRT-LLM's source.

``trtllm_manifest.py`` records what the adapter relies on, each fact with the file and commit it was read at. Here:

* every fact names its source, and those that could not be read say why;
* the stand-in agrees with every structured fact (signatures, keywords, defaults, hook names, call order) - change
  the stand-in away from the source and a test here fails;
* the adapter's classes and calls fit the facts (keyword names, positional counts, hook names, the metadata
  keywords the engine passes, the graph-capture call), so a stand-in that agrees with the source cannot hide a
  mismatch.
"""
from __future__ import annotations

import inspect
import re
import sys

import pytest
import torch

pytest.importorskip("pydantic", reason="TensorRT-LLM's config classes (and the stand-in's) are pydantic models")
import trtllm_manifest as mf  # noqa: E402
import trtllm_standin as sti  # noqa: E402
from conftest import tiny_llama  # noqa: E402


def signature_data(func) -> dict:
    """``func``'s signature in the manifest's form (``self`` and ``*args`` left out)."""
    params = [p for p in inspect.signature(func).parameters.values() if p.name != "self"]
    return mf.sig([p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)],
                  [p.name for p in params if p.kind is p.KEYWORD_ONLY],
                  {p.name: p.default for p in params if p.default is not p.empty},
                  any(p.kind is p.VAR_KEYWORD for p in params))


def signature_fact(fact_id: str) -> dict:
    data = mf.fact(fact_id).data
    return {k: data[k] for k in ("positional", "keyword_only", "defaults", "var_keyword")}


hf_dict = sti.pretrained_config_of


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture()
def standin():
    """The stand-in installed, without the adapter."""
    with sti.installed():
        yield


@pytest.fixture()
def trt():
    """The stand-in installed and the adapter imported (registered)."""
    with sti.adapter_installed() as adapter:
        yield adapter


# ---------------------------------------------------------------- the manifest itself
def test_every_fact_names_its_source():
    commit = re.compile(r"^([0-9a-f]{40}|index:\d+|registry:\d{4}-\d{2}-\d{2})$")
    for f in mf.FACTS:
        assert f.path and f.statement, f.id
        if f.verified:
            assert commit.match(f.commit), f"{f.id}: commit {f.commit!r}"
            assert not f.why, f.id
        else:
            assert f.why, f"{f.id} is unverified without saying why"
    assert {f.id for f in mf.unverified()} >= {"warmup.when", "request.prompt_len_max_new_tokens"}


# ---------------------------------------------------------------- the stand-in agrees with the manifest
SIGNATURES = {
    "factory.signature": lambda: sti.module(sti.UTIL).create_kv_cache_compression_manager,
    "validate.signature": lambda: sti.module(sti.UTIL).validate_kv_cache_compression_compatibility,
    "base.init": lambda: sti.KVCacheCompressionManager.__init__,
    "base.bind": lambda: sti.KVCacheCompressionManager.bind_kv_cache_managers,
    "base.prepare_resources": lambda: sti.KVCacheCompressionManager.prepare_resources,
    "base.update_resources": lambda: sti.KVCacheCompressionManager.update_resources,
    "base.free_resources": lambda: sti.KVCacheCompressionManager.free_resources,
    "base.shutdown": lambda: sti.KVCacheCompressionManager.shutdown,
    "backend.init": lambda: sti.module(sti.ATTN_INTERFACE).AttentionBackend.__init__,
    "backend.forward": lambda: sti.module(sti.ATTN_INTERFACE).AttentionBackend.forward,
    "metadata.cuda_graph": lambda: sti.module(sti.ATTN_INTERFACE).AttentionMetadata.create_cuda_graph_metadata,
    "lookup.signature": lambda: sti.module(sti.ATTN_UTILS).get_attention_backend,
    "forward_args.merge": lambda: sti.module(sti.ATTN_INTERFACE).merge_attention_forward_args,
}


@pytest.mark.parametrize("fact_id", sorted(SIGNATURES))
def test_standin_signatures_are_the_sources(standin, fact_id):
    assert signature_data(SIGNATURES[fact_id]()) == signature_fact(fact_id)


def test_standin_factory_behaves_as_the_source(standin, model):
    util = sti.module(sti.UTIL)
    engine = sti.types.SimpleNamespace(mapping=sti.Mapping(), spec_config=None)
    args = dict(model_engine=engine, kv_cache_config=sti.kv_cache_config(enable_block_reuse=False))
    assert util.create_kv_cache_compression_manager(None, **args) is mf.fact("factory.none").data["returns_for_none"]
    llm_args = sti.module(sti.LLM_ARGS)
    unknown = llm_args.KvCacheCompressionConfig(algorithm="made_up")
    assert util.create_kv_cache_compression_manager(unknown, **args) is None
    assert "'made_up' is not registered" in util.logger.warnings[-1]
    helix = sti.types.SimpleNamespace(mapping=sti.Mapping(cp_config={"cp_type": "HELIX"}), spec_config=None)
    with pytest.raises(ValueError, match="HELIX"):
        util.create_kv_cache_compression_manager(unknown, model_engine=helix, kv_cache_config=args["kv_cache_config"])
    # the validator's messages
    validate = util.validate_kv_cache_compression_compatibility
    messages = mf.fact("validate.signature").data["messages"]
    with pytest.raises(ValueError, match=messages[0]):
        validate(unknown, sti.kv_cache_config(), None)
    with pytest.raises(ValueError, match=messages[1]):
        validate(unknown, sti.kv_cache_config(enable_block_reuse=False), object())
    # the shipped branches validate (block reuse is on by default)
    tri = llm_args.TriAttentionKvCacheCompressionConfig(calibration_path="c.pt", eviction_mode="per_head")
    with pytest.raises(ValueError, match="speculative"):
        util.create_kv_cache_compression_manager(tri, model_engine=sti.types.SimpleNamespace(
            mapping=sti.Mapping(), spec_config=object()), kv_cache_config=sti.kv_cache_config())


def test_standin_llm_args_are_the_sources(standin):
    llm_args = sti.module(sti.LLM_ARGS)
    base = mf.fact("config.base").data
    assert llm_args.KvCacheCompressionConfig.model_config["extra"] == base["extra"]
    assert llm_args.KvCacheCompressionConfig.changes_physical_kv_length is base["changes_physical_kv_length"]
    cfg = llm_args.KvCacheCompressionConfig(algorithm="x")
    assert cfg.supports_block_reuse() is base["supports_block_reuse"]
    assert cfg.supports_speculative_decoding() is base["supports_speculative_decoding"]
    with pytest.raises(ValueError):
        llm_args.KvCacheCompressionConfig()  # algorithm is required
    union = mf.fact("config.union").data
    field = llm_args.TorchLlmArgs.model_fields["kv_cache_compression_config"]
    assert field.default is mf.fact("args.compression_field").data["default"]
    inner = [a for a in field.annotation.__args__ if a is not type(None)][0]
    assert inner.__metadata__[0].discriminator == union["discriminator"]
    assert [m.model_fields["algorithm"].default for m in inner.__args__[0].__args__] == union["tags"]
    kv = sti.kv_cache_config()
    for name, value in mf.fact("args.kv_cache_config").data.items():
        assert getattr(kv, name) == value, name
    args = sti.llm_args()
    torch_args = mf.fact("args.torch").data
    assert (args.cuda_graph_config is None) is torch_args["cuda_graph_config_default_is_none"]
    for name, value in torch_args.items():
        if name != "cuda_graph_config_default_is_none":
            assert getattr(args, name) == value, name
    assert hasattr(llm_args.TorchLlmArgs, "from_yaml")


def test_standin_kv_manager_selection_and_base_manager_are_the_sources(standin, model):
    creator_of = lambda v2: sti.module(sti.UTIL).KvCacheCreator(  # noqa: E731
        model_engine=None, llm_args=sti.llm_args(kv_cache_config=sti.kv_cache_config(use_kv_cache_manager_v2=v2)),
        max_batch_size=1, max_num_tokens=8, max_seq_len=8)._kv_cache_manager_cls()
    assert creator_of("auto") is sti.KVCacheManager and creator_of(False) is sti.KVCacheManager
    assert creator_of(mf.fact("kv_manager.selection").data["v2_when"]) is sti.KVCacheManagerV2
    base = sti.KVCacheCompressionManager
    for name, value in mf.fact("base.flags").data.items():
        assert getattr(base, name) is value, name
    manager = base(sti.module(sti.LLM_ARGS).KvCacheCompressionConfig(algorithm="x"))
    counts = mf.fact("base.counts").data
    assert (manager.get_max_resource_count(), manager.get_needed_resource_to_completion(None)) == \
        (counts["max_resource_count"], counts["needed_resource_to_completion"])
    for hook, first in mf.fact("base.hooks").data["hooks"].items():
        params = signature_data(getattr(base, hook))
        assert params["positional"] == [first] and params["var_keyword"], hook
    v1 = sti.KVCacheManager(sti.kv_cache_config(), num_layers=1, num_kv_heads=1, head_dim=64, tokens_per_block=32,
                            max_seq_len=8, max_batch_size=1, mapping=sti.Mapping())
    with pytest.raises(TypeError, match=mf.fact("base.bind").data["message"]):
        manager.bind_kv_cache_managers(v1)
    v2 = sti.KVCacheManagerV2(sti.kv_cache_config(), num_layers=1, num_kv_heads=1, head_dim=64, tokens_per_block=32,
                              max_seq_len=8, max_batch_size=1, mapping=sti.Mapping())
    for name in mf.fact("kvcm_v2.attributes").data["attributes"]:
        assert hasattr(v2, name), name
    for name in mf.fact("mapping.fields").data["attributes"]:
        assert hasattr(sti.Mapping(), name), name
    # prepare: init for first chunks, then the step's begin; update: the final chunks' end, then the step's end
    calls = []
    for hook in mf.fact("base.hooks").data["hooks"]:
        setattr(manager, hook, lambda arg, _h=hook: calls.append(_h))
    first = sti.LlmRequest(1, [1, 2, 3], 1)
    later = sti.LlmRequest(2, [1, 2, 3, 4], 1, context_chunk_size=2)
    later.context_current_position = 2
    batch = sti.ScheduledRequests([first, later], [])
    manager.prepare_resources(batch)
    manager.update_resources(batch)
    manager.free_resources(first)
    assert calls == ["on_request_init", "on_generation_step_begin", "on_context_step_end", "on_generation_step_end",
                     "on_request_finish"]
    for name in mf.fact("request.fields").data["attributes"]:
        assert hasattr(first, name), name


def test_standin_attention_interface_is_the_sources(standin):
    interface = sti.module(sti.ATTN_INTERFACE)
    args = interface.AttentionForwardArgs()
    for name, value in mf.fact("forward_args.fields").data.items():
        assert getattr(args, name) == value, name
    with pytest.raises(TypeError):
        interface.AttentionForwardArgs(interface.PredefinedAttentionMask.FULL)  # keyword-only
    for name, value in mf.fact("mask.values").data.items():
        assert interface.PredefinedAttentionMask[name].value == value
    fields = mf.fact("metadata.fields").data
    with pytest.raises(TypeError):
        interface.AttentionMetadata(**{fields["required"][0]: 1})  # the other required field missing
    md = interface.AttentionMetadata(max_num_requests=2, max_num_tokens=8)
    for name in fields["fields"]:
        assert hasattr(md, name), name
    graph = md.create_cuda_graph_metadata(3, False, 1)
    assert graph.is_cuda_graph and graph.num_contexts == 0 and graph.seq_lens.tolist() == [2, 2, 2]
    for name in mf.fact("backend.metadata_attr").data["classmethods"]:
        assert hasattr(interface.AttentionBackend, name), name
    assert interface.AttentionBackend.Metadata is interface.AttentionMetadata
    package = sti.module(mf.fact("attention.package").data["package"])
    assert hasattr(package, "AttentionForwardArgs") and not hasattr(package, "get_attention_backend")
    with pytest.raises(ValueError, match="not both"):
        interface.merge_attention_forward_args(args, {"attention_mask": interface.PredefinedAttentionMask.CAUSAL})


def test_standin_lookup_and_its_binding_are_the_sources(standin):
    utils = sti.module(sti.ATTN_UTILS)
    lookup = mf.fact("lookup.signature").data
    assert lookup["upper_cases"] and utils.get_attention_backend("trtllm") is sti.TrtllmAttention
    assert utils.get_attention_backend("vanilla") is sti.VanillaAttention
    assert utils.get_attention_backend("NOPE").__name__ == lookup["fallback"]
    # model_engine binds the name when _util imports it; patching utils afterwards does not reach it
    assert sti.MODEL_ENGINE not in sys.modules
    sti.module(sti.UTIL)
    engine_module = sys.modules[sti.MODEL_ENGINE]
    original = engine_module.get_attention_backend
    assert original is utils.get_attention_backend
    utils.get_attention_backend = lambda name, sparse_params=None: sti.VanillaAttention
    assert engine_module.get_attention_backend is original
    # create_attention: the lookup as a module global of utils, four positionals, the source's keywords
    seen = {}

    class Recording(sti.AttentionBackend):
        def __init__(self, *args, **kwargs):
            seen.update(positional=len(args), keywords=sorted(kwargs))
            super().__init__(*args, **kwargs)

    utils.get_attention_backend = lambda name, sparse_params=None: Recording
    utils.create_attention("X", 0, 8, 64, 2)
    call = mf.fact("create_attention.call").data
    assert seen == {"positional": call["positional"], "keywords": sorted(call["keywords"])}
    with pytest.raises(ValueError, match="chunked"):
        utils.create_attention("VANILLA", 0, 8, 64, 2, attention_chunk_size=64)


def test_standin_creator_and_executor_are_the_sources(standin, model, monkeypatch):
    """The factory call's form, bind's positionals, the managers' order, the engine's metadata keywords, the
    graph-capture call, warm-up dummies that bypass the hooks, the estimation dummies, teardown's order."""
    util, interface = sti.module(sti.UTIL), sti.module(sti.ATTN_INTERFACE)
    record = {"factory": [], "bind": [], "hooks": [], "metadata": [], "capture": []}

    class Manager(sti.KVCacheCompressionManager):
        def bind_kv_cache_managers(self, *args, **kwargs):
            record["bind"].append((len(args), sorted(kwargs)))
            super().bind_kv_cache_managers(*args, **kwargs)

        def on_request_init(self, request, **kwargs):
            record["hooks"].append(request.py_request_id)

        def shutdown(self):
            record.setdefault("shutdown", []).append(self)

    def factory(config, *args, **kwargs):
        record["factory"].append((len(args) + 1, sorted(kwargs)))
        return Manager(config) if config is not None else None

    class RecordingMetadata(interface.AttentionMetadata):
        def __init__(self, **kwargs):
            record["metadata"].append(sorted(kwargs))
            super().__init__(**kwargs)

        def create_cuda_graph_metadata(self, *args, **kwargs):
            record["capture"].append((len(args), sorted(kwargs)))
            return super().create_cuda_graph_metadata(*args, **kwargs)

    class Dense(sti.AttentionBackend):
        Metadata = RecordingMetadata

        def forward(self, q, k, v, metadata, forward_args=None, **kwargs):
            return torch.zeros_like(q)

    monkeypatch.setattr(util, "create_kv_cache_compression_manager", factory)
    monkeypatch.setattr(sti.module(sti.MODEL_ENGINE), "get_attention_backend", lambda name, **kw: Dense)
    monkeypatch.setattr(sti.module(sti.ATTN_UTILS), "get_attention_backend", lambda name, **kw: Dense)
    config = sti.module(sti.LLM_ARGS).ColdPageQuantizationCompressionConfig()  # a union member; built by `factory`
    args = sti.llm_args(kv_cache_compression_config=config, kv_cache_config=sti.kv_cache_config(
        use_kv_cache_manager_v2=True), cuda_graph_config={"batch_sizes": [1, 2]})
    ex = sti.create_executor(model, args, hf_dict(model.config), max_batch_size=2, max_seq_len=64, max_num_tokens=96)
    call = mf.fact("factory.call").data
    assert record["factory"] == [(call["positional"], sorted(call["keywords"]))] * 2  # estimation, final
    assert [c[2] for c in ex.creator.calls if c[0] == "factory"] == [True, False]
    assert record["bind"] == [(mf.fact("bind.call").data["positional"], [])] * 2
    assert [k.name for k in ex.resource_manager.resource_managers][-2:] == mf.fact("bind.call").data["order_tail"]
    assert sorted(mf.fact("engine.metadata_call").data["keywords"]) in record["metadata"]
    assert record["capture"] and all(c == (mf.fact("cuda_graph.capture").data["positional"], [])
                                     for c in record["capture"])
    # the estimation's dummies went through the hooks (prompts of max_seq_len - 1 tokens, capped, one new token);
    # the warm-up's did not: every request the hooks saw is an estimation dummy
    assert record["hooks"] and all(rid >= sti.WARMUP_REQUEST_ID_BASE // 2 for rid in record["hooks"])
    assert len(record["hooks"]) == -(-96 // 63)
    assert ex.model_engine.warmup_forwards == 2 * (len(args.cuda_graph_config.batch_sizes) + 1)
    assert ex.creator.calls[1:3] == [("shutdown", "compression"), ("shutdown", "kv_cache_manager")]
    assert len(record["shutdown"]) == 1


# ---------------------------------------------------------------- the adapter fits the manifest
def test_adapter_signatures_fit_the_manifest(trt):
    from trtllm_diffkv.trtllm_backend import registration

    assert signature_data(registration.create_diffkv_manager) == signature_fact("factory.signature")
    init = signature_data(trt.DiffKVAttention.__init__)
    assert init == signature_fact("backend.init")
    assert signature_data(trt.DiffKVAttention.forward) == signature_fact("backend.forward")
    assert signature_data(trt.DiffKVCompressionManager.bind_kv_cache_managers) == signature_fact("base.bind")
    assert signature_data(trt.DiffKVCompressionManager.shutdown) == signature_fact("base.shutdown")
    for hook, first in mf.fact("base.hooks").data["hooks"].items():
        assert hook in trt.DiffKVCompressionManager.__dict__, f"{hook} is not overridden"
        params = signature_data(getattr(trt.DiffKVCompressionManager, hook))
        assert params["positional"] == [first] and params["var_keyword"], hook
    for translation in ("prepare_resources", "update_resources", "free_resources"):  # the base turns calls into hooks
        assert translation not in trt.DiffKVCompressionManager.__dict__, translation


def test_adapter_calls_fit_the_manifest(trt, model, monkeypatch):
    """The manager's base constructor gets exactly the config; the backend accepts create_attention's call; the
    metadata accepts the engine's keywords and refuses (RuntimeError, not TypeError) the capture call; the wrapped
    factory accepts build_managers' call."""
    seen = []
    base_init = sti.KVCacheCompressionManager.__init__

    def recording(self, *args, **kwargs):
        seen.append((len(args), sorted(kwargs)))
        base_init(self, *args, **kwargs)

    monkeypatch.setattr(sti.KVCacheCompressionManager, "__init__", recording)
    config = trt.DiffKVCompressionConfig(kv_memory_bytes=1 << 20)
    trt.DiffKVCompressionManager(config, pretrained_config=hf_dict(model.config))
    assert seen == [(len(signature_fact("base.init")["positional"]), [])]
    monkeypatch.undo()
    call = mf.fact("create_attention.call").data
    defaults = {"kv_cache_dtype": "auto", "skip_create_weights_in_init": False, "skip_correction_threshold": 0.0}
    backend = trt.DiffKVAttention(*[0, 8, 64, 2][:call["positional"]],
                                  **{k: defaults.get(k) for k in call["keywords"]})
    assert (backend.layer_idx, backend.num_heads, backend.head_dim, backend.num_kv_heads) == (0, 8, 64, 2)
    md = trt.DiffKVAttentionMetadata(**{k: 1 if k.startswith("max_") else None
                                        for k in mf.fact("engine.metadata_call").data["keywords"]})
    with pytest.raises(RuntimeError, match="cuda_graph_config=None"):
        md.create_cuda_graph_metadata(*[4, False, 0, None][:mf.fact("cuda_graph.capture").data["positional"]])
    util = sti.module(sti.UTIL)
    engine = sti.types.SimpleNamespace(
        mapping=sti.Mapping(), spec_config=None, llm_args=sti.llm_args(disable_overlap_scheduler=True,
                                                                       cuda_graph_config=None),
        model=sti.types.SimpleNamespace(model_config=sti.types.SimpleNamespace(pretrained_config=hf_dict(
            model.config))))
    keywords = dict(zip(mf.fact("factory.call").data["keywords"],
                        [engine, sti.kv_cache_config(enable_block_reuse=False), True]))
    manager = util.create_kv_cache_compression_manager(config, **keywords)
    assert isinstance(manager, trt.DiffKVCompressionManager) and manager.estimating
