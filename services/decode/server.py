"""gRPC face of the decode worker: DecodeRequest in, a stream of DecodeResponse out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from kvmesh import tracing
from kvmesh.api.common.v1 import accounting_pb2
from kvmesh.api.decode.v1 import decode_pb2, decode_pb2_grpc
from kvmesh.convert import finish_to_pb, logprob_from_pb, logprob_to_pb, timings_pb
from kvmesh.errors import InvalidArgument, InvalidField
from kvmesh.sampling import SamplingParams, admitted
from kvmesh.worker.nixl_layout import NixlBlocks
from services.decode.core import DecodeWorker, RemotePrefill


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self) -> None:
        self.worker: DecodeWorker
        self.max_model_len: int
        self.vocab_size: int
        self.system_fingerprint: str

    def attach(self, worker: DecodeWorker, max_model_len: int, vocab_size: int, system_fingerprint: str) -> None:
        """Called once the model is loaded; health stays NOT_SERVING (no RPCs arrive) until then."""
        self.worker = worker
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.system_fingerprint = system_fingerprint

    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        t0 = time.perf_counter_ns()
        if not request.request_id:  # streams, leases and migrations are keyed by it
            raise InvalidField("request_id", "request_id is empty: a request must be named")
        prompt = list(request.prompt_token_ids)
        params = admitted(SamplingParams.from_pb(request.sampling), prompt, self.vocab_size, self.max_model_len)
        remote = None
        if request.WhichOneof("prefill") == "remote":
            r = request.remote
            if not r.handoff.source_address or not r.handoff.lease_id:
                raise InvalidArgument("remote prefill needs the hand-off's source_address and lease_id")
            remote = RemotePrefill(
                address=r.handoff.source_address,
                lease_id=r.handoff.lease_id,
                block_hashes=list(r.handoff.block_hashes),
                first_token=r.first_token_id,
                first_logprob=logprob_from_pb(r.first_token_logprob) if r.HasField("first_token_logprob") else None,
                nixl=NixlBlocks.from_pb(r.handoff.nixl) if r.handoff.HasField("nixl") else None,
            )
        resume = list(request.resume_token_ids)
        if resume and remote is not None:
            raise InvalidArgument("resume_token_ids need local prefill: their KV is computed here")
        offset = len(resume)
        accepted = 0
        first_token_ns = queue_ns = None
        tracing.set_attributes(
            **{
                "kvmesh.prefill": "remote" if remote is not None else "local",
                "kvmesh.prompt_tokens": len(prompt),
                "kvmesh.resumed_tokens": len(resume),
            }
        )
        async for out, transfer_ns in self.worker.decode(
            request.request_id, prompt, params, request.cache_salt, remote, resume, request.adapter or None
        ):
            if first_token_ns is None:
                first_token_ns = time.perf_counter_ns() - t0
                tracing.add_event("first_token")
            if queue_ns is None and out.admitted_ns:
                queue_ns = out.admitted_ns - out.added_ns
                tracing.record_span("decode.queue", tracing.wall_ns(out.added_ns), tracing.wall_ns(out.admitted_ns))
            accepted += out.num_draft_accepted
            msg = decode_pb2.DecodeResponse(
                offset=offset,
                token_ids=out.new_token_ids,
                text=out.text_delta,
                logprobs=[logprob_to_pb(lp) for lp in out.new_logprobs],
                accepted_draft_tokens=out.num_draft_accepted,
            )
            offset += len(out.new_token_ids)
            if out.finished:
                msg.final.CopyFrom(
                    decode_pb2.DecodeFinal(
                        finish_reason=finish_to_pb(out.finish_reason),
                        usage=accounting_pb2.Usage(
                            prompt_tokens=out.num_prompt_tokens,
                            completion_tokens=offset,
                            cached_tokens=out.num_cached_tokens,
                        ),
                        timings=timings_pb(
                            queue_ns=queue_ns or 0,
                            transfer_ns=transfer_ns,
                            first_token_ns=first_token_ns,
                            total_ns=time.perf_counter_ns() - t0,
                        ),
                        draft_tokens_proposed=out.num_draft_proposed,
                        draft_tokens_accepted=accepted,
                        system_fingerprint=self.system_fingerprint,
                    )
                )
                tracing.set_attributes(
                    **{
                        "kvmesh.completion_tokens": offset,
                        "kvmesh.finish_reason": out.finish_reason,
                        "kvmesh.cached_tokens": out.num_cached_tokens,
                        "kvmesh.preemptions": out.num_preemptions,
                        "kvmesh.spec.proposed_tokens": out.num_draft_proposed,
                        "kvmesh.spec.accepted_tokens": accepted,
                    }
                )
            yield msg
