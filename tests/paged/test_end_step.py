"""The end of a step is explicit (``PagedDiffKVCache.end_step``): never a side effect of the last layer.

A step whose layers all ran stays planned until ``end_step``; only ``end_step`` commits the prompts' tier counts to
the page manager (the surplus reserved pages back to the ring) and advances the slots' lengths. It refuses a step
whose layers have not all run (the step stays planned) and an empty cache; a step marked ``replayed`` (a CUDA-graph
replay: no ``forward`` calls) ends without layers, when it is decode-only and no layer ran eagerly.
"""
import pytest
import torch

from trtllm_diffkv.config import DiffKVConfig
from trtllm_diffkv.engine_config import EngineConfig
from trtllm_diffkv.paged import PagedDiffKVCache
from trtllm_diffkv.paged.step_plan import DecodeBuffers, PrefillPlan, StepPlan

CFG = DiffKVConfig(recent_window_tokens=4, prompt_score_window_tokens=8, alpha_high=1.0, alpha_low=0.3)
L, HQ, H, D = 3, 4, 2, 64


def _cache(**kwargs):
    return PagedDiffKVCache(CFG, L, HQ, H, D, EngineConfig(max_batch_size=2, max_seq_len=64, high_tokens_per_page=4,
                                                           **kwargs), num_pages=200)


def _run_layers(cache, num_tokens, layers=range(L), seed=0):
    g = torch.Generator().manual_seed(seed)
    for layer in layers:
        cache.forward(layer, torch.randn(num_tokens, HQ, D, generator=g), torch.randn(num_tokens, H, D, generator=g),
                      torch.randn(num_tokens, H, D, generator=g))


def _prefilled(lens=(20, 9)):
    """A cache with ``lens`` prompts prefilled in slots 0, 1 and the step ended."""
    cache = _cache()
    cache.plan([0, 1], list(lens), [0, 0], [True, True])
    _run_layers(cache, sum(lens))
    cache.end_step()
    return cache


def test_a_prefill_step_commits_and_advances_only_at_end_step():
    cache = _cache()
    free = cache.manager.free_pages()
    cache.plan([0, 1], [20, 9], [0, 0], [True, True])
    reserved = cache.manager.free_pages()
    assert isinstance(cache.planned_step, StepPlan) and isinstance(cache.planned_step.prefill, PrefillPlan)
    _run_layers(cache, 29)
    step = cache.planned_step
    assert step is not None and step.next_layer == L  # every layer ran: still planned
    assert cache.seq_len == [0, 0] and cache.prompt_len == [0, 0]
    assert cache.manager.free_pages() == reserved and int(cache.manager.tokens.sum()) == 0  # nothing committed
    with pytest.raises(ValueError, match="end_step"):
        cache.plan([0, 1], [21, 10], [20, 9], [False, False])
    cache.end_step()
    assert cache.planned_step is None
    assert cache.seq_len == [20, 9] and cache.prompt_len == [20, 9]
    assert int(cache.manager.tokens.sum()) > 0 and free > cache.manager.free_pages() > reserved  # surplus back
    cache.plan([0, 1], [21, 10], [20, 9], [False, False])  # plan after end_step works
    assert isinstance(cache.planned_step.decode, DecodeBuffers)


def test_end_step_before_the_last_layer_raises_and_keeps_the_step():
    cache = _prefilled()
    cache.plan([0, 1], [21, 10], [20, 9], [False, False])
    _run_layers(cache, 2, layers=range(L - 1))
    before = (list(cache.seq_len), cache.manager.tokens.clone())
    with pytest.raises(ValueError, match=f"has run {L - 1} of its {L} layers; run layers {L - 1}..{L - 1} first"):
        cache.end_step()
    assert cache.planned_step is not None and cache.planned_step.next_layer == L - 1
    assert cache.seq_len == before[0] and torch.equal(cache.manager.tokens, before[1])
    _run_layers(cache, 2, layers=[L - 1])
    cache.end_step()
    assert cache.seq_len == [21, 10] and cache.planned_step is None


def test_end_step_with_nothing_planned_raises():
    cache = _cache()
    with pytest.raises(ValueError, match="no step is planned"):
        cache.end_step()
    done = _prefilled()
    with pytest.raises(ValueError, match="no step is planned"):  # ending twice
        done.end_step()


def test_a_replayed_step_ends_without_layers():
    cache = _prefilled()
    cache.plan([0, 1], [21, 10], [20, 9], [False, False])
    cache.planned_step.replayed = True  # what DecodeGraphRunner.run does after its graph replay
    with pytest.raises(ValueError, match="replayed"):
        _run_layers(cache, 2, layers=[0])
    assert cache.seq_len == [20, 9]
    cache.end_step()
    assert cache.seq_len == [21, 10] and cache.planned_step is None


def test_replayed_is_refused_for_prefill_or_layers_run_eagerly():
    cache = _prefilled()
    cache.plan([0, 1], [21, 10], [20, 9], [False, False])
    _run_layers(cache, 2, layers=[0])
    cache.planned_step.replayed = True
    with pytest.raises(ValueError, match="1 layers run"):
        cache.end_step()
    fresh = _cache()
    fresh.plan([0], [5], [0], [True])
    fresh.planned_step.replayed = True
    with pytest.raises(ValueError, match="1 prefill requests"):
        fresh.end_step()
    assert fresh.seq_len == [0, 0] and fresh.planned_step is not None


