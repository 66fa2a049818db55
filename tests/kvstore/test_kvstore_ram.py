"""The store without a disk tier: LRU eviction, the budget rule, Lookup, Delete, events."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidArgument, ResourceExhausted
from services.kvstore.block import Block
from services.kvstore.core import EventKind, KvStore


def test_get_returns_the_block_and_none_for_missing(chain, make_block):
    a, b = chain(2)
    store = KvStore(1000)
    block = make_block(100)
    assert store.put(a, block).stored is True
    assert store.get([a, b]) == [block, None]
    stats = store.stats()
    assert (stats.hits_ram, stats.misses, stats.disk) == (1, 1, None)


def test_lru_evicts_least_recently_used_and_get_keeps_a_block(chain, make_block, events):
    a, b, c, d = chain(4)
    store = KvStore(300, on_event=events)
    for h in (a, b, c):
        store.put(h, make_block(100))
    store.get([a])  # a is now the most recent; b is the oldest
    assert store.put(d, make_block(100)).ram_evictions == 1
    assert [block is not None for block in store.get([a, b, c, d])] == [True, False, True, True]
    assert events.hashes(EventKind.REMOVED) == [b]
    assert store.stats().ram.evictions == 1


def test_block_over_budget_is_resource_exhausted(chain, make_block):
    (a,) = chain(1)
    store = KvStore(1000)
    with pytest.raises(ResourceExhausted):
        store.put(a, make_block(1001))
    assert store.stats().ram.blocks == 0


def test_full_store_evicts_and_never_fails(chain, make_block):
    hashes = chain(50)
    store = KvStore(1000)
    for i, h in enumerate(hashes):
        store.put(h, make_block(70 + i, seed=i))
    stats = store.stats()
    assert stats.ram.bytes <= 1000
    assert stats.ram.blocks + stats.ram.evictions == 50
    assert store.get(hashes[-1:])[0] is not None  # the newest always stays


def test_put_is_idempotent(chain, make_block, events):
    (a,) = chain(1)
    store = KvStore(1000, on_event=events)
    assert store.put(a, make_block(100)).stored is True
    assert store.put(a, make_block(100)).stored is False
    assert (store.stats().ram.blocks, store.stats().ram.bytes) == (1, 100)
    assert events.events == [(EventKind.STORED, [a])]


def test_lookup_counts_leading_hits_and_stops_at_first_miss(chain, make_block):
    hashes = chain(5)
    store = KvStore(10_000)
    for i in (0, 1, 3, 4):
        store.put(hashes[i], make_block(10, seed=i))
    assert store.lookup(hashes) == 2
    assert store.lookup(hashes[3:]) == 2
    assert store.lookup(hashes[2:]) == 0
    assert store.lookup([]) == 0


def test_delete_counts_removed_blocks_and_emits(chain, make_block, events):
    a, b, c = chain(3)
    store = KvStore(1000, on_event=events)
    store.put(a, make_block(10))
    store.put(b, make_block(10))
    assert store.delete([a, b, c, a]) == 2
    assert store.get([a, b]) == [None, None]
    assert events.events[-1] == (EventKind.REMOVED, [a, b])
    assert store.stats().ram.bytes == 0


def test_corrupt_block_in_ram_is_reported_missing_and_removed(chain, make_block, events):
    (a,) = chain(1)
    store = KvStore(1000, on_event=events)
    good = make_block(100)
    store.put(a, Block(b"\x00" + good.data[1:], good.shape, good.dtype, good.checksum))
    assert store.get([a]) == [None]
    assert store.lookup([a]) == 0
    assert store.stats().corrupt_detected == 1
    assert events.hashes(EventKind.REMOVED) == [a]


def test_hashes_lists_every_present_block(chain, make_block):
    hashes = chain(3)
    store = KvStore(1000)
    for h in hashes:
        store.put(h, make_block(10))
    assert sorted(store.hashes()) == sorted(hashes)


@pytest.mark.parametrize("bad", [b"short", b"x" * 17, "not bytes"])
def test_malformed_hash_is_invalid_argument(bad, make_block):
    store = KvStore(1000)
    with pytest.raises(InvalidArgument):
        store.put(bad, make_block(10))
    with pytest.raises(InvalidArgument):
        store.get([bad])
    with pytest.raises(InvalidArgument):
        store.lookup([bad])


def test_malformed_block_metadata_is_invalid_argument():
    with pytest.raises(InvalidArgument):
        Block.build(b"abc", shape=[-1], dtype="uint8")
    with pytest.raises(InvalidArgument):
        Block.build(b"abc", shape=[3], dtype="")


def test_bad_budgets_fail_fast(tmp_path):
    with pytest.raises(ValueError):
        KvStore(0)
    with pytest.raises(ValueError):
        KvStore(1000, disk_dir=tmp_path)
    with pytest.raises(ValueError):
        KvStore(1000, disk_dir=tmp_path, disk_budget_bytes=0)


def test_failing_event_listener_does_not_fail_the_store(chain, make_block):
    (a,) = chain(1)

    def broken(kind: str, hashes: list[bytes]) -> None:
        raise RuntimeError("listener bug")

    store = KvStore(1000, on_event=broken)
    assert store.put(a, make_block(10)).stored is True
    assert store.delete([a]) == 1
