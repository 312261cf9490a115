"""Per-request sampling for the in-flight batching executor: parameters and a batched sampler.

- :class:`SamplingParams`: one request's sampling settings, field names as TensorRT-LLM's LLM API
  ``SamplingParams`` (``tensorrt_llm/sampling_params.py``: ``max_tokens``, ``temperature``,
  ``top_k``, ``top_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``seed``,
  ``stop``, ``stop_token_ids``, ``ignore_eos``, ``end_id``, ``pad_id``, ``n``, ``best_of``,
  ``logprobs``, ``prompt_logprobs``, ``min_tokens``, ``include_stop_str_in_output``), checked by
  :meth:`SamplingParams.validate`; TensorRT-LLM's other fields (:data:`TRTLLM_NEUTRAL`: ``use_beam_search``,
  ...) are accepted at their neutral values and refused by name otherwise.
- :class:`Sampler`: one :meth:`Sampler.sample` call per executor step for every running request:
  repetition, presence and frequency penalties, temperature, top-k, top-p as per-row tensors, then
  one draw per row; :meth:`Sampler.sample_with_logprobs` adds the rows' log-probabilities.
- :func:`prompt_logprobs`: the log-probabilities of a prompt's tokens from the prefill's per-position logits.
- :meth:`SamplingParams.child_params` and :func:`best_of_order`: ``n > 1`` / ``best_of`` as independent
  requests with derived seeds, the best picked by cumulative log-probability.

The stop checks after each new token (stop ids, stop strings, ``max_tokens``) read these parameters:
:class:`.stop_checker.StopChecker`.

The filtering rules are those of Hugging Face transformers' logits processors, in their order:
``RepetitionPenaltyLogitsProcessor`` (the CTRL rule: a logit ``x`` of a token already in the
prompt or the output becomes ``x * penalty`` when ``x < 0`` and ``x / penalty`` otherwise), then
OpenAI's presence and frequency penalties (OpenAI's "Parameter details" / advanced usage guide:
``logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty`` with ``c[j]`` the count of
token ``j`` in the *generated* tokens so far, not the prompt; vLLM applies them in this order, after
the repetition penalty), then ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` (keeps every token whose logit is >= the k-th
largest, ties included) and ``TopPLogitsWarper`` (drops the tokens whose ascending cumulative
probability is <= ``1 - top_p``, always keeping the most likely one).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

from ..lazy import LazyModule

torch = LazyModule("torch")  # imported at first use: SamplingParams (and the CLI's flag checks) need no torch

from ..validators import is_int, is_number

__all__ = ["SamplingParams", "Sampler", "TRTLLM_NEUTRAL", "is_neutral_value", "Logprob",
           "StepLogprobs", "prompt_logprobs", "best_of_order", "child_seed", "MAX_LOGPROBS"]

_SEED_LIMIT = 2 ** 64
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
"""Allowed repetition penalties: dividing or multiplying float32 logits by a factor beyond this overflows them."""
GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (see :attr:`SamplingParams.greedy`)."""
PENALTY_RANGE = (-2.0, 2.0)
"""Allowed presence and frequency penalties (OpenAI's API reference: "Number between -2.0 and 2.0")."""
MAX_SEQUENCES = 256
"""Most sequences one request may run (``best_of``, else ``n``): each is one executor request, built by
:meth:`SamplingParams.child_params` only after :meth:`SamplingParams.validate` bounds the count (an unbounded
``n`` of 10**9 hung the caller building its children)."""
MAX_LOGPROBS = 20
"""Most top log-probabilities a token may ask for (``logprobs``, ``prompt_logprobs``; OpenAI's chat
``top_logprobs`` limit, vLLM's default ``max_logprobs``)."""
PROMPT_LOGPROB_ROWS = 512

LOGIT_POSINF = 1e30
"""What a ``+inf`` logit becomes before sampling: finite, and still finite after the division by the smallest
temperature (float32 max is 3.4e38), so that the row's softmax picks that token instead of turning NaN."""

LOGPROB_FLOOR = -9999.0
"""What a reported logprob of ``-inf`` / NaN becomes (vLLM's value): responses stay valid JSON."""


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """float32 ``logits`` the sampler and the logprobs can use: NaN -> ``-inf`` (a NaN never wins; it would make
    every probability NaN and the draw index 0), ``+inf`` -> :data:`LOGIT_POSINF` (a row's softmax stays
    defined, also after the temperature)."""
    return torch.nan_to_num(logits.float(), nan=-math.inf, posinf=LOGIT_POSINF)


def finite_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """``logp`` with ``-inf``/NaN replaced by :data:`LOGPROB_FLOOR` (and ``+inf``, impossible after a
    log-softmax of finite scores, by 0)."""
    return torch.nan_to_num(logp, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR, posinf=0.0)
