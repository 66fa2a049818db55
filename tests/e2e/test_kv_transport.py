"""KV hand-off prefill -> decode between real processes, on each transport (gRPC stream, NIXL READ).

The right bytes arrive (decode's output equals a colocated engine's); a prefill
worker killed between its answer and the transfer costs a local recompute, not
a hang; a decode worker killed mid-transfer strands nothing on prefill (the
lease's TTL frees the blocks); a peer with another block size is refused, and
the request is still served right.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import grpc
import pytest

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.decode.v1 import decode_pb2, decode_pb2_grpc
from kvmesh.api.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.launcher.compose import REPO_ROOT
from kvmesh.launcher.hosts import HostsFile
from kvmesh.launcher.multihost import TCP_ONLY_UCX
from kvmesh.launcher.netns import Network, can_make_hosts
from kvmesh.launcher.spec import ProcessSpec, Topology
from kvmesh.launcher.supervisor import Mesh
from kvmesh.runtime import create_channel
from kvmesh.runtime.ports import free_port
from kvmesh.sampling import SamplingParams
from kvmesh.worker.kv_nixl import load_nixl
from tests.e2e.mesh_helpers import metrics

pytestmark = pytest.mark.timeout(300)

BS = 16
N_NEW = 8
BLOCKS = 12
TTL_MS = 2000
TRANSPORTS = ["grpc", pytest.param("nixl", marks=pytest.mark.skipif(load_nixl() is None, reason="NIXL not installed"))]
NO_HOSTS = can_make_hosts()
# A bound against hanging, not a speed test.
CALL_TIMEOUT_S = 60


def prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 400 + 3 for i in range(BLOCKS * BS + 5)]


@pytest.fixture(scope="module")
def colocated(e2e_model):
    engine = LLMEngine(e2e_model, EngineConfig(num_blocks=64))

    def expected(tokens: list[int]) -> list[int]:
        return engine.generate([tokens], SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))[
            0
        ].token_ids

    return expected


def _spec(name: str, role: str, model: Path, env: dict[str, str], network: Network | None = None) -> ProcessSpec:
    """The worker, on the launcher's 127.0.0.1 or on its own host of ``network``."""
    host = "127.0.0.1" if network is None else network.address(name)
    port, metrics_port = free_port(), free_port()
    env = {
        "KVMESH_HOST": host,
        "KVMESH_PORT": str(port),
        "KVMESH_METRICS_PORT": str(metrics_port),
        "KVMESH_MODEL": str(model),
        "KVMESH_NUM_BLOCKS": "64",
        "KVMESH_WORKER_ID": name,
        "KVMESH_LEASE_TTL_MS": str(TTL_MS),
        "KVMESH_KV_READ_TIMEOUT_S": "2",
        "KVMESH_LOG_LEVEL": "debug",
        "PYTHONUNBUFFERED": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        **env,
    }
    return ProcessSpec(
        name,
        role,
        (sys.executable, "-m", f"services.{role}.main"),
        env,
        host,
        port,
        metrics_port,
        "cpu",
        None if network is None else network.netns(name),
        workdir=REPO_ROOT,
    )


class PairStarter:
    """Starts a prefill and a decode worker on ``transport`` (each may add env); with ``network``, each on a
    host of its own (a network namespace; NIXL over TCP between them). ``close`` stops them all."""

    def __init__(self, model: Path, run_dir: Path) -> None:
        self.model, self.run_dir = model, run_dir
        self.meshes: list[Mesh] = []
        self.networks: list[Network] = []

    def __call__(
        self, transport: str, prefill_env: dict | None = None, decode_env: dict | None = None, *, network: bool = False
    ) -> Mesh:
        env = {"KVMESH_KV_TRANSPORT": transport, **(TCP_ONLY_UCX if network else {})}
        hosts = None
        if network:
            hosts = Network(HostsFile.each_alone(["prefill", "decode"]))
            self.networks.append(hosts.create())
        specs = (
            _spec("prefill", "prefill", self.model, {**env, **(prefill_env or {})}, hosts),
            _spec("decode", "decode", self.model, {**env, **(decode_env or {})}, hosts),
        )
        mesh = Mesh(Topology(specs), self.run_dir / f"run{len(self.meshes)}")
        self.meshes.append(mesh)
        return mesh.start()

    def close(self) -> None:
        try:
            for mesh in self.meshes:
                mesh.kill("prefill", signal.SIGCONT)  # a test may have stopped it: let it stop cleanly
                mesh.stop()
        finally:
            for network in self.networks:
                network.remove()


