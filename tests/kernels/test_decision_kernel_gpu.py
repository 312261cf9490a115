"""The decision kernel (``kernels/decision_kernel.py``) on the GPU equals ``paged.decisions.decide`` run on the
CPU, bit for bit, on random tier states with ties, NaN/inf scores, empty tiers and absent candidates, for every
compressing preset (the GPU's fp32 division must be the IEEE one).

Run on the device: ``python3 -m pytest -q -m gpu tests/kernels/test_decision_kernel_gpu.py``.
"""
import pytest
import torch

from test_decision_kernel import random_state
from trtllm_diffkv.config import PRESETS

pytestmark = pytest.mark.gpu


def test_decision_kernel_on_gpu_equals_reference():
    from trtllm_diffkv.kernels.decision_kernel import alpha_tensor, decide_rows
    from trtllm_diffkv.paged import decisions

    configs = [c.replace(recent_window_tokens=min(c.recent_window_tokens, 8),
                         prompt_score_window_tokens=min(c.prompt_score_window_tokens, 16))
               for c in PRESETS.values() if c.compress]
    for ci, cfg in enumerate(configs):
        for seed in range(2):
            pool, fmt, table, tokens, slots, pos, prompt_len = random_state(
                cfg, 1000 * ci + seed, num_seqs=12, num_layers=3, num_kv_heads=2, max_pos=300, num_pages=6000)
            G = 6
            rows = (slots[:, None] * G + torch.arange(G)).reshape(-1)
            want = decisions.decide(pool, table, tokens, rows, pos.repeat_interleave(G),
                                    prompt_len[slots].repeat_interleave(G), alpha_high=cfg.alpha_high,
                                    alpha_low=cfg.alpha_low, recent_window_tokens=cfg.recent_window_tokens,
                                    prompt_score_window_tokens=cfg.prompt_score_window_tokens, max_pos=int(pos.max()))
            cuda = lambda t: t.cuda()  # noqa: E731
            # one row (default), a layer's 2 KV heads, 8 rows over 3 layers; blocks of 32 and 256 tokens (several
            # loop iterations a row, and one)
            for rows_per_program, block in ((1, 128), (2, 128), (8, 128), (1, 32), (1, 256)):
                got = decide_rows(cuda(pool.pages()), fmt, cuda(table), cuda(tokens), cuda(slots), cuda(pos),
                                  cuda(prompt_len), alpha_tensor(cfg.alpha_high, cfg.alpha_low, "cuda"),
                                  rows_per_slot=G, recent_window_tokens=cfg.recent_window_tokens,
                                  prompt_score_window_tokens=cfg.prompt_score_window_tokens,
                                  rows_per_program=rows_per_program, block_tokens=block)
                for name, a, b in zip(("high_delta", "low_delta", "new_index", "move_from", "move_to"), got,
                                      (want.high_delta, want.low_delta, want.new_index, want.move_from,
                                       want.move_to)):
                    assert torch.equal(a.cpu(), b), (
                        f"{cfg.name} seed {seed} rows {rows_per_program} block {block}: {name} differs")
