"""The user's own traffic for ``trtllm-diffkv bench --prompts-file FILE``: a JSONL file, one request per line.

Two kinds of line, which may be mixed (unknown keys are ignored, so a file written for one of these tools is
read as is):

- **prompts**: ``{"prompt": "text"}`` (vLLM's ``benchmark_serving --dataset-name custom`` and TensorRT-LLM's
  ``trtllm-bench`` dataset), ``{"text": "text"}`` (genai-perf's ``--input-file``) or ``{"input_ids": [1, 2,
  ...]}`` (``trtllm-bench``'s tokenized form);
- **lengths**: ``{"input_length": 512, "output_length": 128}`` (the Mooncake trace format that genai-perf /
  AIPerf replay; ``timestamp`` and ``hash_ids`` are ignored: the benchmark sends requests closed-loop),
  a prompt of exactly ``input_length`` tokens is made up (:func:`materialize`).

Each line may give its own generated-token count, ``output_tokens`` (vLLM, ``trtllm-bench``) or
``output_length`` (Mooncake); lines without one take the command's ``--max-tokens``. Blank lines are skipped.
A bad line is refused with one error naming the file, the line number and the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..validators import is_int

__all__ = ["BenchPrompt", "read_prompts_file", "materialize", "PROMPT_KEYS", "OUTPUT_KEYS"]

PROMPT_KEYS = ("prompt", "text", "input_ids", "input_length")
"""The keys that give a line's prompt; exactly one per line."""
MAX_LENGTH_TOKENS = 1 << 20
"""Largest ``input_length`` / ``output_length`` / ``output_tokens`` a line may give (a made-up prompt is
allocated whole before it is sent: a typo must not ask for gigabytes); far above any model's context."""
OUTPUT_KEYS = ("output_tokens", "output_length")
"""The keys that give a line's generated tokens; at most one per line."""

FILLER_ID_RANGE = (32, 256)
"""Token ids of a made-up prompt sent to a server (no tokenizer at hand): uniform in this half-open range, valid in
any vocabulary of 256 or more entries (byte-level BPE and SentencePiece keep their byte tokens there) and past the
first special tokens."""


@dataclass(frozen=True)
class BenchPrompt:
    """One line of a prompts file: exactly one of ``text``, ``token_ids``, ``input_tokens``.

    Attributes:
        text: the prompt text (``prompt`` / ``text``).
        token_ids: the prompt's token ids (``input_ids``).
        input_tokens: the prompt's length in tokens (``input_length``): the prompt is made up.
        output_tokens: generated tokens of this request (``output_tokens`` / ``output_length``); ``None``: the
            command's ``--max-tokens``.
        line: the line number in the file (1-based), for messages.
    """

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    line: int = 0


def _positive_int(value) -> bool:
    return is_int(value) and value >= 1


