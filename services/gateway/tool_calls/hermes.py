"""The Hermes/Qwen tool-call format, the one kvmesh's own chat template teaches.

A call is a block of its own in the reply::

    <tool_call>
    {"name": "<function name>", "arguments": <arguments as a JSON object>}
    </tool_call>

The arguments are compact JSON (``", "`` and ``": "`` between items, no other whitespace), as
structured outputs are. Several calls follow each other separated by one newline. With
``tool_choice: auto`` the model may write text before a call (and, when more
calls are allowed, between and after them); once it writes ``<tool_call>``
the grammar holds it to a declared name and arguments that validate against
that tool's schema. With ``required`` or a named function the reply is calls
only. Whitespace that merely lays calls out (before, between, after them) is
not content.

Parsing is incremental: text that could be the start of ``<tool_call>`` is
held back until the next chunk decides it; a call is emitted once its closing
tag arrives. A block whose body is not ``{"name": <string>, "arguments":
<object>}`` (possible only where the grammar was not enforced) stays content,
markup and all, as does a block the output ends inside.
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.tool_calls.format import CallPolicy, ParsedCall, Piece, openai_call_id
from services.gateway.tool_calls.json_calls import call_of, load, partial_mark
from services.gateway.tool_calls.layout import Layout
from services.gateway.tool_calls.tags import call_tags, separated

BEGIN = "<tool_call>"
END = "</tool_call>"
SEPARATOR = "\n"


def call_prefix(name: str) -> str:
    """The text of a call up to its arguments: fixed by the grammar once the name is chosen."""
    return f'{BEGIN}\n{{"name": {json.dumps(name)}, "arguments": '


CALL_SUFFIX = f"}}\n{END}"


class HermesFormat:
    name = "hermes"

    def structural_tag(self, policy: CallPolicy) -> dict[str, Any]:
        tags = call_tags(policy.tools, call_prefix, CALL_SUFFIX)
        if policy.required:
            # Calls only, one after another.
            fmt = separated(tags, SEPARATOR, policy.single)
        else:
            # Free text until the model writes <tool_call>; from there on, a valid call.
            fmt = {"type": "triggered_tags", "triggers": [BEGIN], "tags": tags, "stop_after_first": policy.single}
        return {"type": "structural_tag", "format": fmt}

    def parser(self) -> HermesParser:
        return HermesParser()

    def new_call_id(self) -> str:
        return openai_call_id()


class HermesParser:
    def __init__(self) -> None:
        self._pending = ""  # output not yet read: a possible start of BEGIN, or an open call's body so far
        self._in_call = False
        self._layout = Layout()

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        pieces: list[Piece] = []
        while True:
            if self._in_call:
                end = self._pending.find(END)
                if end < 0:
                    return pieces
                body, self._pending = self._pending[:end], self._pending[end + len(END) :]
                self._in_call = False
                call = parse_call(body)
                pieces += self._layout.text(BEGIN + body + END) if call is None else self._layout.call(call)
            else:
                start = self._pending.find(BEGIN)
                if start < 0:
                    held = partial_mark(self._pending, (BEGIN,))
                    cut = len(self._pending) - held
                    pieces += self._layout.text(self._pending[:cut])
                    self._pending = self._pending[cut:]
                    return pieces
                pieces += self._layout.text(self._pending[:start])
                self._pending = self._pending[start + len(BEGIN) :]
                self._in_call = True

    def finish(self) -> list[Piece]:
        rest = (BEGIN if self._in_call else "") + self._pending
        self._pending, self._in_call = "", False
        return self._layout.text(rest) + self._layout.flush()


def parse_call(body: str) -> ParsedCall | None:
    """A call block's body as a call; None unless it is ``{"name": <string>, "arguments": <object>}``."""
    return call_of(load(body), ("arguments",))
