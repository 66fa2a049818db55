from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import pytest

from kvmesh.api.kvstore.v1 import kvstore_pb2_grpc
from kvmesh.runtime import Runtime, configure_logging, serve
from tests.runtime.fakes import build_kvstore


@pytest.fixture
def logs() -> Iterator[Callable[[], list[dict]]]:
    """JSON log lines written so far, parsed."""
    buf = io.StringIO()
    configure_logging("debug", stream=buf)
    yield lambda: [json.loads(line) for line in buf.getvalue().splitlines()]
    configure_logging("info")


@pytest.fixture
async def kvstore() -> AsyncIterator[Runtime]:
    async with serve("kvstore", build_kvstore) as rt:
        yield rt


@pytest.fixture
async def kvstore_stub(kvstore: Runtime) -> AsyncIterator[kvstore_pb2_grpc.KVStoreServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{kvstore.port}") as channel:
        yield kvstore_pb2_grpc.KVStoreServiceStub(channel)
