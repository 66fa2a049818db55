"""Turning a growing list of token ids into text deltas, safely for streaming.

Decoding one token at a time is wrong for byte-level BPE (a character can span
tokens) and for SentencePiece (a token's leading space depends on context).
So each step decodes a short window twice — with and without the new tokens —
and emits the difference, holding back while the text ends in an incomplete
UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations

from typing import Protocol

# Prompt tokens kept as left context so the first output token decodes as it would mid-text.
_CONTEXT_TOKENS = 5


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: _Decoder, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens already turned into text
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly decodable text (possibly empty)."""
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix : self._read], self._skip_special)
        after = self._tok.decode(self._ids[self._prefix :], self._skip_special)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta
