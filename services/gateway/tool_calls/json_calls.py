"""An incremental parser for formats whose calls are JSON values in the text (Llama 3.x, Mistral).

Content is scanned for the places a call block can begin: a *marker* (markup that
is not part of the JSON, such as ``<|python_tag|>`` or ``[TOOL_CALLS]``; it must
be followed, after optional whitespace, by a JSON object or array) or a *start*
(the first characters of the JSON value itself, such as ``{"name":``). From
there one JSON value is read, bracket by bracket and string-aware, until it
closes; the format's ``read`` turns it into calls, or says it is none (it then
stays content, markup and all). Text that could still become a marker or a
start is held back until the next chunk decides it; a value the output ends
inside is content. Whitespace and the format's separator between calls, and
whitespace around them, lay the calls out and are not content.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from services.gateway.tool_calls.format import ParsedCall, Piece
from services.gateway.tool_calls.layout import Layout

# What a complete JSON value says as calls; None: not calls (the text stays content).
Reader = Callable[[Any], list[ParsedCall] | None]

_TEXT, _AFTER_MARKER, _VALUE = range(3)


class JsonCallParser:
    def __init__(self, markers: tuple[str, ...], starts: tuple[str, ...], read: Reader, separator: str = "") -> None:
        self._markers = markers
        self._starts = starts
        self._read = read
        self._layout = Layout(separator)
        self._state = _TEXT
        self._pending = ""  # text not yet decided (in _VALUE: the value so far, from its first bracket)
        self._markup = ""  # the marker (and whitespace) before the value being read
        # The scan of the value being read: how far, how deep, inside a string, after a backslash.
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        pieces: list[Piece] = []
        while True:
            if self._state == _TEXT:
                if not self._find_block(pieces):
                    return pieces
            elif self._state == _AFTER_MARKER:
                body = self._pending.lstrip()
                self._markup += self._pending[: len(self._pending) - len(body)]
                self._pending = body
                if not body:
                    return pieces
                if body[0] in "{[":
                    self._start_value()
                else:  # a marker followed by something else: plain text
                    pieces += self._layout.text(self._markup)
                    self._markup = ""
                    self._state = _TEXT
            else:
                end = self._scan()
                if end < 0:
                    return pieces
                value_text, self._pending = self._pending[:end], self._pending[end:]
                calls = self._calls(value_text)
                if calls is None:
                    pieces += self._layout.text(self._markup + value_text)
                else:
                    for call in calls:
                        pieces += self._layout.call(call)
                self._markup = ""
                self._state = _TEXT

    def finish(self) -> list[Piece]:
        rest = self._markup + self._pending
        self._markup, self._pending, self._state = "", "", _TEXT
        return self._layout.text(rest) + self._layout.flush()

    def _find_block(self, pieces: list[Piece]) -> bool:
        """In text: sends the content before the next block and enters it (True), or sends what cannot
        begin one and holds the rest (False)."""
        found = [(i, m, True) for m in self._markers if (i := self._pending.find(m)) >= 0]
        found += [(i, s, False) for s in self._starts if (i := self._pending.find(s)) >= 0]
        if not found:
            held = partial_mark(self._pending, self._markers + self._starts)
            cut = len(self._pending) - held
            pieces += self._layout.text(self._pending[:cut])
            self._pending = self._pending[cut:]
            return False
        at, what, is_marker = min(found, key=lambda f: f[0])
        pieces += self._layout.text(self._pending[:at])
        self._pending = self._pending[at:]
        if is_marker:
            self._markup, self._pending = what, self._pending[len(what) :]
            self._state = _AFTER_MARKER
        else:
            self._start_value()
        return True

    def _start_value(self) -> None:
        self._state = _VALUE
        self._pos, self._depth, self._in_string, self._escaped = 0, 0, False, False

    def _scan(self) -> int:
        """Where the value being read ends (just past its closing bracket); -1: not yet."""
        text = self._pending
        while self._pos < len(text):
            c = text[self._pos]
            self._pos += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return self._pos
        return -1

    def _calls(self, value_text: str) -> list[ParsedCall] | None:
        value = load(value_text)
        return None if value is None else self._read(value)


def partial_mark(text: str, marks: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that one of ``marks`` begins with (0: none): held back,
    since the next chunk may complete the mark."""
    longest = 0
    for mark in marks:
        for n in range(min(len(text), len(mark) - 1), longest, -1):
            if mark.startswith(text[-n:]):
                longest = n
                break
    return longest


def load(text: str) -> Any:
    """The JSON value ``text`` spells; None if it spells none (or null, which is no call either)."""
    try:
        # strict=False: a raw control character inside a string (which xgrammar's length-bounded strings
        # let a model write) is read as itself; the arguments are re-serialized with it escaped.
        return json.loads(text, strict=False)
    except ValueError:
        return None


def call_of(value: Any, arguments_keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> ParsedCall | None:
    """``{"name": <string>, <one of arguments_keys>: <object>}`` (and ``optional`` string fields) as a call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    keys = [k for k in arguments_keys if k in value]
    if len(keys) != 1 or not isinstance(value[keys[0]], dict):
        return None
    if set(value) - {"name", keys[0], *optional} or any(not isinstance(value[k], str) for k in optional if k in value):
        return None
    return ParsedCall(value["name"], json.dumps(value[keys[0]], ensure_ascii=False))
