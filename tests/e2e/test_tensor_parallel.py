"""Tensor-parallel workers in a mesh of real processes: a prefill worker over 2 ranks handing KV to a
decode worker on 1, the reverse, and 2 to 2. Over NIXL each decode rank READs its KV heads from the
prefill ranks holding them; over gRPC blocks travel whole (every KV head: the one wire layout). Either
way the greedy tokens are what one engine here gives alone.
Every prompt goes through the prefill worker (the e2e meshes never prefill on decode). And a rank of a
decode worker SIGKILLed mid-stream: the worker's group goes down at once, the supervisor starts it
again, and the stream moves to the other decode worker with the tokens it would have had."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import grpc
import pytest

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.launcher import RestartPolicy
from kvmesh.sampling import SamplingParams
from kvmesh.worker.kv_nixl import load_nixl
from tests.e2e.mesh_helpers import metrics, poll, start_mesh
from tests.e2e.stream_breaker import break_mid_stream, read_into
from tests.e2e.test_kv_transport import N_NEW, Pair, PairStarter, eventually, prompt

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PROMPTS = [[(13 * i + k) % 500 + 1 for i in range(20 + 23 * k)] for k in range(3)]  # 1 to 5 blocks
NEW_TOKENS = 32
DECODE = ("decode-0", "decode-1")


def _request(prompt: list[int], max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        sampling=sampling_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


def _tokens(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def _ranks_of(pid: int) -> list[int]:
    """The tensor-parallel follower processes of worker ``pid`` (its children running kvmesh.engine.tp_rank)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass  # the thread or the process ended meanwhile
    out = []
    for child in children:
        try:
            if b"kvmesh.engine.tp_rank" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(child)
        except OSError:
            pass
    return out


def greedy_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)


def _nixl_ranks(log: Path) -> int | None:
    """How many ranks' pools the worker logging to ``log`` registered with NIXL (None: it did not)."""
    for line in log.read_text().splitlines():
        if line.startswith("{") and json.loads(line).get("event") == "KV pool registered with NIXL":
            return json.loads(line)["ranks"]
    return None


@pytest.fixture(scope="module")
def colocated(e2e_model) -> list[list[int]]:
    done = LLMEngine(e2e_model, EngineConfig(num_blocks=64)).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    )
    return [c.token_ids for c in done]


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "transport"),
    [(2, 1, "nixl"), (1, 2, "nixl"), (2, 2, "nixl"), (2, 1, "grpc")],
)
async def test_kv_moves_between_tensor_parallel_degrees(
    e2e_model, tmp_path, colocated, prefill_tp, decode_tp, transport
):
    if transport == "nixl" and load_nixl() is None:
        pytest.skip("NIXL not installed")
    tp = {"prefill": {"KVMESH_TENSOR_PARALLEL_SIZE": str(prefill_tp), "KVMESH_KV_TRANSPORT": transport}}
    tp["decode"] = {"KVMESH_TENSOR_PARALLEL_SIZE": str(decode_tp), "KVMESH_KV_TRANSPORT": transport}
    mesh = start_mesh(e2e_model, tmp_path, role_env=tp)
    try:
        async with grpc.aio.insecure_channel(mesh.address("gateway")) as channel:
            gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
            got = [_tokens(await read_into(gateway.Generate(_request(p, NEW_TOKENS)), [])) for p in PROMPTS]
        assert got == colocated
        decode, prefill = metrics(mesh, "decode-0"), metrics(mesh, "prefill-0")
        # The prompts' KV crossed and none of it failed; over NIXL, no byte through PullKV, the READs' checksums
        # (combined from every rank's part) matched.
        assert decode["kvmesh_decode_bytes_pulled_total"] > 0
        assert decode["kvmesh_decode_transfer_failures_total"] == 0
        sent = prefill["kvmesh_prefill_blocks_sent_total"]
        assert sent == 0 if transport == "nixl" else sent > 0
        if transport == "nixl":  # every rank of each side registered its pool
            for worker, size in (("prefill-0", prefill_tp), ("decode-0", decode_tp)):
                assert _nixl_ranks(tmp_path / "logs" / f"{worker}.log") == size
    finally:
        mesh.stop()


