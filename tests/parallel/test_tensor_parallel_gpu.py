"""Tensor parallelism on 2 GPUs over NCCL (not run yet: the 2-GPU machine was withheld; see docs/RUNTIME.md).

The CPU test's scenarios on the Triton path: 2 ranks (``cuda:0``, ``cuda:1``) against the whole model on
``cuda:0``: greedy tokens equal, each rank's per-(layer, KV head) page counts equal the single run's rows
of its heads, every page back at the end.
"""
import pytest
import torch

from conftest import peaked_tiny_llama
from trtllm_diffkv.config import get_preset
from trtllm_diffkv.runtime.sampling import SamplingParams
from support.tensor_parallel import (run_ranks, single_process_runs, tensor_parallel_runs,
                                                   write_checkpoint)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def test_two_gpu_ranks_equal_one_gpu(tmp_path):
    folder = str(write_checkpoint(tmp_path / "peaked", peaked_tiny_llama()))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (20, 33, 9, 50)]
    sizes = dict(max_batch_size=4, max_seq_len=96, use_triton=None)
    scenarios = [dict(kv_config=get_preset(name), num_pages=400, prompts=prompts,
                      params=[SamplingParams.greedy_params(16)] * len(prompts), executor_kwargs=sizes)
                 for name in ("fp16", "k8v4", "diffkv")]
    ranks = run_ranks(tensor_parallel_runs, 2, folder, scenarios, device="cuda", timeout_s=600)
    single = single_process_runs(folder, scenarios, 2, device="cuda:0")
    for i, scenario in enumerate(scenarios):
        for rank, run in enumerate((ranks[0][i], ranks[1][i])):
            assert run["tokens"] == single[i]["tokens"], (scenario["kv_config"].name, rank)
            for pages, ref in zip(run["pages"], single[i]["pages"]):
                assert torch.equal(pages, ref[:, :, rank:rank + 1])
            assert run["final_free"] == run["pool_pages"]
