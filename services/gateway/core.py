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
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import structlog

from kvmesh.api.common.v1 import accounting_pb2, kv_pb2, sampling_pb2, worker_pb2
from kvmesh.api.decode.v1 import decode_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.api.prefill.v1 import prefill_pb2
from kvmesh.api.router.v1 import router_pb2
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.errors import InvalidArgument, KvmeshError, ResourceExhausted, Unavailable
from kvmesh.sampling import SamplingParams, admitted
from services.gateway.auth import ANONYMOUS, tenant_cache_salt
from services.gateway.backends import Backends, RouterUnreachable
from services.gateway.chat_messages import template_messages
from services.gateway.metrics import GatewayMetrics
from services.gateway.migration import MigrationPolicy, resumed
from services.gateway.model import ServedModel
from services.gateway.route_fallback import LastKnownWorkers
from services.gateway.stream import Finish, Job, ResponseStream
from services.gateway.tool_calls import DEFAULT_FORMAT, FORMATS, ToolCallFormat
from services.gateway.tool_calls.reply import ChatReply
from services.gateway.tool_calls.request import tool_use
from services.gateway.validation import validate_structured_output

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


def _as_is(chunk: gateway_pb2.GenerateResponse) -> gateway_pb2.GenerateResponse:
    return chunk


