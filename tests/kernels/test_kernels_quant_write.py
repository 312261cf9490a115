"""The write path stores exactly what quant.quantize produces (edge case 2), Triton kernel and torch version.

For every tier format (bits 2/4/8/16 with every group count) and head_dim
(64, 80, 96, 128, 256): ramp codes (0, 1, 2, ... mod 2^bits, each group spanning
the full range) -> quantize -> page -> unpack must come back bit-exact, with
tokens written at different steps (earlier tokens untouched by later writes),
the last page partially filled, rows skipped by a negative page id, keys
centered by a per-row fp16 offset, and ``read_tokens`` giving back
``quant.dequantize`` exactly.

The Triton kernel runs on the CPU only under ``TRITON_INTERPRET=1`` set
before Triton is imported, so its test runs this file as a script in a fresh
interpreter process; the torch version runs in-process.
"""
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAD_DIMS = (64, 80, 96, 128, 256)


def _tiers():
    from trtllm_diffkv.config import TierConfig

    sides = [(8, 1), (4, 2), (2, 4), (8, 2), (4, 1), (2, 2), (8, 4), (4, 4), (2, 1)]
    tiers = [TierConfig(kb, vb, kg, vg) for (kb, kg), (vb, vg) in zip(sides, sides[1:] + sides[:1])]
    return tiers + [TierConfig(16, 16), TierConfig(8, 16, 1, None)]


