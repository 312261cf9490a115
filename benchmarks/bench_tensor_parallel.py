"""Decode throughput at tensor_parallel_size 2 against 1 (issue 23): the Llama-3-8B shape, random bf16 weights.

For each ``tp`` in ``--tp`` it spawns ``tp`` ranks (:func:`support.tensor_parallel.run_ranks`:
NCCL, rank ``r`` on ``cuda:r``; gloo on the CPU with ``--smoke``). Each rank builds its shard of a random
model directly on its device (:class:`~trtllm_diffkv.parallel.sharding.WeightShard` shapes, N(0, 0.02^2)
matrices, :func:`trtllm_diffkv.evaluation.throughput.random_llama`; the weights differ between tp values,
which does not change a step's cost), runs an ``Executor`` with
:class:`~trtllm_diffkv.parallel.executor_hook.TensorParallelHook` over ``--batch`` requests of
``--prompt-tokens`` random ids and ``--max-tokens`` greedy tokens (``ignore_eos``), and times every step
(synchronized). tp=1 runs through the same spawn and hook (a group of one: its collectives are no-ops),
so both rows have CUDA graphs off (graphs over collectives are not wired).

Rows: ``tp``, ``preset``, ``batch``, ``prompt_tokens``, ``max_tokens``, ``output_tokens_per_s`` (all tokens
over the wall time of all steps), ``median_decode_step_ms`` (steps without a prefill), ``pool_pages`` (per
rank). Writes ``benchmarks/results/tensor_parallel.json`` (``gpu``, ``date``, ``commit``, ``command``, ``rows``).

    python benchmarks/bench_tensor_parallel.py                    # 2 GPUs: Llama-3-8B shape, tp 1 and 2
    python benchmarks/bench_tensor_parallel.py --smoke --output /tmp/tp.json    # CPU, tiny shape, gloo
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

import torch

import repo_paths  # noqa: E402

repo_paths.use_checkout()  # the package and tests/support

from trtllm_diffkv.evaluation.throughput import LLAMA3_8B_SHAPE, TINY_SHAPE, environment  # noqa: E402
from support.tensor_parallel import run_ranks  # noqa: E402

DEFAULT_OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tensor_parallel.json")


def rank_run(group, shape: dict, preset: str, batch: int, prompt_tokens: int, max_tokens: int,
             kv_memory_fraction: float | None, kv_memory_bytes: int | None) -> dict:
    """One rank's timed run (module docstring); every rank returns its own timings."""
    from trtllm_diffkv.config import get_preset
    from trtllm_diffkv.evaluation.throughput import random_llama
    from trtllm_diffkv.model import ModelConfig
    from trtllm_diffkv.parallel.executor_hook import TensorParallelHook
    from trtllm_diffkv.parallel.sharding import WeightShard, local_kv_config, make_row_parallel
    from trtllm_diffkv.engine_config import EngineConfig
    from trtllm_diffkv.runtime.executor import Executor
    from trtllm_diffkv.runtime.sampling import SamplingParams

    config = ModelConfig(**shape)
    local = WeightShard(group.rank, group.world_size).config(config)
    dtype = torch.bfloat16 if group.device.type == "cuda" else torch.float32
    model = make_row_parallel(random_llama(local, device=group.device, dtype=dtype, seed=group.rank), group)
    engine = EngineConfig(max_batch_size=batch, max_seq_len=prompt_tokens + max_tokens,
                          kv_memory_fraction=kv_memory_fraction, kv_memory_bytes=kv_memory_bytes, use_cuda_graphs=False)
    executor = Executor(model, local, local_kv_config(get_preset(preset), group.world_size), engine,
                        parallel=TensorParallelHook(group))
    g = torch.Generator().manual_seed(0)  # the same prompts on every rank
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for _ in range(batch):
        executor.add_request(torch.randint(0, config.vocab_size, (prompt_tokens,), generator=g).tolist(), params)
    sync = torch.cuda.synchronize if group.device.type == "cuda" else (lambda: None)
    decode_ms, total_s, tokens = [], 0.0, 0
    while executor.has_unfinished():
        prefill = bool(executor.waiting)
        sync()
        t0 = time.perf_counter()
        updates = executor.step()
        sync()
        dt = time.perf_counter() - t0
        total_s += dt
        tokens += sum(len(u.new_token_ids) for u in updates)
        if not prefill:
            decode_ms.append(dt * 1e3)
    return dict(output_tokens=tokens, wall_s=total_s, median_decode_step_ms=statistics.median(decode_ms),
                pool_pages=executor.rm.get_max_resource_count())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes to run (default: 1,2)")
    p.add_argument("--preset", default="llama3-8b", help="DiffKV preset (default: llama3-8b; the smoke: diffkv)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kv-memory-fraction", type=float, default=0.5, help="per rank, of its free GPU memory")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shape, gloo, batch 4 x 32 + 16 tokens")
    p.add_argument("--output", default=DEFAULT_OUTPUT)
    args = p.parse_args(argv)
    shape, device, bytes_, fraction = LLAMA3_8B_SHAPE, "cuda", None, args.kv_memory_fraction
    if args.smoke:
        shape, device, bytes_, fraction = TINY_SHAPE, "cpu", 16 << 20, None
        args.preset, args.batch, args.prompt_tokens, args.max_tokens = "diffkv", 4, 32, 16
    rows = []
    for tp in (int(t) for t in args.tp.split(",")):
        ranks = run_ranks(rank_run, tp, shape, args.preset, args.batch, args.prompt_tokens, args.max_tokens,
                          fraction, bytes_, device=device, timeout_s=1800)
        r0 = ranks[0]
        rows.append(dict(tp=tp, preset=args.preset, batch=args.batch, prompt_tokens=args.prompt_tokens,
                         max_tokens=args.max_tokens, output_tokens_per_s=r0["output_tokens"] / r0["wall_s"],
                         median_decode_step_ms=r0["median_decode_step_ms"], pool_pages=r0["pool_pages"]))
        print(json.dumps(rows[-1]), flush=True)
    out = dict(**environment(), command="python " + " ".join(shlex.quote(a) for a in sys.argv), rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
