"""The gateway's checks of a request's output constraint, before anything is routed.

A request's prompt and sampling settings are checked by ``kvmesh.sampling.admitted``, as every worker
checks them. Constraints are checked here as far as the gateway can without a grammar compiler (it does
not load xgrammar, which needs torch): JSON text and JSON Schema keywords (``GrammarSpec.check``); a
regular expression or EBNF grammar xgrammar cannot parse is refused by the worker that builds it.
"""

from __future__ import annotations

import functools

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.errors import InvalidArgument, InvalidField
from kvmesh.structured.spec import GrammarSpec


def validate_structured_output(s: sampling_pb2.SamplingParams) -> None:
    """A constraint the workers could not enforce is refused here, saying what is wrong with it."""
    spec = GrammarSpec.from_pb(s.structured_output) if s.HasField("structured_output") else None
    if spec is None:
        return
    try:
        check_grammar(spec)
    except InvalidArgument as e:
        raise InvalidField("sampling.structured_output", f"structured output: {e.message}") from None


@functools.lru_cache(maxsize=1024)
def check_grammar(spec: GrammarSpec) -> None:
    """``spec.check()``, cached when it passes: clients repeat their schemas and tools, and a schema check
    takes a millisecond on the event loop."""
    spec.check()
