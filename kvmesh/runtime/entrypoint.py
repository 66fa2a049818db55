"""``run``: the whole life of a service process, for its ``main.py``.

Flags (with env twins) -> JSON logs -> uvloop -> serve until SIGTERM/SIGINT
-> graceful stop -> exit 0. A start-up failure exits 1; bad flags exit 2.
A second signal during the drain exits at once, for an operator who does not
want to wait out the grace period. A service that fails while serving
(``ServiceContext.fail``: its engine died) stops at once and exits 70, so its
supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

import structlog
import uvloop

from kvmesh.runtime.flags import Flag, common_flags, parse_flags
from kvmesh.runtime.logs import configure_logging
from kvmesh.runtime.server import Build, Runtime
from kvmesh.runtime.tls import TlsFiles, use_client_tls
from kvmesh.tracing import TraceSettings, start_tracing, stop_tracing

log = structlog.get_logger("kvmesh.runtime")

EXIT_FAILED = 70  # EX_SOFTWARE: the service failed while serving
# How long the stop after a failure may take before the process goes anyway.
FAILED_STOP_S = 1.5


def run(
    name: str,
    build: Build,
    *,
    flags: Sequence[Flag] = (),
    default_port: int,
    default_metrics_port: int,
    argv: Sequence[str] | None = None,
) -> NoReturn:
    """Parse flags, then serve ``build``'s service until a signal; never returns."""
    args = parse_flags(f"kvmesh-{name}", [*common_flags(default_port, default_metrics_port), *flags], argv)
    try:
        tls = TlsFiles.from_args(args)
        traces = TraceSettings.from_env(args.otlp_endpoint, args.trace_sample_ratio, os.environ)
    except ValueError as e:
        print(f"kvmesh-{name}: error: {e}", file=sys.stderr)
        sys.exit(2)  # like any other bad flag
    configure_logging(args.log_level)
    use_client_tls(tls)
    start_tracing(name, traces, getattr(args, "worker_id", None))
    try:
        code = uvloop.run(_serve_until_signal(name, build, args, tls))
    finally:
        stop_tracing()  # the spans still queued leave before the process does
    sys.exit(code)


async def _serve_until_signal(name: str, build: Build, args: argparse.Namespace, tls: TlsFiles | None) -> int:
    structlog.contextvars.bind_contextvars(service=name)
    runtime = Runtime(
        name,
        build,
        args,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        grace_seconds=args.grace_seconds,
        tls=tls,
    )
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig, stopping)

    # Start-up (model loading) can take minutes: a signal meanwhile cancels it.
    starting = asyncio.create_task(runtime.start())
    signalled = asyncio.create_task(stopping.wait())
    await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        log.info("stopped during start-up")
        return 0
    if starting.exception() is not None:
        log.error("start-up failed", exc_info=starting.exception())
        signalled.cancel()
        return 1
    failed = asyncio.create_task(runtime.failed.wait())
    await asyncio.wait({signalled, failed}, return_when=asyncio.FIRST_COMPLETED)
    if runtime.failure is not None:
        signalled.cancel()
        # Health says NOT_SERVING at once; the rest of shutdown gets a bound, then the process goes
        # anyway, so its supervisor (or Kubernetes) restarts it within seconds.
        try:
            await asyncio.wait_for(runtime.stop(grace_seconds=0), timeout=FAILED_STOP_S)
        except TimeoutError:
            log.error("shutdown after a failure outlasted its bound; exiting now", bound_s=FAILED_STOP_S)
        return EXIT_FAILED
    failed.cancel()
    await runtime.stop()
    return 0


def _on_signal(sig: signal.Signals, stopping: asyncio.Event) -> None:
    if stopping.is_set():
        log.warning("second signal: exiting without finishing the drain", signal=sig.name)
        os._exit(1)
    log.info("signal received: shutting down", signal=sig.name)
    stopping.set()
