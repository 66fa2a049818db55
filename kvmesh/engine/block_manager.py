"""Block allocator with reference counts, prefix reuse by block hash and LRU eviction.

A block is in exactly one of three states:
- *in use*: ref_count > 0 (one or more sequences' block tables hold it);
- *cached free*: ref_count == 0 but it still holds a full block's KV under a
  hash, so a later request with the same prefix can reuse it; these are
  evicted least-recently-released first when fresh blocks are needed;
- *free*: no owner, no content worth keeping.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from kvmesh.blocks import BlockHash

# (kind, hashes): kind is "stored" or "removed" — fed to the router as KV events.
BlockEventSink = Callable[[str, list[BlockHash]], None]


class OutOfBlocks(Exception):
    """Raised by allocate() when neither free nor evictable blocks remain."""


class BlockManager:
    def __init__(self, num_blocks: int, enable_prefix_cache: bool = True, on_event: BlockEventSink | None = None):
        self.num_blocks = num_blocks
        self.enable_prefix_cache = enable_prefix_cache
        self.on_event = on_event
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.hash_to_block: dict[BlockHash, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take right now (free + evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self.hash_to_block)

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids holding the longest leading run of ``hashes`` (not yet acquired)."""
        if not self.enable_prefix_cache:
            return []
        out = []
        for h in hashes:
            b = self.hash_to_block.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            if self.ref_counts[b] == 0:
                self._evictable.pop(b, None)
            self.ref_counts[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} blocks, {self.num_free} free")
        out = []
        removed = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                h = self.block_hash[b]
                self.block_hash[b] = None
                if h is not None and self.hash_to_block.get(h) == b:
                    del self.hash_to_block[h]
                    removed.append(h)
            self.ref_counts[b] = 1
            out.append(b)
        if removed and self.on_event:
            self.on_event("removed", removed)
        return out

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; tail blocks first so prefixes outlive suffixes."""
        for b in reversed(block_ids):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] > 0:
                continue
            if self.block_hash[b] is not None:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def register(self, block_id: int, h: BlockHash) -> bool:
        """Name a now-full block so later requests can reuse it. False if another block has it."""
        if not self.enable_prefix_cache or h in self.hash_to_block:
            return False
        self.block_hash[block_id] = h
        self.hash_to_block[h] = block_id
        if self.on_event:
            self.on_event("stored", [h])
        return True

    def clear_cache(self) -> None:
        """Forget every cached-free block (in-use blocks keep their names)."""
        removed = []
        while self._evictable:
            b, _ = self._evictable.popitem(last=False)
            h = self.block_hash[b]
            self.block_hash[b] = None
            del self.hash_to_block[h]
            removed.append(h)
            self._free.append(b)
        if removed and self.on_event:
            self.on_event("removed", removed)
