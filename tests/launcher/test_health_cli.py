"""``kvmesh health``, the container health check: exit 0 only when the service says SERVING."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from kvmesh.launcher.health_cli import add_health_parser, default_address
from kvmesh.runtime import Runtime, ServiceContext, ServiceDef
from kvmesh.runtime.ports import free_port
from tests.runtime.fakes import build_kvstore


def _health(argv: list[str], capsys) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="kvmesh")
    add_health_parser(parser.add_subparsers())
    args = parser.parse_args(["health", *argv])
    code = args.func(args)
    out = capsys.readouterr()
    said = [line for line in (out.out + out.err).splitlines() if line.startswith(("127.0.0.1", "kvmesh health"))]
    return code, said[-1] if said else ""


async def test_serving_not_serving_and_unknown_services(capsys) -> None:
    may_start = asyncio.Event()

    def build(ctx: ServiceContext) -> ServiceDef:
        return ServiceDef(services=build_kvstore(ctx).services, start=may_start.wait)

    runtime = Runtime("kvstore", build, metrics_port=None, grace_seconds=1)
    starting = asyncio.create_task(runtime.start())
    try:
        while not runtime.port:
            await asyncio.sleep(0.01)
        address = f"127.0.0.1:{runtime.port}"
        # Listening but still starting (loading a model): unhealthy.
        assert await asyncio.to_thread(_health, ["--address", address], capsys) == (1, f"{address}: NOT_SERVING")

        may_start.set()
        await starting
        assert await asyncio.to_thread(_health, ["--address", address], capsys) == (0, f"{address}: SERVING")
        code, _ = await asyncio.to_thread(
            _health, ["--address", address, "--service", "kvmesh.api.kvstore.v1.KVStoreService"], capsys
        )
        assert code == 0
        code, said = await asyncio.to_thread(_health, ["--address", address, "--service", "no.such.Service"], capsys)
        assert code == 1 and "NOT_FOUND" in said
    finally:
        may_start.set()
        await starting
        await runtime.stop()


def test_nobody_listening_is_unhealthy(capsys) -> None:
    code, said = _health(["--address", f"127.0.0.1:{free_port()}", "--timeout", "1"], capsys)
    assert code == 1 and ("UNAVAILABLE" in said or "DEADLINE_EXCEEDED" in said)


def test_nothing_to_check_is_a_usage_error(capsys, monkeypatch) -> None:
    monkeypatch.delenv("KVMESH_PORT", raising=False)
    code, said = _health([], capsys)
    assert code == 2 and "give --address host:port or set KVMESH_PORT" in said


@pytest.mark.parametrize(
    ("environ", "address"),
    [
        ({"KVMESH_PORT": "50052", "KVMESH_HOST": "0.0.0.0"}, "127.0.0.1:50052"),  # the container's own service
        ({"KVMESH_PORT": "50052"}, "127.0.0.1:50052"),
        ({"KVMESH_PORT": "50052", "KVMESH_HOST": "10.0.0.7"}, "10.0.0.7:50052"),
        ({"KVMESH_PORT": "50052", "KVMESH_HOST": "::1"}, "[::1]:50052"),
        ({"KVMESH_HOST": "0.0.0.0"}, None),
    ],
)
def test_the_default_address_is_the_hosts_own_service(environ, address) -> None:
    assert default_address(environ) == address
