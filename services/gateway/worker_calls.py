"""One attempt at a request on the workers a plan names: Route, then Prefill and Decode, streamed back.

``WorkerCalls`` is the gateway's side of the worker protocol: it asks the router for a plan, drives a remote
prefill (``Prefill``, then ``Decode`` with the hand-off) or a local one (``Decode`` alone), resumes a
migrated stream on another decode worker, and aborts a KV lease whenever a request with one ends without
decode finishing it. A worker that cannot be reached, or breaks or falls silent mid-stream, is a
``WorkerFailed``: the caller (``core.Gateway``) retries or migrates.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing

import structlog

from kvmesh import tracing
from kvmesh.api.common.v1 import accounting_pb2, kv_pb2, sampling_pb2, worker_pb2
from kvmesh.api.decode.v1 import decode_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.api.prefill.v1 import prefill_pb2
from kvmesh.api.router.v1 import router_pb2
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.stop_strings import stop_cut
from kvmesh.errors import KvmeshError, Unavailable
from services.gateway.backends import Backends, RouterUnreachable
from services.gateway.metrics import GatewayMetrics
from services.gateway.migration import resumed
from services.gateway.model import ServedModel
from services.gateway.route_fallback import LastKnownWorkers
from services.gateway.stream import Finish, Job, ResponseStream

log = structlog.get_logger("kvmesh.gateway")

Chunks = AsyncGenerator[gateway_pb2.GenerateResponse, None]


class WorkerFailed(Unavailable):
    """A prefill or decode worker could not serve the request (unreachable, timed out, stream broke)."""

    def __init__(self, stage: str, worker: worker_pb2.WorkerEndpoint, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.worker_id = worker.worker_id


class WorkerCalls:
    def __init__(
        self,
        model: ServedModel,
        backends: Backends,
        metrics: GatewayMetrics,
        known_workers: LastKnownWorkers,
        stream_idle_timeout_s: float,
        token_stall_timeout_s: float,
    ) -> None:
        self.model = model
        self._backends = backends
        self._metrics = metrics
        self._known_workers = known_workers
        # Silence allowed before a decode stream's first message (queueing, KV transfer, prefill)
        # and between its messages once tokens flow (a steady stream that stops is a hung worker).
        self._idle_timeout_s = stream_idle_timeout_s
        self._stall_timeout_s = token_stall_timeout_s
        self._background: set[asyncio.Task[None]] = set()  # lease aborts on their way

    async def wait_idle(self) -> None:
        """Wait for lease aborts still on their way (shutdown, tests)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def resume(self, job: Job, plan: router_pb2.RouteResponse, stream: ResponseStream) -> Chunks:
        """Continue on ``plan``'s decode worker after the tokens already sent; it prefills them itself."""
        request = resumed(self.decode_request(job, local=decode_pb2.LocalPrefill()), stream.token_ids)
        async with aclosing(self._decode(plan.decode_worker, request, stream, plan.timings, None, None)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def route(self, job: Job, excluded: Sequence[str]) -> router_pb2.RouteResponse:
        with tracing.span("route", **{"kvmesh.route.excluded": list(excluded)}) as span:
            plan = await self._route(job, excluded)
            span.set_attributes(_plan_attributes(plan))
            return plan

    async def _route(self, job: Job, excluded: Sequence[str]) -> router_pb2.RouteResponse:
        request = router_pb2.RouteRequest(
            request_id=job.request_id,
            tokens=router_pb2.TokenPrompt(token_ids=job.prompt_ids),
            cache_salt=job.cache_salt,
            max_new_tokens=job.sampling.max_tokens,
            exclude_worker_ids=excluded,
            adapter=job.adapter,
        )
        try:
            plan = await self._backends.route(request)
        except RouterUnreachable as e:
            plan = self._known_workers.plan(request, e)  # Unavailable once the outage outlasts its bound
            self._metrics.router_fallbacks.inc()
            tracing.set_attributes(**{"kvmesh.route.reason": "router unreachable: last known workers"})
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

    async def attempt(self, job: Job, plan: router_pb2.RouteResponse, stream: ResponseStream) -> Chunks:
        if plan.prefill_locally:
            request = self.decode_request(job, local=decode_pb2.LocalPrefill())
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
            request = self.decode_request(job, remote=remote)
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
        with tracing.span("prefill", **_worker_attributes(worker)) as span:
            response = await self._call_prefill(job, worker)
            span.set_attributes(
                {"kvmesh.computed_tokens": response.computed_tokens, "kvmesh.reused_tokens": response.reused_tokens}
            )
            return response

    async def _call_prefill(self, job: Job, worker: worker_pb2.WorkerEndpoint) -> prefill_pb2.PrefillResponse:
        request = prefill_pb2.PrefillRequest(
            request_id=job.request_id,
            token_ids=job.prompt_ids,
            sampling=job.sampling,
            cache_salt=job.cache_salt,
            handoff_mode=kv_pb2.HANDOFF_MODE_PULL,
            adapter=job.adapter,
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
        attributes = {**_worker_attributes(worker), "kvmesh.resumed_tokens": len(request.resume_token_ids)}
        with tracing.span("decode", **attributes) as span:
            # Made inside the span: the call carries its context, so decode's spans hang under it.
            async with aclosing(self._backends.decode(worker.address, request)) as messages:
                limit, streaming = self._idle_timeout_s, False
                while True:
                    try:
                        async with asyncio.timeout(limit):
                            msg = await anext(messages)
                    except StopAsyncIteration:
                        raise WorkerFailed(
                            "decode", worker, f"{who} ended its stream without a final message"
                        ) from None
                    except TimeoutError:
                        raise WorkerFailed("decode", worker, f"{who} sent nothing for {limit:g} s") from None
                    except Unavailable as e:
                        raise WorkerFailed("decode", worker, f"{who} failed: {e.message}") from None
                    if not streaming:
                        span.add_event("first_message")
                        streaming = True
                    limit = self._stall_timeout_s
                    finish = None
                    if msg.HasField("final"):
                        final = msg.final
                        # Remote prefill: the prefill worker knows what it reused; decode
                        # only imported what prefill handed over.
                        cached = final.usage.cached_tokens if prefill_reused_tokens is None else prefill_reused_tokens
                        # A resumed request's cache hits may cover streamed tokens too: usage counts the prompt's.
                        cached = min(cached, len(request.prompt_token_ids))
                        finish = Finish(
                            final.finish_reason,
                            cached,
                            route_timings,
                            prefill_timings,
                            final.timings,
                            final.system_fingerprint,
                        )
                    yield stream.chunk(msg.token_ids, msg.text, msg.logprobs, finish)
                    if finish is not None:
                        return

    def _first_token_only(
        self, job: Job, plan: router_pb2.RouteResponse, prefill: prefill_pb2.PrefillResponse, stream: ResponseStream
    ) -> gateway_pb2.GenerateResponse:
        token = prefill.first_token_id
        sampling = job.sampling
        skip_special = sampling.skip_special_tokens if sampling.HasField("skip_special_tokens") else True
        text = IncrementalDetokenizer(self.model.tokenizer, job.prompt_ids, skip_special).add(token)
        if prefill.finish_reason == sampling_pb2.FINISH_REASON_STOP:
            cut = stop_cut(text, sampling.stop, include=sampling.include_stop_str_in_output)
            text = text if cut is None else text[:cut]
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

    def decode_request(self, job: Job, **prefill: object) -> decode_pb2.DecodeRequest:
        return decode_pb2.DecodeRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt_ids,
            sampling=job.sampling,
            cache_salt=job.cache_salt,
            adapter=job.adapter,
            **prefill,
        )


def _worker_attributes(worker: worker_pb2.WorkerEndpoint) -> dict[str, str]:
    return {"kvmesh.worker_id": worker.worker_id, "server.address": worker.address}


def _plan_attributes(plan: router_pb2.RouteResponse) -> dict[str, object]:
    """What the router decided and why: the workers, and the blocks it expected each to hold."""
    return {
        "kvmesh.route.decode_worker": plan.decode_worker.worker_id,
        "kvmesh.route.prefill_worker": "" if plan.prefill_locally else plan.prefill_worker.worker_id,
        "kvmesh.route.prefill_locally": plan.prefill_locally,
        "kvmesh.route.total_blocks": plan.total_blocks,
        "kvmesh.route.prefill_matched_blocks": plan.prefill_matched_blocks,
        "kvmesh.route.decode_matched_blocks": plan.decode_matched_blocks,
        "kvmesh.route.kvstore_matched_blocks": plan.kvstore_matched_blocks,
        "kvmesh.route.index_available": plan.index_available,
        "kvmesh.route.predicted_cached_tokens": plan.predicted_cached_tokens,
    }
