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

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.decode.v1 import decode_pb2, decode_pb2_grpc
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.runtime.interceptor import FIELD_KEY
from tests.e2e.test_mesh import generate, local_greedy

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

    async with grpc.aio.insecure_channel(mesh.address("decode-0")) as channel:
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
