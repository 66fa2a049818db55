"""The Llama 3.x JSON tool-call format (vLLM's ``llama3_json``).

Llama 3.1/3.2's chat templates (as transformers and the Hub ship them) ask for
``{"name": function name, "parameters": dictionary of argument name and its
value}`` and render an earlier call as exactly that, with no marker before it;
the model may also write ``<|python_tag|>`` first (the template's "ipython"
mode). Several calls are separated by ``; `` (Llama 3.2's style; 3.1's template
renders one call per turn)::

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "CET"}}

The grammar writes each call as ``{"name": "<tool>", "parameters": <arguments>}``
(compact JSON, as structured outputs are). With ``tool_choice: auto`` the
model may write text, and once it writes ``{"name": `` (or ``<|python_tag|>``)
a valid call follows. With ``required`` or a named function the reply is the
calls only, optionally after ``<|python_tag|>``, separated by ``; ``.

The parser reads a call wherever ``{"name": `` (spelled as the grammar's trigger,
so that what it reads went through the grammar) or ``<|python_tag|>`` begins a
JSON object ``{"name": <string>, "parameters" | "arguments": <object>}``
(vLLM accepts both keys; so does this); ``<|python_tag|>`` is markup, whether
the text keeps it or it was skipped as a special token. Anything else stays
content.
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.tool_calls.format import CallPolicy, ParsedCall, openai_call_id
from services.gateway.tool_calls.json_calls import JsonCallParser, call_of
from services.gateway.tool_calls.tags import call_tags, separated

PYTHON_TAG = "<|python_tag|>"
CALL_START = '{"name": '
SEPARATOR = "; "


def call_prefix(name: str) -> str:
    """The text of a call up to its arguments: fixed by the grammar once the name is chosen."""
    return f'{CALL_START}{json.dumps(name)}, "parameters": '


CALL_SUFFIX = "}"


class Llama3JsonFormat:
    name = "llama3_json"

    def structural_tag(self, policy: CallPolicy) -> dict[str, Any]:
        tags = call_tags(policy.tools, call_prefix, CALL_SUFFIX)
        if policy.required:
            calls = separated(tags, SEPARATOR, policy.single)
            optional_tag = {"type": "optional", "content": {"type": "const_string", "value": PYTHON_TAG}}
            fmt: dict[str, Any] = {"type": "sequence", "elements": [optional_tag, calls]}
        else:
            # Free text until the model starts a call; from there on, a valid call. A call may follow
            # <|python_tag|>: the same tags once more, with it in front.
            tagged = call_tags(policy.tools, lambda name: PYTHON_TAG + call_prefix(name), CALL_SUFFIX)
            fmt = {
                "type": "triggered_tags",
                "triggers": [CALL_START, PYTHON_TAG],
                "tags": tags + tagged,
                "stop_after_first": policy.single,
            }
        return {"type": "structural_tag", "format": fmt}

    def parser(self) -> JsonCallParser:
        return JsonCallParser(markers=(PYTHON_TAG,), starts=(CALL_START,), read=read_calls, separator=SEPARATOR)

    def new_call_id(self) -> str:
        return openai_call_id()


def read_calls(value: Any) -> list[ParsedCall] | None:
    call = call_of(value, ("parameters", "arguments"))
    return None if call is None else [call]
