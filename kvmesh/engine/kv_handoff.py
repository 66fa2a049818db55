"""The engine's KV hand-off: blocks out to another worker or the kvstore, and blocks in from them.

``KVHandoff`` is the part of ``LLMEngine`` that moves KV between workers (prefill -> decode, the kvstore):
it exports named blocks, holds a finished prompt's blocks for a hand-off until they are read, reserves
pool blocks for KV written in from outside (a NIXL READ) and adopts them once verified, and imports blocks
copied in. Everything here runs on the engine thread like the rest of the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.blocks import BlockHash, block_hashes
from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.block_manager import BlockManager, OutOfBlocks
from kvmesh.engine.config import EngineConfig, dtype_name
from kvmesh.engine.kv_cache import BlockPayload, KVCache, layout_name
from kvmesh.engine.lora import LoraAdapters
from kvmesh.errors import NotFound, ResourceExhausted

if TYPE_CHECKING:
    from kvmesh.engine.outputs import EngineStats


class KVHandoff:
    """Mixed into ``LLMEngine``, whose pool, blocks and stats it works on."""

    config: EngineConfig
    model_config: ModelConfig
    fingerprint: bytes
    lora: LoraAdapters | None
    kv: KVCache
    blocks: BlockManager
    stats: EngineStats
    # request id -> (hash, block id) of the prompt blocks a finished request holds for a hand-off.
    _held: dict[str, list[tuple[BlockHash, int]]]

    def kv_layout(self) -> dict:
        """The layout of the blocks this engine hands off: every KV head, whatever its tensor-parallel degree."""
        mc = self.model_config
        return {
            "block_size": self.config.block_size,
            "dtype": dtype_name(self.kv.dtype),
            "layout": layout_name(mc.kv_components),
            "num_layers": mc.num_layers,
            "num_kv_heads": mc.num_kv_heads,
            "head_dim": mc.head_dim,
            "model_fingerprint": self.fingerprint,
        }

    def prompt_block_hashes(
        self, prompt_ids: list[int], cache_salt: bytes = b"", adapter: str | None = None
    ) -> list[BlockHash]:
        return block_hashes(prompt_ids, self.config.block_size, self.chain_fingerprint(adapter), cache_salt)

    def chain_fingerprint(self, adapter: str | None) -> bytes:
        """The root a request's block hashes chain from: the model's, or under a LoRA adapter its own
        (NotFound when no adapter of that name is loaded)."""
        if adapter is None:
            return self.fingerprint
        if self.lora is None:
            raise NotFound(f"adapter {adapter!r}: LoRA is off on this worker (max_loras 0)")
        return self.lora.chain_fingerprint(adapter)

    def export_blocks(self, hashes: list[BlockHash]) -> list[tuple[BlockHash, BlockPayload]]:
        """The KV of each named block this engine holds (missing ones are skipped)."""
        held = [(h, self.blocks.hash_to_block[h]) for h in hashes if h in self.blocks.hash_to_block]
        out = list(zip([h for h, _ in held], self.kv.export_blocks([b for _, b in held])))
        self.stats.exported_blocks += len(out)
        return out

    def held_hashes(self, request_id: str) -> list[BlockHash]:
        """Names of the prompt blocks a finished ``hold_prompt_blocks`` request still holds."""
        return [h for h, _ in self._held.get(request_id, [])]

    def export_held(
        self, request_id: str, hashes: list[BlockHash] | None = None
    ) -> list[tuple[BlockHash, BlockPayload]]:
        """KV of held blocks (all, or those named, in the order named); unknown names skipped."""
        by_hash = dict(self._held.get(request_id, []))
        wanted = hashes if hashes is not None else list(by_hash)
        named = [h for h in wanted if h in by_hash]
        out = list(zip(named, self.kv.export_blocks([by_hash[h] for h in named])))
        self.stats.exported_blocks += len(out)
        return out

    def release_held(self, request_id: str) -> int:
        """Drop a hand-off's hold; the blocks stay cached until evicted. Returns how many."""
        held = self._held.pop(request_id, [])
        self.blocks.release([b for _, b in held])
        return len(held)

    def held_block_ids(self, request_id: str) -> list[int]:
        """Pool block of each held block, in ``held_hashes`` order (a NIXL reader addresses them)."""
        return [b for _, b in self._held.get(request_id, [])]

    def pin_held(self, request_id: str, hashes: list[BlockHash]) -> list[tuple[BlockHash, int]]:
        """One more reference on each named held block (in the order named; unknown names
        skipped), so a peer can read it after the hold ends; ``release_reserved`` drops it."""
        by_hash = dict(self._held.get(request_id, []))
        pinned = [(h, by_hash[h]) for h in hashes if h in by_hash]
        self.blocks.acquire([b for _, b in pinned])
        return pinned

    def reserve_blocks(self, n: int) -> list[int]:
        """Fresh blocks for KV written into the pool from outside (a NIXL READ): referenced and
        unnamed until ``adopt_reserved`` names them or ``release_reserved`` hands them back."""
        try:
            return self.blocks.allocate(n)
        except OutOfBlocks as e:
            raise ResourceExhausted(f"no room for {n} incoming KV blocks: {e}") from None

    def adopt_reserved(self, blocks: list[tuple[BlockHash, int]]) -> int:
        """Name reserved blocks whose KV has arrived (and been verified) as cached blocks, as
        ``import_block`` does; one whose name another block took meanwhile is dropped. Returns
        how many were adopted."""
        adopted = 0
        for h, b in blocks:
            if self.blocks.register(b, h):
                adopted += 1
        self.blocks.release([b for _, b in blocks])
        self.stats.imported_blocks += adopted
        return adopted

    def release_reserved(self, block_ids: list[int]) -> None:
        """Hand back reserved blocks whose KV never arrived whole."""
        self.blocks.release(block_ids)

    def import_block(self, h: BlockHash, payload: BlockPayload) -> bool:
        """Adopt a block computed elsewhere as a cached block. False if already held."""
        return self.import_blocks([(h, payload)]) == 1

    def import_blocks(self, blocks: list[tuple[BlockHash, BlockPayload]]) -> int:
        """``import_block`` of each (written in one go: a sharded pool's ranks in one exchange each);
        returns how many were adopted (those already held are skipped, as is a repeated name)."""
        fresh: dict[BlockHash, BlockPayload] = {}
        for h, payload in blocks:
            if h not in self.blocks.hash_to_block:
                fresh.setdefault(h, payload)
        if not fresh:
            return 0
        ids = self.blocks.allocate(len(fresh))
        try:
            self.kv.import_blocks(ids, list(fresh.values()))
        except Exception:
            self.blocks.release(ids)
            raise
        for h, b in zip(fresh, ids):
            self.blocks.register(b, h)
        self.blocks.release(ids)  # cached-free: reusable by the next request with this prefix
        self.stats.imported_blocks += len(ids)
        return len(ids)
