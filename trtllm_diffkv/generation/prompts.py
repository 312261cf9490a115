"""Request checks shared by every generation path: a prompt's token ids and its length against the model.

One home for the rule (the reference loop, the static-batch loop, the executor and the ``LLM`` API call
:func:`check_prompt_ids`, and :func:`check_prompt_text` on text prompts; the engine build reads
:func:`position_limit`).
"""
from __future__ import annotations

from ..validators import is_int, positive_int


def position_limit(model_config) -> int:
    """Most positions (prompt + generated tokens) a request may use: ``max_position_embeddings``, or the
    sliding window when smaller (sliding-window models are exact only inside the window)."""
    limit = model_config.max_position_embeddings
    window = model_config.max_supported_positions
    return window if window is not None and window < limit else limit


def check_prompt_text(prompt) -> str:
    """Check a text prompt: any non-empty ``str``; whitespace alone is a prompt too (OpenAI and vLLM take
    ``" "``; it is at least one token), only ``""`` is empty (edge case 8: no token at all).

    A ``str`` that is not valid Unicode (a lone surrogate such as ``"\\ud800"``, which a JSON ``\\ud800`` escape
    or ``os.fsdecode`` of invalid UTF-8 yields) is refused too: no tokenizer can encode it.

    Raises:
        ValueError: not a ``str``, empty, or not valid Unicode (naming the character's position).
    """
    if not isinstance(prompt, str):
        raise ValueError(f"a text prompt is a str, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("empty prompt: at least one character is needed")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"prompt is not valid Unicode text: {exc.reason} at character {exc.start} "
                         f"({prompt[exc.start]!a})") from None
    return prompt


def check_prompt_ids(prompt_ids, max_new_tokens: int, model_config) -> list[int]:
    """Check one request's token ids and length; return the ids as Python ints (shared by every generator).

    Args:
        prompt_ids: list or tuple of integer token ids (any integer type, ``bool`` refused).
        max_new_tokens: new tokens to generate, an integer >= 1.
        model_config: the model's ``vocab_size`` and position limit (:func:`position_limit`).

    Raises:
        ValueError: not a list, an empty prompt (edge case 8), a non-integer id, a bad
            ``max_new_tokens``, an id outside ``[0, vocab_size)``, or prompt + ``max_new_tokens``
            beyond the model's positions; the message names the value.
    """
    if not isinstance(prompt_ids, (list, tuple)):
        raise ValueError(f"a prompt is a list of token ids, got {type(prompt_ids).__name__}")
    if len(prompt_ids) == 0:
        raise ValueError("empty prompt: at least one token is needed")
    not_int = [t for t in prompt_ids if not is_int(t, integral=True)]
    if not_int:
        raise ValueError(f"token id {not_int[0]!r} is not an integer")
    prompt_ids = [int(t) for t in prompt_ids]
    positive_int("max_new_tokens", max_new_tokens, allowed="an integer >= 1")
    vocab = model_config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]!r} is outside the model's vocabulary [0, {vocab})")
    limit = position_limit(model_config)
    if len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's {limit} positions")
    return prompt_ids
