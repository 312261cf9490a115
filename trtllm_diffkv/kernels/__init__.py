"""Triton kernels of DiffKV: inputs in, outputs out, no policy and no state.

Read path (this package's attention kernels):

* :func:`paged_decode_attention` -- decode attention over mixed-precision
  unified pages, with the DiffKV score update (:mod:`.decode_attention`).
* :func:`scored_prefill_attention` -- causal prompt attention plus the prompt
  scores of the last queries (:mod:`.prefill_attention`).

Importing this package needs Triton; with ``TRITON_INTERPRET=1`` set before
the import, the kernels run on the CPU (tests).
"""
from .decode_attention import DecodeAttention, DecodeWorkspace, decode_bytes, default_num_partitions, paged_decode_attention
from .prefill_attention import scored_prefill_attention

__all__ = ["DecodeAttention", "DecodeWorkspace", "decode_bytes", "default_num_partitions", "paged_decode_attention",
           "scored_prefill_attention"]
