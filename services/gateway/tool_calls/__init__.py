"""Tool calling: tools into the prompt, a grammar that keeps calls valid, and calls parsed out of the reply.

``format`` defines what a tool-call format provides; ``hermes`` is the one kvmesh
ships (and its chat template teaches); ``request`` validates a chat request's
tools and tool choice; ``reply`` turns the output stream into content and calls.
"""

from __future__ import annotations

from services.gateway.tool_calls.format import ToolCallFormat
from services.gateway.tool_calls.hermes import HermesFormat

# --tool-call-format picks one by name.
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HermesFormat(),)}
DEFAULT_FORMAT = HermesFormat.name
