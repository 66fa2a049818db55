"""The block-hash chain and the block allocator."""

from __future__ import annotations

import pytest

from kvmesh.blocks import HASH_BYTES, block_hashes
from kvmesh.engine.block_manager import BlockManager, OutOfBlocks

FP = b"model-a"


def test_chain_names_full_blocks_only_and_depends_on_all_prefix_tokens():
    ids = list(range(40))
    hs = block_hashes(ids, 16, FP)
    assert len(hs) == 2 and all(len(h) == HASH_BYTES for h in hs)
    changed = block_hashes([999] + ids[1:], 16, FP)
    assert changed[0] != hs[0] and changed[1] != hs[1]  # block 1 changes through the chain
    assert block_hashes(ids[:32] + [5] * 8, 16, FP) == hs  # the partial block has no name


def test_fingerprint_salt_and_parent():
    ids = list(range(32))
    base = block_hashes(ids, 16, FP)
    assert block_hashes(ids, 16, b"model-b") != base
    assert block_hashes(ids, 16, FP, cache_salt=b"tenant")[0] != base[0]
    assert block_hashes(ids[16:], 16, FP, parent=base[0]) == base[1:]
    with pytest.raises(ValueError):
        block_hashes(ids, 0, FP)


def test_refcounts_and_lru_eviction_order():
    events = []
    bm = BlockManager(4, on_event=lambda kind, hs: events.append((kind, hs)))
    a = bm.allocate(2)
    bm.register(a[0], b"h0")
    bm.register(a[1], b"h1")
    bm.acquire(bm.match_prefix([b"h0", b"h1", b"h2"]))  # a second sequence shares both
    bm.release(a)
    assert bm.num_free == 2  # still referenced by the second sequence
    bm.release(a)  # released tail first: h1 becomes least recently used... h1 then h0
    assert bm.num_free == 4 and bm.num_cached == 2
    bm.allocate(3)  # 2 plain free blocks, then evict the LRU cached one
    assert events[-1] == ("removed", [b"h1"])
    assert bm.match_prefix([b"h0"]) == [a[0]]
    with pytest.raises(OutOfBlocks):
        bm.allocate(2)


def test_duplicate_name_is_not_registered_twice():
    bm = BlockManager(4)
    x, y = bm.allocate(2)
    assert bm.register(x, b"same")
    assert not bm.register(y, b"same")
    bm.release([y])
    assert bm.num_free == 3  # y held no name, so it is plain free
