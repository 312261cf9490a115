"""The generation-level quality harness: every point on the same greedy cases, paired against fp16 and k8v4.

The cases are :mod:`~trtllm_diffkv.evaluation.generation_tasks`' (``copy``, ``recall``). A point is a KV
format run through the product's own serving path: the public :class:`~trtllm_diffkv.llmapi.LLM` over the
in-flight executor (:func:`run_executor_point`: one ``LLM`` per point over the one loaded model, every case
of the point submitted at once, greedy, the executor's KV budget sized for the whole batch), or, for the
baselines that exist only there, the reference path one request at a time (:func:`run_reference_point`:
KIVI). Points (:func:`parse_point`): presets (``fp16``, ``k8v8``, ``k8v4``, ``diffkv``, ...), kv-config
files, and custom DiffKV points ``PRESET,FIELD=VALUE,...`` (thresholds, low tier, rotation, ...).

Per case and point a record holds the generated text, the grade (``copy``: exact match; ``recall``: unit
tests), the KV memory fraction the executor reports for the request at its end (``kv_memory_fraction``:
accounted bytes / FP16 bytes of its tokens), the pool bytes it held over the same FP16 bytes
(``pool_fraction``: whole pages and row metadata) and its tier fractions.

:func:`aggregate_generation` gives, per (model, task, point), each metric's mean with its 95 % percentile
bootstrap band over cases (:func:`~trtllm_diffkv.evaluation.quality.bootstrap_ci`), and the PAIRED
difference of the score against ``fp16`` and against ``k8v4`` (:data:`PAIRED_BASELINES`): the bootstrap of
the per-case differences on the cases both points ran, so the case-to-case spread (which dominates the
unpaired bands) cancels. Records are sorted by case before any resampling: a merged run of shards gives
the very figures of the unsharded run.
"""
from __future__ import annotations

import gc
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..config import (DiffKVConfig, PRESETS, kv_config_from_dict, kv_config_to_dict, resolve_kv_config)
from ..progress import heartbeat
from .generation_tasks import GenerationCase, copied_lines

TASK_METRIC = {"copy": "exact", "recall": "pass_at_1"}
"""The score of each generation task (the record's ``score``, 0 or 1)."""

PARTIAL_METRIC = {"copy": "copied_lines"}
"""A task's graded secondary score (the record's ``partial``, in [0, 1]), paired like the score:
:func:`~trtllm_diffkv.evaluation.generation_tasks.copied_lines`."""

PAIRED_BASELINES = ("fp16", "k8v4")
"""Points every other point is compared with, case by case (``<metric>_delta_vs_<point>`` rows)."""

MEMORY_METRICS = ("kv_memory_fraction", "pool_fraction", "high_fraction", "low_fraction", "pruned_fraction")
"""Per-record memory figures aggregated beside the score (``None`` values, e.g. fp16's tiers, skipped)."""

DEFAULT_POINTS = ("fp16", "k8v8", "k8v4", "diffkv")
"""The points of a run that names none: fp16 (the reference), the uniform formats and ``diffkv``, the tiered DiffKV
preset, whatever ``default`` is; :func:`default_points` adds ``default`` where it is none of them."""

UNIFORM_POINTS = ("fp16", "k8v8", "k8v4")
"""The uniform formats: a point with one of their configurations is drawn on their curve, whatever its name (and
whatever model a kv-config file is restricted to: :func:`curve_of`)."""


def default_points() -> list[str]:
    """:data:`DEFAULT_POINTS`, then ``default`` where its configuration is none of theirs (it is the point
    docs/QUALITY.md's rule picks, so a run always shows it; named twice, the table would show one point twice)."""
    default = PRESETS["default"]
    same = any(default.same_configuration(PRESETS[name]) for name in DEFAULT_POINTS)
    return list(DEFAULT_POINTS) + ([] if same else ["default"])

DEFAULT_MAX_BATCH_SIZE = 256
"""Request slots of a point's executor at most (fewer when the run has fewer cases)."""

ROW_KEYS = ("model", "task", "method", "point", "kv_memory_fraction", "metric", "value", "ci_low", "ci_high", "n")
"""The keys of every row of a generation results JSON, in order."""


