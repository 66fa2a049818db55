"""The disk tier: write-through, restarts, corruption and truncation, its own LRU budget."""

from __future__ import annotations

import os

import pytest

from kvmesh.errors import ResourceExhausted
from services.kvstore.core import EventKind
from services.kvstore.disk_tier import DiskTier


def block_path(tmp_path, block_hash: bytes):
    name = block_hash.hex()
    return tmp_path / "blocks" / name[:2] / f"{name}.kvb"


def test_restart_keeps_blocks(chain, make_block, disk_store):
    hashes = chain(3)
    blocks = [make_block(1000, seed=i) for i in range(3)]
    first = disk_store(ram_budget=10_000, disk_budget=10_000)
    for h, block in zip(hashes, blocks):
        first.put(h, block)

    restarted = disk_store(ram_budget=10_000, disk_budget=10_000)
    stats = restarted.stats()
    assert (stats.ram.blocks, stats.disk.blocks, stats.disk.bytes) == (0, 3, 3000)
    assert restarted.lookup(hashes) == 3
    assert restarted.get(hashes) == blocks
    stats = restarted.stats()
    assert (stats.hits_disk, stats.ram.blocks) == (3, 3)  # promoted to RAM
    restarted.get(hashes)
    assert restarted.stats().hits_ram == 3


def test_files_are_sharded_by_hash_prefix(chain, make_block, disk_store, tmp_path):
    (a,) = chain(1)
    disk_store(ram_budget=1000, disk_budget=1000).put(a, make_block(10))
    assert block_path(tmp_path, a).is_file()


def test_ram_eviction_keeps_the_block_on_disk(chain, make_block, disk_store, events):
    hashes = chain(4)
    store = disk_store(ram_budget=200, disk_budget=10_000)
    for i, h in enumerate(hashes):
        store.put(h, make_block(100, seed=i))
    assert store.stats().ram.evictions == 2
    assert events.hashes(EventKind.REMOVED) == []  # still on disk: nothing left the store
    assert store.get(hashes[:1]) == [make_block(100, seed=0)]
    assert store.stats().hits_disk == 1


def test_disk_budget_evicts_least_recently_used(chain, make_block, disk_store, events, tmp_path):
    a, b, c, d = chain(4)
    store = disk_store(ram_budget=100, disk_budget=300)
    for h in (a, b, c):
        store.put(h, make_block(100))
    store.get([a])  # a disk hit: a becomes the most recent on disk too
    store.put(d, make_block(100))
    assert store.lookup([b]) == 0
    assert not block_path(tmp_path, b).exists()
    assert events.hashes(EventKind.REMOVED) == [b]
    assert store.stats().disk.evictions == 1


def test_block_over_the_disk_budget_is_resource_exhausted(chain, make_block, disk_store):
    (a,) = chain(1)
    store = disk_store(ram_budget=10_000, disk_budget=500)
    assert store.max_block_bytes == 500
    with pytest.raises(ResourceExhausted):
        store.put(a, make_block(501))


def test_restart_orders_lru_by_mtime_and_applies_a_smaller_budget(chain, make_block, disk_store, tmp_path):
    a, b, c, d = chain(4)
    store = disk_store(ram_budget=1000, disk_budget=1000)
    for h in (a, b, c):
        store.put(h, make_block(100))
    for age, h in ((300, b), (200, c), (100, a)):  # oldest first: b, c, a
        os.utime(block_path(tmp_path, h), ns=(0, 10**18 - age * 10**9))

    restarted = disk_store(ram_budget=1000, disk_budget=200)
    assert [restarted.lookup([h]) for h in (a, b, c)] == [1, 0, 1]
    restarted.put(d, make_block(100))
    assert [restarted.lookup([h]) for h in (a, c, d)] == [1, 0, 1]


