"""Launch-size arithmetic shared by the kernels' launchers and the TensorRT layer's recorded launches."""


def next_pow2(x: int) -> int:
    """The smallest power of two >= ``x`` (1 for ``x <= 1``): Triton block sizes must be powers of two."""
    return 1 << max(0, (x - 1).bit_length())
