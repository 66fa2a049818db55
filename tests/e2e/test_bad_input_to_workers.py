"""A worker's gRPC port is reachable without the gateway: what reaches it straight is checked as strictly.

Bad sampling settings sent straight to the decode worker, while streams through the gateway run on it,
each get INVALID_ARGUMENT naming the field (in the message and the ``kvmesh-field`` trailer); the other
streams finish with the tokens they would have had alone, and the worker serves on.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from google.protobuf.internal.encoder import _VarintBytes

from kvmesh.api.common.v1 import kv_pb2, sampling_pb2
from kvmesh.api.decode.v1 import decode_pb2, decode_pb2_grpc
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.api.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from kvmesh.runtime import create_channel
from kvmesh.runtime.interceptor import FIELD_KEY
from tests.e2e.test_mesh import generate, local_greedy
from tests.engine.conftest import VOCAB

pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(40, 60))
DECODE_METHOD = "/kvmesh.api.decode.v1.DecodeService/Decode"


def _request(**sampling: object) -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(
        request_id="bad",
        prompt_token_ids=PROMPT,
        sampling=sampling_pb2.SamplingParams(max_tokens=4, **sampling),
        local=decode_pb2.LocalPrefill(),
    )


def _max_tokens_minus_one() -> bytes:
    """max_tokens = -1 as a client with a signed int would put it on the wire (a 64-bit varint): the
    uint32 field reads it as 2**32 - 1. Python's protobuf refuses to build it, so the bytes are written."""
    request = _request()
    request.sampling.max_tokens = 0
    sampling = request.sampling.SerializeToString() + b"\x30" + _VarintBytes(2**64 - 1)  # field 6, varint
    request.ClearField("sampling")
    return request.SerializeToString() + b"\x1a" + _VarintBytes(len(sampling)) + sampling  # field 3


BAD = [
    ("temperature NaN", _request(temperature=math.nan).SerializeToString(), "sampling.temperature"),
    ("temperature inf", _request(temperature=math.inf).SerializeToString(), "sampling.temperature"),
    ("temperature -0.0", _request(temperature=-0.0).SerializeToString(), "sampling.temperature"),
    # A float32 field: 1e308 arrives as inf, which is refused like any value outside [0, 2].
    ("temperature 1e308", _request(temperature=1e308).SerializeToString(), "sampling.temperature"),
    ("top_p NaN", _request(top_p=math.nan).SerializeToString(), "sampling.top_p"),
    ("max_tokens -1", _max_tokens_minus_one(), "sampling.max_tokens"),
]


async def test_bad_settings_straight_to_decode_are_refused_and_other_streams_finish(mesh, gateway, e2e_model):
    assert decode_pb2.DecodeRequest.FromString(_max_tokens_minus_one()).sampling.max_tokens == 2**32 - 1
    prompts = [list(range(70 + 7 * i, 100 + 7 * i)) for i in range(3)]
    expected = local_greedy(e2e_model, prompts, 48)

    async with create_channel(mesh.address("decode-0"), mesh.identity("gateway")) as channel:
        raw = channel.unary_stream(DECODE_METHOD, response_deserializer=decode_pb2.DecodeResponse.FromString)
        streams = [asyncio.create_task(generate(gateway, p, 48)) for p in prompts]
        for name, body, field in BAD:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in raw(body, metadata=(("x-request-id", f"bad-{name}"),)):
                    pass
            err = info.value
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.details())
            assert dict(err.trailing_metadata()).get(FIELD_KEY) == field, (name, err.details())
            assert field in err.details(), (name, err.details())
        done = await asyncio.gather(*streams)

        assert [tokens for tokens, _ in done] == expected  # unharmed: the tokens they have alone
        assert all(final.finish_reason == sampling_pb2.FINISH_REASON_LENGTH for _, final in done)
        # The worker serves on: a good request straight to it, and one through the gateway.
        ok = decode_pb2_grpc.DecodeServiceStub(channel).Decode(_request(temperature=0.0))
        tokens = [t async for msg in ok for t in msg.token_ids]
        assert len(tokens) == 4
    assert (await generate(gateway, PROMPT, 8))[0] == local_greedy(e2e_model, [PROMPT], 8)[0]


async def test_the_gateway_answers_the_same_settings_with_the_same_field(gateway):
    for name, body, field in BAD:
        sampling = decode_pb2.DecodeRequest.FromString(body).sampling
        request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=PROMPT), sampling=sampling)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in gateway.Generate(request):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, info.value.details())
        assert field in info.value.details(), (name, info.value.details())