"""Prompt positions whose float32 ``log_softmax`` is computed at once by :func:`prompt_logprobs` (the model's
``[P, V]`` logits are already there: a 2k-token prompt of a 49152-token vocabulary holds 400 MB of float32
logits for that prefill step; chunked prefill bounds ``P`` per step)."""
SEED_STRIDE = 0x9E3779B97F4A7C15
"""Child ``i`` of a seeded ``n > 1`` request gets seed ``(seed + i * SEED_STRIDE) mod 2**64``
(:func:`child_seed`; the golden-ratio increment of SplitMix64, so children of nearby seeds do not overlap)."""


TRTLLM_NEUTRAL = {
    "use_beam_search": (False,), "beam_width_array": (None,),
    "beam_search_diversity_rate": (None, 0), "length_penalty": (None, 1), "early_stopping": (None,),
    "no_repeat_ngram_size": (None,), "min_p": (None, 0), "top_p_min": (None,), "top_p_reset_ids": (None,),
    "top_p_decay": (None,), "bad": (None,), "bad_token_ids": (None,),
    "embedding_bias": (None,), "logits_processor": (None,), "apply_batched_logits_processor": (False,),
    "return_context_logits": (False,),
    "return_generation_logits": (False,), "exclude_input_from_output": (True,), "return_encoder_output": (False,),
    "return_perf_metrics": (False,), "additional_model_outputs": (None,), "lookahead_config": (None,),
    "guided_decoding": (None,), "detokenize": (True,), "add_special_tokens": (True,),
    "truncate_prompt_tokens": (None,), "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
}
"""TensorRT-LLM ``SamplingParams`` fields (``tensorrt_llm/sampling_params.py``) this runtime does not implement:
field -> the values accepted (its default and the values that change nothing, e.g.
``use_beam_search=False``, ``length_penalty`` 1). Another value fails the request with a ``ValueError``
naming the field; booleans are never counts (``length_penalty=True`` is refused: :func:`is_neutral_value`)."""


