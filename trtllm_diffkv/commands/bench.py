"""``trtllm-diffkv bench``: serving throughput and latency, a DiffKV preset against the uniform K8V4 / K8V8 and
``fp16`` at one KV budget.

Runs the workloads of :mod:`trtllm_diffkv.evaluation.throughput` (a: default model, b: Llama-3-8B-shaped
random model, c: Poisson arrivals) with a progress bar per run and one line per finished run,
then writes the results JSON (``{"gpu", "date", "commit", "command", "rows"}``), a details
JSON beside it (``<stem>_details.json``: steps, preemptions, wall time, tier split, prompt
source per run) and a PNG (``<stem>.png``): throughput and achieved batch size per workload,
every preset side by side (paper figure 17), and mean latency against request rate (figure 16). Workloads a, b
and file run ``--preset`` (a, file; default ``diffkv``, the tiered DiffKV point) or ``--b-preset`` (b), then
``--baselines`` (default k8v4, k8v8), then ``fp16``, each after its own warm-up pass, at the same KV budget; c runs
the preset and ``fp16``.

``--prompts-file FILE`` runs the user's own requests (JSONL: prompts, or prompt/output token lengths;
:mod:`trtllm_diffkv.evaluation.prompt_files`) on ``--model`` (workload ``file``), or sends them in client mode.
Without ``--output`` the files go to :func:`default_output` (``~/.cache/trtllm-diffkv/bench/``), never into
the current folder or the repository's recorded results.

``--server-url URL`` instead loads a running server (``trtllm-diffkv serve``, ``--api openai``; or
Triton, ``--api triton``) with ``--concurrency`` streaming clients (:mod:`trtllm_diffkv.evaluation.
serving_client`) and writes throughput and TTFT/TPOT/ITL/e2e mean, p50, p90 and p99 to the JSON
(``{"gpu", "date", "commit", "command", "server": {...}}``) and their distributions to the PNG.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from ..config import replaced_atomically, write_text_atomic
from ..evaluation.throughput import UNIFORM_BASELINES, presets_with_baselines
from .common import check_output_path, finite_float

WORKLOADS = ("a", "b", "c")
_OVERRIDES = {"num_requests": int, "prompt_tokens": int, "output_tokens": int, "fp16_capacity": int,
              "kv_memory_bytes": int, "max_batch_size": int}


def add_parser(subparsers) -> None:
    """Register ``bench`` on the ``trtllm-diffkv`` subparsers."""
    p = subparsers.add_parser("bench", help="throughput and latency of the in-flight executor, DiffKV vs fp16",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", help="comma-separated subset of a,b,c, and file with --prompts-file (default: "
                                        "a,b,c; with --prompts-file: file)")
    p.add_argument("--model", help="checkpoint (HF folder or GGUF) of workloads a, c and file (default: the default "
                                   "model)")
    p.add_argument("--prompts-file", metavar="FILE",
                   help="your requests, JSONL, one per line: {\"prompt\": TEXT} (or \"text\", \"input_ids\") or "
                        "{\"input_length\": N, \"output_length\": M}; optional \"output_tokens\" per line (else "
                        "--max-tokens). Runs workload file here, or is what the client mode sends")
    p.add_argument("--smoke", action="store_true", help="tiny random model and a few tokens for every workload "
                                                        "(a CPU check of the whole pipeline; not a measurement)")
    p.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    p.add_argument("--output", help="results JSON; the details JSON and the PNG go beside it (default: "
                                    "~/.cache/trtllm-diffkv/bench/throughput.json, client mode: client.json there; "
                                    "$TRTLLM_DIFFKV_CACHE_DIR or $XDG_CACHE_HOME moves it)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--plot-from", metavar="JSON", help="run nothing: read a results JSON (e.g. fetched from the GPU "
                                                       "machine), print its table and write the PNG at --output's "
                                                       "stem + .png")
    p.add_argument("--preset", help="DiffKV preset or kv-config JSON file of workloads a and c (default: diffkv, the "
                                    "tiered DiffKV point)")
    p.add_argument("--b-preset", help="DiffKV preset of workload b (default: llama3-8b)")
    p.add_argument("--baselines", default=",".join(UNIFORM_BASELINES),
                   help="comma-separated presets run beside the DiffKV preset and fp16 in workloads a, b and file, "
                        f"at the same KV budget; 'none' for fp16 alone (default: {','.join(UNIFORM_BASELINES)})")
    p.add_argument("--kv-memory-bytes", type=int, help="KV budget of workloads a and file (default: the bytes that "
                                                       "hold --a-fp16-capacity full FP16 requests; file: a third of its "
                                                       "requests at their longest)")
    p.add_argument("--request-rates", type=finite_float, nargs="+", help="workload c's Poisson rates, requests/s "
                                                                  "(default: 2 4 8 16)")
    from ..evaluation.throughput import default_workloads

    defaults = default_workloads()
    for workload in WORKLOADS:
        for name in _OVERRIDES:
            p.add_argument(f"--{workload}-{name.replace('_', '-')}", type=int, dest=f"{workload}_{name}",
                           metavar="N", help=f"workload {workload}: {name.replace('_', ' ')} (default: "
                           f"{_default_text(defaults[workload], name)})")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times (default: 0)")
    p.add_argument("--time-limit-s", type=finite_float, help="skip the runs that would start after this many seconds "
                                                      "(results so far are written after every run; default: none)")
    p.add_argument("--eager", action="store_true",
                   help="run decode steps eagerly instead of replaying them from CUDA graphs (default: CUDA graphs "
                        "on a GPU; the CPU is always eager)")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=False,
                   help="synchronize the device around the bookkeeping so that bookkeeping_fraction is device time; "
                        "the synchronizations also leave the overlap scheduler nothing to overlap and lower the "
                        "tokens/s (default: off: bookkeeping_fraction is then the host's time in it)")
    p.add_argument("--disable-overlap-scheduler", action="store_true",
                   help="read every decode step's tokens before launching the next (default: the next step is "
                        "launched first whenever CUDA graphs are on; TensorRT-LLM's disable_overlap_scheduler)")
    client = p.add_argument_group("client mode (a running server)")
    client.add_argument("--server-url", help="load the server at this URL (http://host:port) instead of running the "
                                             "workloads")
    client.add_argument("--api", choices=("openai", "triton"), default="openai", help="the server's API "
                                                                                      "(default: openai)")
    client.add_argument("--server-model", help="model id (openai: default the server's first; triton: default "
                                               "trtllm_diffkv)")
    client.add_argument("--num-requests", type=int, default=256, help="requests to send (default: 256)")
    client.add_argument("--concurrency", type=int, default=64, help="concurrent clients (default: 64)")
    client.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default: 128); with "
                                                                     "--prompts-file: of the lines giving none")
    client.add_argument("--warmup", type=int, default=8, help="requests sent before measuring (default: 8)")
    p.set_defaults(run=run)


def default_output(client: bool) -> Path:
    """Where results go without ``--output``: ``<cache_root()>/bench/`` (:mod:`trtllm_diffkv.user_cache`),
    ``throughput.json`` or (client mode) ``client.json``: outside the current folder and the repository."""
    from .common import default_results_path

    return default_results_path("bench", "client.json" if client else "throughput.json")


def _output(args, client: bool) -> Path:
    return Path(args.output) if args.output else default_output(client)


def _prepare_output(args, client: bool) -> Path:
    """The results path, checked before any work (``--output``'s folder must exist; the default one is made).

    Raises:
        ValueError: ``--output`` is a directory or its folder is missing. OSError: the default folder cannot be made.
    """
    output = _output(args, client)
    if args.output:
        check_output_path(output, "--output")
    return output


CLIENT_PROMPTS = ("The capital of France is", "Once upon a time", "A short history of the bicycle:",
                  "def fibonacci(n):", "Three facts about the moon:", "The best way to learn a language is")
"""Prompts of the client mode without --prompts-file (continuations: no chat template on either API)."""


def _client_mode(args) -> int:
    """``--server-url``: load the server, write the JSON and the PNG, print one line; 0, 1 (a request failed)
    or 2 (a usage error or the server cannot be reached)."""
    import asyncio

    import httpx

    from ..evaluation.serving_client import load, plot
    from ..evaluation.throughput import environment

    try:
        if min(args.num_requests, args.concurrency, args.max_tokens) < 1 or args.warmup < 0:
            raise ValueError("--num-requests, --concurrency and --max-tokens must be >= 1, --warmup >= 0")
        prompts, max_tokens = list(CLIENT_PROMPTS), args.max_tokens
        if args.prompts_file:
            from ..evaluation.prompt_files import materialize, read_prompts_file

            lines = read_prompts_file(args.prompts_file)
            prompts, max_tokens = materialize(lines, default_output_tokens=args.max_tokens, seed=args.seed)
            if args.api == "triton":
                bad = next((p for p, text in zip(lines, prompts) if not isinstance(text, str)), None)
                if bad is not None:
                    raise ValueError(f"--prompts-file {args.prompts_file} line {bad.line}: --api triton sends text "
                                     "(text_input): give 'prompt' or 'text' there ('input_ids' and 'input_length' "
                                     "work with --api openai, which takes token ids)")
        output = _prepare_output(args, client=True)
        model = args.server_model
        if model is None:
            model = "trtllm_diffkv" if args.api == "triton" else httpx.get(
                args.server_url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
    except (ValueError, OSError, httpx.HTTPError, KeyError, IndexError) as exc:
        print(f"trtllm-diffkv bench: error: {exc}", file=sys.stderr)
        return 2
    kwargs = dict(api=args.api, model=model, prompts=prompts, concurrency=args.concurrency, max_tokens=max_tokens)
    if args.warmup:
        asyncio.run(load(args.server_url, num_requests=args.warmup, **kwargs))
    result, records = asyncio.run(load(args.server_url, num_requests=args.num_requests, **kwargs))
    command = getattr(args, "command_line", None) or "trtllm-diffkv bench " + shlex.join(sys.argv[2:])
    server = dict(result, api=args.api, model=model, url=args.server_url, concurrency=args.concurrency,
                  max_tokens=args.max_tokens, prompts_file=args.prompts_file)
    write_text_atomic(output, json.dumps(dict(**environment(), command=command.strip(), server=server), indent=2) + "\n")
    if not args.no_plot:
        plot(records, output.with_suffix(".png"), f"{args.api} server, {args.concurrency} clients, "
                                                  + (f"{args.prompts_file}" if args.prompts_file
                                                     else f"{args.max_tokens} tokens"))
    print(f"[bench] {args.api} {args.server_url}: {result['completed']}/{result['requests']} requests, "
          f"{result['requests_per_s']:.2f} req/s, {result['output_tokens_per_s']:.1f} tok/s, TTFT p50/p99 "
          f"{result['ttft_p50_ms'] or 0:.1f}/{result['ttft_p99_ms'] or 0:.1f} ms, TPOT p99 "
          f"{result['tpot_p99_ms'] or 0:.2f} ms; wrote {output}", flush=True)
    for error in result["errors"]:
        print(f"trtllm-diffkv bench: a request failed: {error}", file=sys.stderr)
    return 1 if result["errors"] else 0


def _default_text(workload, name: str) -> str:
    value = getattr(workload, name)
    if value is None:  # kv_memory_bytes
        return f"the bytes that hold --{workload.name}-fp16-capacity full FP16 requests"
    return str(value)


def workloads_from_args(args) -> list:
    """The :class:`~trtllm_diffkv.evaluation.throughput.Workload` list the flags describe.

    Raises:
        ValueError: an unknown workload name, a bad size (from :class:`Workload`), or ``--model`` with
            ``--smoke``.
    """
    from dataclasses import replace

    from ..evaluation.throughput import default_workloads

    prompts_file = getattr(args, "prompts_file", None)
    spec = args.workloads if args.workloads is not None else ("file" if prompts_file else "a,b,c")
    names = [n.strip() for n in spec.split(",") if n.strip()]
    known = WORKLOADS + (("file",) if prompts_file else ())
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        raise ValueError(f"--workloads {spec!r}: choose among {', '.join(known)}"
                         + ("" if prompts_file or "file" not in unknown else " (file needs --prompts-file)"))
    defaults = default_workloads(smoke=args.smoke)
    baselines = parse_baselines(getattr(args, "baselines", ",".join(UNIFORM_BASELINES)))
    model_path = getattr(args, "model", None)
    if args.smoke and model_path is not None:  # else the run would measure another model than the one named
        raise ValueError(f"--model is not used with --smoke (it runs a tiny random model): leave out --model "
                         f"{model_path} or --smoke")
    out = []
    for name in dict.fromkeys(names):
        if name == "file":
            out.append(_file_workload(args, defaults["a"], model_path, baselines))
            continue
        changes = {key: getattr(args, f"{name}_{key}") for key in _OVERRIDES
                   if getattr(args, f"{name}_{key}", None) is not None}
        if name == "a" and args.kv_memory_bytes is not None:
            changes["kv_memory_bytes"] = args.kv_memory_bytes
        preset = args.b_preset if name == "b" else args.preset
        if name == "c":
            if preset is not None:
                changes["presets"] = tuple(dict.fromkeys((preset, "fp16")))
        else:
            changes["presets"] = presets_with_baselines(preset or defaults[name].presets[0], baselines)
        if name == "c" and args.request_rates:
            changes["request_rates"] = tuple(args.request_rates)
        if name != "b" and model_path is not None and defaults[name].model == "default":
            changes["model_path"] = model_path
        out.append(replace(defaults[name], **changes))
    return out


def parse_baselines(spec: str) -> tuple[str, ...]:
    """``--baselines``: comma-separated presets (``none`` or empty: none).

    Raises:
        ValueError: an unknown preset, naming ``--baselines``.
    """
    from ..config import resolve_kv_config

    names = () if spec.strip().lower() in ("", "none") else tuple(n.strip() for n in spec.split(",") if n.strip())
    for name in names:
        try:
            resolve_kv_config(name)
        except (ValueError, FileNotFoundError) as exc:
            raise ValueError(f"--baselines: {exc}") from None
    return names


def _file_workload(args, base, model_path, baselines=UNIFORM_BASELINES):
    """Workload ``file``: the lines of ``--prompts-file`` on ``--model`` (``--smoke``: the tiny random model, which
    has no tokenizer: lengths and ids only), presets ``--preset``, the baselines and ``fp16``, all submitted at
    once."""
    from dataclasses import replace

    from ..evaluation.prompt_files import read_prompts_file

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens} must be >= 1")
    lines = tuple(read_prompts_file(args.prompts_file))
    return replace(base, name="file", model=base.model, model_path=None if args.smoke else model_path,
                   presets=presets_with_baselines(args.preset or base.presets[0], baselines), requests=lines, prompts_file=args.prompts_file,
                   prompt_tokens=1, output_tokens=args.max_tokens, num_requests=len(lines),
                   fp16_capacity=max(1, len(lines) // 3), kv_memory_bytes=args.kv_memory_bytes,
                   max_batch_size=min(64, max(len(lines), 1)))


def run(args) -> int:
    """Run the benchmark; 0 on success, 1 when a run failed, 2 on a usage error."""
    from .common import resolve_device

    if args.plot_from:
        return _plot_from(Path(args.plot_from), _output(args, client=False).with_suffix(".png"))
    if getattr(args, "server_url", None):
        return _client_mode(args)

    try:
        workloads = workloads_from_args(args)
        device = resolve_device(args.device)
        output = _prepare_output(args, client=False)
    except (ValueError, OSError) as exc:
        print(f"trtllm-diffkv bench: error: {exc}", file=sys.stderr)
        return 2
    from ..evaluation.throughput import environment, run_workloads

    command = getattr(args, "command_line", None) or "trtllm-diffkv bench " + shlex.join(sys.argv[2:])
    meta = dict(**environment(), command=command.strip())

    def save(rows, details):
        write_results(dict(meta, rows=rows), details, output, plot=False)

    try:
        rows, details = run_workloads(workloads, device, seed=args.seed, profile=args.profile,
                                      cuda_graphs=not args.eager,
                                      disable_overlap_scheduler=True if args.disable_overlap_scheduler else None,
                                      log=lambda line: print(line, flush=True), progress_bar=_tqdm, on_run=save,
                                      time_limit_s=args.time_limit_s)
    except RuntimeError as exc:
        print(f"trtllm-diffkv bench: a run failed: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:  # a setup error: a model that cannot load, a preset it cannot run
        print(f"trtllm-diffkv bench: error: {exc}", file=sys.stderr)
        return 2
    write_results(dict(meta, rows=rows), details, output, plot=not args.no_plot and bool(rows))
    print(format_table(rows))
    print(f"[bench] wrote {output}" + ("" if args.no_plot else f", {output.with_suffix('.png')}")
          + f", {details_path(output)}")
    return 0


def _plot_from(source: Path, png: Path) -> int:
    try:
        result = json.loads(source.read_text())
        rows = result["rows"]
        table = format_table(rows)  # every row must have the schema's keys
        png.parent.mkdir(parents=True, exist_ok=True)
        plot_results(result, png)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"trtllm-diffkv bench: error: --plot-from {source}: not a results JSON "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    print(table)
    print(f"[bench] wrote {png}")
    return 0


def _tqdm(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is optional: one line per run is printed anyway
        from ..evaluation.throughput import NullProgress

        return NullProgress()
    return tqdm(total=total, desc=desc, unit="req", leave=False, file=sys.stderr)


def details_path(output: Path) -> Path:
    return output.with_name(output.stem + "_details.json")


def write_results(result: dict, details: list[dict], output: Path, *, plot: bool = True) -> None:
    """Write the results JSON, the details JSON and (``plot``) the PNG beside it."""
    output.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(output, json.dumps(result, indent=1) + "\n")
    write_text_atomic(details_path(output), json.dumps(details, indent=1) + "\n")
    if plot:
        try:
            plot_results(result, output.with_suffix(".png"))
        except ImportError as exc:  # the JSON is what counts; plot later with --plot-from
            print(f"trtllm-diffkv bench: no PNG ({exc}); plot later with --plot-from {output}", file=sys.stderr)


def format_table(rows: list[dict]) -> str:
    """The rows as a Markdown table (the form docs/PERFORMANCE.md quotes); ``x fp16`` and ``x k8v4``: tokens/s over
    those presets' in the same workload and rate (at the same KV budget), where both ran."""
    def cell(value, spec):
        return "" if value is None else format(value, spec)

    def ratio(r, base):
        other = next((o for o in rows if o["workload"] == r["workload"] and o["preset"] == base
                      and o["request_rate"] == r["request_rate"]), None)
        return r["output_tokens_per_s"] / other["output_tokens_per_s"] if other and other["output_tokens_per_s"] \
            else None

    lines = ["| workload | preset | rate req/s | requests | KV budget MB | tokens/s | x fp16 | x k8v4 | mean batch "
             "| KV / FP16 | bookkeeping | mean latency s |", "| --- | --- " + "| ---: " * 10 + "|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['preset']} | {cell(r['request_rate'], 'g')} | {r['num_requests']} | "
                     f"{r['kv_memory_bytes'] / 1e6:.1f} | {r['output_tokens_per_s']:.1f} | "
                     f"{cell(ratio(r, 'fp16'), '.2f')} | {cell(ratio(r, 'k8v4'), '.2f')} | "
                     f"{cell(r['mean_batch_size'], '.1f')} | {cell(r['kv_memory_fraction'], '.3f')} | "
                     f"{cell(r['bookkeeping_fraction'], '.2%')} | {cell(r['mean_latency_s'], '.2f')} |")
    return "\n".join(lines)


def plot_results(result: dict, path: Path) -> None:
    """PNG: tokens/s and mean batch size per closed workload (every preset, x FP16 annotated; paper figure 17) and
    mean latency against request rate for workload c (figure 16)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    closed = [r for r in rows if r["request_rate"] is None]
    poisson = [r for r in rows if r["request_rate"] is not None]
    panels = (2 if closed else 0) + (1 if poisson else 0)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(5 * max(panels, 1), 4), squeeze=False)
    axes = list(axes[0])
    if closed:
        workloads = list(dict.fromkeys(r["workload"] for r in closed))
        presets = sorted(dict.fromkeys(r["preset"] for r in closed), key=lambda p: p == "fp16")  # fp16 last
        width = 0.8 / len(presets)
        colors = {"fp16": "#999999", "k8v4": "#e08a2b", "k8v8": "#c9b458"}
        for ax, key, label in ((axes.pop(0), "output_tokens_per_s", "output tokens/s"),
                               (axes.pop(0), "mean_batch_size", "mean batch size (requests/step)")):
            base = {w: next((r[key] for r in closed if r["workload"] == w and r["preset"] == "fp16"), None)
                    for w in workloads}
            for j, preset in enumerate(presets):
                offset = (j - (len(presets) - 1) / 2) * width
                values = [next(((r[key] or 0) for r in closed if r["workload"] == w and r["preset"] == preset), 0)
                          for w in workloads]
                ax.bar([i + offset for i in range(len(workloads))], values, width=width,
                       label="FP16" if preset == "fp16" else preset, color=colors.get(preset))
                for i, (w, value) in enumerate(zip(workloads, values)):
                    if value and base[w] and preset != "fp16":
                        ax.annotate(f"{value / base[w]:.2f}x", (i + offset, value), ha="center", va="bottom",
                                    fontsize=7)
            ax.set_xticks(range(len(workloads)), [f"workload {w}" for w in workloads])
            ax.set_ylabel(label)
            ax.legend(fontsize=8)
    if poisson:
        ax = axes.pop(0)
        for preset in dict.fromkeys(r["preset"] for r in poisson):
            mine = sorted((r for r in poisson if r["preset"] == preset), key=lambda r: r["request_rate"])
            ax.plot([r["request_rate"] for r in mine], [r["mean_latency_s"] for r in mine], marker="o",
                    label="FP16" if preset == "fp16" else f"DiffKV ({preset})")
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel("mean latency (s)")
        ax.legend()
    fig.suptitle(f"{result['gpu']}, {result['date']}, {result['commit'][:12]}", fontsize=9)
    fig.tight_layout()
    with replaced_atomically(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