def _decode(prompt: list[int], max_tokens: int = 4, **fields: object) -> decode_pb2.DecodeRequest:
    fields.setdefault("sampling", sampling_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return decode_pb2.DecodeRequest(request_id="edge", prompt_token_ids=prompt, **fields)


async def _refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    return info.value


async def test_each_bad_request_straight_to_a_worker_is_refused_and_the_next_one_served(mesh, e2e_model):
    """The boundary cases of the internal APIs, each followed by a normal request on the same worker."""
    vocab, context = VOCAB, 512  # tests.e2e.mesh_helpers.write_model's
    local = decode_pb2.LocalPrefill()
    block = kv_pb2.KVBlockChunk(block_hash=b"\x07" * 16, num_chunks=1, total_bytes=4, data=b"abcd")
    cases = {
        "min_p NaN": ("decode", _decode(PROMPT, local=local, sampling=sampling_pb2.SamplingParams(min_p=math.nan))),
        "token past the vocabulary": ("decode", _decode([*PROMPT, vocab], local=local)),
        "empty prompt": ("decode", _decode([], local=local)),
        "prompt of context + 1": ("decode", _decode(list(range(1, context + 2)), local=local)),
        "resume longer than max_tokens": ("decode", _decode(PROMPT, 4, local=local, resume_token_ids=[5] * 6)),
        "put of a wrong size": ("kvstore", kv_pb2.KVBlockChunk(**_fields(block, total_bytes=8))),
        "put of a wrong checksum": ("kvstore", kv_pb2.KVBlockChunk(**_fields(block, checksum=b"\x00\x00\x00\x00"))),
        "pull of an unknown lease": ("prefill", prefill_pb2.PullKVRequest(lease_id="no-such-lease")),
        "unnamed decode request": ("decode", decode_pb2.DecodeRequest(prompt_token_ids=PROMPT, local=local)),
    }
    expected = local_greedy(e2e_model, [PROMPT], 4)[0]
    async with (
        create_channel(mesh.address("decode-0"), mesh.identity("gateway")) as dch,
        # Each method as the role the mesh lets call it (kvmesh.runtime.authz).
        create_channel(mesh.address("prefill-0"), mesh.identity("decode")) as pch,
        create_channel(mesh.address("prefill-0"), mesh.identity("gateway")) as gpch,
        create_channel(mesh.address("kvstore"), mesh.identity("decode")) as kch,
        create_channel(mesh.address("kvstore"), mesh.identity("operator")) as och,
    ):
        decode = decode_pb2_grpc.DecodeServiceStub(dch)
        puller = prefill_pb2_grpc.PrefillServiceStub(pch)
        prefill = prefill_pb2_grpc.PrefillServiceStub(gpch)
        kvstore = kvstore_pb2_grpc.KVStoreServiceStub(kch)
        kvstore_stats = kvstore_pb2_grpc.KVStoreServiceStub(och).Stats
        for name, (service, request) in cases.items():
            if service == "decode":
                err = await _refused(decode.Decode(request))
                answered = [t async for m in decode.Decode(_decode(PROMPT, local=local)) for t in m.token_ids]
                assert answered == expected, name
            elif service == "kvstore":
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await kvstore.Put(iter([kvstore_pb2.PutRequest(chunk=request)]))
                err = info.value
                assert (await kvstore_stats(kvstore_pb2.StatsRequest())) is not None, name
            else:
                err = await _refused(puller.PullKV(request))
                greedy = sampling_pb2.SamplingParams(temperature=0.0, max_tokens=4)
                ok = await prefill.Prefill(
                    prefill_pb2.PrefillRequest(request_id="ok", token_ids=PROMPT, sampling=greedy)
                )
                assert ok.first_token_id == expected[0], name
                await prefill.ReleaseLease(prefill_pb2.ReleaseLeaseRequest(lease_id=ok.handoff.lease_id))
            wanted = grpc.StatusCode.NOT_FOUND if "unknown lease" in name else grpc.StatusCode.INVALID_ARGUMENT
            assert err.code() == wanted, (name, err.code(), err.details())


def _fields(chunk: kv_pb2.KVBlockChunk, **changed: object) -> dict:
    return {f.name: getattr(chunk, f.name) for f, _ in chunk.ListFields()} | changed


async def test_a_nixl_descriptor_outside_the_prefill_pool_is_refused(mesh, e2e_model):
    """A hand-off whose NIXL block ids point past the prefill worker's pool: refused before any READ."""
    async with (
        create_channel(mesh.address("decode-0"), mesh.identity("gateway")) as dch,
        create_channel(mesh.address("prefill-0"), mesh.identity("gateway")) as pch,
    ):
        prefill = prefill_pb2_grpc.PrefillServiceStub(pch)
        prompt = list(range(100, 140))
        sampling = sampling_pb2.SamplingParams(temperature=0.0, max_tokens=4)
        done = await prefill.Prefill(
            prefill_pb2.PrefillRequest(
                request_id="nixl-bad", token_ids=prompt, sampling=sampling, handoff_mode=kv_pb2.HANDOFF_MODE_PULL
            )
        )
        if not done.handoff.HasField("nixl"):
            pytest.skip("this mesh hands KV off over gRPC (NIXL did not load)")
        handoff = kv_pb2.KVHandoff()
        handoff.CopyFrom(done.handoff)
        handoff.nixl.block_ids[:] = [10**6 + i for i in range(len(handoff.nixl.block_ids))]
        remote = decode_pb2.RemotePrefill(first_token_id=done.first_token_id, handoff=handoff)
        request = decode_pb2.DecodeRequest(
            request_id="nixl-bad", prompt_token_ids=prompt, sampling=sampling, remote=remote
        )
        err = await _refused(decode_pb2_grpc.DecodeServiceStub(dch).Decode(request))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert "outside the prefill worker's pool" in err.details()
        local = _decode(PROMPT, local=decode_pb2.LocalPrefill())
        answered = [t async for m in decode_pb2_grpc.DecodeServiceStub(dch).Decode(local) for t in m.token_ids]
        assert answered == local_greedy(e2e_model, [PROMPT], 4)[0]
