"""``ModelRunner``: TensorRT-LLM's runner API (``tensorrt_llm/runtime/model_runner.py``) over the executor.

Existing runner scripts (``examples/run.py`` style) work with few changes::

    from trtllm_diffkv import ModelRunner
    runner = ModelRunner.from_dir("/path/to/hf_folder_or_engine_dir")      # was tensorrt_llm.runtime.ModelRunner
    outputs = runner.generate(batch_input_ids, max_new_tokens=32, end_id=eos, pad_id=eos,
                              output_sequence_lengths=True, return_dict=True)
    output_ids, sequence_lengths = outputs["output_ids"], outputs["sequence_lengths"]

Output layout, as TensorRT-LLM's Python runner: ``output_ids`` is int32 ``[batch, num_beams=1,
max_input_len + max_new_tokens]``; row ``b`` holds the input ids, then the generated ids, then
``pad_id``. ``sequence_lengths`` is int32 ``[batch, 1]``: input + generated tokens, the ``end_id``
that ended a request not counted (it is not written either: ``pad_id`` follows), as TensorRT-LLM's
runners report it. Differences: the requests of a batch are in-flight batched (each ends on its own),
only one beam, and tensors stay on the CPU (``.cuda()`` them if needed).
"""
from __future__ import annotations

import queue

import torch

from .llm import LLM, take_all
from ..runtime.sampling import is_neutral_value
from ..validators import is_int

# TensorRT-LLM generate() arguments we accept only at their "off" value (anything else is refused).
_OFF_VALUES = {"num_beams": (1,), "num_return_sequences": (None, 1), "length_penalty": (1.0,),
               "early_stopping": (1, 0, False, True),
               "bad_words_list": (None,), "lora_uids": (None,), "prompt_table": (None,), "prompt_tasks": (None,),
               "no_repeat_ngram_size": (None,),
               "output_generation_logits": (False,), "medusa_choices": (None,), "min_length": (1, None),
               "max_attention_window_size": (None,), "sink_token_length": (None,),
               "return_all_generated_tokens": (False,), "input_token_extra_ids": (None,),
               "sampling_config": (None,), "position_ids": (None,), "stopping_criteria": (None,),
               "logits_processor": (None,)}