def is_neutral_value(value, neutrals) -> bool:
    """Whether ``value`` is one of ``neutrals`` (``None`` matches only ``None``), compared by type too: a
    ``bool`` never equals an ``int`` (``True == 1`` in Python), an ``int`` may equal a ``float``."""
    return any(value is None if neutral is None else
               (type(value) is type(neutral) or {type(value), type(neutral)} <= {int, float}) and value == neutral
               for neutral in neutrals)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (TensorRT-LLM LLM API names; checked by :meth:`validate`).

    Attributes:
        max_tokens: new tokens to generate at most, >= 1.
        temperature: logits are divided by it before top-k/top-p; 0 (or below 1e-5) means greedy
            (argmax), >= 0. ``None``: 1.0 when top_k or top_p is set.
        top_k: keep the ``top_k`` most likely tokens (ties with the k-th included); 0 = off,
            1 = greedy; >= 0. Values above the vocabulary size keep everything. ``None``: off.
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability
            reaches ``top_p`` (HF ``TopPLogitsWarper``); in [0, 1], 1 = off, 0 = greedy.
            ``None``: off.

    Greedy unless asked otherwise, as TensorRT-LLM's ``SamplingParams``
    (``params_imply_greedy_decoding``): ``SamplingParams()`` with temperature, top_k and top_p
    all ``None`` decodes greedily; so do ``temperature=0``, ``top_k=1`` and ``top_p=0``.
        repetition_penalty: CTRL/HF rule over the prompt and the generated ids; > 0, 1 = off,
            > 1 discourages repeats.
        presence_penalty: OpenAI's: subtracted once from the logit of every token already
            generated (not the prompt's); in [-2, 2], 0 or ``None`` = off.
        frequency_penalty: OpenAI's: subtracted from a token's logit once per time it was
            generated; in [-2, 2], 0 or ``None`` = off.
        n: sequences returned for the prompt, >= 1 (run as independent requests:
            :meth:`child_params`).
        best_of: sequences generated, >= ``n`` (``None``: ``n``); the ``n`` with the highest
            cumulative log-probability are returned (:func:`best_of_order`).
        logprobs: per generated token, the sampled token's log-probability plus this many top
            alternatives (0: the sampled one only); ``None``: off; at most :data:`MAX_LOGPROBS`.
            Computed after the penalties and the temperature, before top-k/top-p (module doc).
        prompt_logprobs: the prompt tokens' log-probabilities (raw logits) plus this many top
            alternatives per position; ``None``: off; at most :data:`MAX_LOGPROBS`.
        seed: seeds the request's own ``torch.Generator`` (on the sampler's device): the same
            seed, logits and device give the same tokens whatever else is in the batch.
            ``None``: draws come from the sampler's shared generator. 0 <= seed < 2**64.
        stop: a stop string or a list of them; generation stops when the decoded output
            contains one, and the text is cut before it. Non-empty strings.
        stop_token_ids: ids that stop generation besides the model's own stop ids (these
            still apply with ``ignore_eos``); the id stays in the token ids, not in the text.
        ignore_eos: ignore the model's stop ids (benchmarks with fixed output lengths).
        end_id: TensorRT-LLM's end token: an id >= 0 is one more stop id (added to
            ``stop_token_ids``); ``-1`` means no end token, run to ``max_tokens`` (sets ``ignore_eos``).
        pad_id: accepted and unused (outputs are not padded).
        min_tokens: vLLM's and TensorRT-LLM's: no stop before this many tokens are generated; ``None`` or
            0 = off; ``<= max_tokens``. vLLM's rule (``MinTokensLogitsProcessor`` and ``check_stop``): while
            fewer than ``min_tokens`` tokens are generated, the logits of every stop id (``stop_token_ids``,
            ``end_id`` and the model's own end ids, these even with ``ignore_eos``) are ``-inf``, so the
            request cannot stop on an id before; a stop string counts only when it ends in the text of a
            token past the first ``min_tokens`` (it may begin before). The log-probabilities see the masked
            logits.
        include_stop_str_in_output: vLLM's: keep the matched stop string in the text (cut after it,
            not before), and the text of a stop id that ended the request (special tokens such as the
            end-of-sequence id decode to nothing). Default ``False``.
        use_beam_search, length_penalty, ...: TensorRT-LLM's fields at their neutral values only
            (:data:`TRTLLM_NEUTRAL`).

    Validation is explicit (:meth:`validate`), not in ``__init__``, so that an executor can
    accept a request with bad values and fail it alone with the error.
    """

    max_tokens: int = 64
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    end_id: int | None = None
    pad_id: int | None = None
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    beam_width_array: object = None
    beam_search_diversity_rate: float | None = None
    length_penalty: float | None = None
    early_stopping: int | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    min_p: float | None = None
    top_p_min: float | None = None
    top_p_reset_ids: int | None = None
    top_p_decay: float | None = None
    bad: object = None
    bad_token_ids: object = None
    include_stop_str_in_output: bool = False
    embedding_bias: object = None
    logits_processor: object = None
    apply_batched_logits_processor: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    additional_model_outputs: object = None
    lookahead_config: object = None
    guided_decoding: object = None
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if _is_int(self.end_id) and self.end_id >= 0 and self.end_id not in (self.stop_token_ids or ()):
            object.__setattr__(self, "stop_token_ids", [*(self.stop_token_ids or ()), int(self.end_id)])
        elif _is_int(self.end_id) and self.end_id == -1:
            object.__setattr__(self, "ignore_eos", True)
        # NumPy scalars (np.float64 subclasses float, np.int64 does not subclass int) become Python numbers here,
        # so that every later tensor is built from plain floats/ints; anything else is left for validate() to refuse
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (bool, int)) and type(value) is not float:
                object.__setattr__(self, name, float(value))
        for name in ("max_tokens", "top_k", "seed", "n", "best_of", "logprobs", "prompt_logprobs", "min_tokens"):
            value = getattr(self, name)
            if is_int(value, integral=True) and type(value) is not int:
                object.__setattr__(self, name, int(value))
        ids = self.stop_token_ids
        if isinstance(ids, (list, tuple)) and all(_is_int(t) for t in ids):
            object.__setattr__(self, "stop_token_ids", [int(t) for t in ids])

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of the (penalized) logits: temperature, top_k and
        top_p all ``None`` (the default, as TensorRT-LLM), or temperature 0, top_k 1 or top_p 0.

        A temperature below ``GREEDY_TEMPERATURE`` (1e-5, vLLM's ``_SAMPLING_EPS``) counts as 0:
        dividing the logits by it would overflow to infinity."""
        if self.temperature is None and self.top_k is None and self.top_p is None:
            return True
        return self.sampling_temperature < GREEDY_TEMPERATURE or self.top_k == 1 or self.top_p == 0

    @property
    def sampling_temperature(self) -> float:
        """The temperature a sampled row uses (``None`` -> 1.0)."""
        return 1.0 if self.temperature is None else self.temperature

    @property
    def sampling_top_k(self) -> int:
        """The top-k a sampled row uses (``None`` -> 0, off)."""
        return 0 if self.top_k is None else self.top_k

    @property
    def sampling_top_p(self) -> float:
        """The top-p a sampled row uses (``None`` -> 1.0, off)."""
        return 1.0 if self.top_p is None else self.top_p

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (empty when ``None``)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def penalizes_counts(self) -> bool:
        """Whether the presence or frequency penalty is on (needs the generated tokens' counts)."""
        return bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def num_sequences(self) -> int:
        """Sequences generated for the prompt: ``best_of``, else ``n``."""
        return self.n if self.best_of is None else self.best_of

    def child_params(self) -> list["SamplingParams"]:
        """``n > 1`` / ``best_of``: the :attr:`num_sequences` independent requests that run them.

        Each child is a copy with ``n=1``, ``best_of=None`` and seed :func:`child_seed` (child 0 keeps
        the request's seed, so ``n=1`` changes nothing; ``seed=None`` stays ``None``: the children then
        draw from the shared generator, distinct but not reproducible). With ``best_of > n`` the
        children compute ``logprobs`` (at least the sampled token's) for :func:`best_of_order`.
        A greedy request's children are all the same sequence, as with vLLM.
        """
        logprobs = self.logprobs
        if self.num_sequences > self.n and logprobs is None:
            logprobs = 0
        return [self.with_changes(n=1, best_of=None, logprobs=logprobs,
                                  seed=None if self.seed is None else child_seed(self.seed, i))
                for i in range(self.num_sequences)]

    @classmethod
    def greedy_params(cls, max_tokens: int = 64) -> "SamplingParams":
        """Greedy decoding (temperature 0) of at most ``max_tokens`` new tokens."""
        return cls(max_tokens=max_tokens, temperature=0.0)

    def with_changes(self, **changes) -> "SamplingParams":
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return replace(self, **changes)

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field's type and range.

        Args:
            vocab_size: when given, every id in ``stop_token_ids`` must be in [0, vocab_size).

        Raises:
            ValueError: naming the field, the allowed range and the value received.
        """
        _check_int("max_tokens", self.max_tokens, 1, None, ">= 1")
        if self.temperature is not None:
            _check_float("temperature", self.temperature, self.temperature >= 0, ">= 0 (0 = greedy) or None")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, 0, None, ">= 0 (0 = off) or None")
        if self.top_p is not None:
            _check_float("top_p", self.top_p, 0 <= self.top_p <= 1, "in [0, 1] (1 = off, 0 = greedy) or None")
        _check_float("repetition_penalty", self.repetition_penalty,
                     REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1],
                     "in [1e-6, 1e6] (1 = off; beyond, float32 logits overflow)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None:
                _check_float(name, value, isinstance(value, (int, float)) and -2 <= value <= 2,
                             "in [-2, 2] (0 = off) or None")
        _check_int("n", self.n, 1, MAX_SEQUENCES, f"an int >= 1, at most {MAX_SEQUENCES}")
        if self.best_of is not None:
            _check_int("best_of", self.best_of, self.n, MAX_SEQUENCES, f"None or an int >= n ({self.n}), at most {MAX_SEQUENCES}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS,
                           f"None or an int in [0, {MAX_LOGPROBS}] (top alternatives per token)")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, _SEED_LIMIT - 1, "None or an int in [0, 2**64)")
        if self.end_id is not None and self.end_id != -1:
            _check_int("end_id", self.end_id, 0, None if vocab_size is None else vocab_size - 1,
                       "None, -1 (no end token) or a token id")  # before stop_token_ids, which holds it
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and (not isinstance(stops, (list, tuple))
                                  or not all(isinstance(s, str) and s for s in stops)):
            raise ValueError(f"stop must be None, a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
                raise ValueError(f"stop_token_ids must be None or a list of token ids, got {self.stop_token_ids!r}")
            upper = None if vocab_size is None else vocab_size - 1
            where = "ints >= 0" if upper is None else f"ints in [0, {vocab_size})"
            for token in self.stop_token_ids:
                _check_int("stop_token_ids", token, 0, upper, where)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.min_tokens is not None:
            _check_int("min_tokens", self.min_tokens, 0, self.max_tokens,
                       f"None or an int in [0, max_tokens={self.max_tokens}]")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be True or False, got "
                             f"{self.include_stop_str_in_output!r}")
        if self.pad_id is not None:
            _check_int("pad_id", self.pad_id, 0, None, "None or an int >= 0")
        for name, neutrals in TRTLLM_NEUTRAL.items():
            value = getattr(self, name)
            if not is_neutral_value(value, neutrals):
                allowed = " or ".join(repr(v) for v in neutrals)
                raise ValueError(f"{name}={value!r} is not supported by trtllm-diffkv (only {allowed})")


def child_seed(seed: int, index: int) -> int:
    """The seed of child ``index`` of an ``n > 1`` request seeded ``seed``: ``(seed + index * SEED_STRIDE)
    mod 2**64`` (child 0 keeps ``seed``). Reproducible: the same request seed gives the same children."""
    return (seed + index * SEED_STRIDE) % _SEED_LIMIT


def best_of_order(cumulative_logprobs: list[float], n: int) -> list[int]:
    """``best_of``: the indices of the ``n`` sequences with the highest cumulative log-probability (sum of
    their sampled tokens' log-probabilities), best first; ties keep the lower index first (OpenAI's
    "best_of ... the one with the highest log probability per token" is vLLM's and this rule for the
    sum). ``n >= len(cumulative_logprobs)``: every index, in order (nothing is dropped)."""
    if n >= len(cumulative_logprobs):
        return list(range(len(cumulative_logprobs)))
    return sorted(range(len(cumulative_logprobs)), key=lambda i: (-cumulative_logprobs[i], i))[:n]


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability (TensorRT-LLM's ``Logprob``: ``logprob`` and ``rank``).

    Attributes:
        logprob: natural log of the token's probability (float, <= 0).
        rank: 1 for the most likely token, ties ranked by the number of tokens strictly more likely + 1.
    """

    logprob: float
    rank: int


