"""The Mistral ``[TOOL_CALLS]`` tool-call format (vLLM's ``mistral``), as the v3-tokenizer templates write it.

Mistral-7B-Instruct-v0.3's and Mixtral-8x22B-Instruct's chat templates (transformers)
render an assistant's calls as one JSON list after the ``[TOOL_CALLS]`` token::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]

and refuse a ``tool_call_id`` that is not 9 characters (Mistral's tokenizer: 9
alphanumerics), so calls made in this format get such ids. The later style
``[TOOL_CALLS]name[ARGS]{...}`` (v11+ tokenizers: Mistral Small 3.1, Magistral,
Devstral) is not this format.

The grammar writes ``[TOOL_CALLS] [`` (or ``[TOOL_CALLS][``, as Mistral-Nemo's
template has it), the calls as ``{"name": "<tool>", "arguments": <arguments>}``
separated by ``, ``, and ``]``; the reply ends there. With ``tool_choice: auto``
the model may write text first; that text can never contain ``[{"name":``, so
whatever the parser reads as calls went through the grammar. With ``required``
or a named function the reply is the list only.

The parser reads a list of calls after ``[TOOL_CALLS]``, or wherever ``[{"name":``
begins one (the marker is a special token in Mistral's tokenizers: a request
that skips special tokens has no marker in its text). Calls may carry an
``"id"`` string (ignored: the gateway gives each call a fresh one). A list that
is not all calls stays content.
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

from services.gateway.tool_calls.format import CallPolicy, ParsedCall
from services.gateway.tool_calls.json_calls import JsonCallParser, call_of
from services.gateway.tool_calls.tags import call_tags, separated

MARKER = "[TOOL_CALLS]"
LIST_START = '[{"name":'
SEPARATOR = ", "
ID_ALPHABET = string.ascii_letters + string.digits
ID_LENGTH = 9


def call_prefix(name: str) -> str:
    """The text of a call up to its arguments: fixed by the grammar once the name is chosen."""
    return f'{{"name": {json.dumps(name)}, "arguments": '


CALL_SUFFIX = "}"


class MistralFormat:
    name = "mistral"

    def structural_tag(self, policy: CallPolicy) -> dict[str, Any]:
        tags = call_tags(policy.tools, call_prefix, CALL_SUFFIX)
        calls = separated(tags, SEPARATOR, policy.single)
        lists = [{"type": "tag", "begin": MARKER + gap + "[", "content": calls, "end": "]"} for gap in (" ", "")]
        if policy.required:
            fmt: dict[str, Any] = {"type": "or", "elements": lists}
        else:
            # Free text (never spelling the start of a list of calls) until [TOOL_CALLS]; then one list, and the end.
            fmt = {
                "type": "triggered_tags",
                "triggers": [MARKER],
                "tags": lists,
                "stop_after_first": True,
                "excludes": [LIST_START],
            }
        return {"type": "structural_tag", "format": fmt}

    def parser(self) -> JsonCallParser:
        return JsonCallParser(markers=(MARKER,), starts=(LIST_START,), read=read_calls)

    def new_call_id(self) -> str:
        """9 alphanumerics: Mistral's templates refuse any other id when the call is sent back."""
        return "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_LENGTH))


def read_calls(value: Any) -> list[ParsedCall] | None:
    if not isinstance(value, list) or not value:
        return None
    calls = [call_of(item, ("arguments",), optional=("id",)) for item in value]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]