def test_discard_step_drops_a_step_whose_layers_all_ran():
    cache = _prefilled()
    cache.plan([0, 1], [21, 10], [20, 9], [False, False])
    _run_layers(cache, 2)
    cache.discard_step()
    assert cache.planned_step is None and cache.seq_len == [20, 9]


def test_a_slot_of_the_planned_step_is_not_released_until_the_step_ends():
    """Review finding: releasing a slot between its step's last layer and ``end_step`` left ``end_step`` failing
    in the prompt commit (the slot FREE) with the step planned for good. The release is refused, nothing freed."""
    cache = _cache()
    cache.plan([0, 1], [20, 9], [0, 0], [True, True])
    _run_layers(cache, 29)
    free = cache.manager.free_pages()
    with pytest.raises(ValueError, match=r"slots \[0\] belong to the planned step"):
        cache.release([0])
    assert cache.manager.free_pages() == free and cache.planned_step is not None
    cache.end_step()
    cache.release([0])
    assert cache.seq_len[0] == 0 and cache.seq_len[1] == 9 and cache.manager.free_pages() > free


def test_a_failed_composite_layer_op_discards_its_step():
    """Review finding: when ``DiffKVAttention`` (the TensorRT / ORT composite op) raised for a bad input, the step
    stayed planned and every later ``DiffKVPageUpdate`` was refused: a stalled engine. The failed op now discards
    the step; after the caller releases the request, the next step plans and runs."""
    from trtllm_diffkv.export import plugin_ops as ops

    cache = _cache()
    handle = torch.tensor([ops.register_cache(cache)])
    i64 = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731

    def page_update(slots, lens, pos, pre):
        token = torch.zeros(1, dtype=torch.int64)
        ops.run_step_page_update([handle, i64(slots), i64(lens), i64(pos), torch.tensor(pre),
                                  cache.manager.page_table.clone(), cache.manager.tokens.clone()], token)
        return token

    def layer(i, num_tokens, token):
        q = torch.randn(num_tokens, HQ, D)
        ops.run_layer_attention([q, torch.randn(num_tokens, H, D), torch.randn(num_tokens, H, D),
                                 cache.pool.pages().clone(), cache.manager.page_table.clone(),
                                 cache.manager.tokens.clone(), handle, token], torch.empty_like(q), {"layer_idx": i})

    token = page_update([0], [10], [0], [True])
    with pytest.raises(ValueError, match="disagree"):
        layer(0, 11, token)  # one token too many for the planned step
    assert cache.planned_step is None
    cache.release([0])
    token = page_update([1], [5], [0], [True])
    for i in range(L):
        layer(i, 5, token)
    assert cache.planned_step is None and cache.seq_len[1] == 5 and cache.seq_len[0] == 0


def test_a_plan_failing_after_its_reservation_gives_the_new_prompts_back(monkeypatch):
    """Breaker finding: an allocation failing after ``reserve_prompt`` (a chunked prompt's staging out of device
    memory) left the slot RESERVED and its pages taken for good: every later request in that slot failed. The
    failed plan now undoes the new prompts' reservations and staging; the slot plans again."""
    from trtllm_diffkv.paged import prefill

    cache = _cache(chunk_staging_bytes=1 << 22)
    free = cache.manager.free_pages()

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated: the staging allocation failed")

    monkeypatch.setattr(prefill, "PromptStaging", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        cache.plan([0, 1], [8, 9], [0, 0], [True, True], prompt_lens=[40, 9])  # slot 0 chunked: staged
    assert cache.planned_step is None and cache.manager.free_pages() == free and not cache.staging
    monkeypatch.undo()
    cache.plan([0, 1], [20, 9], [0, 0], [True, True])
    _run_layers(cache, 29)
    cache.end_step()
    assert cache.seq_len[:2] == [20, 9]


def test_a_failed_plan_gives_back_its_new_prompts_and_leaves_its_decoding_slots_to_the_caller(monkeypatch):
    """The error path of a failed plan with a decoding request beside a new prompt (``plan``'s docstring): the new
    prompt's reservation goes back (its slot plans again), the decoding slot keeps its pages, length and state, and
    its next decode step plans and runs as if the failed plan had never been."""
    from trtllm_diffkv.paged import decode

    cache = _cache()
    cache.plan([0], [20], [0], [True])
    _run_layers(cache, 20)
    cache.end_step()
    held = cache.manager.free_pages()
    before = cache.manager.pages.clone()

    def failing(*args, **kwargs):
        raise RuntimeError("simulated: the decode planning failed")

    monkeypatch.setattr(decode, "plan_decode", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        cache.plan([1, 0], [9, 21], [0, 20], [True, False])  # slot 1's prompt reserved, then the decode part fails
    assert cache.planned_step is None and cache.manager.free_pages() == held
    assert torch.equal(cache.manager.pages, before)  # slot 0's rows untouched, slot 1's reserve back
    assert cache.active_slots == [0] and cache.seq_len[0] == 20
    monkeypatch.undo()
    cache.plan([0], [21], [20], [False])
    _run_layers(cache, 1)
    cache.end_step()
    assert cache.seq_len[0] == 21
    cache.plan([1], [9], [0], [True])
    _run_layers(cache, 9)
    cache.end_step()
    cache.release([0, 1])
    assert cache.manager.free_pages() == cache.manager.num_pages
    cache.manager.check_invariants()
