"""Tool calling: tools into the prompt, a grammar that keeps calls valid, and calls parsed out of the reply.

``format`` defines what a tool-call format provides; ``hermes`` (kvmesh's own
chat template teaches it), ``llama3`` and ``mistral`` are the formats;
``request`` validates a chat request's tools and tool choice; ``reply`` turns
the output stream into content and calls. ``format_for`` picks the format a
chat template teaches.
"""

from __future__ import annotations

from services.gateway.tool_calls.format import ToolCallFormat
from services.gateway.tool_calls.hermes import HermesFormat
from services.gateway.tool_calls.llama3 import Llama3JsonFormat
from services.gateway.tool_calls.mistral import MistralFormat

# --tool-call-format picks one by name ('auto': format_for the model's chat template).
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat())}
DEFAULT_FORMAT = HermesFormat.name
AUTO = "auto"


def format_for(chat_template: str | None) -> ToolCallFormat:
    """The format a chat template teaches, by what it writes: ``<tool_call>`` (Hermes/Qwen),
    ``[TOOL_CALLS]`` (Mistral), ``<|python_tag|>`` or a ``"parameters"`` call object (Llama 3.x JSON);
    none of them (or no template): hermes."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return FORMATS[HermesFormat.name]
    if "[TOOL_CALLS]" in template:
        return FORMATS[MistralFormat.name]
    if "<|python_tag|>" in template or '"parameters": ' in template:
        return FORMATS[Llama3JsonFormat.name]
    return FORMATS[DEFAULT_FORMAT]


def chosen_format(flag: str, chat_template: str | None) -> ToolCallFormat:
    """``--tool-call-format``: a format's name wins; ``auto`` reads the chat template."""
    return format_for(chat_template) if flag == AUTO else FORMATS[flag]