class ModelRunner:
    """Runner-style batch generation (TensorRT-LLM ``ModelRunner`` / ``ModelRunnerCpp`` shape).

    Build with :meth:`from_dir`. Attributes: ``llm`` (the :class:`~trtllm_diffkv.llmapi.llm.LLM` doing the
    work), ``tokenizer``, ``max_batch_size``, ``max_seq_len``, plus TensorRT-LLM's read-only
    properties ``vocab_size``, ``num_layers``, ``num_heads``, ``hidden_size``, ``max_sequence_length``,
    ``dtype``.
    """

    def __init__(self, llm: LLM, max_batch_size: int):
        self.llm, self.max_batch_size = llm, max_batch_size
        self.tokenizer = llm.tokenizer
        self.max_seq_len = llm.max_seq_len

    @classmethod
    def from_dir(cls, engine_dir, *, kv_config=None, max_batch_size: int | None = None, max_seq_len: int | None = None,
                 max_output_len: int | None = None, device=None, dtype=None, rank: int = 0,
                 **executor_kwargs) -> "ModelRunner":
        """Load a runner.

        Args:
            engine_dir: an engine dir written by ``trtllm-diffkv build`` (its model, preset, batch and
                length limits and dtype are used), a Hugging Face checkpoint folder, a ``.gguf``, or
                ``None`` for the default model.
            kv_config: preset name or :class:`~trtllm_diffkv.config.DiffKVConfig`; ``None``: the engine
                dir's, else ``"default"``.
            max_batch_size, max_seq_len, device, dtype, **executor_kwargs: as :class:`LLM` (``None``: the
                engine dir's limits, else 64 requests and the model's positions).
            max_output_len, rank: accepted for TensorRT-LLM compatibility (``rank`` must be 0).

        Raises:
            FileNotFoundError, ValueError: as :class:`LLM`; ``rank != 0`` (one GPU only).
        """
        if rank != 0:
            raise ValueError(f"rank={rank}: trtllm-diffkv runs on one GPU (rank 0)")
        llm = LLM(None if engine_dir is None else str(engine_dir), kv_config, device=device, dtype=dtype,
                  max_batch_size=max_batch_size, max_seq_len=max_seq_len, **executor_kwargs)
        return cls(llm, llm.max_batch_size)

    # ------------------------------------------------------------------ TensorRT-LLM properties
    @property
    def vocab_size(self) -> int:
        return self.llm.model_config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.llm.model_config.num_layers

    @property
    def num_heads(self) -> int:
        return self.llm.model_config.num_heads

    @property
    def hidden_size(self) -> int:
        return self.llm.model_config.hidden_size

    @property
    def max_sequence_length(self) -> int:
        return self.max_seq_len

    @property
    def dtype(self) -> torch.dtype:
        return next(self.llm.executor.model.parameters()).dtype

    def shutdown(self) -> None:
        """Stop the background loop (see :meth:`LLM.shutdown`)."""
        self.llm.shutdown()

    # ------------------------------------------------------------------ generate
    def generate(self, batch_input_ids, max_new_tokens: int = 20, end_id: int | None = None,
                 pad_id: int | None = None, streaming: bool = False, temperature: float = 1.0, top_k: int = 1,
                 top_p: float = 0.0, repetition_penalty: float = 1.0, random_seed: int | None = None,
                 stop_words_list=None, output_sequence_lengths: bool = False, return_dict: bool = False,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, output_log_probs: bool = False,
                 output_cum_log_probs: bool = False, **kwargs):
        """Generate for a batch of token-id tensors (TensorRT-LLM ``ModelRunner.generate``).

        Args:
            batch_input_ids: list of 1-D integer tensors (or lists) of token ids, one per request.
            max_new_tokens: tokens to generate per request at most (>= 1).
            end_id: the id that ends a request (not counted in ``sequence_lengths``); ``None``: the
                model's stop ids (tokenizer EOS, config/GGUF stop ids).
            pad_id: fills ``output_ids`` after each sequence; ``None``: ``end_id``, else the tokenizer's
                pad id, else its EOS, else 0.
            streaming: return a generator of outputs (one per executor step that changed any request).
            temperature, top_k, top_p: TensorRT-LLM ``SamplingConfig`` semantics: ``top_k == 1`` or
                ``temperature == 0`` is greedy (the defaults: greedy); ``top_p == 0`` is off; ``top_k == 0``
                with ``top_p == 0`` is greedy.
            repetition_penalty: HF/CTRL rule (1 = off). presence_penalty, frequency_penalty: OpenAI's rule over
                the generated tokens (0 = off; :class:`~trtllm_diffkv.runtime.sampling.SamplingParams`).
                random_seed: seeds every request's generator.
            stop_words_list: per request, token sequences that end it (kept in the output, as
                TensorRT-LLM does): a list (one per request) of lists of id lists, or TensorRT-LLM's
                ``[batch, 2, len]`` word-list array (``to_word_list_format``).
            output_sequence_lengths, return_dict: as TensorRT-LLM (``{"output_ids", "sequence_lengths"}``).
            output_log_probs: with ``return_dict``, ``"log_probs"``: float32 ``[batch, 1, max_new_tokens]``, each
                kept generated token's log-probability (``log_softmax`` of the penalized logits / temperature,
                the sampler's, docs/RUNTIME.md), 0 past the sequence's end.
            output_cum_log_probs: with ``return_dict``, ``"cum_log_probs"``: float32 ``[batch, 1]``, their sum.
            **kwargs: other TensorRT-LLM arguments are accepted at their "off" value (``num_beams=1``,
                ``bad_words_list=None``, ...) and refused otherwise.

        Returns:
            ``output_ids`` (int32 ``[batch, 1, max_input_len + max_new_tokens]``), or the dict; with
            ``streaming`` a generator of those.

        Raises:
            ValueError: a bad input (empty or non-integer ids, ids outside the vocabulary, too long,
                bad sampling values, an unsupported option).
            RuntimeError: a request failed while running (its message), after the others finished.
        """
        self._refuse_unsupported(kwargs)
        inputs = [self._as_ids(i, ids) for i, ids in enumerate(batch_input_ids)]
        if not inputs:
            raise ValueError("batch_input_ids is empty")
        for name, value, allowed in (("end_id", end_id, "an int in [0, 2**31), or -1: no end token"),
                                     ("pad_id", pad_id, "an int in [0, 2**31)")):
            if value is None or (name == "end_id" and value == -1):
                continue
            if not is_int(value, integral=True) or not 0 <= value < 2 ** 31:
                raise ValueError(f"{name}={value!r} must be a token id ({allowed})")
        no_end = end_id == -1  # TensorRT-LLM's convention: no end token, run to max_new_tokens
        end_id = None if no_end else end_id
        if (output_log_probs or output_cum_log_probs) and not return_dict:
            raise ValueError("output_log_probs / output_cum_log_probs need return_dict=True (they are dict entries)")
        params = self._params(max_new_tokens, end_id, temperature, top_k, top_p, repetition_penalty, random_seed,
                              presence_penalty, frequency_penalty, output_log_probs or output_cum_log_probs)
        if no_end:
            params = params.with_changes(ignore_eos=True)
        for index, ids in enumerate(inputs):  # TensorRT-LLM raises here too, before anything runs
            if len(ids) + params.max_tokens > self.max_seq_len:
                raise ValueError(f"batch_input_ids[{index}]: {len(ids)} tokens + max_new_tokens {params.max_tokens} "
                                 f"exceeds max_seq_len {self.max_seq_len}")
        stops = _stop_words(stop_words_list, len(inputs))
        pad = _first_not_none(pad_id, end_id, getattr(self.tokenizer, "pad_token_id", None),
                              getattr(self.tokenizer, "eos_token_id", None), 0)
        run = _BatchRun(self.llm, inputs, params, stops, end_id, pad, max_new_tokens)
        shape = dict(output_sequence_lengths=output_sequence_lengths, return_dict=return_dict,
                     output_log_probs=output_log_probs, output_cum_log_probs=output_cum_log_probs)
        if streaming:
            return run.stream(**shape)
        return run.wait(**shape)

    def _refuse_unsupported(self, kwargs: dict) -> None:
        for name, value in kwargs.items():
            if name not in _OFF_VALUES:
                raise ValueError(f"generate() got an unknown argument {name!r}")
            if not is_neutral_value(value, _OFF_VALUES[name]):  # True is not num_beams=1
                raise ValueError(f"{name}={value!r} is not supported by trtllm-diffkv's ModelRunner "
                                 f"(only {_OFF_VALUES[name][0]!r})")

    def _as_ids(self, index: int, ids) -> list[int]:
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
                raise ValueError(f"batch_input_ids[{index}]: a 1-D integer tensor is needed, got {ids.dtype} "
                                 f"of shape {tuple(ids.shape)}")
            ids = ids.tolist()
        elif hasattr(ids, "tolist") and getattr(ids, "ndim", 1) == 1:  # a 1-D NumPy array
            if getattr(getattr(ids, "dtype", None), "kind", "i") not in "iu":
                raise ValueError(f"batch_input_ids[{index}]: an integer array is needed, got dtype {ids.dtype}")
            ids = ids.tolist()
        ids = [int(t) if is_int(t, integral=True) else t for t in ids]
        if not ids:
            raise ValueError(f"batch_input_ids[{index}] is empty: at least one token is needed")
        vocab = self.vocab_size
        bad = [t for t in ids if not is_int(t) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"batch_input_ids[{index}]: token id {bad[0]!r} is not an int in [0, {vocab})")
        return ids

    def _params(self, max_new_tokens, end_id, temperature, top_k, top_p, repetition_penalty, random_seed,
                presence_penalty=0.0, frequency_penalty=0.0, logprobs=False):
        from ..runtime.sampling import SamplingParams

        # every value is checked as given, also where greedy decoding will not use it (a bad input never runs)
        given = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                               top_p=0.0 if top_p is None else top_p, repetition_penalty=repetition_penalty,
                               presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                               logprobs=0 if logprobs else None, seed=random_seed, stop_token_ids=None if end_id is None else [end_id],
                               ignore_eos=end_id is not None)
        given.validate(self.vocab_size)
        top_p_off = top_p is None or top_p == 0  # SamplingConfig's top_p=0 is "off", SamplingParams' is greedy
        greedy = temperature == 0 or top_k == 1 or (top_k == 0 and top_p_off)
        params = given.with_changes(temperature=0.0 if greedy else temperature, top_k=0 if greedy else top_k,
                                    top_p=1.0 if greedy or top_p_off else top_p)
        return params


