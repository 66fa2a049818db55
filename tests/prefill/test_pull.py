"""The prefill side of a KV hand-off: a lease's blocks stream out in growing batches, the next
batch exported (and checksummed) while the current one is sent."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.checksum import checksum
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.errors import NotFound
from kvmesh.sampling import SamplingParams
from services.prefill import core as prefill_core
from services.prefill.core import PrefillWorker
from tests.engine.conftest import write_checkpoint

BS = 16
PROMPT = list(range(7, 7 + 9 * BS + 3))  # nine full blocks


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama-gqa")


@pytest.fixture
async def worker(model, monkeypatch):
    engine = LLMEngine(model, EngineConfig(num_blocks=32))
    # Test blocks are 4 KiB: batches of 1, 2, 2, ... blocks, so a pull spans several.
    monkeypatch.setattr(prefill_core, "FIRST_EXPORT_BATCH_BYTES", engine.kv.block_nbytes)
    monkeypatch.setattr(prefill_core, "MAX_EXPORT_BATCH_BYTES", 2 * engine.kv.block_nbytes)
    aengine = AsyncEngine(engine)
    aengine.start()
    yield PrefillWorker(aengine)
    aengine.stop()


async def handed_off(worker: PrefillWorker):
    res = await worker.prefill("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=4))
    assert res.lease is not None and len(res.block_hashes) == 9
    return res


def other_tasks(before: set) -> set:
    return {t for t in asyncio.all_tasks() - before if not t.done()}


async def test_pull_streams_each_block_once_in_order_with_its_checksum(worker):
    res = await handed_off(worker)
    got = [b async for b in worker.pull(res.lease.lease_id, [])]
    assert [b.block_hash for b in got] == res.block_hashes
    assert all(b.checksum == checksum(b.payload.data) for b in got)
    exported = await worker.engine.call(lambda e: e.export_held("r"))
    assert [b.payload for b in got] == [p for _, p in exported]
    subset = res.block_hashes[5:2:-1]
    assert [b.block_hash async for b in worker.pull(res.lease.lease_id, subset)] == subset


async def test_lease_released_mid_pull_ends_the_stream_with_not_found(worker):
    res = await handed_off(worker)
    before = asyncio.all_tasks()
    stream = worker.pull(res.lease.lease_id, [])
    got = [await anext(stream), await anext(stream)]
    assert await worker.release(res.lease.lease_id, ack=False) == 9
    with pytest.raises(NotFound):
        async for b in stream:
            got.append(b)
    assert len(got) < 9
    assert other_tasks(before) == set()
    assert await worker.engine.call(lambda e: e.blocks.num_free) == 32


async def test_a_pull_abandoned_part_way_leaves_no_export_running(worker):
    res = await handed_off(worker)
    before = asyncio.all_tasks()
    stream = worker.pull(res.lease.lease_id, [])
    await anext(stream)  # the next batch is being exported now
    await stream.aclose()  # the decode worker went away
    assert other_tasks(before) == set()
    assert len(worker.leases) == 1  # the lease ends by release or TTL, not by a dropped stream
    assert await worker.release(res.lease.lease_id, ack=False) == 9
