"""One chat reply as it streams: the core's chunks as ``ChatResponse``s, tool-call markup turned into calls.

Every chunk keeps its tokens (offsets and usage count all of them); its text
is the content the parser has made sure of, so markup held back in one chunk
comes out, as content or as a call, in a later one, at the latest the final
chunk. Each call is sent once, in the chunk that completes it, with a fresh
id (the format's kind). A reply with calls ends with FINISH_REASON_TOOL_CALLS.
"""

from __future__ import annotations

from collections.abc import Callable

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from services.gateway.tool_calls.format import ParsedCall, ToolCallParser, openai_call_id

# How a reply that made calls may have ended; aborts and errors stay what they are.
_ENDED_NORMALLY = (
    sampling_pb2.FINISH_REASON_STOP,
    sampling_pb2.FINISH_REASON_LENGTH,
    sampling_pb2.FINISH_REASON_REPETITION,
)


class ChatReply:
    """Shapes one reply's chunks; ``parser`` None: plain text, passed through."""

    def __init__(self, parser: ToolCallParser | None, new_call_id: Callable[[], str] = openai_call_id) -> None:
        self._parser = parser
        self._new_call_id = new_call_id
        self._calls = 0

    def __call__(self, chunk: gateway_pb2.GenerateResponse) -> gateway_pb2.ChatResponse:
        reply = gateway_pb2.ChatResponse(
            request_id=chunk.request_id,
            offset=chunk.offset,
            token_ids=chunk.token_ids,
            logprobs=chunk.logprobs,
            final=chunk.final if chunk.HasField("final") else None,
        )
        if self._parser is None:
            reply.text = chunk.text
            return reply
        pieces = self._parser.feed(chunk.text)
        if chunk.HasField("final"):
            pieces += self._parser.finish()
        reply.text = "".join(p for p in pieces if isinstance(p, str))
        for call in (p for p in pieces if isinstance(p, ParsedCall)):
            reply.tool_calls.add(id=self._new_call_id(), name=call.name, arguments=call.arguments)
        self._calls += len(reply.tool_calls)
        if reply.HasField("final") and self._calls and reply.final.finish_reason in _ENDED_NORMALLY:
            reply.final.finish_reason = sampling_pb2.FINISH_REASON_TOOL_CALLS
        return reply
