"""Edge case 2 end to end: ramp codes -> quantize -> unified pages (written over several steps,
last page partial) -> unpack, bit-exact, for every tier format and head_dim."""
import pytest
import torch

from trtllm_diffkv.config import DiffKVConfig
from trtllm_diffkv.memory import KVCachePool, PageFormat
from trtllm_diffkv.quant import QuantizedKV, dequantize, quantize, unpack_codes


def _ramp_rows(num_tokens, head_dim, bits, groups):
    """Rows whose quantization codes are a ramp (0, 1, 2, ... mod 2^bits), each group spanning the full range."""
    codes = (torch.arange(num_tokens * head_dim) % 2**bits).reshape(num_tokens, groups, head_dim // groups)
    codes[..., 0], codes[..., -1] = 0, 2**bits - 1
    return (codes * 0.25 - 1.0).reshape(1, num_tokens, head_dim), codes.reshape(num_tokens, head_dim).to(torch.uint8)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("tier", ["high", "low"])
def test_codes_through_pages_bit_exact(head_dim, tier):
    fmt = PageFormat.for_config(DiffKVConfig(), head_dim)
    layout = fmt.tier(tier)
    tokens_per_page = layout.tokens_per_page
    pool = KVCachePool(fmt, 3, device="cpu")
    num_tokens = tokens_per_page + tokens_per_page // 2 + 1  # one full page, one partial
    steps = [0, 5, tokens_per_page - 1, num_tokens]  # three writes, one of them crossing the page boundary
    written = {}
    for side in ("key", "value"):
        bits = getattr(layout.tier, f"{side}_bits")
        groups = getattr(layout.tier, f"{side}_groups")
        rows, codes = _ramp_rows(num_tokens, head_dim, bits, groups)
        q = quantize(rows, bits, groups)
        code_view, meta_view = pool.segment(tier, f"{side}_codes"), pool.segment(tier, f"{side}_meta")
        for lo, hi in zip(steps, steps[1:]):
            before = code_view.clone()
            for t in range(lo, hi):
                page, slot = divmod(t, tokens_per_page)
                code_view[page, slot] = q.codes[0, t]
                meta_view[page, slot, :, 0], meta_view[page, slot, :, 1] = q.scale[0, t], q.zero[0, t]
            # tokens written at earlier steps are untouched by later appends
            for t in range(lo):
                page, slot = divmod(t, tokens_per_page)
                assert torch.equal(code_view[page, slot], before[page, slot])
        written[side] = (codes, rows, bits)
    for side, (codes, rows, bits) in written.items():
        flat_codes = pool.segment(tier, f"{side}_codes").reshape(-1, pool.segment(tier, f"{side}_codes").shape[-1])
        flat_meta = pool.segment(tier, f"{side}_meta").reshape(-1, *pool.segment(tier, f"{side}_meta").shape[2:])
        back = unpack_codes(flat_codes[:num_tokens], bits)
        assert torch.equal(back, codes), f"{side} codes differ"
        q = QuantizedKV(flat_codes[:num_tokens][None], flat_meta[:num_tokens, :, 0][None],
                        flat_meta[:num_tokens, :, 1][None], bits, head_dim)
        assert torch.equal(dequantize(q), rows)
