"""What a step with a prompt chunk costs next to an unchunked prefill and a decode-only step (issue 22).

Random-weight bf16 models (:func:`trtllm_diffkv.evaluation.throughput.random_llama`), random prompt ids, the
``diffkv`` preset (the tiered point), the GPU executor (Triton kernels, CUDA-graph decode). Two measurements per
model shape:

* **isolated steps**: ``--batch`` - 1 requests decoding at ``--context`` tokens, then, repeated, one prompt
  added and the steps until its first token timed (``torch.cuda.synchronize`` around each
  :meth:`Executor.step`), the prompt aborted, one decode-only step timed. Cases: ``decode`` (decode-only),
  ``short`` (a 150-token prompt whole), ``long_whole`` (a 2146-token prompt in one step, chunking off),
  ``long_chunk1`` / ``long_chunk2`` (the same prompt at ``max_num_tokens`` 2048: its first chunk, then its
  final chunk), ``two_short_chunked`` (two 150-token prompts whole in a step that also carries a chunk),
  ``short_alone`` / ``long_alone`` (the prompt's step with no request decoding beside it), ``decode_eager`` (the
  decode-only step without CUDA graphs).
* **closed loop** (``--closed-loop``): the servers benchmark's schedule without the servers: ``--concurrency``
  requests always live (a finished one is replaced at once), prompt lengths of
  ``benchmarks/prompts/humaneval_mixed_long.jsonl`` under the default model's tokenizer (one in eight ~2.2k
  tokens), 128 greedy tokens each with ``ignore_eos``, at ``max_num_tokens`` 2048 (chunked), 8192 (chunked on,
  no prompt chunked) and chunking off. Per config: output tokens/s, requests/s, executor TTFT p50/p99 (added
  -> first token), and per step class (``decode``, ``prefill``: whole prompts only, ``chunk``: a step with a
  chunk) the count and median / mean ms. Each configuration runs a short pass first (discarded) so that kernel
  compilations for its shapes do not land in the measured one. Isolated cases report the median and the minimum.

Writes JSON (``--out``) and prints a table. ``--smoke``: a 2-layer model on the CPU, seconds. ``--profile FILE``:
torch-profiler tables (top operators by host and by device time) of one whole-prompt step and one final-chunk
step, and cProfile tables (Python functions by cumulative time) of those and of ``long_alone`` / ``decode_eager``.

    python benchmarks/bench_mixed_step.py --out /tmp/mixed.json                 # H200: SmolLM2 + Llama-3-8B shapes
    python benchmarks/bench_mixed_step.py --smoke --out /tmp/mixed.json         # CPU check
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trtllm_diffkv.config import get_preset  # noqa: E402
from trtllm_diffkv.engine_config import EngineConfig  # noqa: E402
from trtllm_diffkv.evaluation.throughput import LLAMA3_8B_SHAPE, TINY_SHAPE, environment, random_llama  # noqa: E402
from trtllm_diffkv.model import ModelConfig  # noqa: E402
from trtllm_diffkv.runtime.executor import Executor  # noqa: E402
from trtllm_diffkv.runtime.sampling import SamplingParams  # noqa: E402

SMOLLM2_135M_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                          max_position_embeddings=8192, tie_word_embeddings=True)
HUMANEVAL_MIXED_LONG_TOKENS = (132, 114, 95, 149, 2146, 114, 124, 212, 126, 195, 146, 165, 2197, 183, 83, 172)
"""Prompt lengths of ``benchmarks/prompts/humaneval_mixed_long.jsonl`` under the default model's tokenizer."""


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _executor(model, config, device, *, batch, max_num_tokens, chunked, split, max_seq_len=8192,
              use_cuda_graphs=None):
    kw = dict(kv_memory_fraction=0.5) if device.type == "cuda" else dict(kv_memory_bytes=64 << 20)
    return Executor(model, config, get_preset("diffkv"),
                    EngineConfig(max_batch_size=batch, max_num_tokens=max_num_tokens, enable_chunked_prefill=chunked,
                                 max_seq_len=max_seq_len, use_cuda_graphs=use_cuda_graphs, split_mixed_steps=split, **kw))


def _classify(ex, log: list) -> None:
    """Record each step's class (decode / prefill / chunk) by wrapping the executor's run of a scheduled batch."""
    run = ex._run

    def recorded(batch, updates, t0):
        chunk = any(r.num_cached_tokens or r.num_new_tokens < len(r.prefill_token_ids) for r in batch.context_requests)
        log.append("chunk" if chunk else "prefill" if batch.context_requests else "decode")
        return run(batch, updates, t0)

    ex._run = recorded


def _timed_step(ex, device) -> tuple[float, list]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    updates = ex.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t) * 1e3, updates


def _profiled(ex, device, path: str | None, label: str):
    """Time one step; with ``path``, under the torch profiler: its top operators by host time and by device time
    appended to ``path``."""
    if path is None:
        return _timed_step(ex, device)
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        result = _timed_step(ex, device)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    cuda_table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15) \
        if device.type == "cuda" else ""
    with open(path, "a") as f:
        f.write(f"=== {label}: {result[0]:.1f} ms\n{table}\n{cuda_table}\n")
    return result


