"""Deterministic serving through the mesh, with real processes: a bfloat16 mesh whose workers run
``--deterministic`` gives a request the token ids and logprobs, bit for bit, that one engine gives it
alone in this process (colocated prefill), whether the mesh serves it alone, in a batch of 16, after
its prefix was cached, or moved to the other decode worker after the one streaming it was killed;
for a greedy request and for a seeded sampled one. The mesh hands every prompt to the prefill
worker (split prefill/decode, KV over NIXL)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request

import grpc
import pytest

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.launcher import RestartPolicy
from kvmesh.sampling import SamplingParams
from tests.e2e.mesh_helpers import http_url, metrics, start_mesh
from tests.e2e.stream_breaker import break_mid_stream, read_into

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

DTYPE = "bfloat16"  # the dtype where batching moved tokens, not only logprobs (docs/determinism.md)
DECODE = ("decode-0", "decode-1")
PROMPT = [(7 * i + 3) % 500 + 1 for i in range(60)]
OTHERS = [[(11 * i + j) % 500 + 1 for i in range(5 + 9 * j)] for j in range(15)]
MAX_TOKENS = 200
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "seed": 11},
}


@pytest.fixture(scope="module")
def deterministic_mesh(e2e_model, tmp_path_factory):
    worker = {"KVMESH_DTYPE": DTYPE, "KVMESH_DETERMINISTIC": "1"}
    m = start_mesh(
        e2e_model,
        tmp_path_factory.mktemp("deterministic"),
        decode_workers=2,
        role_env={"prefill": worker, "decode": worker},
        restart=RestartPolicy(initial_backoff_s=0.2),
    )
    yield m
    m.stop()


@pytest.fixture(scope="module")
def engine_here(e2e_model) -> LLMEngine:
    """One deterministic engine in this process: prefill and decode colocated."""
    return LLMEngine(e2e_model, EngineConfig(num_blocks=128, dtype=DTYPE, deterministic=True))


@pytest.fixture(scope="module")
def alone_in_process(engine_here) -> dict[str, tuple]:
    """What the engine here gives each kind of request alone."""
    engine = engine_here
    out = {}
    for kind, sampling in SAMPLING.items():
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5, **sampling)
        (done,) = engine.generate([PROMPT], params)
        out[kind] = (
            done.token_ids,
            [(lp.token_id, lp.logprob, [(t, v) for t, v in lp.top]) for lp in done.logprobs],
        )
    return out


@pytest.fixture
async def gateway(deterministic_mesh):
    async with grpc.aio.insecure_channel(deterministic_mesh.address("gateway")) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


def _request(prompt: list[int], max_tokens: int = MAX_TOKENS, **sampling) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        sampling=sampling_pb2.SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, logprobs=True, top_logprobs=5, **sampling
        ),
    )


def _bits(messages: list[gateway_pb2.GenerateResponse]) -> tuple:
    """Token ids and logprobs as the client got them (float32 on the wire: the engine's values exactly)."""
    tokens = [t for m in messages for t in m.token_ids]
    logprobs = [
        (lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs])
        for m in messages
        for lp in m.logprobs
    ]
    return tokens, logprobs


async def _complete(gateway, request) -> list[gateway_pb2.GenerateResponse]:
    return await read_into(gateway.Generate(request), [])


@pytest.mark.native_cpu
@pytest.mark.parametrize("kind", sorted(SAMPLING))
async def test_the_mesh_gives_the_bits_one_engine_gives_alone_batched_or_cached(
    gateway, alone_in_process, kind
) -> None:
    expected = alone_in_process[kind]
    sampling = SAMPLING[kind]
    assert len(expected[0]) == MAX_TOKENS
    # Alone; in a batch of 16 mixed-length requests (it arrives in the middle); alone again, its prefix cached.
    alone = _bits(await _complete(gateway, _request(PROMPT, **sampling)))
    batch = [_request(p, MAX_TOKENS - 20 + 3 * i, temperature=0.0) for i, p in enumerate(OTHERS)]
    batch.insert(8, _request(PROMPT, **sampling))
    batched = _bits((await asyncio.gather(*(_complete(gateway, r) for r in batch)))[8])
    again = _bits(await _complete(gateway, _request(PROMPT, **sampling)))
    assert alone == expected, "the mesh, alone, differs from one engine alone"
    assert batched == expected, "in a batch of 16 the request's bits moved"
    assert again == expected, "after its prefix was cached the request's bits moved"


