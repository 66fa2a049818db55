"""Entry point of the prefill service: ``python -m services.prefill.main`` / ``kvmesh prefill``."""

from __future__ import annotations

import asyncio
import contextlib

from kvmesh.api.adapter.v1 import adapter_pb2, adapter_pb2_grpc
from kvmesh.api.common.v1 import kv_pb2, worker_pb2
from kvmesh.api.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.flags import ENGINE_FLAGS, engine_config, model_path, served_model_name
from kvmesh.engine.metrics import EngineCollector
from kvmesh.engine.vllm_metrics import VllmEngineCollector
from kvmesh.runtime import Flag, GrpcService, ServiceContext, ServiceDef, run
from kvmesh.runtime.advertise import advertised_address
from kvmesh.runtime.counters import CountersCollector
from kvmesh.worker.adapters import AdapterServicer, load_startup_adapters
from kvmesh.worker.engine_link import attach_router
from kvmesh.worker.kv_transport import KV_TRANSPORT_FLAGS, open_endpoint, whole_block_endpoint
from kvmesh.worker.kvstore_client import KVStoreClient
from services.prefill.core import PrefillWorker
from services.prefill.server import PrefillServicer

FLAGS = [
    *ENGINE_FLAGS,
    *KV_TRANSPORT_FLAGS,
    Flag(
        "--lease-ttl-ms",
        "how long a KV hand-off waits for decode before its blocks are unpinned",
        default=30_000,
        type=int,
    ),
    Flag("--max-lease-ttl-ms", "the longest lease a request may ask for", default=300_000, type=int),
    Flag("--advertise-address", "host:port decode workers use to reach this worker (default: host:port)"),
]


def build(ctx: ServiceContext) -> ServiceDef:
    args = ctx.args
    address = advertised_address(args.host, args.port, args.advertise_address)
    state: dict = {}
    servicer = PrefillServicer(address)
    adapters = AdapterServicer()

    async def start() -> None:
        aengine = await AsyncEngine.started(lambda: LLMEngine(model_path(args), engine_config(args)), ctx.fail)
        engine = aengine.engine
        nixl = state["nixl"] = await asyncio.to_thread(open_endpoint, args, engine.kv, "prefill")
        kvstore = None
        if args.kvstore_address:
            kvstore = KVStoreClient(
                args.kvstore_address, nixl=whole_block_endpoint(nixl), layout=kv_pb2.KVLayout(**engine.kv_layout())
            )
        state["kvstore"] = kvstore
        worker = PrefillWorker(aengine, args.lease_ttl_ms, args.max_lease_ttl_ms, kvstore, nixl)
        servicer.attach(worker, engine.max_model_len, engine.model_config.vocab_size)
        ctx.registry.register(EngineCollector(engine))
        ctx.registry.register(VllmEngineCollector(engine, served_model_name(args)))
        ctx.registry.register(
            CountersCollector(
                "kvmesh_prefill",
                lambda: worker.counters,
                lambda: {"active_leases": (len(worker.leases), "KV hand-offs not yet released.")},
            )
        )
        state.update(engine=aengine, worker=worker, reaper=asyncio.create_task(worker.reap_expired_leases()))
        if nixl is not None:
            state["notifications"] = asyncio.create_task(worker.release_on_notifications())
        await load_startup_adapters(engine, args.lora)
        link = state["link"] = await attach_router(
            args, engine, worker_pb2.WORKER_ROLE_PREFILL, address, "prefill", ctx.registry
        )
        adapters.attach(engine, link.report if link is not None else None)

    async def drain() -> None:
        if state.get("link"):
            await state["link"].stop()  # leave routing first: no new requests arrive while draining

    async def stop() -> None:
        if "reaper" in state:
            for name in ("reaper", "notifications"):
                if name in state:
                    state[name].cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await state[name]
            await state["worker"].release_all()
        if state.get("kvstore"):
            await state["kvstore"].close()  # before the endpoint its transfers use
        if "reaper" in state:
            if state.get("nixl"):
                state["nixl"].close()
            state["engine"].stop()

    return ServiceDef(
        services=[
            GrpcService.of(adapter_pb2, adapter_pb2_grpc, "AdapterService", adapters),
            GrpcService.of(prefill_pb2, prefill_pb2_grpc, "PrefillService", servicer),
        ],
        start=start,
        drain=drain,
        stop=stop,
    )


def main() -> None:
    run("prefill", build, flags=FLAGS, default_port=50053, default_metrics_port=9103)


if __name__ == "__main__":
    main()
