"""The kvstore path (put/get of blocks) between real processes, on each transport.

A prefill worker writes the blocks it computed to the kvstore behind its answer
(on NIXL the kvstore READs them out of its pool); the stored bytes are the
prefill pool's bytes; a decode worker that prefills the same prompt locally
takes them from the kvstore (on NIXL the kvstore WRITEs them into its pool) and
decodes exactly what a colocated engine does (with --deterministic, the same
logprob bits too). A kvstore killed in the middle of a put (its NIXL READ, or
the gRPC Put stream) strands nothing on the worker; a worker with another KV
layout is refused at the NIXL handshake and stays on gRPC.
"""

from __future__ import annotations

import signal
import sys

import pytest

from kvmesh.api.common.v1 import kv_pb2, sampling_pb2
from kvmesh.api.decode.v1 import decode_pb2
from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.api.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.kv_wire import BlockAssembler
from kvmesh.launcher.compose import REPO_ROOT
from kvmesh.launcher.spec import ProcessSpec, Topology
from kvmesh.launcher.supervisor import Mesh
from kvmesh.runtime import create_channel
from kvmesh.runtime.ports import free_port
from kvmesh.sampling import SamplingParams
from kvmesh.worker.kv_nixl import load_nixl
from tests.e2e.mesh_helpers import metrics
from tests.e2e.test_kv_transport import BLOCKS, BS, Pair, _spec, colocated, eventually, greedy, prompt  # noqa: F401

pytestmark = pytest.mark.timeout(300)

TRANSPORTS = ["grpc", pytest.param("nixl", marks=pytest.mark.skipif(load_nixl() is None, reason="NIXL not installed"))]
TCP = {"UCX_TLS": "tcp,self"}


def _kvstore(env: dict[str, str]) -> ProcessSpec:
    port, metrics_port = free_port(), free_port()
    env = {
        "KVMESH_HOST": "127.0.0.1",
        "KVMESH_PORT": str(port),
        "KVMESH_METRICS_PORT": str(metrics_port),
        "KVMESH_LOG_LEVEL": "debug",
        "PYTHONUNBUFFERED": "1",
        **env,
    }
    return ProcessSpec(
        "kvstore",
        "kvstore",
        (sys.executable, "-m", "services.kvstore.main"),
        env,
        "127.0.0.1",
        port,
        metrics_port,
        "cpu",
        workdir=REPO_ROOT,
    )


@pytest.fixture
def start_mesh(e2e_model, tmp_path):
    """A kvstore, a prefill and a decode worker, all on ``transport`` and using the kvstore."""
    meshes: list[Mesh] = []

    def start(transport: str, env: dict | None = None, second_prefill_env: dict | None = None) -> Mesh:
        base = {"KVMESH_KV_TRANSPORT": transport, **(env or {})}
        store = _kvstore(base)
        uses = {**base, "KVMESH_KVSTORE_ADDRESS": store.address}
        specs = (store, _spec("prefill", "prefill", e2e_model, uses), _spec("decode", "decode", e2e_model, uses))
        if second_prefill_env is not None:
            specs += (_spec("prefill-2", "prefill", e2e_model, {**uses, **second_prefill_env}),)
        mesh = Mesh(Topology(specs), tmp_path / f"run{len(meshes)}").start()
        meshes.append(mesh)
        return mesh

    yield start
    for mesh in meshes:
        for name in ("prefill", "kvstore"):
            mesh.kill(name, signal.SIGCONT)  # a test may have stopped it: let it stop cleanly
        mesh.stop()


async def prefill_only(pair: Pair, rid: str, tokens: list[int]) -> prefill_pb2.PrefillResponse:
    """Prefill without a hand-off: the computed blocks only go to the kvstore (behind the answer)."""
    return await pair.prefill.Prefill(
        prefill_pb2.PrefillRequest(
            request_id=rid, token_ids=tokens, sampling=greedy(), handoff_mode=kv_pb2.HANDOFF_MODE_NONE
        ),
        timeout=60,
    )


def stored_blocks(mesh: Mesh) -> float:
    return metrics(mesh, "kvstore").get("kvmesh_kvstore_blocks{tier=ram}", 0)


def log_of(mesh: Mesh, name: str) -> str:
    return (mesh.run_dir / "logs" / f"{name}.log").read_text(errors="replace")


async def pulled_bytes(pair: Pair, tokens: list[int]) -> dict[bytes, bytes]:
    """The prefill pool's bytes of each of the prompt's blocks (PullKV from a fresh lease)."""
    pre = await pair.prefill_call("lease", tokens)
    assembler, out = BlockAssembler(), {}
    async for msg in pair.prefill.PullKV(prefill_pb2.PullKVRequest(lease_id=pre.handoff.lease_id), timeout=60):
        block = assembler.add(msg.chunk)
        if block is not None:
            out[block[0]] = block[1].data
    await pair.prefill.ReleaseLease(prefill_pb2.ReleaseLeaseRequest(lease_id=pre.handoff.lease_id))
    return out


