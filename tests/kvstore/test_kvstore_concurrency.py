"""Concurrent puts of the same block, from threads: one copy, counted once."""

from __future__ import annotations

import random
import threading

from services.kvstore.core import EventKind

THREADS = 16


def test_concurrent_puts_of_the_same_block_are_idempotent(chain, make_block, disk_store, events, tmp_path):
    (a,) = chain(1)
    block = make_block(4096)
    store = disk_store(ram_budget=100_000, disk_budget=100_000)
    start = threading.Barrier(THREADS)
    results: list[bool] = []

    def put() -> None:
        start.wait()
        results.append(store.put(a, block).stored)

    threads = [threading.Thread(target=put) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert sorted(results) == [False] * (THREADS - 1) + [True]
    stats = store.stats()
    assert (stats.ram.blocks, stats.ram.bytes) == (1, 4096)
    assert (stats.disk.blocks, stats.disk.bytes) == (1, 4096)
    assert events.events == [(EventKind.STORED, [a])]
    files = [p for p in (tmp_path / "blocks").rglob("*") if p.is_file()]
    assert [p.name for p in files] == [f"{a.hex()}.kvb"]  # no temp file left behind
    assert store.get([a]) == [block]


def test_mixed_concurrent_traffic_keeps_state_and_events_consistent(chain, make_block, disk_store, events, tmp_path):
    """Puts, gets and deletes racing over small budgets: every get is right or missing,
    the byte counts add up, the files match the index, and replaying the events
    gives exactly the blocks present (no block reappears without a STORED)."""
    hashes = chain(40)
    blocks = {h: make_block(1000 + i, seed=i) for i, h in enumerate(hashes)}
    store = disk_store(ram_budget=8_000, disk_budget=15_000)
    errors: list[BaseException] = []

    def traffic(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                h = rng.choice(hashes)
                op = rng.random()
                if op < 0.5:
                    store.put(h, blocks[h])
                elif op < 0.9:
                    assert store.get([h])[0] in (None, blocks[h])
                else:
                    store.delete([h])
        except BaseException as e:  # surfaced below: a thread's failure must fail the test
            errors.append(e)

    threads = [threading.Thread(target=traffic, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []

    present = set()
    for kind, hs in events.events:
        for h in hs:
            assert (h in present) == (kind == EventKind.REMOVED), f"{kind} out of order"
            (present.add if kind == EventKind.STORED else present.discard)(h)
    assert present == set(store.hashes())

    stats = store.stats()
    files = [p for p in (tmp_path / "blocks").rglob("*") if p.is_file()]
    on_disk = {bytes.fromhex(p.name.removesuffix(".kvb")) for p in files}
    assert len(on_disk) == stats.disk.blocks
    assert sum(blocks[h].nbytes for h in on_disk) == stats.disk.bytes <= 15_000
    assert stats.ram.bytes <= 8_000

    restarted = disk_store(ram_budget=8_000, disk_budget=15_000)
    assert set(restarted.hashes()) == on_disk
    assert restarted.get(list(on_disk)) == [blocks[h] for h in on_disk]
