"""The interceptor maps exceptions to status codes for every RPC kind, without leaking internals."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.api.common.v1 import kv_pb2
from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.api.speculator.v1 import speculator_pb2, speculator_pb2_grpc
from kvmesh.runtime import Runtime
from tests.runtime.fakes import SECRET


async def _lookup_error(stub: kvstore_pb2_grpc.KVStoreServiceStub, block_hash: bytes) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=[block_hash]))
    return info.value


async def test_unary_ok(kvstore_stub: kvstore_pb2_grpc.KVStoreServiceStub) -> None:
    resp = await kvstore_stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=[b"a", b"b"]))
    assert resp.num_present_prefix == 2


async def test_domain_error_maps_to_its_code_and_message(kvstore_stub: kvstore_pb2_grpc.KVStoreServiceStub) -> None:
    err = await _lookup_error(kvstore_stub, b"invalid")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "bad hash chain"
    err = await _lookup_error(kvstore_stub, b"missing")
    assert err.code() == grpc.StatusCode.NOT_FOUND


async def test_unexpected_error_is_internal_without_traceback(
    kvstore_stub: kvstore_pb2_grpc.KVStoreServiceStub, logs
) -> None:
    err = await _lookup_error(kvstore_stub, b"crash")
    assert err.code() == grpc.StatusCode.INTERNAL
    assert SECRET not in err.details() and "Traceback" not in err.details()
    assert err.details().startswith("internal error (request_id=")
    # ...but the server's log has the whole story.
    crash = [e for e in logs() if e["event"] == "rpc crashed"]
    assert len(crash) == 1 and SECRET in crash[0]["exception"] and "Traceback" in crash[0]["exception"]


async def test_servicer_abort_passes_through(kvstore_stub: kvstore_pb2_grpc.KVStoreServiceStub) -> None:
    err = await _lookup_error(kvstore_stub, b"abort")
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.details() == "denied by servicer"


async def test_server_streaming_error_after_some_responses(kvstore_stub: kvstore_pb2_grpc.KVStoreServiceStub) -> None:
    call = kvstore_stub.Get(kvstore_pb2.GetRequest(block_hashes=[b"a", b"b", b"missing"]))
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for resp in call:
            got.append(resp.missing_block_hash)
    assert got == [b"a", b"b"]
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "block gone"

    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in kvstore_stub.Get(kvstore_pb2.GetRequest(block_hashes=[b"crash"])):
            pass
    assert info.value.code() == grpc.StatusCode.INTERNAL and SECRET not in info.value.details()


async def test_client_streaming_error(kvstore_stub: kvstore_pb2_grpc.KVStoreServiceStub) -> None:
    def chunks(*hashes: bytes):  # type: ignore[no-untyped-def]
        return iter(kvstore_pb2.PutRequest(chunk=kv_pb2.KVBlockChunk(block_hash=h)) for h in hashes)

    assert (await kvstore_stub.Put(chunks(b"a", b"b"))).stored_blocks == 2
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await kvstore_stub.Put(chunks(b"a", b"invalid"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_bidi_streaming_ok_and_error(kvstore: Runtime) -> None:
    def update(rid: str) -> speculator_pb2.ProposeRequest:
        ctx = speculator_pb2.ContextUpdate(request_id=rid, token_ids=[5, 9], context_length=2, num_draft_tokens=3)
        return speculator_pb2.ProposeRequest(context=ctx)

    async with grpc.aio.insecure_channel(f"127.0.0.1:{kvstore.port}") as channel:
        stub = speculator_pb2_grpc.SpeculatorServiceStub(channel)
        replies = [r async for r in stub.Propose(iter([update("r1"), update("r2")]))]
        assert [(r.request_id, list(r.draft_token_ids)) for r in replies] == [("r1", [9, 9, 9]), ("r2", [9, 9, 9])]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Propose(iter([update("r1"), update("crash")])):
                pass
        assert info.value.code() == grpc.StatusCode.INTERNAL and SECRET not in info.value.details()


@pytest.mark.parametrize("method", ["Lookup", "Get", "Put"])
async def test_a_request_that_is_no_message_is_invalid_argument(kvstore: Runtime, method: str) -> None:
    """grpc's own deserializer would answer INTERNAL; bytes from the network are the caller's error."""
    garbage = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length-delimited, a length past the end
    path = f"/kvmesh.api.kvstore.v1.KVStoreService/{method}"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{kvstore.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            if method == "Lookup":
                await channel.unary_unary(path)(garbage)
            elif method == "Get":
                async for _ in channel.unary_stream(path)(garbage):
                    pass
            else:
                await channel.stream_unary(path)(iter([garbage]))
        stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
        assert (await stub.Stats(kvstore_pb2.StatsRequest())).ram_blocks == 7  # and it serves on
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid message of this method" in info.value.details()