async def kvstore_bytes(mesh: Mesh, hashes: list[bytes]) -> dict[bytes, bytes]:
    async with create_channel(mesh.address("kvstore"), mesh.identity("decode")) as ch:
        assembler, out = BlockAssembler(), {}
        async for msg in kvstore_pb2_grpc.KVStoreServiceStub(ch).Get(kvstore_pb2.GetRequest(block_hashes=hashes)):
            if msg.WhichOneof("item") == "chunk":
                block = assembler.add(msg.chunk)
                if block is not None:
                    out[block[0]] = block[1].data
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_put_then_get_moves_the_right_bytes(start_mesh, colocated, transport):
    mesh = start_mesh(transport)
    pair = Pair(mesh)
    tokens = prompt(5)
    try:
        await prefill_only(pair, "p", tokens)
        assert await eventually(lambda: stored_blocks(mesh) == BLOCKS)
        pool = await pulled_bytes(pair, tokens)
        assert len(pool) == BLOCKS
        assert await kvstore_bytes(mesh, list(pool)) == pool  # the put stored the pool's bytes
        # Decode prefills locally: the prompt's blocks come from the kvstore, then it decodes.
        request = decode_pb2.DecodeRequest(request_id="d", prompt_token_ids=tokens, sampling=greedy())
        got = [t async for msg in pair.decode.Decode(request, timeout=60) for t in msg.token_ids]
    finally:
        await pair.close()
    assert got == colocated(tokens)
    d, k = metrics(mesh, "decode"), metrics(mesh, "kvstore")
    assert d["kvmesh_decode_kvstore_fetched_blocks_total"] == BLOCKS
    if transport == "nixl":  # both directions went over NIXL, no block over the chunk streams
        assert k["kvmesh_kvstore_nixl_blocks_put_total"] == BLOCKS
        assert k["kvmesh_kvstore_nixl_blocks_got_total"] == BLOCKS
        assert k["kvmesh_kvstore_nixl_arena_slots_in_use"] == 0
    assert await eventually(lambda: metrics(mesh, "decode")["kvmesh_engine_kv_blocks_in_use"] == 0)


@pytest.mark.skipif(load_nixl() is None, reason="NIXL not installed")
async def test_kvstore_killed_while_reading_a_put_strands_nothing(start_mesh, colocated):
    # Over TCP the worker serves the kvstore's READ itself, so a stopped prefill worker holds the
    # READ in flight for as long as the test wants.
    mesh = start_mesh("nixl", env=TCP)
    pair = Pair(mesh)
    try:
        await prefill_only(pair, "warm", prompt(0))  # the handshake is done: the next put goes straight to NIXL
        assert await eventually(lambda: stored_blocks(mesh) == BLOCKS)
        mesh.kill("kvstore", signal.SIGSTOP)  # the next put waits for it (its lookup times out first)
        tokens = prompt(1)
        await prefill_only(pair, "p", tokens)
        assert await eventually(lambda: "PutNixl sent" in log_of(mesh, "prefill"))
        mesh.kill("prefill", signal.SIGSTOP)
        mesh.kill("kvstore", signal.SIGCONT)
        assert await eventually(lambda: "NIXL READ of a put started" in log_of(mesh, "kvstore"))
        mesh.kill("kvstore", signal.SIGKILL)
        mesh.kill("prefill", signal.SIGCONT)
        # The put fails with a clear error, its pins go; the worker still serves (computing).
        assert await eventually(lambda: "kvstore put over NIXL failed" in log_of(mesh, "prefill"), attempts=200)
        assert await eventually(lambda: metrics(mesh, "prefill")["kvmesh_engine_kv_blocks_in_use"] == 0)
        tokens = prompt(2)
        assert await pair.hand_off("after", tokens) == colocated(tokens)
    finally:
        await pair.close()
    assert await eventually(lambda: metrics(mesh, "prefill")["kvmesh_engine_kv_blocks_in_use"] == 0)


