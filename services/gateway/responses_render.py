"""The gateway core's chat chunks as a Responses API response: its stream events as they come, and the whole object.

The chunks go through chat's ``ChatRenderer`` first (one choice), so the text,
the parsed tool calls, the finish reason and the usage are counted exactly as
chat completions count them; this adds the Responses shapes on top.

Output items open and close in order: a message item opens with the first
text and closes when a call or the end comes; each tool call (the core hands
them over whole) is a function_call item opened, given its arguments in one
delta and closed at once. A reply with neither text nor calls is one empty
message. Streamed and whole responses come from the same renderer, so the
``response.completed`` event carries the object a non-streamed request gets.
"""

from __future__ import annotations

import uuid

from kvmesh.api.gateway.v1 import gateway_pb2
from services.gateway.openai_errors import error_body
from services.gateway.openai_render import ChatRenderer, TokenTexts
from services.gateway.openai_responses import ToolCall
from services.gateway.responses_objects import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    Response,
    ResponseEvent,
    ResponseUsage,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
    TextSettings,
)
from services.gateway.responses_requests import FormatText, ResponseRequest


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseRenderer:
    def __init__(self, response_id: str, created_at: int, model: str, req: ResponseRequest, texts: TokenTexts) -> None:
        self.id = response_id
        self._created_at = created_at
        self._model = model
        self._req = req
        self._chat = ChatRenderer(response_id, created_at, model, choices=1, per_prompt=1, texts=texts, logprobs=False)
        self._sequence = 0
        self._items: list[OutputItem] = []
        self._message: OutputMessage | None = None  # the open message item
        self._finish: str | None = None

    # -- events ------------------------------------------------------------------

    def start(self) -> list[StreamEvent]:
        """What a stream begins with."""
        snapshot = self._response("in_progress", [], None)
        return [
            ResponseEvent(type="response.created", sequence_number=self._next(), response=snapshot),
            ResponseEvent(type="response.in_progress", sequence_number=self._next(), response=snapshot),
        ]

    def add(self, chunk: gateway_pb2.ChatResponse) -> list[StreamEvent]:
        """The events for one chunk of the core's stream (none for a chunk without text, calls or the end)."""
        piece = self._chat.add(0, chunk).choices[0]
        events: list[StreamEvent] = []
        if piece.delta.content:
            events += self._text(piece.delta.content)
        for call in piece.delta.tool_calls or ():
            events += self._close_message("completed")
            events += self._call(call)
        if piece.finish_reason is not None:
            self._finish = piece.finish_reason
            if not self._items and self._message is None:
                events += self._open_message()
            events += self._close_message("incomplete" if self._finish == "length" else "completed")
        return events

    def end(self) -> ResponseEvent:
        """The last event: the whole response, completed or incomplete."""
        response = self.response()
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        return ResponseEvent(type=kind, sequence_number=self._next(), response=response)

    def error(self, error: Exception, request_id: str) -> ErrorEvent:
        """The last event of a stream that failed after it began."""
        _, body = error_body(error, request_id)
        detail = body.error
        return ErrorEvent(sequence_number=self._next(), code=detail.code, message=detail.message, param=detail.param)

    # -- the whole response ----------------------------------------------------------

    def response(self) -> Response:
        """Once the core's stream has ended."""
        usage = self._chat.usage()
        return self._response(
            "incomplete" if self._finish == "length" else "completed",
            self._items,
            ResponseUsage(
                input_tokens=usage.prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
                output_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens,
            ),
        )

    def phases(self) -> dict[str, int]:
        """Where the request's time went (nanoseconds per phase), for the Server-Timing header."""
        return self._chat.phases()

    def _response(self, status: str, output: list[OutputItem], usage: ResponseUsage | None) -> Response:
        req = self._req
        text_format = req.text.format if req.text is not None else None
        incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return Response(
            id=self.id,
            created_at=self._created_at,
            status=status,
            incomplete_details=incomplete,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            model=self._model,
            output=list(output),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id,
            store=req.store is not False,
            temperature=req.temperature,
            top_p=req.top_p,
            text=TextSettings(format=text_format or FormatText(type="text")),
            tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
            tools=list(req.tools or ()),
            usage=usage,
            user=req.user,
            metadata=req.metadata or {},
        )

    # -- items ----------------------------------------------------------------------

    def _next(self) -> int:
        self._sequence += 1
        return self._sequence - 1

    def _open_message(self) -> list[StreamEvent]:
        message = self._message = OutputMessage(id=_item_id("msg"), status="in_progress", content=[])
        self._items.append(message)
        index = len(self._items) - 1
        added = OutputItemEvent(
            type="response.output_item.added",
            sequence_number=self._next(),
            output_index=index,
            item=message.model_copy(deep=True),
        )
        message.content.append(OutputText(text=""))
        part = ContentPartEvent(
            type="response.content_part.added",
            sequence_number=self._next(),
            item_id=message.id,
            output_index=index,
            content_index=0,
            part=OutputText(text=""),
        )
        return [added, part]

    def _text(self, delta: str) -> list[StreamEvent]:
        events = self._open_message() if self._message is None else []
        self._message.content[0].text += delta
        events.append(
            TextDeltaEvent(
                sequence_number=self._next(),
                item_id=self._message.id,
                output_index=len(self._items) - 1,
                content_index=0,
                delta=delta,
            )
        )
        return events

    def _close_message(self, status: str) -> list[StreamEvent]:
        message = self._message
        if message is None:
            return []
        self._message = None
        message.status = status
        index = len(self._items) - 1
        part = message.content[0]
        head = {"item_id": message.id, "output_index": index, "content_index": 0}
        return [
            TextDoneEvent(sequence_number=self._next(), text=part.text, **head),
            ContentPartEvent(
                type="response.content_part.done", sequence_number=self._next(), part=part.model_copy(), **head
            ),
            OutputItemEvent(
                type="response.output_item.done",
                sequence_number=self._next(),
                output_index=index,
                item=message.model_copy(deep=True),
            ),
        ]

    def _call(self, call: ToolCall) -> list[StreamEvent]:
        f = call.function
        item = OutputFunctionCall(
            id=_item_id("fc"), status="completed", call_id=call.id, name=f.name, arguments=f.arguments
        )
        self._items.append(item)
        index = len(self._items) - 1
        added = item.model_copy(update={"status": "in_progress", "arguments": ""})
        return [
            OutputItemEvent(
                type="response.output_item.added", sequence_number=self._next(), output_index=index, item=added
            ),
            ArgumentsDeltaEvent(sequence_number=self._next(), item_id=item.id, output_index=index, delta=f.arguments),
            ArgumentsDoneEvent(
                sequence_number=self._next(), item_id=item.id, output_index=index, name=f.name, arguments=f.arguments
            ),
            OutputItemEvent(
                type="response.output_item.done", sequence_number=self._next(), output_index=index, item=item
            ),
        ]
