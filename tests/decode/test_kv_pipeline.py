"""Decode's pipelined KV adoption: the stream keeps reading while earlier blocks are verified
and imported. Faults part way (a corrupted block, a dead peer, a cancelled request) abort the
lease, and what was imported is only ever whole, checksum-verified blocks."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from kvmesh.checksum import checksum
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.errors import Unavailable
from kvmesh.kv_wire import ReceivedBlock
from kvmesh.sampling import SamplingParams
from services.decode import core as decode_core
from services.decode.core import DecodeWorker, RemotePrefill, StreamedKVSource
from tests.engine.conftest import write_checkpoint

BS = 16
PROMPT = list(range(40, 40 + 6 * BS + 5))  # six full blocks and a partial one
N_NEW = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama-gqa")


@pytest.fixture(scope="module")
def prefilled(model):
    """What a prefill worker hands off: the first token and the prompt's blocks, exported."""
    engine = LLMEngine(model, EngineConfig(num_blocks=32))
    engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=1), "src", hold_prompt_blocks=True)
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            first = out.new_token_ids[0]
    blocks = engine.export_held("src")
    expected = (
        LLMEngine(model, EngineConfig(num_blocks=32))
        .generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))[0]
        .token_ids
    )
    return first, blocks, expected


@pytest.fixture(autouse=True)
def one_block_batches(monkeypatch):
    # Test blocks are 4 KiB: without this the whole transfer would be one batch.
    monkeypatch.setattr(decode_core, "MIN_IMPORT_BATCH_BYTES", 1)


class FakeSource(StreamedKVSource):
    """Serves exported blocks like PullKV, with one fault injected at block ``at``."""

    def __init__(self, blocks, fault: str | None = None, at: int = 0) -> None:
        super().__init__()
        self.blocks = dict(blocks)
        self.fault, self.at = fault, at
        self.releases: list[bool] = []
        self.reached_fault = asyncio.Event()

    async def pull(self, address, lease_id, hashes):
        for i, h in enumerate(hashes):
            payload = self.blocks[h]
            digest = checksum(payload.data)
            if i == self.at and self.fault is not None:
                self.reached_fault.set()
                if self.fault == "corrupt":
                    payload = replace(payload, data=bytes([payload.data[0] ^ 1]) + payload.data[1:])
                elif self.fault == "peer_died":
                    raise Unavailable("prefill worker went away")
                elif self.fault == "stall":
                    await asyncio.Event().wait()
            yield ReceivedBlock(h, payload, digest)
            await asyncio.sleep(0.01)  # let the importer run between blocks, as a network would

    async def release(self, address, lease_id, ack):
        self.releases.append(ack)


@pytest.fixture
async def engine(model):
    aengine = AsyncEngine(LLMEngine(model, EngineConfig(num_blocks=32)))
    aengine.start()
    yield aengine
    aengine.stop()


def remote(prefilled) -> RemotePrefill:
    first, blocks, _ = prefilled
    return RemotePrefill("prefill:1", "lease", [h for h, _ in blocks], first)


async def cached_blocks(engine: AsyncEngine, blocks) -> dict[bytes, bytes]:
    """The decode cache's bytes for each of ``blocks`` it holds."""
    got = await engine.call(lambda e: e.export_blocks([h for h, _ in blocks]))
    return {h: p.data for h, p in got}


async def decode_all(worker: DecodeWorker, prefilled) -> list[int]:
    tokens = []
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    async for out, _ in worker.decode("r", PROMPT, params, remote=remote(prefilled)):
        tokens += out.new_token_ids
    return tokens


async def test_every_block_is_imported_then_the_lease_acked(engine, prefilled):
    _, blocks, expected = prefilled
    source = FakeSource(blocks)
    worker = DecodeWorker(engine, source)
    assert await decode_all(worker, prefilled) == expected
    assert source.releases == [True]
    assert engine.engine.stats.imported_blocks == len(blocks)
    assert await cached_blocks(engine, blocks) == {h: p.data for h, p in blocks}


async def test_corrupted_block_mid_stream_aborts_and_only_verified_blocks_are_imported(engine, prefilled):
    _, blocks, _ = prefilled
    source = FakeSource(blocks, "corrupt", at=3)
    worker = DecodeWorker(engine, source)
    await worker._adopt_kv(remote(prefilled))
    assert source.releases == [False] and worker.counters.transfer_failures == 1
    cached = await cached_blocks(engine, blocks)
    assert blocks[3][0] not in cached
    assert set(cached) <= {h for h, _ in blocks[:3]}
    assert all(cached[h] == p.data for h, p in blocks if h in cached)


async def test_peer_failure_mid_stream_falls_back_to_local_compute(engine, prefilled):
    _, blocks, expected = prefilled
    source = FakeSource(blocks, "peer_died", at=4)
    worker = DecodeWorker(engine, source)
    assert await decode_all(worker, prefilled) == expected
    assert source.releases == [False] and worker.counters.transfer_failures == 1
    assert engine.engine.stats.imported_blocks <= 4


async def test_cancelled_transfer_aborts_the_lease_and_leaves_no_task_behind(engine, prefilled):
    _, blocks, _ = prefilled
    source = FakeSource(blocks, "stall", at=3)
    worker = DecodeWorker(engine, source)
    before = asyncio.all_tasks()
    task = asyncio.create_task(decode_all(worker, prefilled))
    await asyncio.wait_for(source.reached_fault.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert source.releases == [False]
    assert asyncio.all_tasks() - before == set()
    cached = await cached_blocks(engine, blocks)
    assert set(cached) <= {h for h, _ in blocks[:3]}
    assert all(cached[h] == p.data for h, p in blocks if h in cached)
    assert await engine.call(lambda e: (e.num_running, e.blocks.num_free)) == (0, 32)
