"""Lockstep drivers of the tensor-parallel tests: N rank processes over gloo/NCCL, and the same run in one process.

:func:`run_ranks` spawns the ranks and returns what each rank's function returned.
:func:`record_executor_run` drives one executor through a scripted run (requests, an optional abort)
and records, after every step, the logits of the step, each slot's per-(layer, KV head) page and
token counts and the free pages, so a rank's run can be compared with the single-process run of the
same requests (its KV heads' slice).
"""
from __future__ import annotations

import json
import pickle
import traceback
from pathlib import Path

import torch

from trtllm_diffkv.memory import PageFormat
from trtllm_diffkv.paged.row_meta import RowMetadataFormat
from trtllm_diffkv.runtime.resource_manager import pages_in_budget


def write_checkpoint(folder, model) -> Path:
    """Write ``model`` (a :class:`~trtllm_diffkv.model.LlamaForCausalLM`) as a HF folder: ``config.json`` and
    ``model.safetensors`` (no tokenizer). Returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = model.config
    hf = {"architectures": [c.architecture], "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
          "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
          "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
          "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
          "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
          "hidden_act": "silu"}
    (folder / "config.json").write_text(json.dumps(hf))
    tensors = {name: t.detach().contiguous().clone() for name, t in model.state_dict().items()}
    if c.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def budget_for_pages(model_config, kv_config, num_pages: int, *, max_batch_size: int, max_seq_len_tokens: int,
                     high_tokens_per_page: int) -> int:
    """The smallest ``kv_memory_bytes`` whose pool holds ``num_pages`` pages (bisection over
    :func:`~trtllm_diffkv.runtime.resource_manager.pages_in_budget`)."""
    fmt = PageFormat.for_config(kv_config, model_config.head_dim, high_tokens_per_page)
    sizes = dict(max_slots=max_batch_size, rows_per_slot=model_config.num_layers * model_config.num_kv_heads,
                 max_seq_len_tokens=max_seq_len_tokens,
                 row_bytes=RowMetadataFormat.for_config(kv_config, model_config.head_dim).row_bytes)
    low, high = 1, 1 << 40
    while low < high:
        mid = (low + high) // 2
        if pages_in_budget(mid, fmt, **sizes) >= num_pages:
            high = mid
        else:
            low = mid + 1
    return low


def record_executor_run(executor, prompts, params, abort_after: dict | None = None) -> dict:
    """Run ``prompts`` (request ids 0..n-1) to the end on ``executor``; record every step.

    Args:
        executor: an :class:`~trtllm_diffkv.runtime.executor.Executor` (a rank's or the whole model's).
        prompts: token-id lists; params: one ``SamplingParams`` per prompt.
        abort_after: ``{request_id: step}``: abort the request after that many steps (0-based count).

    Returns:
        dict: ``tokens`` (request id -> output ids), ``finish`` (id -> finish reason), ``logits`` (one
        float32 ``[rows, vocab]`` tensor per model call), ``pages``/``tokens_per_row`` (per step: int32
        ``[max_slots, num_layers, num_kv_heads, 2]`` from the page manager's snapshot), ``free`` (per step:
        this pool's free pages), ``free_estimate`` (per step: the scheduler's free count),
        ``free_after_abort`` (id -> (free before, free after, pages the slot held)), ``preemptions``,
        ``pool_pages``, ``final_free``, ``key_rotation`` (``float32 [num_layers, num_kv_heads, head_dim,
        head_dim]``, the rotations the executor's model runs, or ``None``).
    """
    logits = []
    handle = executor.model.register_forward_hook(lambda _m, _i, out: logits.append(out.detach().clone()))
    rm = executor.rm
    local_free = getattr(rm, "local_free_pages", rm.free_pages)
    rotations = [layer.self_attn.key_rotation for layer in executor.model.model.layers]
    out = dict(tokens={}, finish={}, logits=logits, pages=[], tokens_per_row=[], free=[], free_estimate=[],
               free_after_abort={}, key_rotation=None if rotations[0] is None else torch.stack(rotations).cpu())
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            executor.add_request(prompt, p, request_id=i)
        step = 0
        while executor.has_unfinished():
            for update in executor.step():
                if update.finished:
                    out["tokens"][update.request_id] = list(update.result.token_ids)
                    out["finish"][update.request_id] = update.finish_reason
            snap = executor.cache.manager.snapshot()
            out["pages"].append(snap.pages.clone())
            out["tokens_per_row"].append(snap.tokens.clone())
            out["free"].append(local_free())
            out["free_estimate"].append(executor.scheduler.free_estimate)
            for rid, at in (abort_after or {}).items():
                request = executor.requests.get(rid)
                if at == step and request is not None:
                    held = int(snap.pages[request.slot].sum()) if request.slot is not None else 0
                    before = local_free()
                    executor.abort(rid)
                    out["free_after_abort"][rid] = (before, local_free(), held)
            step += 1
    finally:
        handle.remove()
    out["preemptions"] = executor.scheduler.preemptions
    out["pool_pages"] = rm.get_max_resource_count()
    out["final_free"] = local_free()
    return out


def _scenario_executor(model, model_config, scenario, parallel=None, pages_scale: int = 1):
    from trtllm_diffkv.engine_config import EngineConfig
    from trtllm_diffkv.runtime.executor import Executor

    kw = dict(scenario.get("executor_kwargs", {}))
    kw.setdefault("high_tokens_per_page", 4)
    kw.setdefault("use_triton", False)
    kv = scenario["kv_config"]
    kw["kv_memory_bytes"] = budget_for_pages(model_config, kv, scenario["num_pages"] * pages_scale,
                                             max_batch_size=kw["max_batch_size"], max_seq_len_tokens=kw["max_seq_len"],
                                             high_tokens_per_page=kw["high_tokens_per_page"])
    return Executor(model, model_config, kv, EngineConfig(**kw), parallel=parallel)


def tensor_parallel_runs(group, folder, scenarios) -> list[dict]:
    """A rank's :func:`record_executor_run` of each scenario over its shard of the checkpoint in ``folder``.

    Each scenario: ``kv_config`` (the whole model's), ``num_pages`` (per rank), ``prompts``, ``params``,
    ``executor_kwargs`` (``max_batch_size``, ``max_seq_len`` required), optional ``abort_after``.
    """
    from trtllm_diffkv.parallel.executor_hook import TensorParallelHook
    from trtllm_diffkv.parallel.sharding import load_model_shard, local_kv_config

    model, _tokenizer, local_config = load_model_shard(folder, group)
    out = []
    for scenario in scenarios:
        scenario = dict(scenario, kv_config=local_kv_config(scenario["kv_config"], group.world_size))
        executor = _scenario_executor(model, local_config, scenario, TensorParallelHook(group))
        out.append(record_executor_run(executor, scenario["prompts"], scenario["params"], scenario.get("abort_after")))
    return out


def single_process_runs(folder, scenarios, tensor_parallel_size: int, device="cpu") -> list[dict]:
    """The same scenarios on the whole model in this process (on ``device``), each pool ``tensor_parallel_size``
    times a rank's pages (the ranks' pools together)."""
    from trtllm_diffkv.model.loader import load_model

    model, _tokenizer, config = load_model(folder, device=device)
    return [record_executor_run(_scenario_executor(model, config, s, pages_scale=tensor_parallel_size),
                                s["prompts"], s["params"], s.get("abort_after")) for s in scenarios]


def _rank_main(rank: int, world_size: int, init_method: str, fn, args, results) -> None:
    from trtllm_diffkv.parallel.groups import destroy_tensor_parallel, init_tensor_parallel

    try:
        torch.set_num_threads(1)
        group = init_tensor_parallel(rank, world_size, init_method, torch.device("cpu") if not torch.cuda.is_available()
                                     else None)
        results.put((rank, True, pickle.dumps(fn(group, *args))))  # plain pickle: no shared-memory tensors
    except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_tensor_parallel()


def run_ranks(fn, world_size: int, *args, device: str = "cpu", timeout_s: float = 120.0) -> list:
    """Spawn ``world_size`` processes; rank ``r`` runs ``fn(group, *args)`` (``fn`` importable by name).

    Args:
        device: ``"cpu"`` (gloo; CUDA hidden from the ranks) or ``"cuda"`` (NCCL, rank r on ``cuda:r``).

    Returns:
        ``[fn's result of rank 0, of rank 1, ...]`` (picklable values).

    Raises:
        RuntimeError: a rank raised (its traceback) or did not answer within ``timeout_s``.
    """
    import os
    import queue as queue_module

    from trtllm_diffkv.parallel.groups import local_init_method

    init_method = local_init_method()
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # children inherit it: gloo on the CPU
    try:
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, init_method, fn, args, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
    finally:
        if device == "cpu":
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
    out, errors = {}, []
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout_s)
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
    except queue_module.Empty:
        errors.append(f"a rank did not answer within {timeout_s} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [out[r] for r in range(world_size)]
