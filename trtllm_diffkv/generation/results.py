"""Result types of every generation path (reference, static batch, executor) and the one rule that fills them.

:class:`GenerationResult` is one finished request's text, ids, stop reason and KV metrics; :class:`PagedGenerationResult`
adds what the request really held in the page pool. :func:`result_fields` computes the fields from a request's
generated ids and cache statistics, so the reference loop, the static-batch loop and the executor report alike.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field


@dataclass
class GenerationResult:
    """Outcome of one request.

    Attributes:
        text: decoded generated text (special tokens removed).
        token_ids: generated token ids (the stop token included).
        prompt_tokens, generated_tokens: counts.
        finish_reason: "stop" (a stop token), "length" or "error".
        stop_token_id: the id that ended generation when ``finish_reason ==
            "stop"``, else ``None``.
        kv_memory_fraction: packed KV bytes / FP16 KV bytes at the end.
        high_fraction, low_fraction, pruned_fraction: share of (layer, KV
            head, token) triples in each tier at the end; they sum to 1.
            ``None`` without compression (the ``fp16`` preset has no tiers).
        kv_cache_bytes, fp16_kv_cache_bytes: the two byte counts.
        prefill_tokens_per_s: prompt tokens / prefill wall time.
        decode_tokens_per_s: decode steps / decode wall time; ``None`` when
            no decode step ran (one generated token).
        error: the message when ``finish_reason == "error"``.

    Every metric is ``None`` (JSON ``null``) for a failed request.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finish_reason: str = "length"
    stop_token_id: int | None = None
    kv_memory_fraction: float | None = None
    high_fraction: float | None = None
    low_fraction: float | None = None
    pruned_fraction: float | None = None
    kv_cache_bytes: int | None = None
    fp16_kv_cache_bytes: int | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    error: str | None = None

    def to_json_dict(self) -> dict:
        """JSON-ready dict (the CLI's ``--json`` line)."""
        return asdict(self)


@dataclass
class PagedGenerationResult(GenerationResult):
    """:class:`GenerationResult` plus the pool memory the request really held at its end.

    Attributes:
        pool_pages: pages its (layer, KV head) rows held.
        pool_used_bytes: ``pool_pages * page_size_bytes`` + its rows' metadata
            (the center_keys offsets); >= ``kv_cache_bytes`` by the unused
            tail of each row's last page per tier.
    """

    pool_pages: int | None = None
    pool_used_bytes: int | None = None


_FIELDS = {f.name for f in dataclasses.fields(PagedGenerationResult)}


def result_from_fields(**kw) -> PagedGenerationResult:
    """A :class:`PagedGenerationResult` from keyword fields, ignoring keys it has no field for."""
    return PagedGenerationResult(**{k: v for k, v in kw.items() if k in _FIELDS})


def result_fields(prompt_len: int, out: list[int], stats, prefill_s: float, decode_s: float, *, kv_config,
                  tokenizer, stop_token_ids, finish_reason: str | None = None, stop_token_id: int | None = None,
                  text: str | None = None) -> dict:
    """The :class:`GenerationResult` fields of a finished request (shared by every generator and the executor).

    Args:
        prompt_len: prompt tokens.
        out: generated token ids, at least one.
        stats: the request's cache statistics (``kv_memory_fraction``, ``fraction(tier)``,
            ``kv_cache_bytes``, ``fp16_kv_cache_bytes``).
        prefill_s, decode_s: wall seconds of the prefill and of the decode steps.
        kv_config: the DiffKV policy (tier fractions only with ``compress``).
        tokenizer: decodes the text (``None``: empty text).
        stop_token_ids: ids that end generation; removed from the text.
        finish_reason, stop_token_id: given by the caller's stop rule (stop strings, per-request
            stop ids); default: ``"stop"`` when the last id is a stop id, else ``"length"``.
        text: the caller's text (e.g. truncated before a stop string); default: ``out`` decoded
            without stop ids and special tokens.
    """
    if finish_reason is None:
        finish_reason = "stop" if out[-1] in stop_token_ids else "length"
        stop_token_id = out[-1] if finish_reason == "stop" else None
    if text is None:
        text_ids = [t for t in out if t not in stop_token_ids]
        text = tokenizer.decode(text_ids, skip_special_tokens=True) if tokenizer else ""
    tiers = kv_config.compress
    decode_steps = len(out) - 1
    return dict(
        text=text, token_ids=list(out), prompt_tokens=prompt_len, generated_tokens=len(out),
        finish_reason=finish_reason, stop_token_id=stop_token_id,
        kv_memory_fraction=stats.kv_memory_fraction,
        high_fraction=stats.fraction("high") if tiers else None,
        low_fraction=stats.fraction("low") if tiers else None,
        pruned_fraction=stats.fraction("pruned") if tiers else None,
        kv_cache_bytes=stats.kv_cache_bytes, fp16_kv_cache_bytes=stats.fp16_kv_cache_bytes,
        prefill_tokens_per_s=prompt_len / max(prefill_s, 1e-9),
        decode_tokens_per_s=decode_steps / max(decode_s, 1e-9) if decode_steps else None,
    )
