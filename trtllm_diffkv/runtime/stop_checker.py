"""Stop conditions of one request, checked after each new token (stop ids, stop strings, ``max_tokens``).

Used by the executor; the
parameters come from :class:`~.sampling.SamplingParams` (``stop``, ``stop_token_ids``,
``max_tokens``, ``ignore_eos``, TensorRT-LLM LLM API names; ``min_tokens`` and
``include_stop_str_in_output`` as vLLM's).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from .sampling import SamplingParams


class StopChecker:
    """One request's stop conditions, checked after each new token.

    Args:
        params: the request's :class:`SamplingParams` (``stop``, ``stop_token_ids``,
            ``max_tokens``, ``ignore_eos``).
        stop_token_ids: the model's end-of-generation ids (ignored with ``ignore_eos``).
        tokenizer: anything with ``decode(ids, skip_special_tokens=True) -> str``; needed only
            when ``params.stop`` is set.

    The text is detokenized incrementally by :class:`~.detokenizer.IncrementalDetokenizer` (the
    prefix-window method of vLLM's ``detokenize_incrementally``); a piece that ends in an
    incomplete UTF-8 character ("\\ufffd") is not settled, but stop strings are searched in it
    too (its :meth:`~.detokenizer.IncrementalDetokenizer.pending_text`). A stop string is found
    even when it spans tokens, and each check decodes only a few tokens.
    ``stop_reason`` is the matched stop id or string after a stop, else ``None``.

    ``min_tokens`` (vLLM's ``check_stop`` and detokenizer): a stop id ends the request only once at least
    ``min_tokens`` tokens are generated (the sampler keeps the stop ids out before:
    :attr:`min_tokens_stop_ids`), and a stop string only when it ends in the text of a token past the first
    ``min_tokens``. ``include_stop_str_in_output``: the text is cut after the matched stop string instead of
    before, and a stop id's own text stays.

    Raises:
        ValueError: ``params.stop`` is set and ``tokenizer`` is None.
    """

    def __init__(self, params: SamplingParams, stop_token_ids: set[int], tokenizer) -> None:
        if params.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the output")
        self.params = params
        self.tokenizer = tokenizer
        self._stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            self._stop_ids |= set(stop_token_ids)
        self._stops = params.stop_strings
        self._min_tokens = params.min_tokens or 0
        self._model_stop_ids = frozenset(stop_token_ids)
        self._checked = 0
        self._detok = IncrementalDetokenizer(tokenizer) if self._stops else None
        self._cut: int | None = None       # text length kept after a stop string
        self._result: tuple[bool, str | None, int | None] = (False, None, None)
        self.stop_reason: int | str | None = None

    def check(self, generated_ids: list[int]) -> tuple[bool, str | None, int | None]:
        """``(finished, finish_reason, stop_token_id)`` for the output so far.

        ``finish_reason`` is ``"stop"`` (a stop id or stop string), ``"length"`` (``max_tokens``
        reached) or ``None``; ``stop_token_id`` is the id that stopped it, else ``None``. Only
        the ids past the previous call are examined; once finished, the same result returns.
        """
        if self._result[0]:
            return self._result
        for position in range(self._checked, len(generated_ids)):
            token = generated_ids[position]
            if token in self._stop_ids and position + 1 >= self._min_tokens:
                self._checked = position + 1
                self.stop_reason = token
                self._result = (True, "stop", token)
                return self._result
            if self._stops and self._advance_text(token, search=position + 1 > self._min_tokens):
                self._checked = position + 1
                self._result = (True, "stop", None)
                return self._result
        self._checked = len(generated_ids)
        if len(generated_ids) >= self.params.max_tokens:
            self._result = (True, "length", None)
        return self._result

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The ids that end this request: its own ``stop_token_ids`` plus the model's unless ``ignore_eos``."""
        return frozenset(self._stop_ids)

    @property
    def min_tokens_stop_ids(self) -> frozenset[int]:
        """The ids the sampler keeps out while fewer than ``min_tokens`` tokens are generated: the request's own
        ``stop_token_ids`` and the model's end ids, these also with ``ignore_eos`` (vLLM's
        ``all_stop_token_ids``); empty without ``min_tokens``."""
        if not self._min_tokens:
            return frozenset()
        return frozenset(self.params.stop_token_ids or ()) | self._model_stop_ids

    def text_for(self, generated_ids: list[int]) -> str:
        """The output text of ``generated_ids`` (special tokens skipped), cut before a matched
        stop string (after it with ``include_stop_str_in_output``); a matched stop id's own text is left
        out (kept with ``include_stop_str_in_output``).

        Raises:
            ValueError: no tokenizer was given.
        """
        if self.tokenizer is None:
            raise ValueError("text_for needs a tokenizer")
        ids = list(generated_ids)
        if (self._result[1] == "stop" and self._result[2] is not None and ids and ids[-1] == self._result[2]
                and not self.params.include_stop_str_in_output):
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if self._cut is not None:
            return text[:self._cut]
        return text

    def _advance_text(self, token: int, search: bool = True) -> bool:
        """Fold the next id into the running text; True when a stop string appeared (``search`` False: fold
        only, a token within ``min_tokens``).

        Each stop string ``s`` is searched from ``len(s) - 1`` characters before the new piece, so it is
        found once, where it completes, also when it spans tokens; the first match in the text wins."""
        settled = len(self._detok.text)  # searched already (or within min_tokens): a match must end past it
        self._detok.push([token])
        if not search:
            return False
        text = self._detok.text + self._detok.pending_text()
        matches = [(text.find(s, max(0, settled - len(s) + 1)), s) for s in self._stops]
        matches = [(index, s) for index, s in matches if index >= 0]
        if not matches:
            return False
        index, self.stop_reason = min(matches)
        self._cut = index + len(self.stop_reason) if self.params.include_stop_str_in_output else index
        return True