@dataclass(frozen=True)
class GenerationPoint:
    """One KV format of a run.

    Attributes:
        name: its label in records and tables: the spec as given (``"k8v4"``, ``"diffkv,alpha_high=0.5"``).
        method: its curve: ``fp16``, ``k8v8``, ``k8v4``, ``diffkv`` (a DiffKV preset or custom point) or a
            reference-path baseline (``kivi``).
        kv_config: the executor's configuration; ``None`` for a reference-path point.
        reference: the reference-path :class:`~trtllm_diffkv.evaluation.quality.MethodPoint`, else ``None``.
    """

    name: str
    method: str
    kv_config: DiffKVConfig | None = None
    reference: object | None = None

    @property
    def path(self) -> str:
        """``"executor"`` (the ``LLM`` API) or ``"reference"`` (one request at a time)."""
        return "reference" if self.reference is not None else "executor"


REFERENCE_POINTS = {"kivi-4": "KIVI-4 (G=32, R=128)", "kivi-2": "KIVI-2 (G=32, R=128)"}
"""Reference-path baselines a run may add by name (KIVI, Liu et al. 2024; :mod:`.baselines`)."""


def _tier(text: str, where: str):
    """``"K4V2"`` or ``"K4V2-1-4"`` (key groups, value groups) -> a tier dict of :func:`kv_config_from_dict`."""
    import re

    match = re.fullmatch(r"[Kk](\d+)[Vv](\d+)(?:-(\d+)-(\d+))?", text)
    if match is None:
        raise ValueError(f"{where}: {text!r} is not a tier such as K4V2 or K4V2-1-4 (key groups, value groups)")
    k, v, kg, vg = match.groups()
    tier = {"key_bits": int(k), "value_bits": int(v)}
    if kg is not None:
        tier.update(key_groups=int(kg), value_groups=int(vg))
    return tier


def _value(text: str, current, field: str, where: str):
    if field in ("high", "low"):
        return _tier(text, where)
    if isinstance(current, bool):
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{where}: {field}={text!r} must be true or false")
        return text.lower() in ("true", "1", "yes")
    for kind in (int, float):
        if isinstance(current, kind):
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"{where}: {field}={text!r} must be {'an integer' if kind is int else 'a number'}") \
                    from None
    return text


