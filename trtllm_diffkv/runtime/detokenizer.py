"""Incremental detokenization: the text of a growing token sequence, a few tokens decoded at a time.

One home for the rule: the executor's :class:`~.stop_checker.StopChecker` searches stop strings in its text,
and the ``LLM`` API's request handles (:mod:`trtllm_diffkv.llmapi.outputs`) stream it. :func:`token_texts` and
:func:`token_bytes` give single tokens' text and bytes (log-probability listings).
"""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
"""What a decode shows for a multi-byte character split across tokens (U+FFFD)."""


class IncrementalDetokenizer:
    """Text of a growing token sequence, decoded a few tokens at a time.

    Keeps a window ``ids[prefix:read]`` of already emitted tokens and decodes
    ``ids[prefix:]``; the text past the window's own decode is new. A decode that ends in
    U+FFFD (a multi-byte character split across tokens) waits for the next tokens, so no
    replacement character appears mid-stream. :meth:`finish` settles the rest and, when the
    emitted text is a prefix of ``tokenizer.decode(ids)``, returns exactly that full decode.
    The same scheme as vLLM's ``detokenize_incrementally`` / transformers' ``TextStreamer``.

    Args:
        tokenizer: a transformers tokenizer (``decode(ids, skip_special_tokens=...)``).
        skip_special_tokens: passed to ``decode``.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; returns the newly settled text (possibly ``""``)."""
        self.ids.extend(new_ids)
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if now.endswith(REPLACEMENT_CHAR) or len(now) <= len(before) or not now.startswith(before):
            return ""  # an incomplete character, or nothing visible yet: wait for more tokens
        delta = now[len(before):]
        self.text += delta
        self._prefix, self._read = self._read, len(self.ids)
        return delta

    def pending_text(self) -> str:
        """The text the tokens past the window would add, trailing U+FFFD removed (``""`` when none).

        What :meth:`push` held back because it ends in an incomplete character: the stop checker
        searches stop strings in it before the character completes.
        """
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) <= len(before) or not now.startswith(before):
            return ""
        return now[len(before):].rstrip(REPLACEMENT_CHAR)

    def finish(self) -> str:
        """Settle everything (the end of the sequence); returns the final full text."""
        full = self._decode(self.ids)
        if full.startswith(self.text):
            self.text = full
        else:  # a tokenizer whose decode is not prefix-stable: keep what was emitted
            self.text += self._decode(self.ids[self._read:])
        self._prefix = self._read = len(self.ids)
        return self.text


def token_texts(tokenizer, token_ids: list[int]) -> list[str]:
    """Each token's own text (``decode([id])``, special tokens kept), for log-probability listings
    (OpenAI's ``tokens`` / ``token``). A token holding part of a multi-byte character shows U+FFFD, as
    its decode alone does. ``tokenizer=None``: ``""`` per token."""
    if tokenizer is None or not token_ids:
        return [""] * len(token_ids)
    if not hasattr(tokenizer, "batch_decode"):  # a minimal tokenizer: decode only
        return [tokenizer.decode([int(t)]) for t in token_ids]
    return list(tokenizer.batch_decode([[int(t)] for t in token_ids], skip_special_tokens=False))


def _byte_level_table(tokenizer) -> dict[str, int] | None:
    """Character -> byte of a byte-level BPE vocabulary (GPT-2's byte-to-unicode map: SmolLM2, Llama 3, Qwen,
    ...), from transformers; ``None`` when ``tokenizer`` is not byte-level (its backend's decoder is not
    ``ByteLevel``) or the map is not importable."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if type(decoder).__name__ != "ByteLevel":
        return None
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:
        return None
    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer, token_ids: list[int]) -> list[bytes]:
    """Each token's own bytes, for OpenAI's ``bytes`` and character offsets: with a byte-level BPE vocabulary the
    bytes the token stands for (a multi-byte character split over tokens gives each token its part, so the
    tokens' bytes joined are the text's UTF-8); a special token, a token outside the byte map, or another kind of
    tokenizer: the UTF-8 of :func:`token_texts` (U+FFFD for a partial character)."""
    texts = token_texts(tokenizer, token_ids)
    table = _byte_level_table(tokenizer) if tokenizer is not None and token_ids else None
    if table is None:
        return [text.encode("utf-8") for text in texts]
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    pieces = tokenizer.convert_ids_to_tokens([int(t) for t in token_ids])
    return [text.encode("utf-8") if int(token) in special or piece is None or any(c not in table for c in piece)
            else bytes(table[c] for c in piece) for token, piece, text in zip(token_ids, pieces, texts)]
