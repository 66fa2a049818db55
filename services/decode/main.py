"""Entry point of the decode service: ``python -m services.decode.main`` / ``kvmesh decode``."""

from __future__ import annotations

import asyncio

from kvmesh.api.adapter.v1 import adapter_pb2, adapter_pb2_grpc
from kvmesh.api.common.v1 import kv_pb2, worker_pb2
from kvmesh.api.decode.v1 import decode_pb2, decode_pb2_grpc
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.flags import COMPILE_FLAG, ENGINE_FLAGS, engine_config, model_path, served_model_name
from kvmesh.engine.metrics import EngineCollector
from kvmesh.engine.vllm_metrics import VllmEngineCollector
from kvmesh.runtime import Flag, GrpcService, ServiceContext, ServiceDef, run
from kvmesh.runtime.advertise import advertised_address
from kvmesh.runtime.counters import CountersCollector
from kvmesh.speculation.draft_length import parse_draft_costs
from kvmesh.speculation.drafter import Drafter
from kvmesh.speculation.eagle import EagleProposer, RemoteWithHead
from kvmesh.speculation.local import LocalProposer
from kvmesh.speculation.metrics import SpeculatorCollector
from kvmesh.worker.adapters import AdapterServicer, load_startup_adapters
from kvmesh.worker.engine_link import attach_router
from kvmesh.worker.kv_transport import KV_TRANSPORT_FLAGS, open_endpoint, whole_block_endpoint
from kvmesh.worker.kvstore_client import KVStoreClient
from services.decode.core import DecodeWorker
from services.decode.nixl_source import NixlKVSource
from services.decode.prefill_client import GrpcKVSource
from services.decode.server import DecodeServicer
from services.speculator.client import SpeculatorProposer

FLAGS = [
    *ENGINE_FLAGS,
    COMPILE_FLAG,
    *KV_TRANSPORT_FLAGS,
    Flag("--advertise-address", "host:port the gateway uses to reach this worker (default: host:port)"),
    Flag("--speculator-address", "speculator host:port (unset: drafts from an in-process prompt lookup)"),
    Flag("--num-speculative-tokens", "draft tokens verified per decode step (0: no speculation)", default=0, type=int),
    Flag(
        "--draft-costs",
        "a verify of 1,2,... drafts in decode steps' time, comma-separated: sequences whose "
        "drafts miss get fewer ('free': always the full count; default: measured on CPU, free elsewhere)",
    ),
    Flag(
        "--kv-pull-timeout-seconds",
        "deadline of pulling a prompt's KV from a prefill worker (past it, decode computes what did not arrive)",
        default=60.0,
        type=float,
    ),
    Flag(
        "--spec-budget-ms",
        "how long a decode step waits for drafts before running without them",
        default=5.0,
        type=float,
    ),
    Flag(
        "--eagle-head",
        "EAGLE head folder for this target (kvmesh train-speculator), run in this process "
        "beside the target; merged with the n-gram drafts (unset: none)",
    ),
]


def build(ctx: ServiceContext) -> ServiceDef:
    args = ctx.args
    address = advertised_address(args.host, args.port, args.advertise_address)
    servicer = DecodeServicer()
    adapters = AdapterServicer()
    grpc_source = GrpcKVSource(pull_timeout_s=args.kv_pull_timeout_seconds)
    state: dict = {}

    async def start() -> None:
        config = engine_config(args)
        proposer = None
        if args.num_speculative_tokens:
            head = EagleProposer(args.eagle_head) if args.eagle_head else None
            if args.speculator_address:
                remote = SpeculatorProposer(
                    args.speculator_address, budget_ms=args.spec_budget_ms, registry=ctx.registry
                )
                await remote.start()  # connects (and reconnects) in the background
                state["proposer"] = remote
                proposer = remote if head is None else RemoteWithHead(remote, head)
            else:
                proposer = LocalProposer(head=head)
                ctx.registry.register(SpeculatorCollector(proposer.speculator))
        drafter = None
        if proposer is not None:
            drafter = Drafter(proposer, args.num_speculative_tokens, parse_draft_costs(args.draft_costs))
        aengine = await AsyncEngine.started(lambda: LLMEngine(model_path(args), config, drafter=drafter), ctx.fail)
        engine = aengine.engine
        endpoints = await asyncio.to_thread(open_endpoint, args, engine.kv, "decode")
        layout = kv_pb2.KVLayout(**engine.kv_layout())
        kvstore = None
        if args.kvstore_address:
            kvstore = KVStoreClient(args.kvstore_address, nixl=whole_block_endpoint(endpoints), layout=layout)
        state["kvstore"] = kvstore
        kv_source = grpc_source
        if endpoints is not None:
            kv_source = state["nixl_source"] = NixlKVSource(endpoints, layout, grpc_source, args.kv_read_timeout_s)
        worker = DecodeWorker(aengine, kv_source, kvstore)
        servicer.attach(worker, engine.max_model_len, engine.model_config.vocab_size, engine.system_fingerprint)
        ctx.registry.register(EngineCollector(engine))
        ctx.registry.register(VllmEngineCollector(engine, served_model_name(args)))
        ctx.registry.register(
            CountersCollector(
                "kvmesh_decode",
                lambda: worker.counters,
                lambda: {"active_requests": (worker.counters.active_requests, "Decode streams open.")},
                skip=frozenset({"active_requests"}),
            )
        )
        state["engine"] = aengine
        await load_startup_adapters(engine, args.lora)
        link = state["link"] = await attach_router(
            args, engine, worker_pb2.WORKER_ROLE_DECODE, address, "decode", ctx.registry
        )
        adapters.attach(engine, link.report if link is not None else None)

    async def drain() -> None:
        if state.get("link"):
            await state["link"].stop()  # leave routing first; in-flight streams finish during the grace period

    async def stop() -> None:
        if state.get("kvstore"):
            await state["kvstore"].close()  # before the endpoint its transfers use
        if "nixl_source" in state:
            await state["nixl_source"].close()
        await grpc_source.close()
        if "engine" in state:
            state["engine"].stop()  # first, so the engine thread stops asking for drafts
        if "proposer" in state:
            await state["proposer"].close()

    return ServiceDef(
        services=[
            GrpcService.of(adapter_pb2, adapter_pb2_grpc, "AdapterService", adapters),
            GrpcService.of(decode_pb2, decode_pb2_grpc, "DecodeService", servicer),
        ],
        start=start,
        drain=drain,
        stop=stop,
    )


def main() -> None:
    run("decode", build, flags=FLAGS, default_port=50054, default_metrics_port=9104)


if __name__ == "__main__":
    main()