class _BatchRun:
    """One ``generate`` call: the requests in flight, their generated ids, the output tensors."""

    def __init__(self, llm: LLM, inputs, params, stops, end_id, pad_id, max_new_tokens):
        self.llm, self.inputs, self.stops, self.end_id, self.pad_id = llm, inputs, stops, end_id, pad_id
        self.width, self.max_new_tokens = max(len(ids) for ids in inputs) + max_new_tokens, max_new_tokens
        self.events: queue.Queue = queue.Queue()
        self.requests = [llm.generate_async(ids, params, streaming=True, _listener=self.events) for ids in inputs]
        self.index = {r.request_id: i for i, r in enumerate(self.requests)}
        self.generated = [[] for _ in inputs]
        self.logprobs = [[] for _ in inputs]  # per generated token its log-probability (when asked)
        self.done = [False] * len(inputs)
        self.errors: dict[int, str] = {}

    def wait(self, **shape):
        try:
            while not all(self.done):
                self._advance()
        finally:
            self._abort_unfinished()
        return self._output(**shape)

    def stream(self, **shape):
        try:
            while not all(self.done):
                self._advance()
                yield self._output(**shape)
        finally:
            self._abort_unfinished()

    def _advance(self) -> None:
        """Wait for at least one request's update, then take every pending one."""
        changed = set(take_all(self.events, block=True))
        for rid in changed:
            i = self.index[rid]
            if self.done[i]:
                continue
            request = self.requests[i]
            out = request._poll()
            checked = len(self.generated[i])
            self.generated[i] = list(out.outputs[0].token_ids)
            self.logprobs[i] = [entry[t].logprob for t, entry in zip(self.generated[i], out.outputs[0].logprobs or [])]
            if out.finished:
                self._finish(i, out, checked)
            elif self._hit_stop_word(i, checked):
                request.abort()
                self.done[i] = True

    def _finish(self, i: int, out, checked: int) -> None:
        self.done[i] = True
        if out.error is not None:
            self.errors[i] = out.error
        ids = self.generated[i]
        if self.end_id is not None and ids and ids[-1] == self.end_id and out.outputs[0].finish_reason == "stop":
            ids.pop()  # the end id is not part of the sequence (TensorRT-LLM's sequence_lengths)
        self._hit_stop_word(i, checked)

    def _hit_stop_word(self, i: int, checked: int) -> bool:
        """Cut request ``i``'s ids after the first stop word ending past position ``checked``; True when
        one was found."""
        ids = self.generated[i]
        for at in range(checked + 1, len(ids) + 1):
            for word in self.stops[i]:
                if at >= len(word) and ids[at - len(word):at] == word:
                    del ids[at:]
                    return True
        return False

    def _abort_unfinished(self) -> None:
        for i, request in enumerate(self.requests):
            if not self.done[i] or not request.finished:
                request.abort()

    def _output(self, output_sequence_lengths: bool, return_dict: bool, output_log_probs: bool = False,
                output_cum_log_probs: bool = False):
        if self.errors and all(self.done):
            first = min(self.errors)
            raise RuntimeError(f"request {first} of the batch failed: {self.errors[first]}"
                               + (f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""))
        output_ids = torch.full((len(self.inputs), 1, self.width), self.pad_id, dtype=torch.int32)
        lengths = torch.zeros((len(self.inputs), 1), dtype=torch.int32)
        for i, (prompt, ids) in enumerate(zip(self.inputs, self.generated)):
            row = prompt + ids
            output_ids[i, 0, :len(row)] = torch.tensor(row, dtype=torch.int32)
            lengths[i, 0] = len(row)
        if not return_dict:
            return output_ids
        out = {"output_ids": output_ids}
        if output_sequence_lengths:
            out["sequence_lengths"] = lengths
        if output_log_probs or output_cum_log_probs:
            kept = [lp[:len(ids)] for lp, ids in zip(self.logprobs, self.generated)]  # end id / stop word cut
            if output_log_probs:
                log_probs = torch.zeros((len(self.inputs), 1, self.max_new_tokens), dtype=torch.float32)
                for i, values in enumerate(kept):
                    log_probs[i, 0, :len(values)] = torch.tensor(values, dtype=torch.float32)
                out["log_probs"] = log_probs
            if output_cum_log_probs:
                out["cum_log_probs"] = torch.tensor([[sum(values)] for values in kept], dtype=torch.float32)
        return out


def _stop_words(stop_words_list, batch_size: int) -> list[list[list[int]]]:
    """Per request, the stop token sequences (from per-request lists, or TensorRT-LLM's word-list array)."""
    if stop_words_list is None:
        return [[] for _ in range(batch_size)]
    if hasattr(stop_words_list, "tolist") and getattr(stop_words_list, "ndim", 0) == 3:
        rows = []
        for ids, offsets in (tuple(r) for r in stop_words_list.tolist()):
            ends = [int(o) for o in offsets if o >= 0]
            rows.append([[int(t) for t in ids[s:e]] for s, e in zip([0] + ends[:-1], ends) if e > s])
        stop_words_list = rows
    if len(stop_words_list) != batch_size:
        raise ValueError(f"stop_words_list has {len(stop_words_list)} entries for a batch of {batch_size}")
    words = []
    for i, per_request in enumerate(stop_words_list):
        seqs = [[w] if isinstance(w, int) else list(w) for w in (per_request or [])]
        if any(not s or not all(is_int(t) for t in s) for s in seqs):
            raise ValueError(f"stop_words_list[{i}]: each stop word is a non-empty list of token ids")
        words.append(seqs)
    return words


def _first_not_none(*values):
    return next(v for v in values if v is not None)