def _ramp(num_tokens, head_dim, bits, groups, seed):
    """Rows whose codes are a ramp; each group holds code 0 and 2^bits-1 so min/max pin the grid."""
    if bits == 16:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(num_tokens, head_dim, generator=g) * 3
    codes = (torch.arange(num_tokens * head_dim) + seed) % 2**bits
    codes = codes.reshape(num_tokens, groups, head_dim // groups)
    codes[..., 0], codes[..., -1] = 0, 2**bits - 1
    return (codes * 0.25 - 1.0).reshape(num_tokens, head_dim).float()


def check_write_path(write_tokens, read_tokens, head_dims=HEAD_DIMS, tiers=None) -> int:
    """Run every check against ``write_tokens`` / ``read_tokens``; return the number of formats checked."""
    from trtllm_diffkv.config import DiffKVConfig
    from trtllm_diffkv.memory import KVCachePool, PageFormat
    from trtllm_diffkv.quant import dequantize, quantize, unpack_codes

    checked = 0
    for head_dim in head_dims:
        for tier_cfg in tiers or _tiers():
            fmt = PageFormat.for_config(DiffKVConfig(high=tier_cfg, low=tier_cfg, alpha_low=0.0), head_dim,
                                        high_tokens_per_page=4)
            lay = fmt.high
            per_page = lay.tokens_per_page
            n = per_page + per_page // 2 + 1  # one full page, one partial
            pool = KVCachePool(fmt, 4, device="cpu")
            pool.buffer.fill_(0xAB)
            pages = torch.tensor([2, 0, 3], dtype=torch.int32)  # token t -> page pages[t // P], slot t % P
            offsets = (torch.randn(5, head_dim) * 0.5).half()
            keys = _ramp(n, head_dim, tier_cfg.key_bits, tier_cfg.key_groups, 1) + offsets[3].float()
            values = _ramp(n, head_dim, tier_cfg.value_bits, tier_cfg.value_groups, 2)
            scores, positions = torch.rand(n), torch.arange(n, dtype=torch.int32) * 3 + 1
            dest_page = pages[torch.arange(n) // per_page].clone()
            dest_slot = (torch.arange(n) % per_page).to(torch.int32)
            steps = [0, 1, per_page - 1, n]
            for lo, hi in zip(steps, steps[1:]):
                before = pool.buffer.clone()
                page = torch.full((n,), -1, dtype=torch.int32)
                page[lo:hi] = dest_page[lo:hi]  # rows outside this step are skipped
                write_tokens(pool.pages(), fmt, "high", page, dest_slot, keys, values,
                             key_offsets=offsets, offset_rows=torch.full((n,), 3, dtype=torch.int32),
                             scores=scores, positions=positions)
                for t in range(lo):  # earlier tokens' bytes untouched
                    p, s = int(dest_page[t]), int(dest_slot[t])
                    for seg in ("key_codes", "value_codes", "key_meta", "value_meta"):
                        view_now, view_before = pool.segment("high", seg), _view(before, pool, seg)
                        assert torch.equal(view_now[p, s], view_before[p, s]), f"token {t} {seg} changed"
            p, s = dest_page.long(), dest_slot.long()
            centered = keys - offsets[3].float()
            for side, x, bits, groups in (("key", centered, tier_cfg.key_bits, tier_cfg.key_groups),
                                          ("value", values, tier_cfg.value_bits, tier_cfg.value_groups)):
                codes = pool.segment("high", f"{side}_codes")[p, s]
                where = f"head_dim {head_dim}, {tier_cfg}, {side}"
                if bits == 16:
                    assert torch.equal(codes.contiguous().view(torch.float16), x.half()), where
                    continue
                q = quantize(x[None], bits, groups)
                meta = pool.segment("high", f"{side}_meta")[p, s]
                assert torch.equal(codes, q.codes[0]), f"{where}: packed codes differ"
                assert torch.equal(meta[..., 0], q.scale[0]) and torch.equal(meta[..., 1], q.zero[0]), f"{where}: meta"
                if side == "value":  # the ramp comes back code for code
                    ramp = torch.round((x - x.reshape(n, groups, -1).amin(-1).repeat_interleave(head_dim // groups, 1)) / 0.25)
                    assert torch.equal(unpack_codes(codes, bits).long(), ramp.long()), f"{where}: ramp"
            assert torch.equal(pool.segment("high", "score")[p, s], scores)
            assert torch.equal(pool.segment("high", "position")[p, s], positions)
            k_out, v_out = torch.full((n, head_dim), 7.0), torch.full((n, head_dim), 7.0)
            sc_out, pos_out = torch.zeros(n), torch.zeros(n, dtype=torch.int32)
            src = dest_page.clone()
            src[1] = -1
            read_tokens(pool.pages(), fmt, "high", src, dest_slot, k_out, v_out, sc_out, pos_out)
            assert bool((k_out[1] == 7.0).all()), "a skipped row was written"
            keep = torch.arange(n) != 1
            for out, x, bits, groups in ((k_out, centered, tier_cfg.key_bits, tier_cfg.key_groups),
                                         (v_out, values, tier_cfg.value_bits, tier_cfg.value_groups)):
                want = x.half().float() if bits == 16 else dequantize(quantize(x[None], bits, groups))[0]
                assert torch.equal(out[keep], want[keep]), f"head_dim {head_dim}, {tier_cfg}: read_tokens"
            assert torch.equal(sc_out[keep], scores[keep]) and torch.equal(pos_out[keep], positions[keep])
            checked += 1
    return checked


def _view(buffer, pool, seg):
    from trtllm_diffkv.memory import KVCachePool

    copy = KVCachePool.__new__(KVCachePool)
    copy.page_format, copy.num_pages, copy.buffer = pool.page_format, pool.num_pages, buffer
    return copy.segment("high", seg)


def check_error_flags(write_tokens) -> None:
    """Non-finite or beyond-fp16 rows raise their request's flag; other rows are written."""
    from trtllm_diffkv.config import DiffKVConfig
    from trtllm_diffkv.memory import KVCachePool, PageFormat

    fmt = PageFormat.for_config(DiffKVConfig(), 64, high_tokens_per_page=4)
    pool = KVCachePool(fmt, 2, device="cpu")
    keys, values = torch.randn(4, 64), torch.randn(4, 64)
    keys[1, 5], values[3, 0] = float("nan"), 70000.0
    flags = torch.zeros(3, dtype=torch.int32)
    write_tokens(pool.pages(), fmt, "high", torch.tensor([0, 0, 1, 1], dtype=torch.int32),
                 torch.tensor([0, 1, 0, 1], dtype=torch.int32), keys, values, scores=torch.zeros(4),
                 positions=torch.zeros(4, dtype=torch.int32), error_flags=flags,
                 error_index=torch.tensor([0, 1, 1, 2], dtype=torch.int32))
    assert flags.tolist() == [0, 1, 1], flags.tolist()


def check_saturation(write_tokens) -> None:
    """Rows far from 0 with a small range: the fp16 zero point misses the minimum by more than a step
    (1000.3 -> 1000.5, 1000.2 -> 1000.0), so unclamped codes would leave [0, 2**bits - 1]; the stored
    codes saturate exactly as ``quant.quantize`` (checked against the scalar oracle in test_quant.py)."""
    from trtllm_diffkv.config import DiffKVConfig, TierConfig
    from trtllm_diffkv.memory import KVCachePool, PageFormat
    from trtllm_diffkv.quant import quantize

    ramp = torch.linspace(0.0, 0.5, 64)
    x = torch.stack([1000.3 + ramp, 1000.2 + ramp, -1000.3 - ramp])
    for bits, groups in ((8, 1), (4, 2), (2, 1)):
        tier = TierConfig(bits, bits, groups, groups)
        fmt = PageFormat.for_config(DiffKVConfig(high=tier, low=tier, alpha_low=0.0), 64, high_tokens_per_page=4)
        pool = KVCachePool(fmt, 1, device="cpu")
        slots = torch.arange(3, dtype=torch.int32)
        write_tokens(pool.pages(), fmt, "high", torch.zeros(3, dtype=torch.int32), slots, x, x,
                     scores=torch.zeros(3), positions=slots)
        q = quantize(x[None], bits, groups)
        for side in ("key", "value"):
            assert torch.equal(pool.segment("high", f"{side}_codes")[0, :3], q.codes[0]), (bits, groups, side)


def check_rounding_ties(write_tokens) -> None:
    """Values exactly half-way between two codes (issue 43: the ramp rows never feed one): each group spans
    ``[0, (2**bits - 1) / 4]``, so the fp16 zero is 0 and the scale exactly 1/4, and every other value is
    ``(k + 1/2) / 4``: ``y = k + 1/2``, stored as the even one of ``k`` and ``k + 1`` (round half to even, the
    rule of ``torch.round`` and of the scalar quantizer in tests/oracle/quant.py); worked out here, not read back
    from ``quant.quantize``."""
    from trtllm_diffkv.config import DiffKVConfig, TierConfig
    from trtllm_diffkv.memory import KVCachePool, PageFormat
    from trtllm_diffkv.quant import unpack_codes

    head_dim = 64
    for bits, groups in ((8, 1), (4, 2), (2, 4), (4, 1)):
        qmax, width = 2 ** bits - 1, head_dim // groups
        halves = torch.arange(width - 2) % qmax  # k of each tie, every k in [0, qmax) for 4 and 2 bits
        group = torch.cat([torch.tensor([0.0, qmax / 4]), (halves + 0.5) / 4])
        rows = torch.stack([group.repeat(groups), group.flip(0).repeat(groups)])  # the ties at other lanes too
        want = torch.where(rows * 4 % 1 == 0.5, torch.floor(rows * 4) + torch.floor(rows * 4) % 2, rows * 4)
        tier = TierConfig(bits, bits, groups, groups)
        fmt = PageFormat.for_config(DiffKVConfig(high=tier, low=tier, alpha_low=0.0), head_dim, high_tokens_per_page=4)
        pool = KVCachePool(fmt, 1, device="cpu")
        slots = torch.arange(2, dtype=torch.int32)
        write_tokens(pool.pages(), fmt, "high", torch.zeros(2, dtype=torch.int32), slots, rows, rows,
                     scores=torch.zeros(2), positions=slots)
        for side in ("key", "value"):
            codes = unpack_codes(pool.segment("high", f"{side}_codes")[0, :2], bits).long()
            assert torch.equal(codes, want.long()), (bits, groups, side, (codes != want).nonzero()[:4].tolist())


def test_torch_write_path_bit_exact():
    from trtllm_diffkv.paged import torch_ops

    assert check_write_path(torch_ops.write_tokens, torch_ops.read_tokens) == len(HEAD_DIMS) * len(_tiers())
    check_error_flags(torch_ops.write_tokens)
    check_saturation(torch_ops.write_tokens)
    check_rounding_ties(torch_ops.write_tokens)


def test_write_tokens_rejects_bad_shapes():
    pytest.importorskip("triton")
    from trtllm_diffkv.config import DiffKVConfig
    from trtllm_diffkv.kernels.quant_write import write_tokens
    from trtllm_diffkv.memory import KVCachePool, PageFormat

    fmt = PageFormat.for_config(DiffKVConfig(), 64)
    pool = KVCachePool(fmt, 2, device="cpu")
    page = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="keys must be"):
        write_tokens(pool.pages(), fmt, "high", page, page, torch.zeros(2, 32), torch.zeros(2, 64))
    with pytest.raises(ValueError, match="scores fp32"):
        write_tokens(pool.pages(), fmt, "high", page, page, torch.zeros(2, 64), torch.zeros(2, 64))


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from trtllm_diffkv.kernels.quant_write import read_tokens, write_tokens

    from trtllm_diffkv.config import DiffKVConfig

    check_error_flags(write_tokens)
    check_saturation(write_tokens)
    check_rounding_ties(write_tokens)
    # Interpreted programs are slow: every format at head_dim 80 (not a power of two: padded lanes),
    # the default tiers at every other head_dim. The torch version covers the full product in-process.
    count = check_write_path(write_tokens, read_tokens, head_dims=(80,))
    default = DiffKVConfig()
    count += check_write_path(write_tokens, read_tokens, head_dims=(64, 96, 128, 256), tiers=[default.high, default.low])
    print("formats", count)
    print("OK")


def test_triton_write_path_bit_exact_under_interpreter():
    pytest.importorskip("triton")
    from conftest import run_script_under_interpreter

    result = run_script_under_interpreter(__file__, timeout=600)
    assert result.returncode == 0 and result.stdout.rstrip().endswith("OK"), result.stdout[-4000:] + result.stderr[-8000:]


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