def test_flipped_payload_byte_is_detected_removed_and_counted(chain, make_block, disk_store, events, tmp_path):
    a, b = chain(2)
    store = disk_store(ram_budget=1000, disk_budget=1000)
    store.put(a, make_block(500))
    store.put(b, make_block(500, seed=1))
    path = block_path(tmp_path, a)
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x01
    path.write_bytes(raw)

    restarted = disk_store(ram_budget=1000, disk_budget=1000)  # the scan reads headers only
    assert restarted.lookup([a]) == 1
    assert restarted.get([a, b]) == [None, make_block(500, seed=1)]
    assert restarted.lookup([a]) == 0
    assert not path.exists()
    stats = restarted.stats()
    assert (stats.corrupt_detected, stats.disk.blocks, stats.disk.bytes) == (1, 1, 500)
    assert events.hashes(EventKind.REMOVED) == [a]


def test_file_truncated_while_running_is_detected(chain, make_block, disk_store, tmp_path):
    a, b = chain(2)
    store = disk_store(ram_budget=500, disk_budget=1000)
    store.put(a, make_block(500))
    store.put(b, make_block(500, seed=1))  # evicts a from RAM: the next get reads its file
    path = block_path(tmp_path, a)
    path.write_bytes(path.read_bytes()[:-100])
    assert store.get([a]) == [None]
    assert not path.exists()
    assert store.stats().corrupt_detected == 1


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda raw: raw[:-1], id="truncated payload"),
        pytest.param(lambda raw: raw[:20], id="truncated header"),
        pytest.param(lambda raw: raw[:70] + bytes([raw[70] ^ 1]) + raw[71:], id="flipped header byte"),
        pytest.param(lambda raw: b"XXXX" + raw[4:], id="bad magic"),
        pytest.param(lambda raw: raw + b"junk", id="trailing bytes"),
    ],
)
def test_startup_scan_removes_damaged_files(damage, chain, make_block, disk_store, tmp_path):
    a, b = chain(2)
    store = disk_store(ram_budget=1000, disk_budget=1000)
    store.put(a, make_block(200))
    store.put(b, make_block(200, seed=1))
    path = block_path(tmp_path, a)
    path.write_bytes(damage(path.read_bytes()))

    restarted = disk_store(ram_budget=1000, disk_budget=1000)
    assert not path.exists()
    stats = restarted.stats()
    assert (stats.corrupt_detected, stats.disk.blocks) == (1, 1)
    assert restarted.get([a, b]) == [None, make_block(200, seed=1)]


def test_file_under_another_hash_name_is_not_served(chain, make_block, disk_store, tmp_path):
    a, b = chain(2)
    disk_store(ram_budget=1000, disk_budget=1000).put(a, make_block(100))
    wrong = block_path(tmp_path, b)
    wrong.parent.mkdir(exist_ok=True)
    block_path(tmp_path, a).rename(wrong)

    restarted = disk_store(ram_budget=1000, disk_budget=1000)
    assert restarted.lookup([a]) == 0 and restarted.lookup([b]) == 0
    assert restarted.stats().corrupt_detected == 1


def test_startup_sweeps_temp_files_and_leaves_foreign_files(chain, make_block, disk_store, tmp_path):
    (a,) = chain(1)
    disk_store(ram_budget=1000, disk_budget=1000).put(a, make_block(100))
    shard = block_path(tmp_path, a).parent
    (shard / f"{a.hex()}.kvb.abc123.tmp").write_bytes(b"half a write")
    (tmp_path / "blocks" / "README").write_text("not a block")

    restarted = disk_store(ram_budget=1000, disk_budget=1000)
    assert sorted(p.name for p in shard.iterdir()) == [f"{a.hex()}.kvb"]
    assert (tmp_path / "blocks" / "README").exists()
    assert restarted.stats().disk.blocks == 1


def test_failed_write_through_keeps_the_block_in_ram(chain, make_block, disk_store, monkeypatch):
    (a,) = chain(1)

    def disk_full(self, block_hash, block):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DiskTier, "write", disk_full)
    store = disk_store(ram_budget=1000, disk_budget=1000)
    assert store.put(a, make_block(100)).stored is True
    assert store.get([a]) == [make_block(100)]
    stats = store.stats()
    assert (stats.disk_write_errors, stats.disk.blocks, stats.ram.blocks) == (1, 0, 1)