@pytest.fixture
def start_pair(e2e_model, tmp_path):
    starter = PairStarter(e2e_model, tmp_path)
    yield starter
    starter.close()


class Pair:
    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self._channels = [create_channel(mesh.address(n), mesh.identity("gateway")) for n in ("prefill", "decode")]
        self.prefill = prefill_pb2_grpc.PrefillServiceStub(self._channels[0])
        self.decode = decode_pb2_grpc.DecodeServiceStub(self._channels[1])

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()

    async def prefill_call(self, rid: str, tokens: list[int]) -> prefill_pb2.PrefillResponse:
        return await self.prefill.Prefill(
            prefill_pb2.PrefillRequest(request_id=rid, token_ids=tokens, sampling=greedy()), timeout=CALL_TIMEOUT_S
        )

    def decode_call(self, rid: str, tokens: list[int], pre: prefill_pb2.PrefillResponse):
        remote = decode_pb2.RemotePrefill(first_token_id=pre.first_token_id, handoff=pre.handoff)
        request = decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=tokens, sampling=greedy(), remote=remote)
        return self.decode.Decode(request, timeout=CALL_TIMEOUT_S)

    async def hand_off(self, rid: str, tokens: list[int]) -> list[int]:
        pre = await self.prefill_call(rid, tokens)
        return [t async for msg in self.decode_call(rid, tokens, pre) for t in msg.token_ids]


def greedy() -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)


async def eventually(check, attempts: int = 100, every_s: float = 0.1) -> bool:
    for _ in range(attempts):
        if check():
            return True
        await asyncio.sleep(every_s)
    return check()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "hosts", ["one", pytest.param("two", marks=pytest.mark.skipif(bool(NO_HOSTS), reason=NO_HOSTS or ""))]
)
async def test_hand_off_moves_the_right_bytes(start_pair, colocated, transport, hosts):
    mesh = start_pair(transport, network=hosts == "two")
    pair = Pair(mesh)
    try:
        for i in range(2):  # the second reuses the cached handshake / channel
            tokens = prompt(i)
            assert await pair.hand_off(f"r{i}", tokens) == colocated(tokens)
    finally:
        await pair.close()
    d, p = metrics(mesh, "decode"), metrics(mesh, "prefill")
    assert d["kvmesh_engine_imported_blocks_total"] == 2 * BLOCKS
    assert d["kvmesh_decode_transfer_failures_total"] == 0
    assert d["kvmesh_decode_bytes_pulled_total"] > 0
    # Over NIXL no byte went through PullKV; the READ's notification acked each lease.
    assert p["kvmesh_prefill_blocks_sent_total"] == (0 if transport == "nixl" else 2 * BLOCKS)
    assert await eventually(lambda: metrics(mesh, "prefill")["kvmesh_prefill_leases_acked_total"] == 2)
    assert metrics(mesh, "prefill")["kvmesh_engine_kv_blocks_in_use"] == 0
    if hosts == "two":  # the KV crossed the decode host's link, not a shared-memory shortcut
        network = start_pair.networks[-1]
        assert network.bytes_through("decode") > d["kvmesh_decode_bytes_pulled_total"]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_prefill_killed_before_the_transfer_decode_recomputes(start_pair, colocated, transport):
    mesh = start_pair(transport)
    pair = Pair(mesh)
    try:
        await pair.hand_off("warm", prompt(0))  # the handshake (NIXL) is cached: the next goes straight to READ
        tokens = prompt(1)
        pre = await pair.prefill_call("r", tokens)
        mesh.kill("prefill", signal.SIGKILL)
        got = [t async for msg in pair.decode_call("r", tokens, pre) for t in msg.token_ids]
    finally:
        await pair.close()
    assert got == colocated(tokens)
    d = metrics(mesh, "decode")
    assert d["kvmesh_decode_transfer_failures_total"] == 1
    assert await eventually(lambda: metrics(mesh, "decode")["kvmesh_engine_kv_blocks_in_use"] == 0)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_decode_killed_mid_transfer_prefill_frees_the_lease_by_ttl(start_pair, transport):
    # Over TCP the holder serves a READ's bytes itself, so a stopped prefill worker holds the
    # READ (or the PullKV stream) in flight for as long as the test wants.
    tcp = {"UCX_TLS": "tcp,self"}
    mesh = start_pair(transport, prefill_env=tcp, decode_env=tcp)
    pair = Pair(mesh)
    try:
        await pair.hand_off("warm", prompt(0))
        assert await eventually(lambda: metrics(mesh, "prefill")["kvmesh_engine_kv_blocks_in_use"] == 0)
        pre = await pair.prefill_call("r", prompt(1))
        assert metrics(mesh, "prefill")["kvmesh_prefill_active_leases"] == 1
        mesh.kill("prefill", signal.SIGSTOP)
        call = pair.decode_call("r", prompt(1), pre)
        started = asyncio.ensure_future(call.read())
        log = mesh.run_dir / "logs" / "decode.log"
        if transport == "nixl":
            posted = [ln for ln in log.read_text(errors="replace").splitlines() if "NIXL READ posted" in ln]
            assert await eventually(
                lambda: any(
                    pre.handoff.lease_id in ln and "NIXL READ posted" in ln
                    for ln in log.read_text(errors="replace").splitlines()
                )
            ), posted
        else:
            await asyncio.sleep(1.0)  # PullKV is under way: its answer cannot come
        assert not started.done()
        mesh.kill("decode", signal.SIGKILL)
        mesh.kill("prefill", signal.SIGCONT)
        with pytest.raises(grpc.aio.AioRpcError):
            await started
    finally:
        await pair.close()

    def back_to_baseline() -> bool:
        try:
            p = metrics(mesh, "prefill")
        except OSError:  # a scrape reset while the thawed worker catches up: ask again (a dead one never answers)
            return False
        return p["kvmesh_prefill_active_leases"] == 0 and p["kvmesh_engine_kv_blocks_in_use"] == 0

    assert await eventually(back_to_baseline, attempts=200)
    p = metrics(mesh, "prefill")
    assert p["kvmesh_prefill_leases_expired_total"] == 1 and p["kvmesh_prefill_leases_acked_total"] == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_peer_with_another_block_size_is_refused(start_pair, colocated, transport):
    mesh = start_pair(transport, decode_env={"KVMESH_BLOCK_SIZE": str(2 * BS)})
    pair = Pair(mesh)
    try:
        tokens = prompt(3)
        assert await pair.hand_off("r", tokens) == colocated(tokens)  # served right, recomputed on decode
    finally:
        await pair.close()
    d = metrics(mesh, "decode")
    assert d["kvmesh_decode_transfer_failures_total"] == 1
    assert d["kvmesh_engine_imported_blocks_total"] == 0
    assert "layout mismatch" in (mesh.run_dir / "logs" / "decode.log").read_text(errors="replace")
    if transport == "nixl":  # refused at the handshake, before any byte moved
        assert d["kvmesh_decode_bytes_pulled_total"] == 0


