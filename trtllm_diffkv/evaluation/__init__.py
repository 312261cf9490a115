"""Evaluation and calibration of DiffKV configurations against the uncompressed cache: quality vs
memory with the paper's baselines in the same cache protocol (``trtllm-diffkv eval``, docs/QUALITY.md),
and per-model calibration (``trtllm-diffkv calibrate``)."""