def parse_point(spec: str) -> GenerationPoint:
    """A point from its spec: ``PRESET``, a kv-config ``FILE``, a reference baseline (:data:`REFERENCE_POINTS`),
    or ``PRESET|FILE,FIELD=VALUE[,FIELD=VALUE...]``: the preset with :class:`~trtllm_diffkv.config.DiffKVConfig`
    fields replaced (e.g. ``diffkv,alpha_low=0.005``, ``diffkv,low=K8V2,key_rotation=none``; tiers as
    ``K4V2`` or ``K4V2-1-4`` with key and value groups; booleans ``true``/``false``).

    Raises:
        ValueError: an unknown preset or field, or a value out of range, naming the spec and the field.
        FileNotFoundError: a kv-config file that does not exist.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"point spec {spec!r}: give a preset, a kv-config file or PRESET,FIELD=VALUE,...")
    name = spec.strip()
    if name in REFERENCE_POINTS:
        from .quality import method_points

        point = next(p for p in method_points() if p.config == REFERENCE_POINTS[name])
        return GenerationPoint(name, "kivi", reference=point)
    base, *changes = [part.strip() for part in name.split(",")]
    where = f"point {name!r}"
    try:
        config = resolve_kv_config(base)
    except (ValueError, FileNotFoundError) as exc:
        raise type(exc)(f"{where}: {exc}") from None
    if changes:
        data = kv_config_to_dict(config)
        for change in changes:
            field, sep, text = change.partition("=")
            field = field.strip()
            if not sep or not field:
                raise ValueError(f"{where}: {change!r} is not FIELD=VALUE")
            if field == "name":
                raise ValueError(f"{where}: the point's name is its spec; 'name' cannot be set")
            data[field] = _value(text.strip(), data.get(field), field, where)
        data["name"] = name
        config = kv_config_from_dict(data, where=where).replace(calibrated_for=config.calibrated_for)
    return GenerationPoint(name, curve_of(config), kv_config=config)


def curve_of(config: DiffKVConfig) -> str:
    """The curve ``config`` is drawn on: the uniform format of :data:`UNIFORM_POINTS` whose configuration it is, else
    ``"diffkv"``. ``calibrated_for`` and ``layers`` are left out of the comparison: they say which model the
    configuration may run on (a kv-config file's ``model``, a model's sliding windows), not its KV format."""
    mine = config.replace(calibrated_for=None, layers=())
    return next((name for name in UNIFORM_POINTS if mine.same_configuration(PRESETS[name])), "diffkv")


def resolve_points(specs: list[str]) -> list[GenerationPoint]:
    """The points of ``specs`` in order, ``fp16`` first (added when missing), each name once.

    Raises:
        ValueError: as :func:`parse_point`; a spec given twice.
    """
    names = [s.strip() for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"point {dup[0]!r} is given twice")
    if "fp16" not in names:
        names.insert(0, "fp16")
    names.remove("fp16")
    return [parse_point(n) for n in ["fp16"] + names]


# --------------------------------------------------------------------------------------- running
def executor_budget_bytes(model_config, cases: list[GenerationCase], max_batch_size: int, device) -> int:
    """KV bytes for a point's executor: every case at once at FP16 (prompt + ``max_tokens``; the compressed
    points need less), capped on CUDA at 0.85 of the free memory (requests then wait for pages)."""
    import torch

    from .throughput import fp16_budget_bytes

    tokens = [len(c.prompt_ids) + c.max_tokens for c in cases]
    need = fp16_budget_bytes(model_config, tokens, max_batch_size, max(tokens))
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        need = min(need, int(0.85 * free))
    return need


def _record(model_name: str, case: GenerationCase, point: GenerationPoint, text: str, generated_tokens: int,
            finish_reason: str | None, error: str | None, memory: dict) -> dict:
    fp16_bytes = memory.get("fp16_kv_cache_bytes")
    pool = memory.get("pool_used_bytes")
    return {"model": model_name, "task": case.task, "case_id": case.case_id, "index": case.index,
            "point": point.name, "method": point.method, "path": point.path, "prompt_tokens": len(case.prompt_ids),
            "depth": round(case.depth, 4), "text": text, "generated_tokens": generated_tokens,
            "finish_reason": finish_reason, "error": error,
            "kv_memory_fraction": memory.get("kv_memory_fraction"),
            "pool_fraction": pool / fp16_bytes if pool is not None and fp16_bytes else None,
            "high_fraction": memory.get("high_fraction"), "low_fraction": memory.get("low_fraction"),
            "pruned_fraction": memory.get("pruned_fraction"), "kv_cache_bytes": memory.get("kv_cache_bytes"),
            "fp16_kv_cache_bytes": fp16_bytes, "pool_used_bytes": pool}


def run_executor_point(model, tokenizer, model_config, point: GenerationPoint, cases: list[GenerationCase], *,
                       model_name: str, stop_token_ids=(), kv_memory_bytes: int | None = None,
                       max_batch_size: int | None = None, use_cuda_graphs: bool | None = None,
                       progress=None) -> list[dict]:
    """Every case through one :class:`~trtllm_diffkv.llmapi.LLM` of ``point``, all submitted at once.

    The LLM runs over ``model`` (no second load; a ``key_rotation`` point runs the rotated copy the executor
    makes once per model), greedy (``temperature=0``), each case with its own ``max_tokens`` and stop
    strings; it is shut down and its pool freed before this returns.

    Args:
        kv_memory_bytes: the executor's KV budget (default :func:`executor_budget_bytes`).
        max_batch_size: request slots (default ``min(len(cases), DEFAULT_MAX_BATCH_SIZE)``).
        use_cuda_graphs: the executor's (``None``: on CUDA).
        progress: called once per finished case.

    Returns:
        one record per case (ungraded: :func:`grade_records` adds ``score``), in ``cases``' order.
    """
    import torch

    from ..llmapi import LLM
    from ..runtime.sampling import SamplingParams

    if not cases:
        return []
    device = next(model.parameters()).device
    batch = max_batch_size or min(len(cases), DEFAULT_MAX_BATCH_SIZE)
    budget = kv_memory_bytes or executor_budget_bytes(model_config, cases, batch, device)
    max_seq_len = max(len(c.prompt_ids) + c.max_tokens for c in cases)
    llm = LLM.from_model(model, tokenizer, model_config, point.kv_config, stop_token_ids=stop_token_ids,
                         max_seq_len=max_seq_len, kv_memory_bytes=budget, max_batch_size=batch,
                         use_cuda_graphs=use_cuda_graphs)
    try:
        requests = [llm.generate_async(c.prompt_ids, SamplingParams(max_tokens=c.max_tokens, temperature=0.0,
                                                                    stop=list(c.stop))) for c in cases]
        records = []
        for case, request in zip(cases, requests):
            out = request.result()
            seq = out.outputs[0] if out.outputs else None
            records.append(_record(model_name, case, point, seq.text if seq else "",
                                   len(seq.token_ids) if seq else 0, seq.finish_reason if seq else "error",
                                   out.error, out.metrics or {}))
            if progress is not None:
                progress()
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def run_reference_point(model, tokenizer, model_config, point: GenerationPoint, cases: list[GenerationCase], *,
                        model_name: str, stop_token_ids=(), progress=None) -> list[dict]:
    """Every case through the reference path of a baseline (one request at a time, greedy, cut at the case's
    stop strings: :func:`~trtllm_diffkv.evaluation.quality.greedy_completion`); records as
    :func:`run_executor_point`'s (``pool_fraction`` ``None``: the reference path has no pool)."""
    from .quality import PointGenerator, greedy_completion

    gen = PointGenerator(model, tokenizer, model_config, point.reference, stop_token_ids)
    records = []
    for case in cases:
        text, out, cache = greedy_completion(gen, case.prompt_ids, case.max_tokens, case.stop, return_cache=True)
        stats = cache.stats()
        memory = dict(kv_memory_fraction=stats.kv_memory_fraction, kv_cache_bytes=stats.kv_cache_bytes,
                      fp16_kv_cache_bytes=stats.fp16_kv_cache_bytes, high_fraction=stats.fraction("high"),
                      low_fraction=stats.fraction("low"), pruned_fraction=stats.fraction("pruned"))
        stopped = len(out) < case.max_tokens
        records.append(_record(model_name, case, point, text, len(out), "stop" if stopped else "length", None,
                               memory))
        if progress is not None:
            progress()
    return records


