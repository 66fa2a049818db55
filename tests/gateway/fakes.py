"""The router, prefill and decode workers as plain Python, behind the gateway's ``Backends`` interface.

Behaviour is set per test through attributes: which addresses are dead,
where a decode stream fails or holds, whether prefill finishes the request.
Leases are tracked like a prefill worker would: created by Prefill, ended by
decode's ACK or the gateway's ABORT; ``leases`` left non-empty is a leak.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from kvmesh.api.adapter.v1 import adapter_pb2
from kvmesh.api.common.v1 import accounting_pb2, kv_pb2, sampling_pb2, worker_pb2
from kvmesh.api.decode.v1 import decode_pb2
from kvmesh.api.prefill.v1 import prefill_pb2
from kvmesh.api.router.v1 import router_pb2
from kvmesh.errors import NotFound, Unavailable
from services.gateway.backends import RouterUnreachable

FIRST_TOKEN = 7
DECODE_TOKENS = [11, 12, 13]


def endpoint(worker_id: str) -> worker_pb2.WorkerEndpoint:
    return worker_pb2.WorkerEndpoint(worker_id=worker_id, address=f"{worker_id}:1")


class FakeMesh:
    def __init__(self, prefill: tuple[str, ...] = ("p0", "p1"), decode: tuple[str, ...] = ("d0", "d1")) -> None:
        self.prefill_workers = list(prefill)
        self.decode_workers = list(decode)
        self.prefill_locally = False
        self.router_down = False
        self.dead: set[str] = set()  # worker ids whose calls fail as unreachable
        self.prefill_finish = sampling_pb2.FINISH_REASON_UNSPECIFIED
        self.prefill_error: Exception | None = None
        self.hold_prefill = False
        self.decode_tokens = list(DECODE_TOKENS)
        self.token_text: Callable[[int], str] = lambda token: f"<{token}>"  # each decode message's text
        self.fail_decode_at: dict[str, int] = {}  # worker id -> message index that breaks the stream
        self.hold_decode_at: dict[str, int] = {}  # worker id -> message index it never gets past
        self.held = asyncio.Event()  # a prefill or decode reached its hold point
        # What happened:
        self.routes: list[router_pb2.RouteRequest] = []
        self.prefills: list[tuple[str, prefill_pb2.PrefillRequest]] = []
        self.decodes: list[tuple[str, decode_pb2.DecodeRequest]] = []
        self.cancelled: list[tuple[str, str]] = []  # (stage, worker id) calls cancelled by the gateway
        self.released: list[tuple[str, str, int]] = []  # (address, lease id, outcome)
        self.leases: set[str] = set()
        self.open_streams = 0
        # LoRA adapters: worker id -> names loaded there; worker id -> the error its next load raises.
        self.adapters: dict[str, set[str]] = {w: set() for w in (*prefill, *decode)}
        self.adapter_errors: dict[str, Exception] = {}

    async def list_workers(self) -> router_pb2.ListWorkersResponse:
        if self.router_down:
            raise Unavailable("router (r:1) unreachable: connection refused")
        roles = {**dict.fromkeys(self.prefill_workers, "PREFILL"), **dict.fromkeys(self.decode_workers, "DECODE")}
        return router_pb2.ListWorkersResponse(
            workers=[
                router_pb2.WorkerStatus(
                    endpoint=endpoint(w),
                    role=worker_pb2.WorkerRole.Value(f"WORKER_ROLE_{role}"),
                    load=worker_pb2.WorkerLoad(
                        adapters=[
                            worker_pb2.AdapterState(name=n, fingerprint=b"f", resident=False)
                            for n in sorted(self.adapters[w])
                        ]
                    ),
                )
                for w, role in roles.items()
            ]
        )

    async def load_adapter(self, address: str, role: str, request: adapter_pb2.LoadAdapterRequest):
        worker = address.split(":")[0]
        if worker in self.adapter_errors:
            raise self.adapter_errors[worker]
        self.adapters[worker].add(request.name)
        return adapter_pb2.LoadAdapterResponse(adapter=adapter_pb2.Adapter(name=request.name, path=request.path))

    async def unload_adapter(self, address: str, role: str, request: adapter_pb2.UnloadAdapterRequest):
        worker = address.split(":")[0]
        if request.name not in self.adapters[worker]:
            raise NotFound(f"adapter {request.name!r} is not loaded on this worker")
        self.adapters[worker].discard(request.name)
        return adapter_pb2.UnloadAdapterResponse()

    async def route(self, request: router_pb2.RouteRequest) -> router_pb2.RouteResponse:
        self.routes.append(request)
        if self.router_down:
            raise RouterUnreachable("router (r:1) unreachable: connection refused")
        excluded = set(request.exclude_worker_ids)
        decode = [w for w in self.decode_workers if w not in excluded]
        prefill = [w for w in self.prefill_workers if w not in excluded]
        if not decode or not (prefill or self.prefill_locally):
            raise Unavailable("no worker available for this request")
        plan = router_pb2.RouteResponse(
            decode_worker=endpoint(decode[0]),
            prefill_locally=self.prefill_locally,
            total_blocks=len(request.tokens.token_ids) // 16,
            timings=accounting_pb2.Timings(total_ns=1),
        )
        if not self.prefill_locally:
            plan.prefill_worker.CopyFrom(endpoint(prefill[0]))
        return plan

    async def prefill(self, address: str, request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        worker = address.split(":")[0]
        self.prefills.append((worker, request))
        if worker in self.dead:
            raise Unavailable("unreachable: connection refused")
        if self.prefill_error is not None:
            raise self.prefill_error
        if self.hold_prefill:
            self.held.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(("prefill", worker))
                raise
        response = prefill_pb2.PrefillResponse(
            first_token_id=FIRST_TOKEN,
            finish_reason=self.prefill_finish,
            computed_tokens=len(request.token_ids) - 16,
            reused_tokens=16,
            timings=accounting_pb2.Timings(total_ns=2),
        )
        if self.prefill_finish == sampling_pb2.FINISH_REASON_UNSPECIFIED:
            lease = f"lease-{len(self.prefills)}"
            self.leases.add(lease)
            response.handoff.CopyFrom(
                kv_pb2.KVHandoff(
                    mode=kv_pb2.HANDOFF_MODE_PULL,
                    source_address=address,
                    lease_id=lease,
                    lease_ttl_ms=30_000,
                    block_hashes=[b"h" * 16],
                )
            )
        return response

    async def release_lease(
        self, address: str, request: prefill_pb2.ReleaseLeaseRequest
    ) -> prefill_pb2.ReleaseLeaseResponse:
        self.released.append((address, request.lease_id, request.outcome))
        known = request.lease_id in self.leases
        self.leases.discard(request.lease_id)
        return prefill_pb2.ReleaseLeaseResponse(released=known)

    async def decode(
        self, address: str, request: decode_pb2.DecodeRequest
    ) -> AsyncGenerator[decode_pb2.DecodeResponse, None]:
        worker = address.split(":")[0]
        self.decodes.append((worker, request))
        if worker in self.dead:
            raise Unavailable("unreachable: connection refused")
        remote = request.WhichOneof("prefill") == "remote"
        tokens = [request.remote.first_token_id if remote else FIRST_TOKEN, *self.decode_tokens]
        resume = len(request.resume_token_ids)  # a migrated stream: continue as the unbroken one would
        assert list(request.resume_token_ids) == tokens[:resume]
        self.open_streams += 1
        try:
            for i, token in enumerate(tokens):
                if i < resume:
                    continue
                if self.hold_decode_at.get(worker) == i:
                    self.held.set()
                    await asyncio.Event().wait()
                if self.fail_decode_at.get(worker) == i:
                    raise Unavailable("unreachable: Socket closed")
                if i == 0 and remote:
                    self.leases.discard(request.remote.handoff.lease_id)  # pulled the KV and ACKed
                last = i == len(tokens) - 1
                yield decode_pb2.DecodeResponse(
                    offset=i,
                    token_ids=[token],
                    text=self.token_text(token),
                    final=decode_pb2.DecodeFinal(
                        finish_reason=sampling_pb2.FINISH_REASON_LENGTH,
                        usage=accounting_pb2.Usage(
                            prompt_tokens=len(request.prompt_token_ids), completion_tokens=len(tokens), cached_tokens=32
                        ),
                        timings=accounting_pb2.Timings(total_ns=3),
                        system_fingerprint=f"fp_{worker}",
                    )
                    if last
                    else None,
                )
        except (GeneratorExit, asyncio.CancelledError):
            self.cancelled.append(("decode", worker))
            raise
        finally:
            self.open_streams -= 1
