"""Decode steps replayed from CUDA graphs equal eager decode steps bit for bit.

Run on the device: ``python3 -m pytest -q -m gpu tests/runtime/test_cuda_graphs_gpu.py``.

Two identical caches and one model: one runs every decode step eagerly (``plan(..., pad_to=B)`` then
  ``model(...)``), the other replays the :class:`DecodeGraphRunner`'s graph of bucket ``B`` and the plan
  graphs (captured at the first padded plan of each request count). After every
  step the logits of the real rows, the pool bytes and the page manager's state are identical, while
  the batch changes (requests finish, new prompts are prefilled eagerly, buckets 1, 4 and 8 are used).
"""
import pytest
import torch

from conftest import random_llama
from trtllm_diffkv.config import PRESETS, DiffKVConfig
from trtllm_diffkv.engine_config import EngineConfig
from trtllm_diffkv.paged import PagedDiffKVCache

pytestmark = pytest.mark.gpu


def _model():
    model = random_llama(7, vocab_size=512, hidden_size=576, intermediate_size=1536, num_layers=4, num_heads=9,
                         num_kv_heads=3, head_dim=64, max_position_embeddings=2048)
    return model.to("cuda", torch.float16)


def _cache(model, kv):
    mc = model.config
    return PagedDiffKVCache(kv, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                            EngineConfig(max_batch_size=8, max_seq_len=512, device="cuda", high_tokens_per_page=16),
                            num_pages=3000, dtype=torch.float16)


@pytest.mark.parametrize("preset", ["custom", "fp16"])
def test_graph_replay_equals_eager_decode(preset):
    from trtllm_diffkv.runtime.cuda_graphs import DecodeGraphRunner

    kv = DiffKVConfig(recent_window_tokens=8, prompt_score_window_tokens=16, alpha_high=1.0, alpha_low=0.3) \
        if preset == "custom" else PRESETS["fp16"]
    model = _model()
    eager, graphed = _cache(model, kv), _cache(model, kv)
    runner = DecodeGraphRunner(model, graphed, buckets=(1, 4, 8))
    g = torch.Generator().manual_seed(3)
    lens, toks = {}, {}

    def prefill(slots_lens):
        slots = sorted(slots_lens)
        prompts = {s: torch.randint(0, 512, (slots_lens[s],), generator=g).tolist() for s in slots}
        ids = torch.tensor([t for s in slots for t in prompts[s]], device="cuda")
        positions = torch.cat([torch.arange(len(prompts[s])) for s in slots]).cuda()
        last = torch.tensor([len(prompts[s]) for s in slots]).cumsum(0).cuda() - 1
        outs = []
        for cache in (eager, graphed):
            cache.plan(slots, [len(prompts[s]) for s in slots], [0] * len(slots), [True] * len(slots))
            outs.append(model(ids, positions, cache, logits_indices=last))
            cache.end_step()
        assert torch.equal(outs[0], outs[1])
        for i, s in enumerate(slots):
            lens[s], toks[s] = len(prompts[s]), int(outs[0][i].argmax())

    def release(slots):
        for cache in (eager, graphed):
            cache.release(slots)
        for s in slots:
            del lens[s], toks[s]

    buckets_seen = set()
    with torch.inference_mode():
        prefill({0: 37, 1: 90, 2: 5})
        for step in range(24):
            if step == 6:
                release([1])
            if step == 9:
                prefill({1: 20, 5: 64})
            if step == 13:
                release([0, 1, 2])
            if step == 17:
                prefill({0: 11, 2: 45, 3: 33, 6: 70})
            slots = sorted(toks)
            n = len(slots)
            B = runner.bucket_for(n)
            buckets_seen.add(B)
            args = (slots, [lens[s] + 1 for s in slots], [lens[s] for s in slots], [False] * n)
            ids = torch.tensor([toks[s] for s in slots], device="cuda")
            positions = torch.tensor([lens[s] for s in slots], device="cuda")
            eager.plan(*args, pad_to=B)
            pad = torch.zeros(B - n, dtype=torch.int64, device="cuda")
            want = model(torch.cat([ids, pad]), torch.cat([positions, pad]), eager)[:n]
            eager.end_step()
            graphed.plan(*args, pad_to=B)
            got = runner.run(ids, positions).clone()
            assert torch.equal(got, want), f"step {step} (bucket {B}): replayed logits differ by " \
                                           f"{(got - want).abs().max().item()}"
            torch.cuda.synchronize()
            assert torch.equal(eager.pool.buffer, graphed.pool.buffer), f"step {step}: pool bytes differ"
            assert eager.manager.snapshot().diff(graphed.manager.snapshot()) == [], f"step {step}: page state differs"
            assert eager.seq_len == graphed.seq_len and graphed.planned_step is None
            for i, s in enumerate(slots):
                lens[s], toks[s] = lens[s] + 1, int(want[i].argmax())
    assert buckets_seen == {1, 4, 8}
    # the plan's device work was captured at the first padded plan of each request count, then replayed
    assert {(3, 4), (2, 4), (4, 4), (1, 1), (5, 8)} <= set(graphed.plan_graphs) and not eager.plan_graphs
    for cache in (eager, graphed):
        assert cache.step_errors() == {}
        cache.release(sorted(lens))
        cache.manager.check_invariants()
        assert cache.manager.free_pages() == 3000


def test_runner_refuses_unpadded_or_mismatched_steps():
    from trtllm_diffkv.runtime.cuda_graphs import DecodeGraphRunner

    model = _model()
    cache = _cache(model, PRESETS["fp16"])
    runner = DecodeGraphRunner(model, cache, buckets=(2,))
    with torch.inference_mode():
        cache.plan([0], [4], [0], [True])
        model(torch.arange(4, device="cuda"), torch.arange(4, device="cuda"), cache)
        cache.end_step()
        cache.plan([0], [5], [4], [False])  # not padded to a bucket
        with pytest.raises(ValueError, match="pad_to"):
            runner.run([1], [4])
        model(torch.tensor([1], device="cuda"), torch.tensor([4], device="cuda"), cache)
        cache.end_step()
        cache.plan([0], [6], [5], [False], pad_to=2)
        with pytest.raises(ValueError, match="1 decode requests"):
            runner.run([1, 2], [5, 5])
        logits = runner.run([1], [5])
        assert logits.shape == (1, 512) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="buckets"):
        runner.bucket_for(3)