@dataclass
class StepLogprobs:
    """One sampler step's log-probabilities on the device (:meth:`Sampler.sample_with_logprobs`).

    Attributes:
        rows: batch rows that asked for them (``SamplingParams.logprobs`` not ``None``).
        sampled: ``[len(rows)]`` float32: each row's sampled token's log-probability.
        rank: ``[len(rows)]`` int64: its rank (1 = most likely).
        top_ids, top_logprobs: ``[len(rows), K]`` int64 / float32: the K most likely tokens, best first
            (``K = max`` of the rows' ``logprobs``; a row keeps its own first ``logprobs`` columns).
    """

    rows: list[int]
    sampled: torch.Tensor
    rank: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def to_host(self, tokens: list[int], top_counts: list[int]) -> dict[int, dict[int, Logprob]]:
        """``{batch row: {token id: Logprob}}`` (the sampled token first, then the row's top ``top_counts[i]``)
        as Python values: one device-to-host copy per tensor."""
        sampled, rank = self.sampled.tolist(), self.rank.tolist()
        top_ids, top_lp = self.top_ids.tolist(), self.top_logprobs.tolist()
        return {row: _entry(tokens[row], sampled[i], rank[i], top_ids[i][:top_counts[i]], top_lp[i])
                for i, row in enumerate(self.rows)}


