"""The reference quantizer gives the same bytes on the GPU as on the CPU (issue 6, found and fixed).

torch on CUDA computes ``tensor / python_number`` as a multiplication by the reciprocal, whose fp16 rounding is one
step off the IEEE quotient at ties; the reference cache then stored other scales than the Triton write kernels and
the GPU lockstep tests differed (``tests/paged/test_paged_gpu.py``). ``quant.quantize`` divides by a tensor since. The
device repro that found it (a 915-line lockstep dump) is gone; its device-against-CPU check of ``quantize`` is this
test. Run on the device: ``python3 -m pytest -q -m gpu tests/core/test_quant_gpu.py``.
"""
import pytest
import torch

from trtllm_diffkv.quant import quantize

pytestmark = pytest.mark.gpu

GROUPINGS = ((8, 1), (4, 2), (4, 1), (2, 4))
"""(bits, groups) of the presets' tiers: K8, K4 in two groups, V4, V2 in four groups."""


@pytest.mark.parametrize("bits, groups", GROUPINGS)
def test_quantize_on_cuda_equals_the_cpu_bit_for_bit(bits, groups):
    """Codes, scales and zeros of 65k random rows (and the fp16 tie of ``test_quant.py``, span / 15) are equal."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(1, 1 << 16, 64, generator=g) * 3
    tie = torch.tensor([0.0, 7.2821045] + [1.0] * 62).view(1, 1, 64)
    x = torch.cat([rows, tie], dim=1)
    cpu, gpu = quantize(x, bits, groups), quantize(x.cuda(), bits, groups)
    for field in ("scale", "zero", "codes"):
        assert torch.equal(getattr(gpu, field).cpu(), getattr(cpu, field)), field
