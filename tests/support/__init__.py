"""Helpers the tests, benchmarks and tools share (not part of the product, in no wheel), imported as ``support``:
the tests find it through pytest's pythonpath (``tests/``), benchmarks and tools through
``benchmarks/repo_paths.py``.

- :mod:`.attention`: hand-built paged rows and dense references for the attention kernels;
- :mod:`.page_manager`: the page manager's lockstep driver (CPU oracle vs Triton) and call generators;
- :mod:`.paged_oracle`: a request's pages read back as dense K/V (the paged oracle);
- :mod:`.paged`: the paged cache's lockstep runs against the reference cache;
- :mod:`.nvrtc`: the CUDA decode kernel's register cap as the GPU's NVRTC settles it, without a GPU.

The independent references the tests assert against live in ``tests/oracle/``.
"""
