"""What a tool-call format is: how a model writes calls, as a grammar to enforce and a parser to read them back.

The gateway is format-agnostic: it validates the request's tools, renders them
into the prompt through the model's chat template, and then asks the format
for two things:

- ``structural_tag(policy)``: an xgrammar structural tag (a JSON object) that
  the workers enforce token by token, so every call the model starts names a
  declared tool and carries arguments that validate against its schema;
- ``parser()``: an incremental parser that splits the output text, chunk by
  chunk, into content and completed calls.

The chat template must teach the model the same format the gateway enforces
and parses; ``--tool-call-format`` picks it (``FORMATS``).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Tool:
    """A declared function, validated."""

    name: str
    description: str
    # JSON Schema of the arguments object. The workers constrain the arguments to compact JSON that
    # validates against it, exactly as a response_format of that schema (kvmesh.structured.grammar).
    parameters: dict[str, Any]

    def for_template(self) -> dict[str, Any]:
        """As transformers passes a tool to chat templates (the OpenAI shape); no description: none shown."""
        function = {"name": self.name} | ({"description": self.description} if self.description else {})
        return {"type": "function", "function": function | {"parameters": self.parameters}}


@dataclass(frozen=True)
class CallPolicy:
    """Which calls the grammar allows in a reply."""

    tools: tuple[Tool, ...]  # the tools that may be called (a named tool_choice: only that one)
    required: bool  # at least one call, and nothing but calls
    single: bool  # at most one call


@dataclass(frozen=True)
class ParsedCall:
    """A complete call read from the output."""

    name: str
    arguments: str  # JSON text of an object


# What a parser reads out of the text: content, or a call.
Piece = str | ParsedCall


class ToolCallParser(Protocol):
    """Reads one reply. Text that may still turn out to be markup is held back until it is known."""

    def feed(self, text: str) -> list[Piece]:
        """The pieces this much more output completes, in output order."""
        ...

    def finish(self) -> list[Piece]:
        """The end of the output: whatever was held back (an unfinished call is content)."""
        ...


class ToolCallFormat(Protocol):
    name: str

    def structural_tag(self, policy: CallPolicy) -> dict[str, Any]:
        """The grammar of a reply that follows ``policy`` (xgrammar's structural tag JSON)."""
        ...

    def parser(self) -> ToolCallParser: ...

    def new_call_id(self) -> str:
        """A fresh id for a call the reply makes (clients send it back with the call and its result)."""
        ...


def openai_call_id() -> str:
    """``call_`` and 24 hex digits, as OpenAI's ids look."""
    return "call_" + secrets.token_hex(12)