def _host_profiled(ex, device, path: str, label: str):
    """Time one step under cProfile; the Python functions by cumulative time appended to ``path``."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    result = _timed_step(ex, device)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(45)
    with open(path, "a") as f:
        f.write(f"=== {label} (cProfile): {result[0]:.1f} ms\n{buf.getvalue()}\n")
    return result


def _host_profiled_prompt(ex, device, path: str, label: str, ids: list[int] | None, params, steps_before: int = 0):
    """Add a prompt of ``ids`` (none: profile the decodes alone), run ``steps_before`` steps, profile the next one
    with :func:`_host_profiled`, then abort the prompt and step once (its pages back)."""
    rid = ex.add_request(ids, params) if ids is not None else None
    for _ in range(steps_before):
        ex.step()
    _host_profiled(ex, device, path, label)
    if rid is not None:
        ex.abort(rid)
        ex.step()


def isolated(model, config, device, *, batch, context, repeats, split, long_tokens=2146, short_tokens=150,
             profile_path: str | None = None) -> dict:
    """Median ms of each case (module docstring), ``batch - 1`` requests decoding at ``context`` tokens;
    ``profile_path``: the last round's ``long_whole`` and ``long_chunk2`` steps profiled into that file;
    ``split``: the executors' ``split_mixed_steps`` (the eager decode case never splits)."""
    vocab, out = config.vocab_size, {}
    params = SamplingParams(max_tokens=8, temperature=0.0)
    background = SamplingParams(max_tokens=min(4096, config.max_position_embeddings - context - 64), temperature=0.0,
                                ignore_eos=True)
    case_sets = (("whole", 8192, False, None), ("chunked", 2048, True, None), ("alone", 8192, False, None),
                 ("eager", 8192, False, False))
    for case_set, mnt, chunked, graphs in case_sets:
        ex = _executor(model, config, device, batch=batch, max_num_tokens=mnt, chunked=chunked, split=split,
                       use_cuda_graphs=graphs)
        if case_set != "alone":
            for i in range(batch - 1):
                ex.add_request(_ids(context, vocab, 100 + i), background)
            for _ in range(3):
                ex.step()
        cases = dict(whole=["decode", "short", "long_whole"], chunked=["long_chunk1", "long_chunk2", "two_short_chunked"],
                     alone=["short_alone", "long_alone"], eager=["decode_eager"])[case_set]
        times = {c: [] for c in cases}
        for r in range(repeats + 1):  # the first round warms up
            record = r > 0
            prof = profile_path if r == repeats else None
            if case_set in ("alone", "eager"):
                for case in cases:
                    n = dict(short_alone=short_tokens, long_alone=long_tokens).get(case)
                    rid = ex.add_request(_ids(n, vocab, r), params) if n else None
                    ms, _ = _timed_step(ex, device)
                    times[case].append(ms)
                    if rid is not None:
                        ex.abort(rid)
                        ex.step()
                    if prof is not None and case in ("long_alone", "decode_eager"):
                        _host_profiled_prompt(ex, device, prof, case, _ids(n, vocab, r) if n else None, params)
            elif case_set == "whole":
                ms, _ = _timed_step(ex, device)
                times["decode"].append(ms)
                for case, n in (("short", short_tokens), ("long_whole", long_tokens)):
                    rid = ex.add_request(_ids(n, vocab, r), params)
                    ms, _ = _profiled(ex, device, prof if case == "long_whole" else None, case)
                    times[case].append(ms)
                    ex.abort(rid)
                    ex.step()
                    if prof is not None and case == "long_whole":
                        _host_profiled_prompt(ex, device, prof, case, _ids(n, vocab, r), params)
            else:
                rid = ex.add_request(_ids(long_tokens, vocab, r), params)
                ms1, _ = _timed_step(ex, device)
                ms2, _ = _profiled(ex, device, prof, "long_chunk2")
                times["long_chunk1"].append(ms1)
                times["long_chunk2"].append(ms2)
                ex.abort(rid)
                ex.step()
                if prof is not None:
                    _host_profiled_prompt(ex, device, prof, "long_chunk2", _ids(long_tokens, vocab, r), params,
                                          steps_before=1)
                # a chunk (first of a long prompt) with two short prompts whole in the same step
                ids = [ex.add_request(_ids(short_tokens, vocab, 50 + r), params),
                       ex.add_request(_ids(short_tokens, vocab, 60 + r), params),
                       ex.add_request(_ids(long_tokens, vocab, 70 + r), params)]
                ms, _ = _timed_step(ex, device)
                times["two_short_chunked"].append(ms)
                for rid in ids:
                    ex.abort(rid)
                ex.step()
            if not record:
                times = {c: [] for c in cases}
        out.update({c: round(statistics.median(v), 3) for c, v in times.items()})
        out.update({f"{c}_min": round(min(v), 3) for c, v in times.items()})
        del ex
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def closed_loop(model, config, device, *, concurrency, num_requests, max_tokens, max_num_tokens, chunked, split,
                lengths=HUMANEVAL_MIXED_LONG_TOKENS) -> dict:
    """The servers benchmark's schedule on the executor alone (module docstring)."""
    ex = _executor(model, config, device, batch=concurrency, max_num_tokens=max_num_tokens, chunked=chunked,
                   split=split)
    log, vocab = [], config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sent, added, ttft, done, step_ms, errors = 0, {}, [], 0, [], 0

    def send():
        nonlocal sent
        rid = ex.add_request(_ids(lengths[sent % len(lengths)], vocab, sent), params)
        added[rid] = time.perf_counter()
        sent += 1

    for _ in range(min(concurrency, num_requests)):
        send()
    _classify(ex, log)
    t0 = time.perf_counter()
    while done < num_requests:
        ms, updates = _timed_step(ex, device)
        step_ms.append(ms)
        now = time.perf_counter()
        for u in updates:
            if u.request_id in added and u.new_token_ids:
                ttft.append((now - added.pop(u.request_id)) * 1e3)
            if u.finished:
                done += 1
                errors += u.finish_reason == "error"
                if sent < num_requests:
                    send()
    wall = time.perf_counter() - t0
    ttft.sort()
    row = dict(max_num_tokens=max_num_tokens, chunked=chunked, split_mixed_steps=split, requests=num_requests, wall_s=round(wall, 3),
               output_tokens_per_s=round(num_requests * max_tokens / wall, 1), requests_per_s=round(num_requests / wall, 2),
               ttft_p50_ms=round(ttft[len(ttft) // 2], 1), ttft_p99_ms=round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 1),
               steps=len(step_ms), errors=errors)
    for cls in ("decode", "prefill", "chunk"):
        ms = [m for m, c in zip(step_ms, log) if c == cls]
        row[cls] = dict(count=len(ms), median_ms=round(statistics.median(ms), 3) if ms else None,
                        mean_ms=round(statistics.fmean(ms), 3) if ms else None, total_s=round(sum(ms) / 1e3, 3))
    del ex
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--shapes", default="smollm2,llama3-8b")
    parser.add_argument("--closed-loop", default="smollm2", help="shapes that also run the closed loop")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--split", default="off,on",
                        help="the executors' split_mixed_steps settings to run, side by side (on: the default with "
                             "CUDA graphs; off: one model call per step)")
    parser.add_argument("--profile", help="write torch-profiler tables of one whole-prompt step and one final-chunk "
                                          "step (the last isolated round) to this file")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = {"smollm2": SMOLLM2_135M_SHAPE, "llama3-8b": LLAMA3_8B_SHAPE}
    if args.smoke:
        shapes = {"tiny": dict(TINY_SHAPE)}
        wanted, loop_shapes = ["tiny"], ["tiny"]
    else:
        wanted, loop_shapes = args.shapes.split(","), args.closed_loop.split(",")
    result = dict(environment(), command=" ".join(sys.argv), commit=os.environ.get("DIFFKV_COMMIT"), rows=[])
    for name in wanted:
        config = ModelConfig(**shapes[name])
        model = random_llama(config, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        small = args.smoke
        for split in args.split.split(","):
            split = dict(on=True, off=False)[split]
            row = dict(shape=name, split_mixed_steps=split, isolated=isolated(
                model, config, device, batch=4 if small else 64, context=24 if small else 1024,
                repeats=1 if small else args.repeats, split=split, long_tokens=40 if small else 2146,
                short_tokens=6 if small else 150, profile_path=args.profile if split else None))
            print(name, "split" if split else "one call", "isolated ms:", row["isolated"], flush=True)
            _write(args.out, result, row)
            if name in loop_shapes:
                row["closed_loop"] = []
                for mnt, chunked in ((2048, True), (8192, True), (8192, False)):
                    if small:
                        mnt = mnt // 128
                    # a short pass first, discarded: the kernels' compilations for this schedule's shapes
                    closed_loop(model, config, device, concurrency=4 if small else 64, num_requests=4 if small else 64,
                                max_tokens=4 if small else 32, max_num_tokens=mnt, chunked=chunked, split=split,
                                lengths=(5, 9, 30, 6) if small else HUMANEVAL_MIXED_LONG_TOKENS)
                    loop = closed_loop(model, config, device, concurrency=4 if small else 64,
                                       num_requests=8 if small else args.num_requests, max_tokens=4 if small else 128,
                                       max_num_tokens=mnt, chunked=chunked, split=split,
                                       lengths=(5, 9, 30, 6) if small else HUMANEVAL_MIXED_LONG_TOKENS)
                    row["closed_loop"].append(loop)
                    print(name, "closed loop:", loop, flush=True)
                    _write(args.out, result, row)
            result["rows"].append(row)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _write(args.out, result)
    return 0


def _write(path: str, result: dict, partial_row: dict | None = None) -> None:
    """Write the results so far (a run cut by a time limit keeps its finished parts)."""
    with open(path, "w") as f:
        json.dump(dict(result, rows=result["rows"] + ([partial_row] if partial_row else [])), f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
