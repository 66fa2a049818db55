"""The RAM tier: blocks in memory under a byte budget, least recently used first out."""

from __future__ import annotations

from collections import OrderedDict

from kvmesh.blocks import BlockHash
from services.kvstore.block import Block


class RamTier:
    """Not thread-safe on its own: the ``KvStore`` serializes every call under its lock.

    The budget counts payload bytes; the per-block overhead is a few hundred bytes.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.evictions = 0
        # Oldest access first: eviction pops from the front, an access moves to the end.
        self._blocks: OrderedDict[BlockHash, Block] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def hashes(self) -> list[BlockHash]:
        return list(self._blocks)

    def get(self, block_hash: BlockHash) -> Block | None:
        """The block, marked as just used; None when absent."""
        block = self._blocks.get(block_hash)
        if block is not None:
            self._blocks.move_to_end(block_hash)
        return block

    def put(self, block_hash: BlockHash, block: Block) -> list[BlockHash]:
        """Insert (or just touch, when present) and return the hashes evicted to make room.

        The caller has checked that ``block`` fits the budget on its own.
        """
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return []
        evicted = self._make_room(block.nbytes)
        self._blocks[block_hash] = block
        self.used_bytes += block.nbytes
        return evicted

    def remove(self, block_hash: BlockHash) -> bool:
        block = self._blocks.pop(block_hash, None)
        if block is None:
            return False
        self.used_bytes -= block.nbytes
        return True

    def _make_room(self, nbytes: int) -> list[BlockHash]:
        evicted = []
        while self._blocks and self.used_bytes + nbytes > self.budget_bytes:
            block_hash, block = self._blocks.popitem(last=False)
            self.used_bytes -= block.nbytes
            self.evictions += 1
            evicted.append(block_hash)
        return evicted
