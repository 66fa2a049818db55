"""The gateway core's chunks as OpenAI bodies: stream chunks as they come, and the whole response at the end.

A renderer is fed every chunk of every choice, in arrival order (``add``);
each call returns the stream chunk for it, and ``response``/``usage`` sum up
once all choices have ended. Streaming and non-streaming requests go through
the same renderer, so they cannot disagree: a chat's tool calls go out in the
chunk that completed them (``delta.tool_calls``) and add up to the message's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.errors import KvmeshError, Unavailable
from services.gateway.openai_responses import (
    CalledFunction,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FinishReason,
    PromptTokensDetails,
    ResponseMessage,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from services.gateway.timing import phases, slowest

_FINISH: dict[int, FinishReason] = {
    sampling_pb2.FINISH_REASON_STOP: "stop",
    sampling_pb2.FINISH_REASON_LENGTH: "length",
    # The repetition guard cut a degenerate output short: like "length", the
    # model did not choose to end there.
    sampling_pb2.FINISH_REASON_REPETITION: "length",
    sampling_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
# What OpenAI sends for a token whose probability underflowed (-inf).
_LOGPROB_FLOOR = -9999.0


def finish_reason(code: int) -> FinishReason:
    if code in _FINISH:
        return _FINISH[code]
    if code == sampling_pb2.FINISH_REASON_ABORT:
        raise Unavailable("the request was aborted in the mesh (a worker shut down or its KV lease expired); retry it")
    raise KvmeshError(f"the request ended with {sampling_pb2.FinishReason.Name(code)}")


class TokenTexts:
    """Each token id's own text, for logprobs (cached: the same ids recur all the time)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else _LOGPROB_FLOOR


def _bytes(text: str) -> list[int] | None:
    """The token's UTF-8 bytes; unknown (None) for a token that is only part of a character on its own."""
    return None if "\ufffd" in text else list(text.encode())


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    started: bool = False
    finish: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tool_calls: list[ToolCall] = field(default_factory=list)
    end: gateway_pb2.StreamEnd | None = None  # the final chunk's report


class _Renderer:
    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        *,
        choices: int,
        per_prompt: int,
        texts: TokenTexts,
        logprobs: bool,
        timings: bool = False,
    ) -> None:
        """``choices`` in all, ``per_prompt`` of them for each prompt (n); ``timings``: usage names the phases."""
        self.id = response_id
        self.created = created
        self.model = model
        self._per_prompt = per_prompt
        self._texts = texts
        self._logprobs = logprobs
        self._timings = timings
        self._choices = [_Choice() for _ in range(choices)]

    def _record(
        self, index: int, chunk: gateway_pb2.GenerateResponse | gateway_pb2.ChatResponse
    ) -> tuple[_Choice, FinishReason | None]:
        choice = self._choices[index]
        choice.text.append(chunk.text)
        choice.completion_tokens += len(chunk.token_ids)
        finish = None
        if chunk.HasField("final"):
            finish = choice.finish = finish_reason(chunk.final.finish_reason)
            choice.prompt_tokens = chunk.final.usage.prompt_tokens
            choice.cached_tokens = chunk.final.usage.cached_tokens
            choice.end = chunk.final
        return choice, finish

    def _head(self) -> dict:
        """What every body and chunk of this response begins with."""
        return {"id": self.id, "created": self.created, "model": self.model}

    def system_fingerprint(self) -> str | None:
        """The configuration the choices ended on (the first one's that names it; None: none does)."""
        return next((c.end.system_fingerprint for c in self._choices if c.end and c.end.system_fingerprint), None)

    def phases(self) -> dict[str, int]:
        """Where the request's time went (nanoseconds per phase), for its slowest choice: the client's wait."""
        end = slowest([c.end for c in self._choices if c.end is not None])
        return phases(end) if end is not None else {}

    def usage(self) -> Usage:
        """Each prompt counts once however many choices it had (as OpenAI counts).

        Its cached tokens are the fewest any of its choices got from cache:
        every copy of the prompt was served at least that much from cache.
        """
        prompt = cached = 0
        for start in range(0, len(self._choices), self._per_prompt):
            group = self._choices[start : start + self._per_prompt]
            prompt += group[0].prompt_tokens
            cached += min(c.cached_tokens for c in group)
        completion = sum(c.completion_tokens for c in self._choices)
        timings = {k: round(v / 1e6, 3) for k, v in self.phases().items()} if self._timings else None
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            timings=timings,
        )

    def _token_logprob(self, lp: sampling_pb2.TokenLogprob) -> TokenLogprob:
        token = self._texts(lp.token_id)
        top = [
            TopLogprob(token=(t := self._texts(alt.token_id)), logprob=_logprob(alt.logprob), bytes=_bytes(t))
            for alt in lp.top_logprobs
        ]
        return TokenLogprob(token=token, logprob=_logprob(lp.logprob), bytes=_bytes(token), top_logprobs=top)


