"""Graceful stop: in-flight streams finish, new calls are refused; a real process exits 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import grpc
import pytest

from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.runtime import Runtime, serve
from tests.runtime.demo_process import log_until, spawn_demo
from tests.runtime.fakes import build_kvstore


async def _read_all(call: grpc.aio.UnaryStreamCall) -> list:
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


async def test_graceful_stop_lets_an_in_flight_stream_finish() -> None:
    async with serve("kvstore", build_kvstore, metrics_port=None, grace_seconds=5) as rt:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as channel:
            stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
            call = stub.Get(kvstore_pb2.GetRequest(block_hashes=[b"a", b"slow", b"slow", b"b"]))
            first = await call.read()
            assert first.missing_block_hash == b"a"
            stopping = asyncio.create_task(rt.stop())
            rest = await _read_all(call)
            assert [r.missing_block_hash for r in rest[:-1]] == [b"slow", b"slow", b"b"]
            assert rest[-1].summary.missing_blocks == 4
            assert await call.code() == grpc.StatusCode.OK
            await stopping
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Stats(kvstore_pb2.StatsRequest(), timeout=2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_grace_period_bounds_the_drain() -> None:
    rt = Runtime("kvstore", build_kvstore, metrics_port=None)
    await rt.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as channel:
        call = kvstore_pb2_grpc.KVStoreServiceStub(channel).Get(kvstore_pb2.GetRequest(block_hashes=[b"slow"] * 50))
        await call.read()
        loop = asyncio.get_running_loop()
        began = loop.time()
        await rt.stop(grace_seconds=0.2)
        assert loop.time() - began < 2
        with pytest.raises(grpc.aio.AioRpcError):
            await _read_all(call)


async def _read_event(stream: asyncio.StreamReader, event: str) -> dict:
    return (await log_until(stream, event))[-1]


async def test_sigterm_drains_and_exits_0() -> None:
    proc = await spawn_demo("--log-level", "debug", env={**os.environ, "KVMESH_GREETING": "hello"})
    try:
        assert proc.stderr is not None
        assert (await _read_event(proc.stderr, "demo ready"))["greeting"] == "hello"
        serving = await _read_event(proc.stderr, "serving")
        assert serving["service"] == "demo"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{serving['port']}") as channel:
            stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
            call = stub.Get(
                kvstore_pb2.GetRequest(block_hashes=[b"a", b"slow", b"slow"]), metadata=(("x-request-id", "sig-1"),)
            )
            await call.read()
            proc.send_signal(signal.SIGTERM)
            assert len(await _read_all(call)) == 3  # two blocks and the summary
            assert await call.code() == grpc.StatusCode.OK
        await _read_event(proc.stderr, "demo stop hook")
        assert (await _read_event(proc.stderr, "stopped"))["service"] == "demo"
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_missing_required_flag_exits_2() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVMESH_GREETING"}
    proc = await spawn_demo(env=env)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 2
    assert "missing required --greeting (or set KVMESH_GREETING)" in err.decode()


async def test_start_failure_exits_1(kvstore: Runtime) -> None:
    # The port is taken (SO_REUSEPORT is off, so the bind fails instead of sharing it).
    proc = await spawn_demo("--greeting", "hi", "--port", str(kvstore.port), env=os.environ)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 1
    failed = [
        json.loads(line) for line in err.decode().splitlines() if line.startswith("{") and "start-up failed" in line
    ]
    assert failed and "Failed to bind" in failed[0]["exception"]
