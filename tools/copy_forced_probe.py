"""The copy task teacher-forced: a CPU screen for low-memory points before a GPU run decides them.

The generation-level ``copy`` task (docs/QUALITY.md) is graded by exact match, one bit per case, so at the n a CPU
affords (16-32 cases) it separates nothing: a CPU pilot at n = 16 ranked ``low=K4V2-4-2`` below the tiered point,
the GPU run at n = 100 above it. This probe runs the same cases with the gold passage teacher-forced through each
point's cache on the reference path (:func:`trtllm_diffkv.evaluation.quality.evaluate`: the prompt's prefill
attends in full precision, then the cache compresses and every passage token is a decode step with the point's
tier decisions, as in generation). Per case and point it records:

* ``span_exact``: every passage token is the top-1: with greedy decoding, the model copies the passage exactly
  (the generation-level grade, up to the stop string and numerics of another path);
* ``span_logprob``: the mean log-probability of the passage tokens (continuous: paired differences against fp16
  separate points at a small n);
* ``span_top1``, ``top1_agreement``, ``mean_kl_nats`` (:func:`~trtllm_diffkv.evaluation.quality.case_metrics`).

    python3 tools/copy_forced_probe.py --model gemma3-270m --num-cases 16 \\
        --points 'k8v4;k8v8;diffkv;diffkv,low=K4V4,score_pool_tokens=5' --output /tmp/probe.json

Points are ``trtllm-diffkv eval --point`` specs (``PRESET[,FIELD=VALUE...]``; ``diffkv,low=K8V2`` is one point:
separate points with ``;`` when a spec has commas, e.g. ``k8v4;diffkv,low=K8V2``); fp16 always runs first.
Writes ``{"model", "date", "commit", "command", "device", "rows", "records"}``: ``rows`` from
:func:`~trtllm_diffkv.evaluation.quality.aggregate` (mean, 95 % bootstrap band, and the paired ``_delta_vs_fp16``),
``records`` one per (case, point). A screen, not a result: the GPU's generation-level run at n >= 100 decides.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PAIRED = ("span_exact", "span_logprob")
"""Metrics shown with their paired difference against fp16 (the same case's fp16 record)."""


def split_points(spec: str) -> list[str]:
    """``a;b,c=1`` -> ``["a", "b,c=1"]``; without ``;``, a comma starts a new point unless the part is FIELD=VALUE.

    Raises:
        ValueError: an empty list; a point that starts with FIELD=VALUE (no preset before it), naming the part.
    """
    if ";" in spec:
        parts = [p.strip() for p in spec.split(";")]
    else:
        parts = []
        for piece in (p.strip() for p in spec.split(",")):
            if "=" in piece and parts:
                parts[-1] += "," + piece
            elif piece:
                parts.append(piece)
    parts = [p for p in parts if p]
    if not parts:
        raise ValueError(f"--points {spec!r}: no point")
    for part in parts:
        if "=" in part.split(",", 1)[0] and not os.path.exists(part.split(",", 1)[0]):
            raise ValueError(f"--points {spec!r}: {part.split(',', 1)[0]!r} is FIELD=VALUE before any preset "
                             "(write PRESET,FIELD=VALUE)")
    return parts


def forced_cases(tokenizer, num_cases: int, context_tokens: int, seed: int):
    """The copy task's cases (:func:`~trtllm_diffkv.evaluation.generation_tasks.copy_cases`) as teacher-forced
    :class:`~trtllm_diffkv.evaluation.tasks.Case`: the prompt ids as generated, the span the passage's remaining
    lines in the tokenizer's split of prompt + passage (so the boundary token is the one a copy would produce); where
    that split merges the prompt's last token with the passage's first, the passage's own split that decodes, after
    the prompt's tokens, to prompt + passage.

    Raises:
        ValueError: a case whose passage no split reproduces after the prompt (naming the case).
    """
    from trtllm_diffkv.evaluation.generation_tasks import copy_cases
    from trtllm_diffkv.evaluation.tasks import Case

    def text(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    out = []
    for case in copy_cases(tokenizer, num_cases, context_tokens, seed):
        prompt_ids = list(case.prompt_ids)
        whole = tokenizer(case.prompt + case.expected, add_special_tokens=True)["input_ids"]
        candidates = [whole[len(prompt_ids):]] if whole[:len(prompt_ids)] == prompt_ids else []
        # the boundary merged: the passage in its own split, or after an anchor character where the tokenizer
        # prefixes a lone text with a space (SentencePiece's dummy prefix: the split alone starts with "▁")
        alone = tokenizer(case.expected, add_special_tokens=False)["input_ids"]
        anchor = tokenizer("a", add_special_tokens=False)["input_ids"]
        anchored = tokenizer("a" + case.expected, add_special_tokens=False)["input_ids"]
        candidates += [alone] + ([anchored[len(anchor):]] if anchored[:len(anchor)] == anchor else [])
        span = next((s for s in candidates if s and text(prompt_ids + s) == text(prompt_ids) + case.expected), None)
        if span is None:
            raise ValueError(f"copy case {case.case_id}: no split of the passage follows the prompt's tokens and "
                             "decodes to the passage (the tokenizer does not round-trip it)")
        out.append(Case("copy_forced", case.case_id, prompt_ids, span))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="copy_forced_probe.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint path or packaged name (default: the default model)")
    parser.add_argument("--points", default="k8v4;diffkv",
                        help="`trtllm-diffkv eval --point` specs, PRESET[,FIELD=VALUE...], separated by ';' (or by ',' "
                             "where a part is not FIELD=VALUE); fp16 always runs first (default: k8v4;diffkv)")
    parser.add_argument("--num-cases", type=int, default=16, help="copy cases (default: 16; about 1-2 CPU minutes a "
                        "case at 4k tokens for 8 points on 2 cores)")
    parser.add_argument("--context-tokens", type=int, default=4096, help="context per case (default: 4096)")
    parser.add_argument("--seed", type=int, default=0, help="case selection (default: 0, the eval's cases)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument("--output", required=True, help="results JSON (its folder is created)")
    args = parser.parse_args(argv)
    for name in ("num_cases", "context_tokens"):  # refused before the model loads
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give at least 1")

    import torch

    from trtllm_diffkv.evaluation.generation_eval import parse_point
    from trtllm_diffkv.evaluation.quality import aggregate, custom_point, evaluate, method_points
    from trtllm_diffkv.evaluation.throughput import environment
    from trtllm_diffkv.model.loader import load_model
    from trtllm_diffkv.progress import heartbeat

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        specs = split_points(args.points)
        points_given = [(spec, parse_point(spec)) for spec in specs]
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc) if str(exc).startswith("--points") else f"--points: {exc}")
    configs = []
    for spec, point in points_given:
        if point.kv_config is None:
            parser.error(f"--points: {spec} is a reference baseline; give DiffKV presets or specs")
        configs.append((spec, point.kv_config))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)  # before the first case writes it
    device = torch.device(args.device)
    model, tokenizer, model_config = load_model(args.model, device=device, dtype=torch.float32)
    reference = next(p for p in method_points() if p.method == "fp16")
    points = [reference]
    for spec, cfg in configs:
        cfg.validate_for_model(model_config.head_dim, model_config.num_heads, model_config.num_kv_heads)
        points.append(dataclasses.replace(custom_point(cfg), config=spec))  # labelled by the spec given
    cases = forced_cases(tokenizer, args.num_cases, args.context_tokens, args.seed)
    print(f"[probe] {len(cases)} copy cases, span {min(len(c.span_ids) for c in cases)}-"
          f"{max(len(c.span_ids) for c in cases)} tokens, points: fp16, {', '.join(specs)}", file=sys.stderr, flush=True)
    env = environment()
    meta = {"model": args.model or "default", "date": env["date"], "commit": env["commit"],
            "command": "python3 tools/copy_forced_probe.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
            "device": args.device, "path": "reference, teacher-forced (tools/copy_forced_probe.py)"}
    start = time.perf_counter()

    def write(records):
        with open(args.output, "w") as f:
            json.dump({**meta, "seconds": round(time.perf_counter() - start, 1), "rows": aggregate(records),
                       "records": records}, f, indent=1)

    with heartbeat("screening copy cases", prefix="[probe]"):  # a line every 10 s; one per finished case
        records = evaluate(model, tokenizer, model_config, cases, points, progress=False, on_case=write)
    write(records)
    print(table(aggregate(records)))
    return 0


def table(rows: list[dict]) -> str:
    """A Markdown table: per point the KV fraction, the mean of each :data:`PAIRED` metric with its paired
    difference against fp16 and 95 % band, and the mean KL from fp16 with its band."""
    head = "| point | KV / FP16 | " + " | ".join(f"{m} | Δ vs fp16 [95 %]" for m in PAIRED) + " | KL nats [95 %] |"
    out = [head, "| --- | ---: |" + " ---: | ---: |" * len(PAIRED) + " ---: |"]
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = {r["metric"]: r for r in rows if r["config"] == config}
        cells = [config, f"{next(iter(mine.values()))['kv_memory_fraction']:.3f}"]
        for m in PAIRED:
            r, d = mine.get(m), mine.get(f"{m}_delta_vs_fp16")
            cells.append("—" if r is None else f"{r['value']:.3f}")
            cells.append("—" if d is None else f"{d['value']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]")
        kl = mine.get("mean_kl_nats")
        cells.append("—" if kl is None else f"{kl['value']:.4f} [{kl['ci_low']:.4f}, {kl['ci_high']:.4f}]")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
