"""Evaluation library code behind the benchmarks and commands: throughput workloads (:mod:`.throughput`,
``trtllm-diffkv bench``) and teacher-forced agreement against a reference generator (:mod:`.accuracy`)."""
