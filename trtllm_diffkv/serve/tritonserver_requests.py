"""The Triton model's tensors (names, types, dims as TensorRT-LLM's Triton models) and their translation.

Inputs and outputs follow ``all_models/inflight_batcher_llm/ensemble/config.pbtxt`` of TensorRT-LLM's
Triton backend (``text_input``, ``max_tokens``, ``stop_words``, ``end_id``, ``top_k``, ``top_p``,
``temperature``, ``repetition_penalty``, ``seed``, ``stream``, ... -> ``text_output``), with the
same data types and dims, so a client written for a TensorRT-LLM deployment sends the same
request. ``random_seed`` (the older name, ``tensorrt_llm_bls``) is accepted as well, and
``finish_reason`` comes from the newer ``llmapi`` model. Inputs we accept only at their neutral
value (``beam_width`` 1, ``length_penalty`` 1, no ``bad_words``, no context logits, ...) are declared
so that clients that always send them work; another value is a clear error for that request.

This module has no Triton import: :func:`parse_request` takes plain NumPy arrays (what
``pb_utils.Tensor.as_numpy()`` gives), so it is tested without a server.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass

import numpy as np

__all__ = ["TensorSpec", "INPUTS", "OUTPUTS", "DIFFKV_OUTPUTS", "LOG_PROB_OUTPUTS", "RowRequest", "parse_request",
           "llm_kwargs_from_parameters", "diffkv_output_values", "log_prob_values", "DEFAULT_MAX_TOKENS"]

DEFAULT_MAX_TOKENS = 64
"""New tokens when a request has no ``max_tokens`` (TensorRT-LLM's ensemble requires it; we default)."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of the Triton model (``config.pbtxt`` fields).

    Attributes:
        name: tensor name.
        data_type: Triton type (``TYPE_STRING``, ``TYPE_INT32``, ``TYPE_UINT64``, ``TYPE_FP32``, ``TYPE_BOOL``).
        dims: dims without the batch dimension (``-1`` = variable).
        optional: whether a request may leave it out (inputs only).
        neutral: for inputs we do not implement: the only value accepted (``None``: implemented).
        doc: what it does here.
    """

    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = True
    neutral: object = None
    doc: str = ""


INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_input", "TYPE_STRING", (1,), False, doc="the prompt, UTF-8, used as is (no chat template)"),
    TensorSpec("max_tokens", "TYPE_INT32", (1,), doc=f"new tokens at most, >= 1 (default {DEFAULT_MAX_TOKENS})"),
    TensorSpec("bad_words", "TYPE_STRING", (-1,), neutral="", doc="not supported: must be empty"),
    TensorSpec("stop_words", "TYPE_STRING", (-1,), doc="stop strings; each element is a comma-separated list "
               "(TensorRT-LLM's preprocessing rule); the text is cut before the stop string"),
    TensorSpec("exclude_input_in_output", "TYPE_BOOL", (1,), doc="non-streaming: leave the prompt out of "
               "text_output (default false: prompt + generated text, as TensorRT-LLM)"),
    TensorSpec("end_id", "TYPE_INT32", (1,), doc="a token id that ends generation, besides the model's stop ids; "
               "-1: no end token, the model's stop ids ignored (TensorRT-LLM's benchmark convention)"),
    TensorSpec("pad_id", "TYPE_INT32", (1,), doc="accepted and unused (outputs are text, nothing is padded)"),
    TensorSpec("top_k", "TYPE_INT32", (1,), doc="keep the k most likely tokens; 0 = off, 1 = greedy"),
    TensorSpec("top_p", "TYPE_FP32", (1,), doc="nucleus sampling in [0, 1]; 1 = off, 0 = greedy"),
    TensorSpec("temperature", "TYPE_FP32", (1,), doc=">= 0; 0 = greedy; no temperature/top_k/top_p = greedy"),
    TensorSpec("length_penalty", "TYPE_FP32", (1,), neutral=1.0, doc="beam search only: must be 1"),
    TensorSpec("repetition_penalty", "TYPE_FP32", (1,), doc="> 0, 1 = off (CTRL/HF rule)"),
    TensorSpec("min_tokens", "TYPE_INT32", (1,), doc="no end id or stop word before this many tokens are generated "
               "(0 = off; vLLM's rule: SamplingParams.min_tokens)"),
    TensorSpec("presence_penalty", "TYPE_FP32", (1,), doc="OpenAI's, in [-2, 2] over the generated tokens; 0 = off"),
    TensorSpec("frequency_penalty", "TYPE_FP32", (1,), doc="OpenAI's, in [-2, 2] over the generated tokens; 0 = off"),
    TensorSpec("seed", "TYPE_UINT64", (1,), doc="per-request sampling seed"),
    TensorSpec("random_seed", "TYPE_UINT64", (1,), doc="the older name of seed (tensorrt_llm_bls)"),
    TensorSpec("return_log_probs", "TYPE_BOOL", (1,), doc="true: cum_log_probs and output_log_probs come with "
               "each response (the sampler's log-probabilities: after penalties and temperature)"),
    TensorSpec("return_context_logits", "TYPE_BOOL", (1,), neutral=False, doc="not supported: must be false"),
    TensorSpec("return_generation_logits", "TYPE_BOOL", (1,), neutral=False, doc="not supported: must be false"),
    TensorSpec("beam_width", "TYPE_INT32", (1,), neutral=1, doc="greedy or sampled decoding only: must be 1"),
    TensorSpec("num_return_sequences", "TYPE_INT32", (1,), neutral=1, doc="one sequence per prompt: must be 1"),
    TensorSpec("stream", "TYPE_BOOL", (1,), doc="true: one response per new piece of text (decoupled)"),
    TensorSpec("return_num_input_tokens", "TYPE_BOOL", (1,), doc="accepted either way: num_input_tokens is "
               "always returned"),
    TensorSpec("return_num_output_tokens", "TYPE_BOOL", (1,), doc="accepted either way: num_output_tokens is "
               "always returned"),
    TensorSpec("return_perf_metrics", "TYPE_BOOL", (1,), neutral=False, doc="not supported: must be false "
               "(the DiffKV outputs kv_memory_fraction, ... come with every final response)"),
    TensorSpec("return_kv_cache_reuse_stats", "TYPE_BOOL", (1,), neutral=False,
               doc="not supported (no KV cache reuse): must be false"),
    TensorSpec("embedding_bias_words", "TYPE_STRING", (-1,), neutral="", doc="not supported: must be empty"),
    TensorSpec("embedding_bias_weights", "TYPE_FP32", (-1,), doc="accepted only with no embedding_bias_words "
               "(ignored then)"),
)
"""Inputs: TensorRT-LLM's ensemble's (``all_models/inflight_batcher_llm/ensemble/config.pbtxt``) except those
for features outside this model, which are not declared, so Triton refuses a request sending them
(``unexpected inference input``): ``decoder_text_input``, ``image_input`` and the other multimodal
inputs (text-only models), ``prompt_embedding_table`` / ``prompt_vocab_size`` / ``prompt_table_extra_id``
(prompt tuning), ``lora_task_id`` / ``lora_weights`` / ``lora_config`` (LoRA), ``num_draft_tokens`` /
``use_draft_logits`` (speculative decoding), ``guided_decoding_guide_type`` / ``guided_decoding_guide``
(guided decoding) and ``min_length`` (the older name of ``min_tokens``)."""

OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "TYPE_STRING", (-1,), doc="streaming: the new text; else the whole text"),
    TensorSpec("finish_reason", "TYPE_STRING", (-1,), doc="stop, length or cancelled; empty while streaming"),
    TensorSpec("num_input_tokens", "TYPE_INT32", (1,), doc="prompt tokens"),
    TensorSpec("num_output_tokens", "TYPE_INT32", (1,), doc="generated tokens so far"),
    TensorSpec("batch_index", "TYPE_INT32", (1,), doc="the row of the request this response is for"),
    TensorSpec("kv_memory_fraction", "TYPE_FP32", (1,), doc="DiffKV: KV bytes / FP16 KV bytes of the request's "
               "tokens at its end (final responses only; NaN when not reported)"),
    TensorSpec("high_fraction", "TYPE_FP32", (1,), doc="DiffKV: share of (layer, KV head, token) in the high "
               "tier at the end (final responses; NaN for the fp16 preset)"),
    TensorSpec("low_fraction", "TYPE_FP32", (1,), doc="DiffKV: share in the low tier (as high_fraction)"),
    TensorSpec("pruned_fraction", "TYPE_FP32", (1,), doc="DiffKV: share pruned (as high_fraction)"),
    TensorSpec("kv_pool_bytes", "TYPE_INT64", (1,), doc="DiffKV: KV pool bytes the request held at its end "
               "(final responses; -1 when not reported)"),
    TensorSpec("cum_log_probs", "TYPE_FP32", (-1,), doc="with return_log_probs: [batch, 1] the sum of the "
               "generated tokens' log-probabilities so far"),
    TensorSpec("output_log_probs", "TYPE_FP32", (-1, -1), doc="with return_log_probs: [batch, 1, tokens] each "
               "token's log-probability (streaming: the new tokens; rows padded with 0)"),
)
DIFFKV_OUTPUTS = ("kv_memory_fraction", "high_fraction", "low_fraction", "pruned_fraction", "kv_pool_bytes")
"""The outputs carrying DiffKV's numbers (``RequestOutput.metrics``), sent with final responses only."""
LOG_PROB_OUTPUTS = ("cum_log_probs", "output_log_probs")
"""TensorRT-LLM's log-probability outputs (beam dimension 1), sent when the request sets ``return_log_probs``."""

_BY_NAME = {spec.name: spec for spec in INPUTS}


@dataclass(frozen=True)
class RowRequest:
    """One row of a Triton request, ready for ``LLM.generate_async``.

    Attributes:
        prompt: the text.
        sampling_params: a :class:`~trtllm_diffkv.runtime.sampling.SamplingParams` (not yet
            validated: the LLM validates it and fails the request alone with the message).
        stream: whether to send a response per new piece of text.
        exclude_input: leave the prompt out of a non-streaming ``text_output``.
        return_log_probs: send :data:`LOG_PROB_OUTPUTS` (``sampling_params.logprobs`` is then 0).
    """

    prompt: str
    sampling_params: object
    stream: bool
    exclude_input: bool
    return_log_probs: bool = False


def _row_values(name: str, array: np.ndarray, batch_size: int, row: int) -> np.ndarray:
    if array.ndim == 0 or array.shape[0] != batch_size:
        raise ValueError(f"input '{name}' has shape {list(array.shape)}; expected batch size {batch_size} first "
                         "(the model's max_batch_size > 0: every input is [batch, ...])")
    return array.reshape(batch_size, -1)[row]


def _scalar(name: str, values: np.ndarray):
    if values.size != 1:
        raise ValueError(f"input '{name}' must hold one value per row, got {values.size}")
    value = values[0]
    return value.item() if isinstance(value, np.generic) else value  # BYTES elements are already bytes


def _text(name: str, value) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"input '{name}' is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return str(value)


def _stop_strings(values: np.ndarray) -> list[str]:
    words = []
    for value in values:
        text = _text("stop_words", value)
        if text:
            words.extend(word for word in next(csv.reader([text])) if word)
    return words


def parse_request(inputs: dict[str, np.ndarray]) -> list[RowRequest]:
    """Translate one Triton request's input arrays into one :class:`RowRequest` per batch row.

    Args:
        inputs: input name -> array ``[batch, ...]`` as ``as_numpy()`` gives it (BYTES as
            ``object`` arrays of ``bytes``); missing optional inputs left out.

    Returns:
        the rows in order (``batch`` of them).

    Raises:
        ValueError: naming the input: an unknown or missing required input, a batch size that
            differs between inputs, non-UTF-8 text, an unsupported input at a non-neutral value,
            or a row mixing ``stream`` values.
    """
    from ..runtime.sampling import SamplingParams

    unknown = sorted(set(inputs) - set(_BY_NAME))
    if unknown:
        raise ValueError(f"unknown inputs {unknown}")
    if "text_input" not in inputs:
        raise ValueError("input 'text_input' is required")
    batch_size = int(inputs["text_input"].shape[0]) if inputs["text_input"].ndim else 0
    rows = []
    for row in range(batch_size):
        values = {name: _row_values(name, array, batch_size, row) for name, array in inputs.items()}
        lists = ("bad_words", "stop_words", "embedding_bias_words", "embedding_bias_weights")
        scalars = {name: _scalar(name, v) for name, v in values.items() if name not in lists}
        for name, value in scalars.items():
            neutral = _BY_NAME[name].neutral
            if neutral is not None and value != neutral:
                raise ValueError(f"input '{name}' = {value!r} is not supported (only {neutral!r}): "
                                 f"{_BY_NAME[name].doc}")
        for name in ("bad_words", "embedding_bias_words"):
            if any(_text(name, v) for v in values.get(name, ())):
                raise ValueError(f"input '{name}' is not supported: send it empty or leave it out")
        seed = scalars.get("seed", scalars.get("random_seed"))
        end_id = scalars.get("end_id")
        params = SamplingParams(
            max_tokens=int(scalars.get("max_tokens", DEFAULT_MAX_TOKENS)),
            temperature=None if "temperature" not in scalars else float(scalars["temperature"]),
            top_k=None if "top_k" not in scalars else int(scalars["top_k"]),
            top_p=None if "top_p" not in scalars else float(scalars["top_p"]),
            repetition_penalty=float(scalars.get("repetition_penalty", 1.0)),
            presence_penalty=float(scalars["presence_penalty"]) if "presence_penalty" in scalars else None,
            frequency_penalty=float(scalars["frequency_penalty"]) if "frequency_penalty" in scalars else None,
            logprobs=0 if scalars.get("return_log_probs") else None,
            seed=None if seed is None else int(seed),
            stop=_stop_strings(values["stop_words"]) or None if "stop_words" in values else None,
            end_id=None if end_id is None else int(end_id),  # an id, or -1: no end token (SamplingParams' rule)
            min_tokens=int(scalars["min_tokens"]) if "min_tokens" in scalars else None)
        rows.append(RowRequest(_text("text_input", scalars["text_input"]), params, bool(scalars.get("stream", False)),
                               bool(scalars.get("exclude_input_in_output", False)),
                               bool(scalars.get("return_log_probs", False))))
    if len({r.stream for r in rows}) > 1:
        raise ValueError("input 'stream' must be the same for every row of a request")
    return rows


def diffkv_output_values(metrics: dict | None) -> dict[str, float | int]:
    """The :data:`DIFFKV_OUTPUTS` of one finished request from its ``RequestOutput.metrics`` (the executor's
    result: ``kv_memory_fraction``, tier fractions, ``pool_used_bytes``); NaN / -1 where not reported."""
    metrics = metrics or {}
    values = {name: float("nan") if metrics.get(name) is None else float(metrics[name])
              for name in DIFFKV_OUTPUTS[:4]}
    values["kv_pool_bytes"] = -1 if metrics.get("pool_used_bytes") is None else int(metrics["pool_used_bytes"])
    return values


def log_prob_values(token_ids: list[list[int]], entries: list[list | None]) -> tuple[np.ndarray, np.ndarray]:
    """:data:`LOG_PROB_OUTPUTS` of a response's rows: ``cum_log_probs`` ``[rows, 1]`` float32 (the sum over
    ``token_ids[r]``) and ``output_log_probs`` ``[rows, 1, max tokens]`` float32 (each token's, padded with 0),
    from each row's ``CompletionOutput.logprobs`` entries of those tokens (``None``: zeros)."""
    width = max((len(ids) for ids in token_ids), default=0)
    per_token = np.zeros((len(token_ids), 1, width), dtype=np.float32)
    for r, (ids, row) in enumerate(zip(token_ids, entries)):
        for t, (token, entry) in enumerate(zip(ids, row or ())):
            per_token[r, 0, t] = entry[token].logprob
    return per_token.sum(axis=2, dtype=np.float64).astype(np.float32), per_token


def llm_kwargs_from_parameters(parameters: dict[str, str]) -> dict:
    """``LLM(**kwargs)`` from the ``parameters`` of ``config.pbtxt`` (string values; empty = default).

    Keys: ``model`` (path; empty = the default model), ``kv_config`` (preset), ``max_batch_size``,
    ``kv_memory_bytes``, ``max_seq_len``, ``num_threads``, ``device``, ``dtype`` (``float32``, ``float16``,
    ``bfloat16``). Other keys (``python_path``, ``shutdown_timeout_s``) are the model's own.

    Raises:
        ValueError: a number that does not parse, an unknown dtype.
    """
    import torch

    def value(key):
        text = parameters.get(key, "").strip()
        return text or None

    kwargs = {"model": value("model"), "kv_config": value("kv_config"), "device": value("device")}
    for key in ("max_batch_size", "kv_memory_bytes", "max_seq_len", "num_threads"):
        if value(key) is not None:
            try:
                kwargs[key] = int(value(key))
            except ValueError:
                raise ValueError(f"parameter '{key}' = {value(key)!r} is not an integer") from None
    if value("dtype") is not None:
        if value("dtype") not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"parameter 'dtype' = {value('dtype')!r}: expected float32, float16 or bfloat16")
        kwargs["dtype"] = getattr(torch, value("dtype"))
    return kwargs