def _ending_fingerprint(chunk: gateway_pb2.GenerateResponse | gateway_pb2.ChatResponse) -> str | None:
    """The decode worker's system_fingerprint on the chunk that ends a choice (None on the others)."""
    return (chunk.final.system_fingerprint or None) if chunk.HasField("final") else None


def _no_completion_logprobs() -> CompletionLogprobs:
    return CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])


class CompletionRenderer(_Renderer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._choice_logprobs = [_no_completion_logprobs() for _ in self._choices]

    def add(self, index: int, chunk: gateway_pb2.GenerateResponse) -> Completion:
        choice, finish = self._record(index, chunk)
        logprobs = None
        if self._logprobs:
            logprobs = self._completion_logprobs(chunk.logprobs, self._choice_logprobs[index])
        text = CompletionChoice(index=index, text=chunk.text, logprobs=logprobs, finish_reason=finish)
        return Completion(
            **self._head(),
            choices=[text],
            usage=None,
            system_fingerprint=_ending_fingerprint(chunk),
        )

    def _completion_logprobs(
        self, logprobs: Sequence[sampling_pb2.TokenLogprob], whole: CompletionLogprobs
    ) -> CompletionLogprobs:
        """This chunk's logprobs, also appended to the choice's; offsets count the tokens' own texts."""
        offset = whole.text_offset[-1] + len(whole.tokens[-1]) if whole.tokens else 0
        part = _no_completion_logprobs()
        for lp in logprobs:
            token = self._texts(lp.token_id)
            part.tokens.append(token)
            part.token_logprobs.append(_logprob(lp.logprob))
            part.top_logprobs.append({self._texts(a.token_id): _logprob(a.logprob) for a in lp.top_logprobs})
            part.text_offset.append(offset)
            offset += len(token)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(whole, name).extend(getattr(part, name))
        return part

    def usage_chunk(self) -> Completion:
        return Completion(
            **self._head(),
            choices=[],
            usage=self.usage(),
            system_fingerprint=self.system_fingerprint(),
        )

    def response(self) -> Completion:
        choices = [
            CompletionChoice(
                index=i,
                text="".join(c.text),
                logprobs=self._choice_logprobs[i] if self._logprobs else None,
                finish_reason=c.finish,
            )
            for i, c in enumerate(self._choices)
        ]
        return Completion(
            **self._head(),
            choices=choices,
            usage=self.usage(),
            system_fingerprint=self.system_fingerprint(),
        )


class ChatRenderer(_Renderer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._choice_logprobs: list[list[TokenLogprob]] = [[] for _ in self._choices]

    def add(self, index: int, chunk: gateway_pb2.ChatResponse) -> ChatCompletionChunk:
        first = not self._choices[index].started
        choice, finish = self._record(index, chunk)
        choice.started = True
        logprobs = None
        if self._logprobs:
            content = [self._token_logprob(lp) for lp in chunk.logprobs]
            self._choice_logprobs[index].extend(content)
            logprobs = ChatLogprobs(content=content)
        calls = [
            ToolCallDelta(
                index=len(choice.tool_calls) + i, id=c.id, function=CalledFunction(name=c.name, arguments=c.arguments)
            )
            for i, c in enumerate(chunk.tool_calls)
        ]
        choice.tool_calls.extend(ToolCall(id=c.id, function=c.function) for c in calls)
        # A chunk that carries only calls has no content (null, as OpenAI sends it).
        text = None if calls and not chunk.text else chunk.text
        delta = ChatDelta(role="assistant" if first else None, content=text, tool_calls=calls or None)
        piece = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)
        return ChatCompletionChunk(**self._head(), choices=[piece], system_fingerprint=_ending_fingerprint(chunk))

    def usage_chunk(self) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            **self._head(),
            choices=[],
            usage=self.usage(),
            system_fingerprint=self.system_fingerprint(),
        )

    def response(self) -> ChatCompletion:
        choices = [
            ChatChoice(
                index=i,
                message=_message("".join(c.text), c.tool_calls),
                logprobs=ChatLogprobs(content=self._choice_logprobs[i]) if self._logprobs else None,
                finish_reason=c.finish,
            )
            for i, c in enumerate(self._choices)
        ]
        return ChatCompletion(
            **self._head(),
            choices=choices,
            usage=self.usage(),
            system_fingerprint=self.system_fingerprint(),
        )


def _message(text: str, calls: list[ToolCall]) -> ResponseMessage:
    """A reply of calls and no text has content null."""
    return ResponseMessage(content=None if calls and not text else text, tool_calls=calls or None)