class WorkerFailed(Unavailable):
    """A prefill or decode worker could not serve the request (unreachable, timed out, stream broke)."""

    def __init__(self, stage: str, worker: worker_pb2.WorkerEndpoint, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.worker_id = worker.worker_id


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
    ) -> None:
        if max_inflight <= 0:
            raise ValueError(f"max_inflight must be > 0, got {max_inflight}")
        self.model = model
        self._backends = backends
        self._max_inflight = max_inflight
        # Silence allowed before a decode stream's first message (queueing, KV transfer, prefill)
        # and between its messages once tokens flow (a steady stream that stops is a hung worker).
        self._idle_timeout_s = stream_idle_timeout_s
        self._stall_timeout_s = token_stall_timeout_s
        self._metrics = metrics or GatewayMetrics()
        self._tool_format = tool_call_format
        self._migration = migration
        self._known_workers = known_workers or LastKnownWorkers()
        self._inflight = 0
        self._background: set[asyncio.Task[None]] = set()  # lease aborts on their way

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def max_inflight(self) -> int:
        """Generation requests in flight at most; more are refused with RESOURCE_EXHAUSTED."""
        return self._max_inflight

    # -- the unary API -------------------------------------------------------

    def list_models(self) -> list[gateway_pb2.ModelInfo]:
        m = self.model
        # ModelInfo has no description; owned_by is where a client sees "random weights".
        owner = m.label or "kvmesh"
        return [gateway_pb2.ModelInfo(id=m.name, max_model_len=m.max_model_len, owned_by=owner, created=m.created)]

    def tokenize(self, request: gateway_pb2.TokenizeRequest) -> list[int]:
        self.model.check_name(request.model)
        which = request.WhichOneof("input")
        if which == "text":
            return self.model.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        if which == "chat":
            return self._chat_prompt(request.chat.messages, None)
        raise InvalidArgument("nothing to tokenize: set text or chat")

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
                return _Prepared(self._chat_prompt(request.messages, None), request.sampling, ChatReply(None))
            sampling = sampling_pb2.SamplingParams()
            sampling.CopyFrom(request.sampling)
            sampling.structured_output.CopyFrom(tools.grammar.to_pb())
            prompt = self._chat_prompt(request.messages, tools.template_tools())
            return _Prepared(prompt, sampling, ChatReply(self._tool_format.parser()))

        return self._serve("chat", request_id, tenant, request, prepare)

    async def wait_idle(self) -> None:
        """Wait for lease aborts still on their way (shutdown, tests)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def _serve(
        self,
        method: str,
        request_id: str,
        tenant: str,
        request: gateway_pb2.GenerateRequest | gateway_pb2.ChatRequest,
        prepare: Callable[[], _Prepared],
    ) -> AsyncGenerator[Any, None]:
        received = time.monotonic_ns()
        if self._inflight >= self._max_inflight:
            self._metrics.requests.labels(method, "resource_exhausted").inc()
            raise ResourceExhausted(
                f"the gateway is at its limit of {self._max_inflight} requests in flight; retry later"
            )
        self._inflight += 1
        self._metrics.inflight.inc()
        outcome, stream = "internal", None
        try:
            self.model.check_name(request.model)
            prepared = prepare()
            prompt_ids, m = prepared.prompt_ids, self.model
            params = SamplingParams.from_pb(prepared.sampling)
            sampling = admitted(params, prompt_ids, m.vocab_size, m.max_model_len, m.defaults).to_pb()
            prepare_ns = time.monotonic_ns() - received
            salt = tenant_cache_salt(tenant, request.cache_salt)
            job = Job(method, request_id, prompt_ids, sampling, salt, received, prepare_ns)
            stream = ResponseStream(job, self._metrics)
            async with aclosing(self._run(job, stream)) as chunks:
                async for chunk in chunks:
                    if chunk.HasField("final"):
                        outcome = "ok"  # a client that stops reading after the final chunk did get it all
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
                    chunks = self._resume(job, plan, stream)
                else:
                    attempts += 1
                    chunks = self._attempt(job, plan, stream)
                async with aclosing(chunks):
                    async for chunk in chunks:
                        yield chunk
                return
            except WorkerFailed as e:
                excluded.append(e.worker_id)
                failure = e
                if stream.tokens_sent:
                    if migrations >= self._migration.max_migrations:
                        self._metrics.migrations.labels("limit").inc()
                        raise Unavailable(
                            f"{e.message} after {stream.tokens_sent} tokens were streamed, and this request "
                            f"already moved {migrations} times (the limit)"
                        ) from None
                    migrations += 1
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

    async def _resume(self, job: Job, plan: router_pb2.RouteResponse, stream: ResponseStream) -> Chunks:
        """Continue on ``plan``'s decode worker after the tokens already sent; it prefills them itself."""
        request = resumed(self._decode_request(job, local=decode_pb2.LocalPrefill()), stream.token_ids)
        async with aclosing(self._decode(plan.decode_worker, request, stream, plan.timings, None, None)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _route(self, job: Job, excluded: Sequence[str]) -> router_pb2.RouteResponse:
        request = router_pb2.RouteRequest(
            request_id=job.request_id,
            tokens=router_pb2.TokenPrompt(token_ids=job.prompt_ids),
            cache_salt=job.cache_salt,
            max_new_tokens=job.sampling.max_tokens,
            exclude_worker_ids=excluded,
        )
        try:
            plan = await self._backends.route(request)
        except RouterUnreachable as e:
            plan = self._known_workers.plan(request, e)  # Unavailable once the outage outlasts its bound
            self._metrics.router_fallbacks.inc()
            log.warning(
                "router unreachable; routing on its last known workers",
                error=e.message,
                decode_worker=plan.decode_worker.worker_id,
            )
            return plan
        if not plan.decode_worker.address or not (plan.prefill_locally or plan.prefill_worker.address):
            raise KvmeshError(f"the router returned an incomplete plan: {plan}")
        self._known_workers.learn(plan)
        return plan

    async def _attempt(self, job: Job, plan: router_pb2.RouteResponse, stream: ResponseStream) -> Chunks:
        if plan.prefill_locally:
            request = self._decode_request(job, local=decode_pb2.LocalPrefill())
            async with aclosing(self._decode(plan.decode_worker, request, stream, plan.timings, None, None)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return

        prefill = await self._prefill(job, plan.prefill_worker)
        if prefill.finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED:
            yield self._first_token_only(job, plan, prefill, stream)  # nothing to decode, no lease
            return
        handoff = prefill.handoff
        lease = handoff.lease_id if handoff.mode == kv_pb2.HANDOFF_MODE_PULL else ""
        finished = False
        try:
            remote = decode_pb2.RemotePrefill(first_token_id=prefill.first_token_id, handoff=handoff)
            if prefill.HasField("first_token_logprob"):
                remote.first_token_logprob.CopyFrom(prefill.first_token_logprob)
            request = self._decode_request(job, remote=remote)
            decode = self._decode(
                plan.decode_worker, request, stream, plan.timings, prefill.timings, prefill.reused_tokens
            )
            async with aclosing(decode) as chunks:
                async for chunk in chunks:
                    yield chunk
            finished = True
        finally:
            if not finished and lease:
                self._abort_lease(handoff.source_address, lease)

    async def _prefill(self, job: Job, worker: worker_pb2.WorkerEndpoint) -> prefill_pb2.PrefillResponse:
        request = prefill_pb2.PrefillRequest(
            request_id=job.request_id,
            token_ids=job.prompt_ids,
            sampling=job.sampling,
            cache_salt=job.cache_salt,
            handoff_mode=kv_pb2.HANDOFF_MODE_PULL,
        )
        call = asyncio.ensure_future(self._backends.prefill(worker.address, request))
        try:
            return await call
        except Unavailable as e:
            who = f"prefill worker {worker.worker_id} ({worker.address})"
            raise WorkerFailed("prefill", worker, f"{who} failed: {e.message}") from None
        except asyncio.CancelledError:
            # The client went away mid-prefill. Cancelling the call aborts the
            # prefill; if its answer had already arrived, its lease is ours to end.
            call.cancel()
            if call.done() and not call.cancelled() and call.exception() is None:
                handoff = call.result().handoff
                if handoff.lease_id:
                    self._abort_lease(handoff.source_address, handoff.lease_id)
            raise

    async def _decode(
        self,
        worker: worker_pb2.WorkerEndpoint,
        request: decode_pb2.DecodeRequest,
        stream: ResponseStream,
        route_timings: accounting_pb2.Timings,
        prefill_timings: accounting_pb2.Timings | None,
        prefill_reused_tokens: int | None,
    ) -> Chunks:
        who = f"decode worker {worker.worker_id} ({worker.address})"
        messages = self._backends.decode(worker.address, request)
        async with aclosing(messages):
            limit = self._idle_timeout_s
            while True:
                try:
                    async with asyncio.timeout(limit):
                        msg = await anext(messages)
                except StopAsyncIteration:
                    raise WorkerFailed("decode", worker, f"{who} ended its stream without a final message") from None
                except TimeoutError:
                    raise WorkerFailed("decode", worker, f"{who} sent nothing for {limit:g} s") from None
                except Unavailable as e:
                    raise WorkerFailed("decode", worker, f"{who} failed: {e.message}") from None
                limit = self._stall_timeout_s
                finish = None
                if msg.HasField("final"):
                    final = msg.final
                    # Remote prefill: the prefill worker knows what it reused; decode
                    # only imported what prefill handed over.
                    cached = final.usage.cached_tokens if prefill_reused_tokens is None else prefill_reused_tokens
                    # A resumed request's cache hits may cover streamed tokens too: usage counts the prompt's.
                    cached = min(cached, len(request.prompt_token_ids))
                    finish = Finish(final.finish_reason, cached, route_timings, prefill_timings, final.timings)
                yield stream.chunk(msg.token_ids, msg.text, msg.logprobs, finish)
                if finish is not None:
                    return

    def _first_token_only(
        self, job: Job, plan: router_pb2.RouteResponse, prefill: prefill_pb2.PrefillResponse, stream: ResponseStream
    ) -> gateway_pb2.GenerateResponse:
        token = prefill.first_token_id
        text = IncrementalDetokenizer(self.model.tokenizer, job.prompt_ids).add(token)
        if prefill.finish_reason == sampling_pb2.FINISH_REASON_STOP:
            text = _cut_at_stop(text, job.sampling.stop)
        logprobs = [prefill.first_token_logprob] if prefill.HasField("first_token_logprob") else []
        finish = Finish(prefill.finish_reason, prefill.reused_tokens, plan.timings, prefill.timings)
        return stream.chunk([token], text, logprobs, finish)

    def _abort_lease(self, address: str, lease_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._release_lease(address, lease_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_lease(self, address: str, lease_id: str) -> None:
        try:
            await self._backends.release_lease(
                address, prefill_pb2.ReleaseLeaseRequest(lease_id=lease_id, outcome=prefill_pb2.LEASE_OUTCOME_ABORT)
            )
        except KvmeshError as e:
            log.warning(
                "could not abort a KV lease; its holder frees it at the TTL",
                lease_id=lease_id,
                address=address,
                error=e.message,
            )

    # -- prompts ---------------------------------------------------------------

    def _decode_request(self, job: Job, **prefill: object) -> decode_pb2.DecodeRequest:
        return decode_pb2.DecodeRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt_ids,
            sampling=job.sampling,
            cache_salt=job.cache_salt,
            **prefill,
        )

    def _text_prompt(self, request: gateway_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "token_ids":
            return list(request.token_ids.ids)
        if which == "text" and request.text:
            return self.model.tokenizer.encode(request.text, add_special_tokens=True)
        raise InvalidArgument("prompt is empty: set text or token_ids")

    def _chat_prompt(
        self, messages: Sequence[gateway_pb2.ChatMessage], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        text = self.model.tokenizer.apply_chat_template(
            template_messages(messages), add_generation_prompt=True, tools=tools
        )
        # The template writes any special tokens (BOS) itself.
        return self.model.tokenizer.encode(text, add_special_tokens=False)


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before the earliest stop string (stop strings are not part of the output)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]