def _entry(token: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float]) -> dict:
    """One token's ``{token id: Logprob}``: the token first, then the top alternatives (ranks 1, 2, ...)."""
    entry = {token: Logprob(logprob, rank)}
    for j, alternative in enumerate(top_ids):
        entry.setdefault(alternative, Logprob(top_logprobs[j], j + 1))
    return entry


def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: list[int], top: int,
                    start: int = 0) -> list[dict[int, Logprob] | None]:
    """The log-probabilities of a prompt's tokens from the prefill's per-position logits (echo, lm-eval).

    Args:
        logits: ``[L, V]`` (any float dtype): row ``i`` is the model's next-token logits after prompt
            position ``start + i`` (one prefill, or one chunk of a chunked prefill); rows that predict
            past the prompt (the first generated token) are not used.
        prompt_token_ids: the ``P`` prompt ids.
        top: alternatives per position besides the prompt's own token (0: that token only).
        start: the prompt position of ``logits``' first row (0 for an unchunked prefill).

    Returns:
        the entries of prompt positions ``start + 1 .. min(start + L, P - 1)``, each ``{token id: Logprob}``
        with the prompt token first, preceded by ``None`` for position 0 when ``start == 0`` (nothing
        predicts the first token: OpenAI's ``null``); so an unchunked prefill's ``[P, V]`` gives ``P``
        entries and the chunks' lists concatenate to the same. ``log_softmax`` of the raw logits in
        float32, :data:`PROMPT_LOGPROB_ROWS` rows at a time.

    Raises:
        ValueError: ``logits`` is not 2-D, or ``start`` is not a prompt position.
    """
    count = len(prompt_token_ids)
    if logits.dim() != 2 or not 0 <= start < count:
        raise ValueError(f"logits must be [L, V] and start a prompt position in [0, {count}), got "
                         f"{list(logits.shape)} and start {start}")
    used = max(0, min(logits.shape[0], count - 1 - start))  # rows predicting a prompt token
    head: list = [None] if start == 0 else []
    if not used:
        return head
    ids = torch.tensor(prompt_token_ids[start + 1:start + 1 + used], dtype=torch.long, device=logits.device)
    chosen, rank, top_lp, top_ids = [], [], [], []
    for first in range(0, used, PROMPT_LOGPROB_ROWS):  # float32 copies of a block of rows at a time
        logp = finite_logprobs(torch.log_softmax(finite_logits(logits[first:min(first + PROMPT_LOGPROB_ROWS, used)]),
                                                 dim=-1))
        picked = logp.gather(1, ids[first:first + logp.shape[0]].unsqueeze(1))
        rank += ((logp > picked).sum(-1) + 1).tolist()
        chosen += picked.squeeze(1).tolist()
        if top:
            values, indices = logp.topk(top, dim=-1)
            top_lp, top_ids = top_lp + values.tolist(), top_ids + indices.tolist()
    if not top:
        top_lp = top_ids = [[]] * used
    return head + [_entry(token, chosen[i], rank[i], top_ids[i], top_lp[i])
                   for i, token in enumerate(prompt_token_ids[start + 1:start + 1 + used])]


