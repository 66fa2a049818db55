"""The whitespace around calls in a reply: it lays them out rather than says anything, so it is not content.

Trailing whitespace of content is held until more content follows (then it is
sent) or a call does (then it is dropped); whitespace right after a call is
dropped, and so is one separator (with its whitespace) where the format has
one. A reply without calls comes out unchanged.
"""

from __future__ import annotations

from services.gateway.tool_calls.format import ParsedCall, Piece


class Layout:
    def __init__(self, separator: str = "") -> None:
        self._separator = separator.strip()
        self._held = ""  # trailing whitespace of content: sent when content follows, dropped when a call does
        self._after_call = False
        self._separated = False  # the separator after the last call was dropped

    def text(self, text: str) -> list[Piece]:
        if self._after_call:
            text = text.lstrip()
            if self._separator and not self._separated and text.startswith(self._separator):
                self._separated = True
                text = text[len(self._separator) :].lstrip()
            if not text:
                return []
            self._after_call = False
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body) :]
        return [body] if body else []

    def call(self, call: ParsedCall) -> list[Piece]:
        self._held = ""
        self._after_call, self._separated = True, False
        return [call]

    def flush(self) -> list[Piece]:
        held, self._held = self._held, ""
        return [held] if held else []
