"""Independent test oracles for the DiffKV reference path (issue 11).

Everything here is written plainly, loop by loop, from the rules in
``shared/reference/DiffKV.md`` and the project brief, and shares no code with
``trtllm_diffkv.policy``, ``trtllm_diffkv.quant`` or ``trtllm_diffkv.cache``:

* :mod:`oracle.rules`: the prompt and decode tier rules (thresholds, recent
  window, candidate, victim, the N of ``alpha / N``, query counts);
* :mod:`oracle.attention`: dense float64 attention (causal prefill, decode over
  the kept tokens) and the prompt score sums with the GQA merge;
* :mod:`oracle.quant`: a scalar re-implementation of the asymmetric min/max
  quantizer and the bit packing (golden bytes), per-group error bounds and
  level counts;
* :mod:`oracle.checked_cache`: a backend wrapper that checks every prefill and
  decode step of a ``DiffKVReferenceCache`` against the three above, and the
  memory accounting.
"""
