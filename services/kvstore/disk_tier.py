"""The disk tier: one file per block under a directory, within a byte budget.

Files live at ``<root>/<first 2 hex chars>/<hex hash>.kvb`` (sharded so no
directory grows huge). The index — hash → payload bytes, least recently used
first — lives in memory; at startup it is rebuilt from the files' headers,
oldest mtime first, so the LRU order roughly survives a restart.
"""

from __future__ import annotations

import logging
import os
import re
from collections import OrderedDict
from pathlib import Path

from kvmesh.blocks import HASH_BYTES, BlockHash
from services.kvstore.block import Block
from services.kvstore.block_file import CorruptBlockFile, read_block_file, read_header, write_block_file

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
_SHARD_NAME = re.compile(r"[0-9a-f]{2}")
_BLOCK_NAME = re.compile(rf"([0-9a-f]{{{2 * HASH_BYTES}}}){re.escape(SUFFIX)}")


class DiskTier:
    """Index calls (``in``, ``touch``, ``add``, ``remove``) are not thread-safe:
    the ``KvStore`` makes them under its lock. ``write`` and ``read`` only do
    file I/O and run outside that lock, so a slow fsync never stalls RAM hits.

    The budget counts payload bytes, like the RAM tier's; headers add ~100 bytes a file.
    """

    def __init__(self, root: str | os.PathLike[str], budget_bytes: int) -> None:
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.evictions = 0
        self._index: OrderedDict[BlockHash, int] = OrderedDict()
        self.root.mkdir(parents=True, exist_ok=True)
        self.corrupt_at_startup = self._scan()

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def hashes(self) -> list[BlockHash]:
        return list(self._index)

    def path_for(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.root / name[:2] / f"{name}{SUFFIX}"

    # -- file I/O, outside the store's lock --------------------------------

    def write(self, block_hash: BlockHash, block: Block) -> None:
        """Put the block's file in place (atomically); ``add`` then indexes it."""
        path = self.path_for(block_hash)
        path.parent.mkdir(exist_ok=True)
        write_block_file(path, block_hash, block)

    def read(self, block_hash: BlockHash) -> Block:
        """The verified block; raises ``CorruptBlockFile`` or ``OSError``."""
        return read_block_file(self.path_for(block_hash), block_hash)

    # -- index, under the store's lock -------------------------------------

    def touch(self, block_hash: BlockHash) -> None:
        if block_hash in self._index:
            self._index.move_to_end(block_hash)

    def add(self, block_hash: BlockHash, nbytes: int) -> list[BlockHash]:
        """Index a block whose file ``write`` put in place; return the hashes evicted.

        The caller has checked that ``nbytes`` fits the budget on its own.
        """
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return []
        evicted = self._make_room(nbytes)
        self._index[block_hash] = nbytes
        self.used_bytes += nbytes
        return evicted

    def remove(self, block_hash: BlockHash) -> bool:
        nbytes = self._index.pop(block_hash, None)
        if nbytes is None:
            return False
        self.used_bytes -= nbytes
        self._unlink(self.path_for(block_hash))
        return True

    def _make_room(self, nbytes: int) -> list[BlockHash]:
        evicted = []
        while self._index and self.used_bytes + nbytes > self.budget_bytes:
            block_hash, size = self._index.popitem(last=False)
            self.used_bytes -= size
            self.evictions += 1
            self._unlink(self.path_for(block_hash))
            evicted.append(block_hash)
        return evicted

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            # The block is gone from the index either way; only its disk space leaks.
            log.warning("kvstore: could not remove %s: %s", path, e)

    # -- startup -------------------------------------------------------------

    def _scan(self) -> int:
        """Index the block files already here; remove corrupt ones and return how many."""
        found: list[tuple[int, BlockHash, int]] = []
        corrupt = 0
        for shard in self.root.iterdir():
            if not (shard.is_dir() and _SHARD_NAME.fullmatch(shard.name)):
                continue
            for path in shard.iterdir():
                if path.name.endswith(".tmp"):
                    self._unlink(path)  # a write a crash interrupted before its rename
                    continue
                match = _BLOCK_NAME.fullmatch(path.name)
                if match is None or not match[1].startswith(shard.name):
                    continue  # not a file this tier wrote
                block_hash = bytes.fromhex(match[1])
                try:
                    mtime_ns, nbytes = self._check_header(path, block_hash)
                except (CorruptBlockFile, OSError) as e:
                    log.warning("kvstore: removing corrupt block file %s: %s", path, e)
                    self._unlink(path)
                    corrupt += 1
                    continue
                found.append((mtime_ns, block_hash, nbytes))
        for _, block_hash, nbytes in sorted(found):
            self._index[block_hash] = nbytes
            self.used_bytes += nbytes
        self._make_room(0)  # the budget may be smaller than in the last run
        return corrupt

    @staticmethod
    def _check_header(path: Path, block_hash: BlockHash) -> tuple[int, int]:
        """(mtime in ns, payload bytes) of a file whose header is sound and whose
        size matches it; the payload itself is verified when it is read."""
        with path.open("rb") as f:
            header = read_header(f)
            stat = os.fstat(f.fileno())
        if header.block_hash != block_hash:
            raise CorruptBlockFile(f"file holds block {header.block_hash.hex()}")
        if stat.st_size != header.file_bytes:
            raise CorruptBlockFile(f"file is {stat.st_size} bytes, header says {header.file_bytes}")
        return stat.st_mtime_ns, header.payload_bytes
