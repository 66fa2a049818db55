"""A whole service process the way every kvmesh ``services/<name>/main.py`` is written.

The shutdown tests run it as a subprocess: ``python -m tests.runtime.demo_service``.
"""

from __future__ import annotations

import structlog

from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.runtime import Flag, GrpcService, ServiceContext, ServiceDef, run
from tests.runtime.fakes import FakeKVStore

log = structlog.get_logger("demo")


def build(ctx: ServiceContext) -> ServiceDef:
    servicer = FakeKVStore()

    async def start() -> None:
        log.info("demo ready", greeting=ctx.args.greeting)

    async def stop() -> None:
        log.info("demo stop hook")

    return ServiceDef(
        services=[GrpcService.of(kvstore_pb2, kvstore_pb2_grpc, "KVStoreService", servicer)],
        start=start,
        stop=stop,
    )


def main() -> None:
    run(
        "demo",
        build,
        flags=[Flag("--greeting", "a required setting", required=True)],
        default_port=0,
        default_metrics_port=0,
    )


if __name__ == "__main__":
    main()