def _is_int(value) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return is_int(value, integral=True)


def _check_int(name: str, value, low: int | None, high: int | None, allowed: str) -> None:
    if not _is_int(value) or (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_float(name: str, value, in_range, allowed: str) -> None:
    number = is_number(value)  # NaN is refused by the finiteness check below either way
    if not number or not math.isfinite(value) or not in_range:
        raise ValueError(f"{name} must be a finite number {allowed}, got {value!r}")


class Sampler:
    """Batched sampling of one token per request per step (per-row parameters and generators).

    Args:
        vocab_size: logits width V (the model's vocabulary, padding included).
        device: device of the logits; the request generators live there.

    Sampling is the exponential race (equivalent to Gumbel-max): ``argmax_i p_i / E_i`` with
    ``E_i ~ Exp(1)`` drawn from the row's own generator, which picks token ``i`` with
    probability ``p_i``. A seeded row draws exactly ``V`` values per step from its generator,
    so its tokens depend only on its seed, its logits and its history.
    """

    def __init__(self, vocab_size: int, device) -> None:
        _check_int("vocab_size", vocab_size, 1, None, ">= 1")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._params: dict = {}
        self._generators: dict = {}
        self._seen: dict = {}       # request_id -> (ids folded into the mask, bool mask [V])
        self._counts: dict = {}     # request_id -> (ids folded in, float32 counts [V] of the generated ids)
        self._prompt_tokens: dict = {}  # request_id -> prompt length (where its history's generated ids start)
        self._min_tokens: dict = {}  # request_id -> (min_tokens, int64 [S] stop ids masked until then)
        self._shared = torch.Generator(device=self.device)
        self._shared.seed()

    def add(self, request_id, params: SamplingParams, prompt_tokens: int = 0, stop_token_ids=()) -> None:
        """Register a request (validates ``params`` against the vocabulary; makes its generator).

        ``prompt_tokens``: the prompt's length: the presence and frequency penalties and ``min_tokens`` count
        only the history's ids past it (the generated ones). ``stop_token_ids``: the ids whose logits are
        ``-inf`` while fewer than ``params.min_tokens`` are generated (:attr:`.stop_checker.StopChecker.min_tokens_stop_ids`).

        Raises:
            ValueError: bad ``params`` (see :meth:`SamplingParams.validate`) or ``request_id``
                already registered.
        """
        params.validate(self.vocab_size)
        if request_id in self._params:
            raise ValueError(f"request {request_id!r} is already registered with the sampler")
        self._params[request_id] = params
        self._prompt_tokens[request_id] = prompt_tokens
        ids = sorted({int(t) for t in stop_token_ids if 0 <= int(t) < self.vocab_size})
        if params.min_tokens and ids:
            self._min_tokens[request_id] = (params.min_tokens, torch.tensor(ids, dtype=torch.long, device=self.device))
        if params.seed is not None and not params.greedy:
            self._generators[request_id] = torch.Generator(device=self.device).manual_seed(params.seed)

    def remove(self, request_id) -> None:
        """Forget a request (no error if unknown)."""
        for table in (self._params, self._generators, self._seen, self._counts, self._prompt_tokens,
                      self._min_tokens):
            table.pop(request_id, None)

    def __contains__(self, request_id) -> bool:
        return request_id in self._params

    def sample(self, logits: torch.Tensor, request_ids: list, histories: list[list[int]]) -> torch.Tensor:
        """One token per row.

        Args:
            logits: [B, V] float (any float dtype) on the sampler's device; row b is request
                ``request_ids[b]``'s next-token logits.
            request_ids: B registered request ids.
            histories: B lists of token ids (prompt + generated so far) for the repetition
                penalty; read only for rows whose penalty is not 1 (append-only per request:
                only the ids past the previous call are folded in; a shorter list restarts).

        Returns:
            [B] int64 token ids on ``logits.device``. Greedy rows are exactly
            ``torch.argmax`` of the penalized float32 logits.

        Raises:
            ValueError: shapes disagree, an unknown request id, or a history id outside [0, V).
        """
        return self.sample_with_logprobs(logits, request_ids, histories, with_logprobs=False)[0]

    def sample_with_logprobs(self, logits: torch.Tensor, request_ids: list, histories: list[list[int]],
                             with_logprobs: bool = True) -> tuple[torch.Tensor, StepLogprobs | None]:
        """:meth:`sample`, plus the log-probabilities of the rows whose ``logprobs`` is set.

        Same arguments and errors as :meth:`sample`. Returns ``(tokens, step)``: tokens as :meth:`sample`
        (the same draws: the log-probabilities change nothing), ``step`` a :class:`StepLogprobs` on the
        device, or ``None`` when no row asked (or ``with_logprobs`` is false). The values are
        ``log_softmax`` of the penalized logits divided by the row's temperature (1 for a greedy row),
        before top-k and top-p (module doc).
        """
        self._check_batch(logits, request_ids, histories)
        params = [self._params[rid] for rid in request_ids]
        scores = self._penalized(logits, params, request_ids, histories)
        tokens = torch.argmax(scores, dim=-1)
        rows = [b for b, p in enumerate(params) if not p.greedy]
        if rows:
            filtered = _filter(scores[rows], [params[b] for b in rows])
            drawn = self._race(torch.softmax(filtered, dim=-1), [request_ids[b] for b in rows])
            tokens[torch.tensor(rows, device=tokens.device)] = drawn
        asked = [b for b, p in enumerate(params) if p.logprobs is not None] if with_logprobs else []
        if not asked:
            return tokens, None
        temperature = torch.tensor([1.0 if params[b].greedy else params[b].sampling_temperature for b in asked],
                                   dtype=torch.float32, device=scores.device).unsqueeze(1)
        logp = finite_logprobs(torch.log_softmax(scores[asked] / temperature, dim=-1))
        chosen = logp.gather(1, tokens[asked].unsqueeze(1))
        rank = (logp > chosen).sum(-1) + 1
        top = max(params[b].logprobs for b in asked)
        top_lp, top_ids = logp.topk(top, dim=-1) if top else (logp[:, :0], tokens.new_empty(len(asked), 0))
        return tokens, StepLogprobs(asked, chosen.squeeze(1), rank, top_ids, top_lp)

    def filtered_logits(self, logits: torch.Tensor, request_ids: list, histories: list[list[int]]) -> torch.Tensor:
        """What :meth:`sample` draws from: [B, V] float32 logits after the repetition penalty,
        temperature, top-k and top-p, dropped tokens at ``-inf`` (greedy rows: penalized only).
        Same arguments and errors as :meth:`sample`; for tests and inspection."""
        self._check_batch(logits, request_ids, histories)
        params = [self._params[rid] for rid in request_ids]
        scores = self._penalized(logits, params, request_ids, histories).clone()
        rows = [b for b, p in enumerate(params) if not p.greedy]
        if rows:
            scores[rows] = _filter(scores[rows], [params[b] for b in rows])
        return scores

    def _check_batch(self, logits, request_ids, histories) -> None:
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size or logits.shape[0] != len(request_ids):
            raise ValueError(f"logits must be [len(request_ids)={len(request_ids)}, vocab_size={self.vocab_size}], "
                             f"got {list(logits.shape)}")
        if len(histories) != len(request_ids):
            raise ValueError(f"{len(histories)} histories for {len(request_ids)} requests")
        missing = [rid for rid in request_ids if rid not in self._params]
        if missing:
            raise ValueError(f"requests not registered with the sampler: {missing[:5]}")

    @staticmethod
    def reads_history(params: SamplingParams) -> bool:
        """Whether a row's draw reads its host history (the repetition, presence or frequency penalty, or
        ``min_tokens``: the tokens generated so far must all be on the host); without them a step can be sampled
        before the last step's token is read (the executor's overlap)."""
        return params.repetition_penalty != 1.0 or params.penalizes_counts or bool(params.min_tokens)

    def _penalized(self, logits, params, request_ids, histories) -> torch.Tensor:
        """[B, V] float32 logits with the repetition penalty, then the presence and frequency penalties,
        applied, and the stop ids of rows short of their ``min_tokens`` at ``-inf`` (may alias float32
        ``logits``)."""
        scores = finite_logits(logits)
        rows = [b for b, p in enumerate(params) if p.repetition_penalty != 1.0]
        counted = [b for b, p in enumerate(params) if p.penalizes_counts]
        short = [b for b, rid in enumerate(request_ids) if rid in self._min_tokens
                 and len(histories[b]) - self._prompt_tokens[rid] < self._min_tokens[rid][0]]
        if not rows and not counted and not short:
            return scores
        scores = scores.clone()
        if rows:
            masks = torch.stack([self._seen_mask(request_ids[b], histories[b]) for b in rows])
            penalty = torch.tensor([params[b].repetition_penalty for b in rows], dtype=torch.float32,
                                   device=scores.device).unsqueeze(1)
            chosen = scores[rows]
            scores[rows] = torch.where(masks, torch.where(chosen < 0, chosen * penalty, chosen / penalty), chosen)
        if counted:
            counts = torch.stack([self._generated_counts(request_ids[b], histories[b]) for b in counted])
            presence = torch.tensor([float(params[b].presence_penalty or 0) for b in counted], dtype=torch.float32,
                                    device=scores.device).unsqueeze(1)
            frequency = torch.tensor([float(params[b].frequency_penalty or 0) for b in counted], dtype=torch.float32,
                                     device=scores.device).unsqueeze(1)
            scores[counted] = scores[counted] - counts * frequency - (counts > 0).float() * presence
        for b in short:  # vLLM's MinTokensLogitsProcessor: no stop id before min_tokens
            scores[b, self._min_tokens[request_ids[b]][1]] = -math.inf
        return scores

    def _generated_counts(self, request_id, history: list[int]) -> torch.Tensor:
        """[V] float32 counts of the generated ids (the history past the prompt), folded in incrementally."""
        start = self._prompt_tokens.get(request_id, 0)
        count, counts = self._counts.get(request_id, (start, None))
        if counts is None or len(history) < count:
            count, counts = start, torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
        new = list(history[count:])
        if new:
            bad = next((t for t in new if not (_is_int(t) and 0 <= t < self.vocab_size)), None)
            if bad is not None:
                raise ValueError(f"request {request_id!r}: history token id {bad!r} outside [0, {self.vocab_size})")
            counts.index_add_(0, torch.tensor(new, dtype=torch.long, device=self.device),
                              torch.ones(len(new), dtype=torch.float32, device=self.device))
        self._counts[request_id] = (max(len(history), start), counts)
        return counts

    def _seen_mask(self, request_id, history: list[int]) -> torch.Tensor:
        count, mask = self._seen.get(request_id, (0, None))
        if mask is None or len(history) < count:
            count, mask = 0, torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
        new = list(history[count:])
        if new:
            if not all(_is_int(t) and 0 <= t < self.vocab_size for t in new):
                bad = next(t for t in new if not (_is_int(t) and 0 <= t < self.vocab_size))
                raise ValueError(f"request {request_id!r}: history token id {bad!r} outside [0, {self.vocab_size})")
            mask[torch.tensor(new, dtype=torch.long, device=self.device)] = True
        self._seen[request_id] = (len(history), mask)
        return mask

    def _race(self, probs: torch.Tensor, request_ids: list) -> torch.Tensor:
        """The exponential race over probs [R, V]: seeded rows draw from their own generator."""
        device = probs.device
        noise = torch.empty_like(probs)
        shared = [r for r, rid in enumerate(request_ids) if rid not in self._generators]
        if shared:
            noise[shared] = torch.empty(len(shared), self.vocab_size, device=device).exponential_(
                generator=self._shared)
        for r, rid in enumerate(request_ids):
            if rid in self._generators:  # a fresh [V] tensor: the draw cannot depend on the row's place
                noise[r] = torch.empty(self.vocab_size, device=device).exponential_(generator=self._generators[rid])
        noise.clamp_(min=torch.finfo(torch.float32).tiny)
        return torch.argmax(probs / noise, dim=-1)


def _filter(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p, per row; scores [R, V] float32 -> [R, V], dropped at -inf."""
    device = scores.device
    temperature = torch.tensor([p.sampling_temperature for p in params], dtype=torch.float32, device=device)
    scores = scores / temperature.unsqueeze(1)
    top_k = [min(p.sampling_top_k, scores.shape[1]) for p in params]
    if any(top_k):
        scores = _top_k(scores, top_k)
    if any(p.sampling_top_p < 1.0 for p in params):
        top_p = torch.tensor([p.sampling_top_p for p in params], dtype=torch.float32, device=device)
        scores = _top_p(scores, top_p.unsqueeze(1))
    return scores


def _top_k(scores: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """HF ``TopKLogitsWarper`` per row: drop logits below the k-th largest (k=0: keep all)."""
    k_max = max(top_k)
    values = torch.topk(scores, k_max, dim=-1).values
    index = torch.tensor([max(k, 1) - 1 for k in top_k], device=scores.device).unsqueeze(1)
    kth = values.gather(1, index)
    kth = torch.where(torch.tensor(top_k, device=scores.device).unsqueeze(1) > 0, kth, -math.inf)
    return scores.masked_fill(scores < kth, -math.inf)


def _top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """HF ``TopPLogitsWarper`` per row: drop tokens whose ascending cumulative probability <= 1 - top_p."""
    sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= (1 - top_p)
    drop_sorted[:, -1] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return scores.masked_fill(drop, -math.inf)
