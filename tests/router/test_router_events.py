"""KV events applied in sequence: retries ignored, gaps detected, snapshots resync."""

from __future__ import annotations

from services.router.events import EventKind, KVEvent, KVEventApplier
from services.router.index import InMemoryPrefixIndex, Tier

from .conftest import chain


def stored(hashes, tier=Tier.GPU) -> KVEvent:
    return KVEvent(EventKind.STORED, tier, hashes)


async def test_in_order_batches_apply_and_retries_are_ignored():
    index = InMemoryPrefixIndex()
    events = KVEventApplier(index)
    c = chain(10)
    assert await events.reset("w") == 1
    r = await events.publish("w", 1, [stored(c[:4])])
    assert r.accepted and r.expected_seq == 2
    r = await events.publish("w", 2, [stored(c[4:8]), KVEvent(EventKind.REMOVED, Tier.GPU, c[6:8])])
    assert r.accepted and r.expected_seq == 3
    assert (await index.longest_prefix(c)).gpu_blocks == {"w": 6}
    r = await events.publish("w", 2, [stored(c)])  # a retry of batch 2: acknowledged, not re-applied
    assert r.accepted and not r.resync_required and r.expected_seq == 3
    assert (await index.longest_prefix(c)).gpu_blocks == {"w": 6}


async def test_gap_requires_resync_then_snapshot_restores_sync():
    index = InMemoryPrefixIndex()
    events = KVEventApplier(index)
    c = chain(10)
    await events.reset("w")
    await events.publish("w", 1, [stored(c[:2])])
    r = await events.publish("w", 3, [stored(c[2:5])])  # batch 2 was lost
    assert r.resync_required and not r.accepted and r.expected_seq == 2
    assert r.message == "resync required (expected seq 2)"
    assert (await index.longest_prefix(c)).gpu_blocks == {"w": 2}
    n = await events.resync("w", 3, {Tier.GPU: c[:5], Tier.KVSTORE: c[:8]})
    assert n == 13
    hits = await index.longest_prefix(c)
    assert hits.gpu_blocks == {"w": 5} and hits.kvstore_blocks == 8
    r = await events.publish("w", 4, [KVEvent(EventKind.ALL_CLEARED, Tier.GPU)])
    assert r.accepted and r.expected_seq == 5
    hits = await index.longest_prefix(c)
    assert hits.gpu_blocks == {} and hits.kvstore_blocks == 8


async def test_unknown_sequence_requires_resync():
    events = KVEventApplier(InMemoryPrefixIndex())
    r = await events.publish("never-registered", 1, [stored(chain(1))])
    assert r.resync_required and r.expected_seq is None
    assert r.message == "resync required (sequence unknown)"