def grade_records(cases: list[GenerationCase], records: list[dict], workers: int = 8) -> list[dict]:
    """``records`` with ``score`` (1.0 / 0.0) set by each case's grader (:meth:`GenerationCase.grade`); a
    record with an ``error`` scores 0. The unit tests of ``recall`` run ``workers`` subprocesses at a time."""
    by_key = {(c.task, c.case_id): c for c in cases}

    def grade(record):
        if record["error"] is not None:
            return 0.0
        return float(by_key[(record["task"], record["case_id"])].grade(record["text"]))

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        scores = list(pool.map(grade, records))
    for record, score in zip(records, scores):
        record["score"] = score
        case = by_key[(record["task"], record["case_id"])]
        if record["task"] in PARTIAL_METRIC:
            record["partial"] = 0.0 if record["error"] is not None else copied_lines(record["text"], case.expected)
    return records


def evaluate_generation(model, tokenizer, model_config, cases: list[GenerationCase],
                        points: list[GenerationPoint], *, model_name: str, stop_token_ids=(),
                        kv_memory_bytes: int | None = None, max_batch_size: int | None = None,
                        use_cuda_graphs: bool | None = None, time_limit_s: float | None = None,
                        grade_workers: int = 8, log=None, progress_bar=None,
                        on_point=None) -> list[dict]:
    """Run every point on ``cases`` (all tasks of a point at once), grade, and return every record.

    A point starts only before ``time_limit_s`` seconds (the points finished are kept; the rest are
    logged as skipped); ``on_point(records so far)`` is called after each point (to rewrite the files);
    ``progress_bar(total, desc)``: tqdm's shape, advanced once per finished case.
    """
    from .throughput import NullProgress

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    records: list[dict] = []
    start = time.perf_counter()
    for point in points:
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            log(f"[eval] point {point.name} skipped: past --time-limit-s {time_limit_s:g}")
            continue
        t0 = time.perf_counter()
        bar = progress_bar(len(cases), point.name) if progress_bar is not None else NullProgress()
        # every case of a point is submitted at once, so the bar moves only near the end: a line every 10 s
        with bar, heartbeat(f"running point {point.name} ({len(cases)} cases)", prefix="[eval]"):
            kw = dict(model_name=model_name, stop_token_ids=stop_token_ids, progress=lambda: bar.update(1))
            if point.path == "executor":
                got = run_executor_point(model, tokenizer, model_config, point, cases, kv_memory_bytes=kv_memory_bytes,
                                         max_batch_size=max_batch_size, use_cuda_graphs=use_cuda_graphs, **kw)
            else:
                got = run_reference_point(model, tokenizer, model_config, point, cases, **kw)
        t1 = time.perf_counter()
        got = grade_records(cases, got, grade_workers)
        records += got
        log(f"[eval] {model_name} {point.name}: {len(got)} cases in {t1 - t0:.1f} s (+{time.perf_counter() - t1:.1f} s "
            f"grading); " + ", ".join(f"{task} {sum(r['score'] for r in got if r['task'] == task):.0f}/"
                                      f"{sum(1 for r in got if r['task'] == task)}"
                                      for task in dict.fromkeys(r["task"] for r in got)))
        if on_point is not None:
            on_point(records)
    return records