def read_prompts_file(path) -> list[BenchPrompt]:
    """Read and check a prompts file (UTF-8 JSONL, formats in the module doc).

    Returns:
        One :class:`BenchPrompt` per non-blank line, in order.

    Raises:
        ValueError: the file cannot be read, is not UTF-8, holds no request, or a line is not a JSON object, has
            none or several of :data:`PROMPT_KEYS`, an empty or non-string text, ids that are not non-negative
            integers, or a length that is not a positive integer; the message names ``path``, the line and the field.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"--prompts-file {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ValueError(f"--prompts-file {path} line {line}: not UTF-8 text") from None
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"--prompts-file {path} line {number}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg} at column {exc.colno}); one JSON object per line, "
                             f"e.g. {{\"prompt\": \"...\"}} or {{\"input_length\": 512, \"output_length\": 128}}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: a JSON object is needed, got {type(record).__name__}")
        out.append(_prompt(record, where, number))
    if not out:
        raise ValueError(f"--prompts-file {path} holds no request (one JSON object per line)")
    return out


def _prompt(record: dict, where: str, number: int) -> BenchPrompt:
    given = [key for key in PROMPT_KEYS if key in record]
    if len(given) != 1:
        raise ValueError(f"{where}: needs exactly one of {', '.join(repr(k) for k in PROMPT_KEYS)}"
                         + (f", got {', '.join(repr(k) for k in given)}" if given else ""))
    key, value = given[0], record[given[0]]
    outputs = [k for k in OUTPUT_KEYS if k in record]
    if len(outputs) > 1:
        raise ValueError(f"{where}: give one of 'output_tokens' and 'output_length', not both")
    output = record[outputs[0]] if outputs else None
    if output is not None and not _positive_int(output):
        raise ValueError(f"{where}: field {outputs[0]!r} must be a positive integer, got {output!r}")
    if output is not None and output > MAX_LENGTH_TOKENS:
        raise ValueError(f"{where}: field {outputs[0]!r} = {output} exceeds {MAX_LENGTH_TOKENS} tokens")
    if key in ("prompt", "text"):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}: field {key!r} must be a non-empty string, got {value!r}"[:300])
        return BenchPrompt(text=value, output_tokens=output, line=number)
    if key == "input_ids":
        if not isinstance(value, list) or not value:
            raise ValueError(f"{where}: field 'input_ids' must be a non-empty list of token ids")
        bad = next((v for v in value if not is_int(v) or v < 0), None)
        if bad is not None:
            raise ValueError(f"{where}: field 'input_ids' holds {bad!r}, not a token id (an integer >= 0)")
        return BenchPrompt(token_ids=tuple(value), output_tokens=output, line=number)
    if not _positive_int(value):
        raise ValueError(f"{where}: field 'input_length' must be a positive integer, got {value!r}")
    if value > MAX_LENGTH_TOKENS:
        raise ValueError(f"{where}: field 'input_length' = {value} exceeds {MAX_LENGTH_TOKENS} tokens")
    return BenchPrompt(input_tokens=value, output_tokens=output, line=number)


def materialize(prompts: list[BenchPrompt], *, default_output_tokens: int, tokenizer=None, vocab_size: int | None = None,
                seed: int = 0) -> tuple[list, list[int]]:
    """The requests to send: ``(prompts, output_tokens)``, one entry per line.

    With ``vocab_size`` (the offline benchmark, which holds the model): every prompt as token ids: texts
    tokenized with ``tokenizer`` (no special tokens added, as the other workloads), ``input_length`` prompts cut
    from the workloads' filler text (:func:`~trtllm_diffkv.evaluation.workload_prompts.make_prompts`: HumanEval, or
    random ids without a tokenizer). Without it (a client of a server): texts stay text, ``input_ids`` go as
    ids and ``input_length`` prompts are ids drawn from :data:`FILLER_ID_RANGE` (seeded).

    Raises:
        ValueError: a text prompt and no tokenizer, or an id outside ``[0, vocab_size)``; the message names the line.
    """
    import torch

    outputs = [p.output_tokens or default_output_tokens for p in prompts]
    lengths = [p.input_tokens for p in prompts if p.input_tokens is not None]
    filler = iter(())
    if lengths and vocab_size is not None:
        from types import SimpleNamespace

        from .workload_prompts import make_prompts

        made, _ = make_prompts(SimpleNamespace(num_requests=len(lengths), prompt_tokens=max(lengths)), tokenizer,
                               vocab_size, seed)
        filler = iter(ids[:n] for ids, n in zip(made, lengths))
    elif lengths:
        g = torch.Generator().manual_seed(seed)
        low, high = FILLER_ID_RANGE
        filler = iter(torch.randint(low, high, (n,), generator=g).tolist() for n in lengths)
    out = []
    for p in prompts:
        if p.input_tokens is not None:
            out.append(next(filler))
        elif p.token_ids is not None:
            if vocab_size is not None and max(p.token_ids) >= vocab_size:
                raise ValueError(f"--prompts-file line {p.line}: 'input_ids' holds {max(p.token_ids)}, outside the "
                                 f"model's vocabulary [0, {vocab_size})")
            out.append(list(p.token_ids))
        elif vocab_size is None:
            out.append(p.text)
        elif tokenizer is None:
            raise ValueError(f"--prompts-file line {p.line}: a text prompt, and the model has no tokenizer (give "
                             "'input_ids' or 'input_length' instead)")
        else:
            ids = tokenizer.encode(p.text, add_special_tokens=False)
            if not ids:
                raise ValueError(f"--prompts-file line {p.line}: the prompt text tokenizes to no token")
            out.append(ids)
    return out, outputs


def source_text(path, prompts: list[BenchPrompt]) -> str:
    """A one-line description of a prompts file for the details JSON (``prompt_source``)."""
    kinds = {"text": sum(p.text is not None for p in prompts), "input_ids": sum(p.token_ids is not None for p in prompts),
             "input_length": sum(p.input_tokens is not None for p in prompts)}
    return f"--prompts-file {path}: {len(prompts)} requests (" + ", ".join(f"{n} {k}" for k, n in kinds.items() if n) + ")"