@pytest.mark.skipif(load_nixl() is None, reason="NIXL not installed")
async def test_a_read_past_its_deadline_is_abandoned_and_recomputed(start_pair, colocated):
    # A stopped holder never serves a READ over TCP: the transfer stays in progress, as one to a
    # peer that hangs would. Decode's own deadline ends it.
    tcp = {"UCX_TLS": "tcp,self"}
    mesh = start_pair("nixl", prefill_env=tcp, decode_env=tcp)
    pair = Pair(mesh)
    try:
        await pair.hand_off("warm", prompt(0))
        tokens = prompt(1)
        pre = await pair.prefill_call("r", tokens)
        mesh.kill("prefill", signal.SIGSTOP)
        try:
            got = [t async for msg in pair.decode_call("r", tokens, pre) for t in msg.token_ids]
        finally:
            mesh.kill("prefill", signal.SIGCONT)
    finally:
        await pair.close()
    assert got == colocated(tokens)
    assert metrics(mesh, "decode")["kvmesh_decode_transfer_failures_total"] == 1
    assert "still in progress after" in (mesh.run_dir / "logs" / "decode.log").read_text(errors="replace")

    def nothing_held() -> bool:
        p, d = metrics(mesh, "prefill"), metrics(mesh, "decode")
        return (
            p["kvmesh_prefill_active_leases"],
            p["kvmesh_engine_kv_blocks_in_use"],
            d["kvmesh_engine_kv_blocks_in_use"],
        ) == (0, 0, 0)

    # The abandoned READ's blocks go back once it can no longer land; the lease is aborted.
    assert await eventually(nothing_held, attempts=200)
