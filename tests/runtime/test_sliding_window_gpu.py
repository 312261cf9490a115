"""Sliding-window layers (Gemma 3) on the GPU: the executor with the Triton kernels and CUDA graphs against
transformers, and the decode kernel at gemma-3-270m's shape over long rows (run on the device; skipped here).

1. The tiny random Gemma 3 (``tests/tiny_gemma.py``: window 8, MQA group 4, head_dim 64) in fp32 on CUDA, the
   executor's defaults there (Triton decisions, decode and prompt kernels, decode replayed from CUDA graphs, the
   overlap scheduler), fp16 preset: greedy tokens equal transformers' (fp32 on the same GPU) up to a swap of a
   near-tie (``tiny_gemma.check_greedy``), logprobs within ``LOGPROB_TOL`` up to there; k8v4 and default:
   each sliding layer's rows hold exactly min(seq, W) high tokens after every step, none while the 130-token prompt
   is half-prefilled in chunks (its K/V in the staging; ``tiny_gemma.check_window_rows``), pages conserved after
   finish and abort.
2. The Triton decode attention at head_dim 256, 4 query heads on 1 KV head, bf16, rows of a full window (512 high
   tokens) and of a full layer (high and low tiers, several partitions) against the dense fp32 reference.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")

STEPS = 24
LOGPROB_TOL = 2e-3  # fp16 pages round K/V; on the CPU twin (test_sliding_window_engines.py) within 1.2e-3


@pytest.fixture(scope="module")
def gemma_cuda(tmp_path_factory):
    from tiny_gemma import hf_greedy, save_tiny_gemma3
    from trtllm_diffkv.model import load_model

    folder = tmp_path_factory.mktemp("tiny_gemma3")
    hf = save_tiny_gemma3(folder, seed=0).to("cuda")
    model, _, config = load_model(folder, device="cuda", dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (61, 5, 23, 130)]
    refs = [hf_greedy(hf, p, STEPS) for p in prompts]
    return model, config, prompts, refs


def _drive(ex, prompts, params, aborts=()):
    ids = [ex.add_request(p, params) for p in prompts]
    tokens = {i: [] for i in ids}
    step = 0
    while ex.has_unfinished():
        if step == 3:
            for k in aborts:
                ex.abort(ids[k])
        for update in ex.step():
            tokens[update.request_id] += update.new_token_ids
        step += 1
    manager = ex.cache.manager
    manager.check_invariants()
    assert manager.free_pages() == manager.num_pages, "pages leaked"
    return [tokens[i] for i in ids]


def test_executor_with_cuda_graphs_equals_transformers(gemma_cuda):
    from trtllm_diffkv.config import get_preset
    from trtllm_diffkv.engine_config import EngineConfig
    from trtllm_diffkv.runtime.executor import Executor
    from trtllm_diffkv.runtime.sampling import SamplingParams
    from tiny_gemma import check_greedy

    model, config, prompts, refs = gemma_cuda
    ex = Executor(model, config, get_preset("fp16"),
                  EngineConfig(max_batch_size=8, max_seq_len=256, max_num_tokens=64, kv_memory_bytes=64 << 20))
    assert ex._graphs is not None and ex.cache.use_triton  # the decode steps replay graphs
    got = _drive(ex, prompts, SamplingParams(max_tokens=STEPS, temperature=0.0))
    assert ex.stats()["overlapped_steps"] > 0
    for i, (tokens, (want_tokens, want_logits)) in enumerate(zip(got, refs)):
        check_greedy(tokens, want_tokens, want_logits, len(prompts[i]), LOGPROB_TOL, f"prompt {i}")
    # logprobs: every step read before the next (no overlap), decode still replayed from the graphs
    ids = [ex.add_request(p, SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=2)) for p in prompts]
    tokens, entries = {i: [] for i in ids}, {i: [] for i in ids}
    while ex.has_unfinished():
        for update in ex.step():
            tokens[update.request_id] += update.new_token_ids
            entries[update.request_id] += update.logprobs or []
    for i, rid in enumerate(ids):
        want_tokens, want_logits = refs[i]
        agree = check_greedy(tokens[rid], want_tokens, want_logits, len(prompts[i]), LOGPROB_TOL, f"prompt {i}")
        logp = torch.log_softmax(want_logits[len(prompts[i]) - 1:].cpu(), -1)
        for step, entry in enumerate(entries[rid][:agree]):
            for token, lp in entry.items():
                assert abs(lp.logprob - float(logp[step, token])) < LOGPROB_TOL, (i, step, token)


@pytest.mark.parametrize("preset", ["k8v4", "diffkv"])
def test_diffkv_presets_hold_the_window_and_return_every_page(gemma_cuda, preset):
    from trtllm_diffkv.config import get_preset
    from trtllm_diffkv.engine_config import EngineConfig
    from trtllm_diffkv.runtime.executor import Executor
    from trtllm_diffkv.runtime.sampling import SamplingParams
    from tiny_gemma import check_window_coverage, check_window_rows

    model, config, prompts, _ = gemma_cuda
    ex = Executor(model, config, get_preset(preset),
                  EngineConfig(max_batch_size=8, max_seq_len=256, max_num_tokens=64, kv_memory_bytes=64 << 20))
    cache, checked = ex.cache, []
    for p in prompts:
        ex.add_request(p, SamplingParams(max_tokens=STEPS, temperature=0.0))
    while ex.has_unfinished():
        ex.step()
        torch.cuda.synchronize()
        checked += check_window_rows(cache)
    assert cache.manager.free_pages() == cache.manager.num_pages
    # every request's sliding rows at (nearly) each of its steps; the 5-token prompt crosses the window, the
    # 130-token one is half-prefilled after step 1 (slot 3, 35 of its tokens staged)
    n_sliding = sum(w is not None for w in config.sliding_windows)
    check_window_coverage(checked, cache, len(prompts) * (STEPS - 1) * n_sliding)
    _drive(ex, prompts, SamplingParams(max_tokens=STEPS, temperature=0.0), aborts=(0, 3))


@pytest.mark.parametrize("preset", ["k8v4", "diffkv", "fp16"])
def test_decode_kernel_at_gemma3_270m_shape_long_rows(preset):
    """A sliding layer's row (512 high tokens) and a full layer's (700 high, 1300 low), bf16 queries, 4 partitions."""
    from trtllm_diffkv.config import PRESETS
    from trtllm_diffkv.kernels import DecodeWorkspace, paged_decode_attention
    from trtllm_diffkv.memory import PageFormat
    from support.attention import build_paged_rows, decode_reference, rel_err

    fmt = PageFormat.for_config(PRESETS[preset], 256)
    rows = build_paged_rows(fmt, [(512, 0), (700, 1300)], seed=3, device="cuda")
    row_ids = torch.arange(2, dtype=torch.int32, device="cuda").view(2, 1)
    q = torch.randn(2, 4, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).cuda()
    out = torch.full_like(q, float("nan"))
    update = fmt.high.score.size_bytes > 0
    ws = DecodeWorkspace.allocate(2, 4, 1, fmt, rows.page_table.shape[1], "cuda", num_partitions=4,
                                  update_scores=update)
    paged_decode_attention(q, rows.pool.pages(), fmt, rows.page_table, rows.tier_tokens, row_ids, out,
                           sm_scale=256 ** -0.5, update_scores=update, workspace=ws)
    torch.cuda.synchronize()
    ref, _ = decode_reference(q.float().cpu(), rows, row_ids.cpu(), 256 ** -0.5)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-2
