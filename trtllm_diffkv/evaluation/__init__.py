"""Evaluation library code behind the benchmarks and commands: throughput workloads (:mod:`.throughput`,
``trtllm-diffkv bench``), teacher-forced agreement against a reference generator (:mod:`.accuracy`), quality vs
memory with the paper's baselines in the same cache protocol (:mod:`.quality`, :mod:`.tasks`, :mod:`.baselines`;
``trtllm-diffkv eval``, docs/QUALITY.md) and per-model calibration (:mod:`.calibration`, ``trtllm-diffkv
calibrate``) and the client of a running server (:mod:`.serving_client`, ``trtllm-diffkv bench --server-url``)."""