# --------------------------------------------------------------------------------------- aggregation
def _sorted(group: list[dict]) -> list[dict]:
    return sorted(group, key=lambda r: (r["index"], r["case_id"]))


def aggregate_generation(records: list[dict], baselines=PAIRED_BASELINES) -> list[dict]:
    """Rows (:data:`ROW_KEYS`) per (model, task, point): the score (:data:`TASK_METRIC`), the partial score
    (:data:`PARTIAL_METRIC`) and each of :data:`MEMORY_METRICS` with their 95 % bootstrap bands, and
    ``<score>_delta_vs_<baseline>`` (and the partial score's) for each
    baseline point of ``baselines`` present: the bootstrap of the per-case differences over the cases both
    ran (paired). ``kv_memory_fraction`` of a row is the point's mean on that task. Records are sorted by
    case first, so the figures do not depend on the records' order (shards merged)."""
    from .quality import bootstrap_ci

    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["model"], r["task"], r["point"])].append(r)
    by_case = {(r["model"], r["task"], r["point"], r["case_id"]): r for r in records}
    rows = []
    for (model, task, point), group in groups.items():
        group = _sorted(group)
        method = group[0]["method"]
        memory = [r["kv_memory_fraction"] for r in group if r["kv_memory_fraction"] is not None]
        mean_memory = round(sum(memory) / len(memory), 4) if memory else None

        def row(metric, values):
            mean, low, high = bootstrap_ci(values)
            return dict(model=model, task=task, method=method, point=point, kv_memory_fraction=mean_memory,
                        metric=metric, value=mean, ci_low=low, ci_high=high, n=len(values))

        scores = [(TASK_METRIC[task], "score")] + ([(PARTIAL_METRIC[task], "partial")] if task in PARTIAL_METRIC else [])
        for metric, key in scores:
            rows.append(row(metric, [r[key] for r in group]))
        for name in MEMORY_METRICS:
            values = [r[name] for r in group if r.get(name) is not None]
            if values:
                rows.append(row(name, values))
        for metric, key in scores:
            for base in baselines:
                if base == point:
                    continue
                pairs = [(r[key], by_case[(model, task, base, r["case_id"])][key]) for r in group
                         if (model, task, base, r["case_id"]) in by_case]
                if pairs:
                    rows.append(row(f"{metric}_delta_vs_{base}", [a - b for a, b in pairs]))
    return rows


def _point_identities(details: dict) -> dict[tuple[str, str], tuple[str, DiffKVConfig | None]]:
    """``(model, point) -> (method, configuration or None)`` of every point with records in a details JSON: the
    configuration as its runs recorded it (compared by :meth:`~trtllm_diffkv.config.DiffKVConfig.same_configuration`,
    which leaves out the name; the records hold no ``calibrated_for``; ``None`` where the file has no runs, a
    reference-path point, or a record this version cannot read), the method as its records name it."""
    configs = {}
    for run in details.get("runs", []):
        for point in run.get("points", []):
            if point.get("kv_config") is None:
                continue
            try:
                config = kv_config_from_dict(point["kv_config"])
            except (ValueError, TypeError):
                continue
            configs[(run.get("model"), point["name"])] = config
    out = {}
    for r in details["records"]:
        key = (r["model"], r["point"])
        if key not in out:
            out[key] = (r["method"], configs.get(key))
    return out