async def test_a_rank_killed_mid_stream_takes_its_group_down_and_the_stream_moves(e2e_model, tmp_path):
    shared_before = set(Path("/dev/shm").glob("kvmesh-tp-*"))
    mesh = start_mesh(
        e2e_model,
        tmp_path,
        decode_workers=2,
        role_env={"decode": {"KVMESH_TENSOR_PARALLEL_SIZE": "2"}},
        restart=RestartPolicy(initial_backoff_s=0.2),
    )
    try:
        async with grpc.aio.insecure_channel(mesh.address("gateway")) as channel:
            gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
            request = _request(PROMPTS[1], 400)  # long enough to break in the middle
            expected = _tokens(await read_into(gateway.Generate(request), []))

            def kill_a_rank(worker: str) -> None:
                os.kill(_ranks_of(mesh.process(worker).pid)[0], signal.SIGKILL)

            reader, victim, _ = await break_mid_stream(mesh, gateway, request, DECODE, kill_a_rank, lambda w: None)
            got = await asyncio.wait_for(reader, timeout=60)  # a bound against hanging, not speed
        assert _tokens(got) == expected
        assert metrics(mesh, "gateway")["kvmesh_gateway_migrations_total{outcome=resumed}"] >= 1
        # The victim's whole group went down and came back: a new worker process with a rank of its own.
        assert poll(lambda: mesh.restarts(victim), lambda n: n >= 1, polls=600) >= 1
        assert poll(lambda: _ranks_of(mesh.process(victim).pid), bool, polls=600)
    finally:
        mesh.stop()
    assert set(Path("/dev/shm").glob("kvmesh-tp-*")) <= shared_before  # the killed group's memory went with it


@pytest.mark.skipif(load_nixl() is None, reason="NIXL not installed")
async def test_a_holder_rank_that_stops_answering_costs_a_recompute(e2e_model, tmp_path):
    """Prefill and decode at TP2 on NIXL, each decode rank reading from its prefill rank. Prefill's rank 1
    stopped between the answer and the transfer (over TCP a holder serves a READ's bytes itself: this one
    cannot): decode's rank 1 READ runs past its deadline and is cancelled, the request recomputes to the same
    tokens, and the blocks every decode rank had reserved for it are freed."""
    env = {"KVMESH_TENSOR_PARALLEL_SIZE": "2", "UCX_TLS": "tcp,self"}
    starter = PairStarter(e2e_model, tmp_path)
    stopped = None
    try:
        mesh = starter("nixl", prefill_env=env, decode_env=env)
        pair = Pair(mesh)
        engine = LLMEngine(e2e_model, EngineConfig(num_blocks=64))
        expected = [engine.generate([prompt(i)], greedy_params())[0].token_ids for i in range(2)]
        engine.close()
        try:
            assert await pair.hand_off("warm", prompt(0)) == expected[0]  # the handshake is cached from here
            assert metrics(mesh, "prefill")["kvmesh_prefill_blocks_sent_total"] == 0  # over NIXL
            pre = await pair.prefill_call("r", prompt(1))
            stopped = _ranks_of(mesh.process("prefill").pid)[0]
            os.kill(stopped, signal.SIGSTOP)
            got = [t async for msg in pair.decode_call("r", prompt(1), pre) for t in msg.token_ids]
        finally:
            await pair.close()
        assert got == expected[1]
        assert metrics(mesh, "decode")["kvmesh_decode_transfer_failures_total"] == 1
        assert await eventually(lambda: metrics(mesh, "decode")["kvmesh_engine_kv_blocks_in_use"] == 0)
        assert "tensor-parallel rank 1's NIXL READ failed" in (mesh.run_dir / "logs" / "decode.log").read_text()
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        starter.close()
