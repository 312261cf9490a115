"""Quality-vs-memory evaluation: tasks from real data, the paper's baselines in the same cache
protocol, metrics with noise bands (``trtllm-diffkv eval``, docs/QUALITY.md)."""
