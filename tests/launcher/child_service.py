"""A tiny real service process for the supervisor tests: gRPC health via the runtime, behaviour set by env.

``python -m tests.launcher.child_service`` with KVMESH_PORT etc., plus the
flags below (each also KVMESH_<NAME>).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.runtime import Flag, ServiceContext, ServiceDef, run

log = structlog.get_logger("child")

FLAGS = [
    Flag("--pid-file", "write this process's pid here once started"),
    Flag("--fail-at-start", "raise in the start hook, like a service whose model is missing", default=False, type=bool),
    Flag("--fail-at-start-if-exists", "fail like --fail-at-start while this file exists (a crash loop to be)"),
    Flag("--start-delay-s", "seconds the start hook takes", default=0.0, type=float),
    Flag("--require-serving", "host:port that must already be SERVING when this one starts"),
    Flag("--ignore-sigterm", "keep running on SIGTERM", default=False, type=bool),
    Flag("--grandchild-pid-file", "spawn a long sleep and write its pid here"),
]


async def _is_serving(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def build(ctx: ServiceContext) -> ServiceDef:
    args = ctx.args

    async def start() -> None:
        if args.pid_file:
            Path(args.pid_file).write_text(str(os.getpid()))
        if args.fail_at_start or (args.fail_at_start_if_exists and Path(args.fail_at_start_if_exists).exists()):
            raise RuntimeError("boom: the model folder is missing")
        if args.require_serving and not await _is_serving(args.require_serving):
            raise RuntimeError(f"{args.require_serving} is not serving yet")
        if args.grandchild_pid_file:
            sleeper = subprocess.Popen(["sleep", "1000"])
            Path(args.grandchild_pid_file).write_text(str(sleeper.pid))
        if args.ignore_sigterm:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        await asyncio.sleep(args.start_delay_s)
        log.info("child ready")

    return ServiceDef(services=[], start=start)


def main() -> None:
    run("child", build, flags=FLAGS, default_port=0, default_metrics_port=0)


if __name__ == "__main__":
    main()
