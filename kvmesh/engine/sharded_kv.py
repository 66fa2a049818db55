"""A tensor-parallel engine's KV pool, as everything that moves blocks sees it: whole blocks.

Each rank's pool holds only its KV heads (``TPLayout.kv_head_range``). A block handed off (prefill to
decode, to and from the kvstore) travels in the one wire layout, with every KV head
(``kvmesh.engine.kv_cache``), so a worker of any degree reads it and the block hash does not change:
exporting gathers the followers' slices of the blocks (over their pipes, every block of a hand-off in
one exchange a rank) beside rank 0's own and puts the heads in order, each once where ranks replicate a
head; importing writes each rank its heads, likewise in one exchange. A block's checksum is combined from
each rank's part (``kvmesh.engine.kv_checksum``): the blocks stay where they are.
"""

from __future__ import annotations

import torch

from kvmesh.engine.config import dtype_name
from kvmesh.engine.kv_cache import BlockPayload, KVCache, check_payload
from kvmesh.engine.kv_checksum import combine_block_checksums, partial_block_checksums
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
        self.head_ranges = [layout.kv_head_range() for layout in layouts]  # per rank: (first, count)
        # The ranks whose slices, in order, hold every head once: with replicated heads, the first of each.
        self.owners = [
            r for r, (first, _) in enumerate(self.head_ranges) if r == 0 or first != self.head_ranges[r - 1][0]
        ]

    @property
    def block_nbytes(self) -> int:
        return self.local.block_nbytes // self.head_ranges[0][1] * self.block_shape[3]

    def export_block(self, block_id: int) -> BlockPayload:
        return self.export_blocks([block_id])[0]

    def export_blocks(self, block_ids: list[int]) -> list[BlockPayload]:
        if not block_ids:
            return []
        # Per rank, its heads of every block: [layers, 2, blocks, block_size, its KV heads, head_dim].
        slices = [self.local.tensor[:, :, block_ids].cpu(), *self.group.block_slices(block_ids)]
        out = []
        for i in range(len(block_ids)):
            whole = torch.cat([slices[r][:, :, i] for r in self.owners], dim=3).contiguous()
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
        slices = [blocks[..., first : first + count, :].contiguous() for first, count in self.head_ranges]
        self.local.tensor[:, :, block_ids] = slices[0]
        self.group.write_block_slices(block_ids, slices[1:])

    def block_checksum(self, block_id: int) -> bytes:
        return self.block_checksums([block_id])[0]

    def block_checksums(self, block_ids: list[int]) -> list[bytes]:
        """``checksum(export_block(b).data)`` of each block, from each owning rank's part."""
        if not block_ids:
            return []
        parts = [partial_block_checksums(self.local.tensor, block_ids, 0, self.block_shape[3])]
        parts += self.group.block_checksum_parts(self.owners[1:], block_ids)
        return combine_block_checksums(parts, self.block_nbytes)
