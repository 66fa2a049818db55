"""The gateway core: admit, tokenize, route, drive prefill -> decode, stream back.

Per request: admission (a cap on requests in flight) -> tokenize and validate
-> ``Route`` -> either ``Decode`` with a local prefill, or ``Prefill`` on the
chosen prefill worker and then ``Decode`` with the remote result. Every decode
message goes to the client as it arrives.

Failures: a worker that is unreachable or breaks before the client got a
token is excluded and the request is routed once more; a decode worker that
fails after tokens were sent (stream broken, or silent past its timeouts)
is excluded and the stream migrates to another decode worker, which resumes
after the tokens already sent (``migration.py``), up to a limit per request.
A router that cannot be reached is stood in for by the decode workers it
named last, for a bounded time (``route_fallback.py``).
Whenever a request with a KV lease ends without decode finishing it (client
cancel, decode failure), the gateway aborts the lease at once rather than
leaving the prefill worker to wait out its TTL.

Chat replies go through ``tool_calls``: with tools, the prompt shows them, a
grammar keeps the model's calls valid, and the calls come back parsed out of
the text (``ChatResponse.tool_calls``).

Cancellation needs no extra machinery: a cancelled client call cancels the
task running this generator; the ``CancelledError`` (or ``GeneratorExit``)
unwinds through the ``aclosing`` blocks, which close the decode stream, which
cancels the downstream call.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import structlog
from opentelemetry.trace import Span

from kvmesh import tracing
from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.api.router.v1 import router_pb2
from kvmesh.errors import InvalidArgument, InvalidField, KvmeshError, ResourceExhausted, Unavailable
from kvmesh.sampling import SamplingParams, admitted
from services.gateway.adapters import Adapters
from services.gateway.auth import ANONYMOUS, tenant_cache_salt, tenant_digest
from services.gateway.avoided_workers import AvoidedWorkers
from services.gateway.backends import Backends
from services.gateway.chat_messages import template_messages
from services.gateway.metrics import GatewayMetrics
from services.gateway.migration import MigrationPolicy
from services.gateway.model import ServedModel
from services.gateway.route_fallback import LastKnownWorkers
from services.gateway.stream import Job, ResponseStream
from services.gateway.tool_calls import DEFAULT_FORMAT, FORMATS, ToolCallFormat
from services.gateway.tool_calls.reply import ChatReply
from services.gateway.tool_calls.request import tool_use
from services.gateway.validation import validate_structured_output
from services.gateway.worker_calls import WorkerCalls, WorkerFailed

log = structlog.get_logger("kvmesh.gateway")

# The first try and one retry on other workers.
MAX_ATTEMPTS = 2

Chunks = AsyncGenerator[gateway_pb2.GenerateResponse, None]
ChatChunks = AsyncGenerator[gateway_pb2.ChatResponse, None]


@dataclass(frozen=True)
class _Prepared:
    """A request made ready to route: its prompt, its sampling, and how its chunks reach the client."""

    prompt_ids: list[int]
    sampling: sampling_pb2.SamplingParams
    shape: Callable[[gateway_pb2.GenerateResponse], Any]


def _describe_end(span: Span, end: gateway_pb2.StreamEnd) -> None:
    span.set_attributes(
        {
            "gen_ai.usage.input_tokens": end.usage.prompt_tokens,
            "gen_ai.usage.output_tokens": end.usage.completion_tokens,
            "kvmesh.cached_tokens": end.usage.cached_tokens,
            "kvmesh.finish_reason": sampling_pb2.FinishReason.Name(end.finish_reason),
        }
    )


def _as_is(chunk: gateway_pb2.GenerateResponse) -> gateway_pb2.GenerateResponse:
    return chunk


class Gateway:
    def __init__(
        self,
        model: ServedModel,
        backends: Backends,
        *,
        max_inflight: int = 256,
        stream_idle_timeout_s: float = 600.0,
        token_stall_timeout_s: float = 30.0,
        metrics: GatewayMetrics | None = None,
        tool_call_format: ToolCallFormat = FORMATS[DEFAULT_FORMAT],
        migration: MigrationPolicy = MigrationPolicy(),
        known_workers: LastKnownWorkers | None = None,
        avoided_workers: AvoidedWorkers | None = None,
    ) -> None:
        if max_inflight <= 0:
            raise ValueError(f"max_inflight must be > 0, got {max_inflight}")
        self.model = model
        self._max_inflight = max_inflight
        self._metrics = metrics or GatewayMetrics()
        self._tool_format = tool_call_format
        self._migration = migration
        self._inflight = 0
        self._avoided = avoided_workers or AvoidedWorkers()
        self.adapters = Adapters(backends, model.name)
        self._workers = WorkerCalls(
            model,
            backends,
            self._metrics,
            known_workers or LastKnownWorkers(),
            stream_idle_timeout_s,
            token_stall_timeout_s,
        )

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def max_inflight(self) -> int:
        """Generation requests in flight at most; more are refused with RESOURCE_EXHAUSTED."""
        return self._max_inflight

    # -- the unary API -------------------------------------------------------

    async def list_models(self) -> list[gateway_pb2.ModelInfo]:
        """The base model, then every LoRA adapter the workers have loaded (its ``parent`` the base)."""
        base = self._model_info(self.model.name)
        return [base, *(self._model_info(a.name, parent=base.id) for a in await self.adapters.catalog())]

    def _model_info(self, name: str, parent: str = "") -> gateway_pb2.ModelInfo:
        m = self.model
        # ModelInfo has no description; owned_by is where a client sees "random weights".
        owner = m.label or "kvmesh"
        return gateway_pb2.ModelInfo(
            id=name, max_model_len=m.max_model_len, owned_by=owner, created=m.created, parent=parent
        )

    async def load_adapter(self, name: str, path: str) -> gateway_pb2.LoadAdapterResponse:
        served = await self.adapters.load(name, path)
        model = self._model_info(name, parent=self.model.name)
        return gateway_pb2.LoadAdapterResponse(model=model, workers=served.workers)

    async def unload_adapter(self, name: str) -> gateway_pb2.UnloadAdapterResponse:
        return gateway_pb2.UnloadAdapterResponse(workers=await self.adapters.unload(name))

    async def tokenize(self, request: gateway_pb2.TokenizeRequest) -> list[int]:
        await self.adapters.resolve(request.model)  # an adapter shares the base model's tokenizer
        which = request.WhichOneof("input")
        if which == "text":
            return self.model.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        if which == "chat":
            return self._chat_prompt(request.chat.messages, None, request.chat_template_kwargs_json)
        raise InvalidArgument("nothing to tokenize: set text or chat")

    async def detokenize(self, request: gateway_pb2.DetokenizeRequest) -> str:
        """The ids' text with special tokens shown (as a prompt holds them)."""
        await self.adapters.resolve(request.model)
        vocab = self.model.vocab_size
        bad = next((t for t in request.token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidField("token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        return self.model.tokenizer.decode(list(request.token_ids), skip_special_tokens=False)

    # -- the streaming API ---------------------------------------------------

    def generate(self, request: gateway_pb2.GenerateRequest, request_id: str, tenant: str = ANONYMOUS) -> Chunks:
        """``tenant`` is the authenticated caller's (``auth.ApiKeys``): it scopes the request's cache salt."""

        def prepare() -> _Prepared:
            validate_structured_output(request.sampling)
            return _Prepared(self._text_prompt(request), request.sampling, _as_is)

        return self._serve("generate", request_id, tenant, request, prepare)

    def chat(self, request: gateway_pb2.ChatRequest, request_id: str, tenant: str = ANONYMOUS) -> ChatChunks:
        """With tools, the prompt shows them, the grammar keeps calls valid, and calls come back parsed."""

        def prepare() -> _Prepared:
            validate_structured_output(request.sampling)
            tools = tool_use(request, self._tool_format)
            if tools is None:
                prompt = self._chat_prompt(request.messages, None, request.chat_template_kwargs_json)
                return _Prepared(prompt, request.sampling, ChatReply(None))
            sampling = sampling_pb2.SamplingParams()
            sampling.CopyFrom(request.sampling)
            sampling.structured_output.CopyFrom(tools.grammar.to_pb())
            prompt = self._chat_prompt(request.messages, tools.template_tools(), request.chat_template_kwargs_json)
            return _Prepared(prompt, sampling, ChatReply(self._tool_format.parser(), self._tool_format.new_call_id))

        return self._serve("chat", request_id, tenant, request, prepare)

    async def wait_idle(self) -> None:
        """Wait for lease aborts still on their way (shutdown, tests)."""
        await self._workers.wait_idle()

    async def _serve(
        self,
        method: str,
        request_id: str,
        tenant: str,
        request: gateway_pb2.GenerateRequest | gateway_pb2.ChatRequest,
        prepare: Callable[[], _Prepared],
    ) -> AsyncGenerator[Any, None]:
        received = time.monotonic_ns()
        received_wall = time.time_ns()
        if self._inflight >= self._max_inflight:
            self._metrics.requests.labels(method, "resource_exhausted").inc()
            raise ResourceExhausted(
                f"the gateway is at its limit of {self._max_inflight} requests in flight; retry later"
            )
        self._inflight += 1
        self._metrics.inflight.inc()
        outcome, stream = "internal", None
        attributes = {"kvmesh.request_id": request_id, "gen_ai.request.model": request.model or self.model.name}
        with tracing.span(f"gateway.{method}", **attributes, **{"kvmesh.tenant": tenant_digest(tenant)}) as span:
            try:
                adapter = await self.adapters.resolve(request.model)
                prepared = prepare()
                prompt_ids, m = prepared.prompt_ids, self.model
                params = SamplingParams.from_pb(prepared.sampling)
                sampling = admitted(params, prompt_ids, m.vocab_size, m.max_model_len, m.defaults).to_pb()
                prepare_ns = time.monotonic_ns() - received
                tracing.record_span(
                    "tokenize", received_wall, received_wall + prepare_ns, **{"kvmesh.prompt_tokens": len(prompt_ids)}
                )
                salt = tenant_cache_salt(tenant, request.cache_salt)
                job = Job(method, request_id, prompt_ids, sampling, salt, received, prepare_ns, adapter)
                stream = ResponseStream(job, self._metrics)
                async with aclosing(self._run(job, stream)) as chunks:
                    async for chunk in chunks:
                        if chunk.HasField("final"):
                            outcome = "ok"  # a client that stops reading after the final chunk did get it all
                            _describe_end(span, chunk.final)
                        yield prepared.shape(chunk)
            except KvmeshError as e:
                outcome = e.code.lower()
                raise
            except (asyncio.CancelledError, GeneratorExit):
                if outcome != "ok":
                    outcome = "cancelled"
                raise
            finally:
                self._inflight -= 1
                self._metrics.inflight.dec()
                self._metrics.requests.labels(method, outcome).inc()
                span.set_attribute("kvmesh.outcome", outcome)
                log.info(
                    "request finished",
                    method=method,
                    outcome=outcome,
                    user=request.user or None,
                    completion_tokens=stream.tokens_sent if stream else 0,
                )

    async def _run(self, job: Job, stream: ResponseStream) -> Chunks:
        excluded: list[str] = []
        failure: WorkerFailed | None = None
        attempts = migrations = 0
        while True:
            try:
                plan = await self._route(job, excluded)
            except Unavailable as e:
                if failure is None:
                    raise
                if stream.tokens_sent:
                    self._metrics.migrations.labels("no_worker").inc()
                    raise Unavailable(
                        f"{failure.message} after {stream.tokens_sent} tokens were streamed; "
                        f"no other worker to resume on: {e.message}"
                    ) from None
                raise Unavailable(f"{failure.message}; no other worker to retry on: {e.message}") from None
            try:
                if stream.tokens_sent:
                    self._metrics.migrations.labels("resumed").inc()
                    chunks = self._workers.resume(job, plan, stream)
                else:
                    attempts += 1
                    stream.predicted_cached_tokens = plan.predicted_cached_tokens
                    chunks = self._workers.attempt(job, plan, stream)
                async with aclosing(chunks):
                    async for chunk in chunks:
                        yield chunk
                self._avoided.served(plan.decode_worker.worker_id, plan.prefill_worker.worker_id)
                return
            except WorkerFailed as e:
                excluded.append(e.worker_id)
                self._avoided.failed(e.worker_id)
                failure = e
                if stream.tokens_sent:
                    if migrations >= self._migration.max_migrations:
                        self._metrics.migrations.labels("limit").inc()
                        raise Unavailable(
                            f"{e.message} after {stream.tokens_sent} tokens were streamed, and this request "
                            f"already moved {migrations} times (the limit)"
                        ) from None
                    migrations += 1
                    tracing.add_event(
                        "migration",
                        **{"kvmesh.migration.from": e.worker_id, "kvmesh.migration.tokens_sent": stream.tokens_sent},
                    )
                    log.warning(
                        "decode worker failed mid-stream; migrating the stream",
                        worker_id=e.worker_id,
                        tokens_sent=stream.tokens_sent,
                        migration=migrations,
                        error=e.message,
                    )
                    continue
                if attempts == MAX_ATTEMPTS:
                    raise Unavailable(f"{e.message} (after a retry on another worker)") from None
                log.warning(
                    "worker failed before the first token; retrying elsewhere",
                    stage=e.stage,
                    worker_id=e.worker_id,
                    error=e.message,
                )
                self._metrics.retries.labels(e.stage).inc()

    async def _route(self, job: Job, excluded: list[str]) -> router_pb2.RouteResponse:
        """A plan without the workers this request or, lately, this gateway could not reach (or, when that
        leaves nobody, without this request's alone)."""
        avoided = [w for w in self._avoided.avoided() if w not in excluded]
        if avoided:
            try:
                return await self._workers.route(job, [*excluded, *avoided])
            except Unavailable:
                pass  # nobody else is left: try them after all
        return await self._workers.route(job, excluded)

    # -- prompts ---------------------------------------------------------------

    def _text_prompt(self, request: gateway_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "token_ids":
            return list(request.token_ids.ids)
        if which == "text" and request.text:
            return self.model.tokenizer.encode(request.text, add_special_tokens=True)
        raise InvalidArgument("prompt is empty: set text or token_ids")

    def _chat_prompt(
        self, messages: Sequence[gateway_pb2.ChatMessage], tools: list[dict[str, Any]] | None, kwargs_json: str = ""
    ) -> list[int]:
        text = self.model.tokenizer.apply_chat_template(
            template_messages(messages), add_generation_prompt=True, tools=tools, extra=_template_kwargs(kwargs_json)
        )
        # The template writes any special tokens (BOS) itself.
        return self.model.tokenizer.encode(text, add_special_tokens=False)


def _template_kwargs(kwargs_json: str) -> dict[str, Any] | None:
    """A request's chat_template_kwargs_json as the variables it names (None: empty)."""
    if not kwargs_json:
        return None
    try:
        kwargs = json.loads(kwargs_json)
    except json.JSONDecodeError as e:
        raise InvalidField("chat_template_kwargs_json", f"chat_template_kwargs_json is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise InvalidField("chat_template_kwargs_json", "chat_template_kwargs_json must be a JSON object")
    return kwargs
