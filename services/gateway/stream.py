"""One request's response stream as the client sees it: offsets, usage, timings, latency metrics."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.api.common.v1 import accounting_pb2, sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from services.gateway.metrics import GatewayMetrics
from services.gateway.timing import phases

# vLLM's finished_reason words (its engine ends a sequence on stop, length or abort).
_VLLM_FINISH = {
    sampling_pb2.FINISH_REASON_STOP: "stop",
    sampling_pb2.FINISH_REASON_TOOL_CALLS: "stop",
    sampling_pb2.FINISH_REASON_LENGTH: "length",
    sampling_pb2.FINISH_REASON_REPETITION: "length",
}


@dataclass(frozen=True)
class Job:
    """A validated request, ready to route."""

    method: str  # "generate" or "chat": the metrics label
    request_id: str
    prompt_ids: list[int]
    sampling: sampling_pb2.SamplingParams
    cache_salt: bytes
    received_ns: int  # time.monotonic_ns() when the gateway got the request
    prepare_ns: int  # spent tokenizing and validating
    adapter: str = ""  # the LoRA adapter it runs under ("": the base model)


@dataclass(frozen=True)
class Finish:
    """What the last chunk reports besides its tokens."""

    reason: int  # common.v1.FinishReason
    cached_tokens: int
    route_timings: accounting_pb2.Timings
    prefill_timings: accounting_pb2.Timings | None = None
    decode_timings: accounting_pb2.Timings | None = None
    system_fingerprint: str = ""  # the decode worker's (empty: none ran)


class ResponseStream:
    """Builds the chunks sent to the client and counts what was sent.

    Offsets are the gateway's own count of tokens sent, so they stay exact
    even if a request was retried on another worker before its first token.
    """

    def __init__(self, job: Job, metrics: GatewayMetrics) -> None:
        self._job = job
        self._metrics = metrics
        self.tokens_sent = 0
        self.token_ids: list[int] = []  # what the client got, to resume from if its decode worker fails
        self._first_ns: int | None = None
        self._last_ns = 0
        # What the router expected the attempt that served the prompt to find cached (its precision's numerator
        # is what the worker then found: the final chunk's cached tokens).
        self.predicted_cached_tokens = 0

    def chunk(
        self,
        token_ids: Sequence[int],
        text: str,
        logprobs: Sequence[sampling_pb2.TokenLogprob] = (),
        finish: Finish | None = None,
    ) -> gateway_pb2.GenerateResponse:
        offset = self.tokens_sent
        self.token_ids.extend(token_ids)
        self._count(len(token_ids))
        return gateway_pb2.GenerateResponse(
            request_id=self._job.request_id,
            offset=offset,
            token_ids=token_ids,
            text=text,
            logprobs=logprobs,
            final=self._end(finish) if finish is not None else None,
        )

    def _count(self, n: int) -> None:
        if not n:
            return
        now = time.monotonic_ns()
        if self._first_ns is None:
            self._first_ns = now
            self._metrics.ttft.observe((now - self._job.received_ns) / 1e9)
            self._metrics.vllm.ttft.observe((now - self._job.received_ns) / 1e9)
        else:
            # Speculative decoding sends several tokens at once: spread the gap over them.
            per_token = (now - self._last_ns) / 1e9 / n
            for _ in range(n):
                self._metrics.inter_token.observe(per_token)
                self._metrics.vllm.inter_token.observe(per_token)
        self._last_ns = now
        self.tokens_sent += n
        self._metrics.tokens.inc(n)

    def _end(self, finish: Finish) -> gateway_pb2.StreamEnd:
        job = self._job
        total = time.monotonic_ns() - job.received_ns
        end = gateway_pb2.StreamEnd(
            finish_reason=finish.reason,
            usage=accounting_pb2.Usage(
                prompt_tokens=len(job.prompt_ids),
                completion_tokens=self.tokens_sent,
                cached_tokens=finish.cached_tokens,
            ),
            timings=accounting_pb2.Timings(
                compute_ns=job.prepare_ns,
                transfer_ns=max(total - job.prepare_ns, 0),  # the rest was waiting on the mesh
                total_ns=total,
                first_token_ns=self._first_ns - job.received_ns if self._first_ns is not None else 0,
            ),
            route_timings=finish.route_timings,
            prefill_timings=finish.prefill_timings,
            decode_timings=finish.decode_timings,
            system_fingerprint=finish.system_fingerprint,
        )
        for phase, ns in phases(end).items():
            self._metrics.phases.labels(phase).observe(ns / 1e9)
        self._metrics.cached_tokens.labels("predicted").inc(self.predicted_cached_tokens)
        self._metrics.cached_tokens.labels("found").inc(finish.cached_tokens)
        self._metrics.vllm.finished(
            _VLLM_FINISH.get(finish.reason, "abort"), total / 1e9, len(job.prompt_ids), self.tokens_sent
        )
        return end
