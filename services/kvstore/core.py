"""The kvstore's core: a content-addressed store of KV blocks keyed by block hash.

A RAM tier (byte budget, LRU) sits over an optional disk tier (a directory
that survives restarts, with its own budget and LRU). Puts write through to
disk, so a RAM eviction loses nothing; a RAM miss that hits disk promotes the
block back to RAM. Every read verifies the block's checksum: a corrupt or
truncated block is removed and reported missing, never served.

Thread-safe: one lock guards both tiers' indexes and the counters, while file
I/O and checksum verification run outside it, so a slow fsync or a large
read never stalls a RAM hit. Events are emitted under the lock, so they come
in the order the state changed; the callback must be quick (e.g. hand off to
an event loop) and must not call back into the store.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvmesh.blocks import HASH_BYTES, BlockHash
from kvmesh.errors import InvalidArgument, ResourceExhausted
from services.kvstore.block import Block
from services.kvstore.block_file import CorruptBlockFile
from services.kvstore.disk_tier import DiskTier
from services.kvstore.ram_tier import RamTier

log = logging.getLogger(__name__)


class EventKind(StrEnum):
    STORED = "STORED"  # blocks that became present in the store
    REMOVED = "REMOVED"  # blocks no longer in any tier: evicted, deleted or found corrupt


EventCallback = Callable[[str, list[BlockHash]], None]


@dataclass(frozen=True, slots=True)
class PutResult:
    stored: bool  # False: the block was already present (a put is idempotent)
    ram_evictions: int  # blocks this put pushed out of RAM (they may live on on disk)


@dataclass(frozen=True, slots=True)
class TierStats:
    blocks: int
    bytes: int  # payload bytes held
    budget_bytes: int
    evictions: int


@dataclass(frozen=True, slots=True)
class StoreStats:
    ram: TierStats
    disk: TierStats | None  # None without a disk tier
    hits_ram: int
    hits_disk: int
    misses: int
    corrupt_detected: int  # blocks found corrupt and removed, startup scan included
    disk_write_errors: int  # write-throughs that failed; those blocks live in RAM only


class KvStore:
    def __init__(
        self,
        ram_budget_bytes: int,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_budget_bytes: int | None = None,
        on_event: EventCallback | None = None,
    ) -> None:
        if ram_budget_bytes <= 0:
            raise ValueError(f"ram_budget_bytes must be positive, got {ram_budget_bytes}")
        if (disk_dir is None) != (disk_budget_bytes is None):
            raise ValueError("disk_dir and disk_budget_bytes come together")
        if disk_budget_bytes is not None and disk_budget_bytes <= 0:
            raise ValueError(f"disk_budget_bytes must be positive, got {disk_budget_bytes}")
        self._lock = threading.Lock()
        self._ram = RamTier(ram_budget_bytes)
        self._disk = DiskTier(disk_dir, disk_budget_bytes) if disk_dir is not None else None
        self._on_event = on_event
        self._hits_ram = 0
        self._hits_disk = 0
        self._misses = 0
        self._corrupt = self._disk.corrupt_at_startup if self._disk is not None else 0
        self._disk_write_errors = 0

    @property
    def max_block_bytes(self) -> int:
        """The largest block a put accepts: it must fit each tier on its own."""
        if self._disk is None:
            return self._ram.budget_bytes
        return min(self._ram.budget_bytes, self._disk.budget_bytes)

    def put(self, block_hash: BlockHash, block: Block) -> PutResult:
        """Store ``block`` (a block already here only counts as used). A full store
        evicts its least recently used blocks; only a block bigger than a tier's
        whole budget raises ``ResourceExhausted``."""
        _check_hash(block_hash)
        if block.nbytes > self.max_block_bytes:
            raise ResourceExhausted(
                f"block of {block.nbytes} bytes exceeds the store's {self.max_block_bytes}-byte budget"
            )
        with self._lock:
            write_through = self._disk is not None and block_hash not in self._disk
        if write_through:
            write_through = self._write_to_disk(block_hash, block)
        with self._lock:
            was_present = self._present(block_hash)
            evicted = self._ram.put(block_hash, block)
            ram_evictions = len(evicted)
            if self._disk is not None:
                # A concurrent put of the same block may have indexed it meanwhile: add() then only touches.
                if write_through:
                    evicted += self._disk.add(block_hash, block.nbytes)
                else:
                    self._disk.touch(block_hash)
            self._emit_removed(evicted)
            if not was_present:
                self._emit(EventKind.STORED, [block_hash])
        return PutResult(stored=not was_present, ram_evictions=ram_evictions)

    def get(self, hashes: Sequence[BlockHash]) -> list[Block | None]:
        """Each block, verified, or None where it is missing (or was corrupt)."""
        for block_hash in hashes:
            _check_hash(block_hash)
        return [self._get_one(block_hash) for block_hash in hashes]

    def lookup(self, chain: Sequence[BlockHash]) -> int:
        """How many leading hashes of ``chain`` are present (stops at the first miss).

        Presence only — no checksum is read; a Get still verifies. Nothing is touched.
        """
        for block_hash in chain:
            _check_hash(block_hash)
        with self._lock:
            for matched, block_hash in enumerate(chain):
                if not self._present(block_hash):
                    return matched
        return len(chain)

    def delete(self, hashes: Iterable[BlockHash]) -> int:
        """Remove the blocks from every tier; return how many were present."""
        unique = list(dict.fromkeys(hashes))
        for block_hash in unique:
            _check_hash(block_hash)
        with self._lock:
            deleted = [h for h in unique if self._remove_everywhere(h)]
            self._emit(EventKind.REMOVED, deleted)
        return len(deleted)

    def hashes(self) -> list[BlockHash]:
        """Every block present, for a full resync of the router's index."""
        with self._lock:
            disk = self._disk.hashes() if self._disk is not None else []
            return list(dict.fromkeys(self._ram.hashes() + disk))

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                ram=_tier_stats(self._ram),
                disk=_tier_stats(self._disk) if self._disk is not None else None,
                hits_ram=self._hits_ram,
                hits_disk=self._hits_disk,
                misses=self._misses,
                corrupt_detected=self._corrupt,
                disk_write_errors=self._disk_write_errors,
            )

    # -- internals -------------------------------------------------------------

    def _get_one(self, block_hash: BlockHash) -> Block | None:
        with self._lock:
            block = self._ram.get(block_hash)
            on_disk = self._disk is not None and block_hash in self._disk
            if on_disk:
                # Disk recency follows every access, so a hot block is not the disk's next victim.
                self._disk.touch(block_hash)
        if block is not None:
            if block.is_intact():
                with self._lock:
                    self._hits_ram += 1
                return block
            log.warning("kvstore: block %s corrupt in RAM, removed", block_hash.hex())
            with self._lock:
                if self._ram.remove(block_hash):  # else a concurrent get already removed and counted it
                    self._corrupt += 1
                    self._emit_removed([block_hash])
        if on_disk:
            block = self._read_from_disk(block_hash)
            if block is not None:
                with self._lock:
                    self._hits_disk += 1
                    # Promote only what is still stored: a block evicted or deleted while
                    # its file was being read is served this once but must not come back.
                    if block_hash in self._disk:
                        self._emit_removed(self._ram.put(block_hash, block))
                return block
        with self._lock:
            self._misses += 1
        return None

    def _read_from_disk(self, block_hash: BlockHash) -> Block | None:
        """The verified block, or None after dropping an unreadable file.

        A read failure removes the entry even if a concurrent re-put just replaced
        the file: the rare cost is a miss, never a bad block served.
        """
        assert self._disk is not None
        try:
            return self._disk.read(block_hash)
        except FileNotFoundError:
            corrupt = False  # evicted meanwhile, or deleted behind the store's back
        except (CorruptBlockFile, OSError) as e:
            log.warning("kvstore: block %s unreadable on disk, removed: %s", block_hash.hex(), e)
            corrupt = True
        with self._lock:
            # Not indexed any more means evicted, deleted or found corrupt meanwhile: already handled.
            if self._disk.remove(block_hash):
                if corrupt:
                    self._corrupt += 1
                self._emit_removed([block_hash])
        return None

    def _write_to_disk(self, block_hash: BlockHash, block: Block) -> bool:
        """Write the block's file; on failure (disk full, I/O error) keep serving it from RAM."""
        assert self._disk is not None
        try:
            self._disk.write(block_hash, block)
        except OSError as e:
            log.warning("kvstore: write-through of block %s failed, RAM only: %s", block_hash.hex(), e)
            with self._lock:
                self._disk_write_errors += 1
            return False
        return True

    def _present(self, block_hash: BlockHash) -> bool:
        return block_hash in self._ram or (self._disk is not None and block_hash in self._disk)

    def _remove_everywhere(self, block_hash: BlockHash) -> bool:
        in_ram = self._ram.remove(block_hash)
        on_disk = self._disk is not None and self._disk.remove(block_hash)
        return in_ram or on_disk

    def _emit_removed(self, candidates: list[BlockHash]) -> None:
        """REMOVED for the candidates gone from every tier: a RAM eviction the disk
        still holds is no removal."""
        self._emit(EventKind.REMOVED, [h for h in dict.fromkeys(candidates) if not self._present(h)])

    def _emit(self, kind: EventKind, hashes: list[BlockHash]) -> None:
        if not hashes or self._on_event is None:
            return
        try:
            self._on_event(kind, hashes)
        except Exception:
            # The state change already happened; a failing listener must not undo or fail it.
            log.exception("kvstore: on_event callback failed for %s", kind)


def _tier_stats(tier: RamTier | DiskTier) -> TierStats:
    return TierStats(len(tier), tier.used_bytes, tier.budget_bytes, tier.evictions)


def _check_hash(block_hash: BlockHash) -> None:
    if not isinstance(block_hash, bytes) or len(block_hash) != HASH_BYTES:
        raise InvalidArgument(f"a block hash is {HASH_BYTES} bytes, got {block_hash!r:.80}")
