"""A tensor-parallel engine's KV pool, as everything that moves blocks sees it: whole blocks.

Each rank's pool holds only its KV heads (``TPLayout.kv_head_range``). A block handed off (prefill to
decode, to and from the kvstore) travels in the one wire layout, with every KV head
(``kvmesh.engine.kv_cache``), so a worker of any degree reads it and the block hash does not change:
exporting gathers the followers' slices of the blocks (over their pipes, every block of a hand-off in
one exchange a rank) beside rank 0's own and puts the heads in order, each once where ranks replicate a
head; importing writes each rank its heads, likewise in one exchange.
"""

from __future__ import annotations

import torch

from kvmesh.checksum import checksum
from kvmesh.engine.config import dtype_name
from kvmesh.engine.kv_cache import BlockPayload, KVCache, check_payload
from kvmesh.engine.tensor_parallel import TensorParallelGroup
from kvmesh.engine.tp_layout import TPLayout


class ShardedKVCache:
    """``KVCache``'s interface over rank 0's pool (``tensor``: what its forward passes use) and the others'."""

    def __init__(self, local: KVCache, group: TensorParallelGroup, layouts: list[TPLayout], num_kv_heads: int) -> None:
        self.local, self.group = local, group
        self.tensor = local.tensor
        self.block_size, self.num_blocks, self.dtype = local.block_size, local.num_blocks, local.dtype
        layers, kv, block_tokens, _, head_dim = local.block_shape
        self.block_shape = (layers, kv, block_tokens, num_kv_heads, head_dim)
        self._heads = [layout.kv_head_range() for layout in layouts]  # per rank: (first, count)
        # The ranks whose slices, in order, hold every head once: with replicated heads, the first of each.
        self._owners = [r for r, (first, _) in enumerate(self._heads) if r == 0 or first != self._heads[r - 1][0]]

    @property
    def block_nbytes(self) -> int:
        return self.local.block_nbytes // self._heads[0][1] * self.block_shape[3]

    def export_block(self, block_id: int) -> BlockPayload:
        return self.export_blocks([block_id])[0]

    def export_blocks(self, block_ids: list[int]) -> list[BlockPayload]:
        if not block_ids:
            return []
        # Per rank, its heads of every block: [layers, 2, blocks, block_size, its KV heads, head_dim].
        slices = [self.local.tensor[:, :, block_ids].cpu(), *self.group.block_slices(block_ids)]
        out = []
        for i in range(len(block_ids)):
            whole = torch.cat([slices[r][:, :, i] for r in self._owners], dim=3).contiguous()
            out.append(
                BlockPayload(self.block_shape, dtype_name(self.dtype), whole.view(torch.uint8).numpy().tobytes())
            )
        return out

    def import_block(self, block_id: int, payload: BlockPayload) -> None:
        self.import_blocks([block_id], [payload])

    def import_blocks(self, block_ids: list[int], payloads: list[BlockPayload]) -> None:
        if not block_ids:
            return
        wholes = []
        for payload in payloads:
            check_payload(payload, self.block_shape, self.dtype, self.block_nbytes)
            raw = torch.frombuffer(bytearray(payload.data), dtype=torch.uint8)
            wholes.append(raw.view(self.dtype).view(self.block_shape))
        blocks = torch.stack(wholes, dim=2)  # [layers, 2, blocks, block_size, KV heads, head_dim]
        slices = [blocks[..., first : first + count, :].contiguous() for first, count in self._heads]
        self.local.tensor[:, :, block_ids] = slices[0]
        self.group.write_block_slices(block_ids, slices[1:])

    def block_checksum(self, block_id: int) -> bytes:
        return checksum(self.export_block(block_id).data)