async def test_kvstore_killed_during_a_grpc_put_strands_nothing(start_mesh, colocated):
    mesh = start_mesh("grpc")
    pair = Pair(mesh)
    try:
        mesh.kill("kvstore", signal.SIGSTOP)  # the put stream waits for it (the lookup times out first)
        await prefill_only(pair, "p", prompt(1))
        assert await eventually(lambda: "kvstore Put stream started" in log_of(mesh, "prefill"))
        mesh.kill("kvstore", signal.SIGKILL)

        def put_failed() -> bool:
            return any(
                "kvstore call failed" in ln and '"op": "put"' in ln for ln in log_of(mesh, "prefill").splitlines()
            )

        assert await eventually(put_failed, attempts=200)
        tokens = prompt(2)
        assert await pair.hand_off("after", tokens) == colocated(tokens)
    finally:
        await pair.close()
    assert await eventually(lambda: metrics(mesh, "prefill")["kvmesh_engine_kv_blocks_in_use"] == 0)


@pytest.mark.skipif(load_nixl() is None, reason="NIXL not installed")
async def test_a_worker_with_another_layout_is_refused_at_the_handshake(start_mesh):
    mesh = start_mesh("nixl", second_prefill_env={"KVMESH_BLOCK_SIZE": str(2 * BS)})
    pair = Pair(mesh)
    try:
        await prefill_only(pair, "p", prompt(3))  # the first worker's layout shapes the arena
        assert await eventually(lambda: stored_blocks(mesh) == BLOCKS)
        async with create_channel(mesh.address("prefill-2"), mesh.identity("gateway")) as ch:
            other = prefill_pb2_grpc.PrefillServiceStub(ch)
            await other.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="q", token_ids=prompt(4), sampling=greedy(), handoff_mode=kv_pb2.HANDOFF_MODE_NONE
                ),
                timeout=60,
            )
        # Refused on NIXL before any byte moved; its blocks still reach the store, over gRPC.
        assert await eventually(lambda: stored_blocks(mesh) == BLOCKS + len(prompt(4)) // (2 * BS))
    finally:
        await pair.close()
    k = metrics(mesh, "kvstore")
    assert (k["kvmesh_kvstore_nixl_handshakes_total"], k["kvmesh_kvstore_nixl_handshakes_refused_total"]) == (1, 1)
    assert k["kvmesh_kvstore_nixl_blocks_put_total"] == BLOCKS  # the first worker's only
    assert "layout mismatch" in log_of(mesh, "prefill-2")


@pytest.mark.native_cpu
@pytest.mark.parametrize("tier", ["ram", "disk"])
async def test_deterministic_workers_give_the_same_bits_from_the_kvstore_as_computed_here(
    start_mesh, e2e_model, tmp_path, tier
):
    """--deterministic over the kvstore's tiers: a decode worker that takes a prompt's blocks from the
    kvstore (another worker computed them; from RAM, or read back from disk after RAM dropped them) gives
    the token ids and logprobs, bit for bit, that one deterministic engine gives computing the whole prompt
    itself (bfloat16, where batching and caching moved tokens)."""
    deterministic = {"KVMESH_DTYPE": "bfloat16", "KVMESH_DETERMINISTIC": "1"}
    if tier == "disk":  # RAM for 2 of the prompt's blocks: the others are served from their files
        mc = ModelConfig.from_dir(e2e_model)
        block_bytes = 2 * mc.num_layers * BS * mc.num_kv_heads * mc.head_dim * 2  # K and V, bfloat16
        deterministic |= {"KVMESH_RAM_BUDGET_BYTES": str(2 * block_bytes), "KVMESH_DISK_DIR": str(tmp_path / "disk")}
    mesh = start_mesh("grpc", deterministic)
    pair = Pair(mesh)
    tokens = prompt(6)
    sampling = sampling_pb2.SamplingParams(
        temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=5
    )
    try:
        await prefill_only(pair, "p", tokens)
        stored = f"kvmesh_kvstore_blocks{{tier={tier}}}"
        assert await eventually(lambda: metrics(mesh, "kvstore").get(stored, 0) == BLOCKS)
        request = decode_pb2.DecodeRequest(request_id="d", prompt_token_ids=tokens, sampling=sampling)
        messages = [msg async for msg in pair.decode.Decode(request, timeout=60)]
    finally:
        await pair.close()
    assert metrics(mesh, "decode")["kvmesh_decode_kvstore_fetched_blocks_total"] == BLOCKS
    assert metrics(mesh, "kvstore")[f"kvmesh_kvstore_hits_total{{tier={tier}}}"] >= (
        BLOCKS - 2 if tier == "disk" else BLOCKS
    )
    got = (
        [t for m in messages for t in m.token_ids],
        [(lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs]) for m in messages for lp in m.logprobs],
    )
    engine = LLMEngine(e2e_model, EngineConfig(num_blocks=64, dtype="bfloat16", deterministic=True))
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True, logprobs=5)
    (done,) = engine.generate([tokens], params)
    # float32 on the wire: the engine's values exactly
    assert got == (done.token_ids, [(lp.logprob, list(lp.top)) for lp in done.logprobs])