def check_point_names(details: list[dict], sources: list[str]) -> None:
    """Refuse to merge runs in which one (model, point) name is two configurations: their records would pool under
    one name (the first run's record of a case wins), e.g. files written before ``default`` became uniform K8V4
    (issue 41), whose ``default`` is the tiered point that is ``diffkv`` now, beside a newer run's ``default``.

    Args:
        details: the details JSONs (``{"runs": [...], "records": [...]}``; ``runs`` optional).
        sources: their file names, for the message.

    Raises:
        ValueError: a point whose records name another method, or whose runs recorded another configuration, in
            one file than in an earlier one, naming the point, the model and both files.
    """
    seen: dict = {}
    for run, source in zip(details, sources):
        for key, (method, config) in _point_identities(run).items():
            if key not in seen:
                seen[key] = (method, config, source)
                continue
            first_method, first_config, first_source = seen[key]
            if method != first_method or (config is not None and first_config is not None
                                           and not config.same_configuration(first_config)):
                what = (f"method {first_method} in {first_source}, {method} in {source}" if method != first_method
                        else f"two configurations of method {method} in {first_source} and {source}")
                raise ValueError(f"point {key[1]!r} of model {key[0]!r} is {what}: merged, one name would pool two "
                                 "configurations' cases; rename the point in one file's records and runs (the tiered "
                                 "point is 'diffkv' since issue 41 made 'default' uniform K8V4)")


def merge_records(runs: list[list[dict]]) -> list[dict]:
    """The union of several runs' records (shards, or runs of other models or points on the same cases); the
    first run wins a duplicate (model, task, case, point)."""
    seen, out = set(), []
    for run in runs:
        for r in run:
            key = (r["model"], r["task"], r["case_id"], r["point"])
            if key not in seen:
                seen.add(key)
                out.append(r)
    return out


# --------------------------------------------------------------------------------------- tables
def _find(rows, model, task, point, metric):
    return next((r for r in rows if r["model"] == model and r["task"] == task and r["point"] == point
                 and r["metric"] == metric), None)


def _score_cell(rows, model, task, point) -> str:
    score = _find(rows, model, task, point, TASK_METRIC[task])
    return "—" if score is None else f"{round(score['value'] * score['n'])}/{score['n']}"


def _delta_cell(rows, model, task, point, base) -> str:
    d = _find(rows, model, task, point, f"{TASK_METRIC[task]}_delta_vs_{base}")
    return "—" if d is None else f"{d['value']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"


def format_tables(rows: list[dict], baselines=PAIRED_BASELINES) -> str:
    """One Markdown table per model (issue 41's form): point, KV / FP16 (the point's mean over its cases of
    every task), and per task the score as count/n and its paired difference against each of ``baselines``
    (``Δ [95 %]``; ``—`` where not measured, or the point is that baseline)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        tasks = [t for t in TASK_METRIC if any(r["task"] == t for r in mine)]
        points = list(dict.fromkeys(r["point"] for r in mine))
        head = ["point", "KV / FP16"]
        for task in tasks:
            head += [f"{task} {TASK_METRIC[task]}"] + [f"Δ vs {b} [95 %]" for b in baselines]
        out.append(f"model: {model}")
        out.append("| " + " | ".join(head) + " |")
        out.append("| --- | ---: | " + " | ".join(["---:"] * (len(head) - 2)) + " |")
        for point in points:
            kv = [r for r in mine if r["point"] == point and r["metric"] == "kv_memory_fraction"]
            weight = sum(r["n"] for r in kv)
            memory = sum(r["value"] * r["n"] for r in kv) / weight if weight else None
            cells = [point, "" if memory is None else f"{memory:.3f}"]
            for task in tasks:
                cells.append(_score_cell(mine, model, task, point))
                cells += [_delta_cell(mine, model, task, point, b) for b in baselines]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plot_generation(rows: list[dict], path, title: str = "") -> None:
    """The Pareto PNG: one panel per (model, task), the score against KV memory per point (95 % bands);
    drawn by :func:`~trtllm_diffkv.evaluation.quality.plot_pareto`."""
    from .quality import plot_pareto

    panels = []
    for r in rows:
        if r["metric"] == TASK_METRIC[r["task"]]:
            panels.append(dict(r, task=f"{r['model']}: {r['task']}",
                               method=r["point"] if r["method"] == "diffkv" else r["method"]))
    plot_pareto(panels, path, title, metric_of=lambda panel: TASK_METRIC[panel.rsplit(": ", 1)[1]])


def known_points() -> list[str]:
    """Names a point spec may start with: the presets and the reference baselines."""
    return sorted(PRESETS) + sorted(REFERENCE_POINTS)