@pytest.mark.native_cpu
async def test_every_response_names_the_configuration_that_produced_it(deterministic_mesh, gateway, engine_here):
    """system_fingerprint: the decode worker's, over gRPC and HTTP, equal to what the same configuration here says
    (model fingerprint with batch-invariant execution, dtype, kernels, torch, device type)."""
    final = (await _complete(gateway, _request(PROMPT, 4, temperature=0.0)))[-1].final
    assert final.system_fingerprint == engine_here.system_fingerprint
    body = json.dumps({"model": "llama", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
    call = urllib.request.Request(
        f"{http_url(deterministic_mesh)}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(call, timeout=60) as reply:
        assert json.load(reply)["system_fingerprint"] == engine_here.system_fingerprint


@pytest.mark.native_cpu
async def test_a_stream_moved_after_its_worker_was_killed_keeps_its_bits(
    deterministic_mesh, gateway, alone_in_process
) -> None:
    mesh = deterministic_mesh

    def freeze(worker: str) -> None:
        os.killpg(mesh.process(worker).pid, signal.SIGSTOP)

    def thaw(worker: str) -> None:
        os.killpg(mesh.process(worker).pid, signal.SIGCONT)

    reader, victim, _ = await break_mid_stream(
        mesh, gateway, _request(PROMPT, **SAMPLING["seeded"]), DECODE, freeze, thaw
    )
    mesh.crash(victim)
    got = await asyncio.wait_for(reader, timeout=60)  # a bound against hanging, not speed
    assert len(got) > 3 and _bits(got) == alone_in_process["seeded"], f"the stream moved off {victim} changed"


@pytest.mark.native_cpu
async def test_a_tensor_parallel_float32_mesh_over_grpc_gives_its_degree_s_bits(e2e_model, tmp_path) -> None:
    """The other half of the promise's matrix: float32, prefill and decode each over 2 ranks (the same
    degree on both sides), KV over gRPC (a tensor-parallel worker keeps NIXL off). The mesh gives a request
    what one deterministic engine at that degree gives it alone here, alone, in a batch and cached."""
    worker = {"KVMESH_DTYPE": "float32", "KVMESH_DETERMINISTIC": "1", "KVMESH_TENSOR_PARALLEL_SIZE": "2"}
    config = EngineConfig(num_blocks=128, dtype="float32", deterministic=True, tensor_parallel_size=2)
    engine = LLMEngine(e2e_model, config)
    try:
        expected = {}
        for kind, sampling in SAMPLING.items():
            params = SamplingParams(max_tokens=64, ignore_eos=True, logprobs=5, **sampling)
            (done,) = engine.generate([PROMPT], params)
            expected[kind] = (
                done.token_ids,
                [(lp.token_id, lp.logprob, [(t, v) for t, v in lp.top]) for lp in done.logprobs],
            )
    finally:
        engine.close()
    mesh = start_mesh(e2e_model, tmp_path, role_env={"prefill": worker, "decode": worker})
    try:
        async with grpc.aio.insecure_channel(mesh.address("gateway")) as channel:
            gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
            for kind, sampling in SAMPLING.items():
                alone = _bits(await _complete(gateway, _request(PROMPT, 64, **sampling)))
                batch = [_request(p, 40 + 3 * i, temperature=0.0) for i, p in enumerate(OTHERS)]
                batch.insert(8, _request(PROMPT, 64, **sampling))
                batched = _bits((await asyncio.gather(*(_complete(gateway, r) for r in batch)))[8])
                again = _bits(await _complete(gateway, _request(PROMPT, 64, **sampling)))
                assert alone == batched == again == expected[kind], f"{kind}: the mesh's bits moved"
        decode = metrics(mesh, "decode-0")
        assert decode["kvmesh_decode_bytes_pulled_total"] > 0  # the prompts' KV crossed (gRPC: NIXL is off at TP 2)
    finally:
        mesh.stop()
