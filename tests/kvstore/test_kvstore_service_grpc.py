"""The kvstore service over gRPC, started in-process with its real ``build``.

Blocks bigger than one message round-trip in chunks, bad streams are refused
without storing anything, the budget is enforced, the disk tier survives a
restart and a corrupted file is reported missing. The client's channel is
capped near 1 MiB per message, so any larger message on the wire fails a test.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.common.v1 import kv_pb2
from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.blocks import block_hashes
from kvmesh.checksum import checksum
from kvmesh.chunking import split
from kvmesh.runtime import Runtime, common_flags, parse_flags, serve
from services.kvstore.main import FLAGS, build

MiB = 1 << 20
# Enough for a 1 MiB chunk plus its descriptive fields and protobuf framing, far below 2 MiB.
WIRE_LIMIT = MiB + 4096


@dataclass(frozen=True)
class Blob:
    block_hash: bytes
    data: bytes
    shape: tuple[int, ...] = ()
    dtype: str = "uint8"

    def chunks(self, chunk_bytes: int = MiB) -> list[kv_pb2.KVBlockChunk]:
        shape = self.shape or (len(self.data),)
        return [
            kv_pb2.KVBlockChunk(
                block_hash=self.block_hash,
                chunk_index=c.index,
                num_chunks=c.count,
                total_bytes=c.total_bytes,
                shape=shape,
                dtype=self.dtype,
                checksum=checksum(self.data),
                data=c.data,
            )
            for c in split(self.data, chunk_bytes)
        ]


def blobs(sizes: Sequence[int], seed: int = 0) -> list[Blob]:
    chain = block_hashes(list(range(len(sizes) * 16)), 16, b"service-test", cache_salt=bytes([seed]))
    rng = random.Random(seed)
    return [Blob(h, rng.randbytes(n)) for h, n in zip(chain, sizes)]


def put_stream(chunks: Sequence[kv_pb2.KVBlockChunk]) -> Iterator[kvstore_pb2.PutRequest]:
    return (kvstore_pb2.PutRequest(chunk=c) for c in chunks)


@dataclass
class GetResult:
    blocks: dict[bytes, bytes]
    order: list[bytes]  # hashes as the stream named them: chunks' and missing ones'
    missing: list[bytes]
    summary: kvstore_pb2.GetSummary
    largest_chunk: int


async def get(
    stub: kvstore_pb2_grpc.KVStoreServiceStub, hashes: Sequence[bytes], max_chunk_bytes: int = 0
) -> GetResult:
    parts: dict[bytes, list[bytes]] = {}
    order: list[bytes] = []
    missing: list[bytes] = []
    summary = None
    largest = 0
    async for item in stub.Get(kvstore_pb2.GetRequest(block_hashes=hashes, max_chunk_bytes=max_chunk_bytes)):
        kind = item.WhichOneof("item")
        assert summary is None, "the summary comes last"
        if kind == "chunk":
            c = item.chunk
            if c.chunk_index == 0:
                order.append(c.block_hash)
                parts[c.block_hash] = []
            assert c.chunk_index == len(parts[c.block_hash]), "chunks of a block are consecutive"
            parts[c.block_hash].append(c.data)
            largest = max(largest, len(c.data))
        elif kind == "missing_block_hash":
            order.append(item.missing_block_hash)
            missing.append(item.missing_block_hash)
        else:
            summary = item.summary
    assert summary is not None
    blocks = {h: b"".join(p) for h, p in parts.items()}
    return GetResult(blocks, order, missing, summary, largest)


@asynccontextmanager
async def kvstore(*argv: str) -> AsyncIterator[tuple[Runtime, kvstore_pb2_grpc.KVStoreServiceStub]]:
    args = parse_flags("kvmesh-kvstore", [*common_flags(0, 0), *FLAGS], ["--port", "0", *argv], environ={})
    async with serve("kvstore", build, args) as rt:
        options = [("grpc.max_receive_message_length", WIRE_LIMIT), ("grpc.max_send_message_length", WIRE_LIMIT)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}", options=options) as channel:
            yield rt, kvstore_pb2_grpc.KVStoreServiceStub(channel)


async def expect_error(code: grpc.StatusCode, call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value.details()
    return err.value.details()


async def test_blocks_bigger_than_a_message_round_trip_in_chunks() -> None:
    a, b, c = blobs([int(3.5 * MiB), 10, 2 * MiB])
    (absent,) = blobs([1], seed=9)
    async with kvstore() as (_, stub):
        resp = await stub.Put(put_stream(a.chunks() + b.chunks() + c.chunks()))
        assert (resp.stored_blocks, resp.already_present_blocks, resp.evicted_blocks) == (3, 0, 0)
        assert resp.timings.total_ns > 0

        got = await get(stub, [a.block_hash, absent.block_hash, b.block_hash, c.block_hash])
        assert got.blocks == {a.block_hash: a.data, b.block_hash: b.data, c.block_hash: c.data}
        assert got.order == [a.block_hash, absent.block_hash, b.block_hash, c.block_hash]  # request order
        assert got.missing == [absent.block_hash]
        assert (got.summary.found_blocks, got.summary.missing_blocks) == (3, 1)
        assert got.summary.timings.total_ns > 0
        assert got.largest_chunk == MiB

        # A client may ask for smaller chunks, never for bigger ones than 1 MiB.
        small = await get(stub, [a.block_hash], max_chunk_bytes=300_000)
        assert small.blocks[a.block_hash] == a.data and small.largest_chunk == 300_000
        big = await get(stub, [a.block_hash], max_chunk_bytes=8 * MiB)
        assert big.blocks[a.block_hash] == a.data and big.largest_chunk == MiB

        # The same blocks again: counted, not rewritten.
        again = await stub.Put(put_stream(a.chunks(chunk_bytes=700_000)))
        assert (again.stored_blocks, again.already_present_blocks) == (0, 1)


async def test_lookup_delete_and_stats() -> None:
    chain = blobs([1000, 1000, 1000, 1000])
    async with kvstore("--ram-budget-bytes", "10000") as (_, stub):
        await stub.Put(put_stream([c for blob in chain[:3] for c in blob.chunks()]))
        hashes = [blob.block_hash for blob in chain]
        assert (await stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=hashes))).num_present_prefix == 3

        deleted = await stub.Delete(kvstore_pb2.DeleteRequest(block_hashes=[hashes[1], hashes[3]]))
        assert deleted.deleted_blocks == 1
        lookup = await stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=hashes))
        assert lookup.num_present_prefix == 1 and lookup.timings.total_ns > 0

        await get(stub, hashes[:2])  # one hit, one miss
        stats = await stub.Stats(kvstore_pb2.StatsRequest())
        assert (stats.ram_blocks, stats.ram_bytes, stats.ram_budget_bytes) == (2, 2000, 10000)
        assert (stats.disk_blocks, stats.disk_budget_bytes) == (0, 0)
        assert (stats.hits, stats.misses, stats.evictions, stats.corrupt_blocks) == (1, 1, 0, 0)

        bad_hash = kvstore_pb2.LookupRequest(block_hashes=[b"short"])
        assert "16 bytes" in await expect_error(grpc.StatusCode.INVALID_ARGUMENT, stub.Lookup(bad_hash))
        bad_get = get(stub, [hashes[0], b"short"])  # refused before any block is streamed
        assert "16 bytes" in await expect_error(grpc.StatusCode.INVALID_ARGUMENT, bad_get)


def _corrupted(blob: Blob) -> list[kv_pb2.KVBlockChunk]:
    chunks = blob.chunks()
    flipped = bytearray(chunks[1].data)
    flipped[123] ^= 0x40
    chunks[1].data = bytes(flipped)
    return chunks


def _inconsistent(blob: Blob) -> list[kv_pb2.KVBlockChunk]:
    chunks = blob.chunks()
    chunks[2].dtype = "float16"
    return chunks


@pytest.mark.parametrize(
    ("make_stream", "message"),
    [
        (lambda blob, other: blob.chunks()[:-1], "end of the stream"),  # truncated: the last chunk never came
        (lambda blob, other: blob.chunks()[:2] + other.chunks(), "another block"),  # cut off mid-block
        (lambda blob, other: _corrupted(blob), "checksum mismatch"),
        (lambda blob, other: _inconsistent(blob), "disagrees"),
        (lambda blob, other: blob.chunks()[:1] + blob.chunks()[2:], "arrived where chunk 1 was due"),
    ],
    ids=["truncated", "cut-off", "corrupted", "inconsistent", "out-of-order"],
)
async def test_a_bad_chunk_stream_is_refused_and_stores_nothing(make_stream, message: str) -> None:
    blob, other = blobs([int(3.5 * MiB), 100])
    async with kvstore() as (_, stub):
        details = await expect_error(grpc.StatusCode.INVALID_ARGUMENT, stub.Put(put_stream(make_stream(blob, other))))
        assert message in details
        stats = await stub.Stats(kvstore_pb2.StatsRequest())
        assert (stats.ram_blocks, stats.ram_bytes) == (0, 0)
        assert (await get(stub, [blob.block_hash])).missing == [blob.block_hash]


async def test_verified_blocks_before_a_bad_one_are_kept() -> None:
    good, bad = blobs([2 * MiB, 2 * MiB])
    async with kvstore() as (_, stub):
        await expect_error(grpc.StatusCode.INVALID_ARGUMENT, stub.Put(put_stream(good.chunks() + _corrupted(bad))))
        got = await get(stub, [good.block_hash, bad.block_hash])
        assert got.blocks == {good.block_hash: good.data} and got.missing == [bad.block_hash]


async def test_one_block_over_the_budget_is_refused_a_full_store_evicts() -> None:
    (huge,) = blobs([3 * MiB])
    fits = blobs([MiB, MiB, MiB], seed=1)
    async with kvstore("--ram-budget-bytes", str(2 * MiB + 10)) as (_, stub):
        details = await expect_error(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Put(put_stream(huge.chunks())))
        assert "exceeds" in details
        assert (await stub.Stats(kvstore_pb2.StatsRequest())).ram_blocks == 0

        resp = await stub.Put(put_stream([c for blob in fits for c in blob.chunks()]))
        assert (resp.stored_blocks, resp.evicted_blocks) == (3, 1)
        got = await get(stub, [blob.block_hash for blob in fits])
        assert got.missing == [fits[0].block_hash]  # the least recently used went


async def test_concurrent_puts_of_the_same_block_are_idempotent(tmp_path: Path) -> None:
    (blob,) = blobs([int(2.5 * MiB)])
    disk = ["--disk-dir", str(tmp_path / "blocks"), "--disk-budget-bytes", str(64 * MiB)]
    async with kvstore(*disk) as (_, stub):
        responses = await asyncio.gather(*(stub.Put(put_stream(blob.chunks())) for _ in range(8)))
        assert sum(r.stored_blocks for r in responses) == 1
        assert sum(r.already_present_blocks for r in responses) == 7
        stats = await stub.Stats(kvstore_pb2.StatsRequest())
        assert (stats.ram_blocks, stats.disk_blocks, stats.disk_bytes) == (1, 1, len(blob.data))
        assert (await get(stub, [blob.block_hash])).blocks == {blob.block_hash: blob.data}
    assert len(list((tmp_path / "blocks").rglob("*.kvb"))) == 1
    assert not list((tmp_path / "blocks").rglob("*.tmp"))


async def test_restart_with_a_disk_tier_keeps_blocks(tmp_path: Path) -> None:
    stored = blobs([int(1.5 * MiB), 4000, MiB])
    disk = ["--disk-dir", str(tmp_path / "blocks"), "--disk-budget-bytes", str(64 * MiB)]
    async with kvstore(*disk) as (_, stub):
        await stub.Put(put_stream([c for blob in stored for c in blob.chunks()]))

    async with kvstore(*disk) as (_, stub):
        stats = await stub.Stats(kvstore_pb2.StatsRequest())
        assert (stats.ram_blocks, stats.disk_blocks) == (0, 3)
        got = await get(stub, [blob.block_hash for blob in stored])
        assert got.blocks == {blob.block_hash: blob.data for blob in stored}
        assert (await stub.Stats(kvstore_pb2.StatsRequest())).hits == 3


async def test_a_corrupted_file_on_disk_is_reported_missing(tmp_path: Path) -> None:
    intact, damaged = blobs([MiB, MiB])
    disk = ["--disk-dir", str(tmp_path / "blocks"), "--disk-budget-bytes", str(64 * MiB)]
    async with kvstore(*disk) as (_, stub):
        await stub.Put(put_stream(intact.chunks() + damaged.chunks()))

    name = damaged.block_hash.hex()
    path = tmp_path / "blocks" / name[:2] / f"{name}.kvb"
    raw = bytearray(path.read_bytes())
    raw[-1000] ^= 0x01  # a bit flip in the payload: the header (and the startup scan) still look fine
    path.write_bytes(bytes(raw))

    async with kvstore(*disk) as (_, stub):
        hashes = [intact.block_hash, damaged.block_hash]
        assert (await stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=hashes))).num_present_prefix == 2
        got = await get(stub, hashes)
        assert got.blocks == {intact.block_hash: intact.data} and got.missing == [damaged.block_hash]
        stats = await stub.Stats(kvstore_pb2.StatsRequest())
        assert (stats.corrupt_blocks, stats.disk_blocks) == (1, 1)
        assert (await stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=hashes[::-1]))).num_present_prefix == 0
    assert not path.exists()


async def test_health_and_metrics() -> None:
    (blob,) = blobs([5000])
    async with kvstore() as (rt, stub):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        await stub.Put(put_stream(blob.chunks()))
        await get(stub, [blob.block_hash])

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{rt.metrics_port}/metrics", timeout=5) as r:
                return r.read().decode()

        text = await asyncio.to_thread(scrape)
        assert 'kvmesh_kvstore_blocks{tier="ram"} 1.0' in text
        assert 'kvmesh_kvstore_bytes{tier="ram"} 5000.0' in text
        assert 'kvmesh_kvstore_hits_total{tier="ram"} 1.0' in text
        assert "kvmesh_kvstore_misses_total 0.0" in text
        assert "kvmesh_kvstore_corrupt_blocks_total 0.0" in text
        assert "kvmesh_router_link" not in text  # no --router-address: no link


async def test_chunks_over_one_mib_are_refused() -> None:
    (blob,) = blobs([3 * MiB])
    async with kvstore() as (rt, _):
        # A plain channel (16 MiB cap) can send the oversized chunk; the server refuses it.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rt.port}") as channel:
            stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
            details = await expect_error(grpc.StatusCode.INVALID_ARGUMENT, stub.Put(put_stream(blob.chunks(2 * MiB))))
            assert "over the 1048576-byte limit" in details
            assert (await stub.Stats(kvstore_pb2.StatsRequest())).ram_blocks == 0
