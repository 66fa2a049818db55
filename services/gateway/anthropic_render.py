"""The gateway core's chat chunks as an Anthropic message: stream events as they come, and the whole message.

Like ``openai_render``, one renderer serves both ways: fed every chunk
(``add``), it returns the stream events for it and builds the message's
content blocks as it goes, so the streamed events add up to the message.
Text opens a text block that runs until a tool call; each call (the core
sends it whole) is a tool_use block of its own, its arguments one
``input_json_delta``.

Which stop sequence ended a reply: the core reports only that the reply
stopped (EOS and stop strings alike) and leaves the stop string out of the
text, but it does send every token, the stop's included. So when stop
sequences were asked for, the reply's tokens are decoded once at the end: a
stop sequence in them is the one that ended it (the engine stops at the
first), none means the model ended its turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from kvmesh.api.gateway.v1 import gateway_pb2
from services.gateway.anthropic_responses import (
    ContentBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageEnd,
    MessageStart,
    MessageStop,
    MessageUsage,
    StopReason,
    StreamEvent,
    TextContent,
    TextDelta,
    ToolUseContent,
)
from services.gateway.openai_render import finish_reason
from services.gateway.timing import phases

_STOP_REASONS: dict[str, StopReason] = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

Decode = Callable[[list[int]], str]


def fired_stop(text: str, stop_sequences: Sequence[str]) -> str | None:
    """The stop sequence that ended ``text`` (the whole reply, decoded): the earliest in it, the longest of
    those starting there; None when there is none (the model ended its turn)."""
    hits = [(i, -len(s), s) for s in stop_sequences if (i := text.find(s)) >= 0]
    return min(hits)[2] if hits else None


class MessageRenderer:
    def __init__(self, message_id: str, model: str, stop_sequences: Sequence[str], decode: Decode) -> None:
        """``decode``: token ids to text (special tokens left out), to tell which stop sequence fired."""
        self._id = message_id
        self._model = model
        self._stop_sequences = stop_sequences
        self._decode = decode
        self._content: list[ContentBlock] = []
        self._open_text = False  # the last block is text that more text extends
        self._token_ids: list[int] = []
        self._end: gateway_pb2.StreamEnd | None = None
        self._stop_reason: StopReason | None = None
        self._stop_sequence: str | None = None

    def start(self) -> MessageStart:
        return MessageStart(message=self._message([], None))

    def add(self, chunk: gateway_pb2.ChatResponse) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        self._token_ids.extend(chunk.token_ids)
        if chunk.text:
            if not self._open_text:
                events.append(ContentBlockStart(index=len(self._content), content_block=TextContent(text="")))
                self._content.append(TextContent(text=""))
                self._open_text = True
            block = self._content[-1]
            block.text += chunk.text
            events.append(ContentBlockDelta(index=len(self._content) - 1, delta=TextDelta(text=chunk.text)))
        for call in chunk.tool_calls:
            events += self._close_text()
            index = len(self._content)
            self._content.append(ToolUseContent(id=call.id, name=call.name, input=json.loads(call.arguments)))
            events += [
                ContentBlockStart(index=index, content_block=ToolUseContent(id=call.id, name=call.name, input={})),
                ContentBlockDelta(index=index, delta=InputJsonDelta(partial_json=call.arguments)),
                ContentBlockStop(index=index),
            ]
        if chunk.HasField("final"):
            self._end = chunk.final
            self._stop_reason = _STOP_REASONS[finish_reason(chunk.final.finish_reason)]
            if self._stop_reason == "end_turn" and self._stop_sequences:
                self._stop_sequence = fired_stop(self._decode(self._token_ids), self._stop_sequences)
                if self._stop_sequence is not None:
                    self._stop_reason = "stop_sequence"
        return events

    def finish(self) -> list[StreamEvent]:
        """The events that end the stream, once the core's has ended."""
        end = MessageEnd(stop_reason=self._ended(), stop_sequence=self._stop_sequence)
        return [*self._close_text(), MessageDelta(delta=end, usage=self._usage()), MessageStop()]

    def message(self) -> Message:
        """The whole message, once the core's stream has ended."""
        return self._message(self._content, self._ended())

    def phases(self) -> dict[str, int]:
        """Where the request's time went (nanoseconds per phase)."""
        return phases(self._end) if self._end is not None else {}

    def _close_text(self) -> list[StreamEvent]:
        if not self._open_text:
            return []
        self._open_text = False
        return [ContentBlockStop(index=len(self._content) - 1)]

    def _ended(self) -> StopReason:
        if self._stop_reason is None:
            raise RuntimeError("the core's stream ended without its final chunk")
        return self._stop_reason

    def _usage(self) -> MessageUsage:
        prompt = self._end.usage.prompt_tokens if self._end is not None else 0
        cached = self._end.usage.cached_tokens if self._end is not None else 0
        return MessageUsage(
            input_tokens=prompt - cached, output_tokens=len(self._token_ids), cache_read_input_tokens=cached
        )

    def _message(self, content: list[ContentBlock], stop_reason: StopReason | None) -> Message:
        return Message(
            id=self._id,
            content=content,
            model=self._model,
            stop_reason=stop_reason,
            stop_sequence=self._stop_sequence,
            usage=self._usage(),
        )
