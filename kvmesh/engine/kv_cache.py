"""The paged KV pool of one device, and the export/import of single blocks as bytes.

One tensor holds every layer's K and V:
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
A block exported to the wire is the slice ``[:, :, block_id]`` — shape
``[num_layers, 2, block_size, num_kv_heads, head_dim]`` (``KV_LAYOUT``) — as
raw little-endian bytes of the pool's dtype. This is the one tensor wire
format: the kvstore keeps these bytes, prefill ships them, decode imports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch

from kvmesh.checksum import Crc32, checksum
from kvmesh.engine.config import dtype_name, parse_dtype
from kvmesh.errors import InvalidArgument

KV_LAYOUT = "layers,kv,block_tokens,kv_heads,head_dim"


@dataclass(frozen=True)
class BlockPayload:
    """One block's KV as bytes, with what is needed to check and rebuild it."""

    shape: tuple[int, ...]
    dtype: str
    data: bytes


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.tensor = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        self.block_shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
        self._pieces: numpy.ndarray | None = None  # [layers * 2, blocks, piece bytes] view, made on first use

    @property
    def block_nbytes(self) -> int:
        return self.tensor[:, :, 0].numel() * self.tensor.element_size()

    def _host_bytes_view(self, block_id: int) -> "numpy.ndarray":
        """The block as a (strided) uint8 numpy view of host memory.

        Copies go through numpy, not torch: a torch copy of this strided slice is split
        across OpenMP threads, and on a CPU shared by several worker processes those
        threads spin-wait on each other (~100x slower); numpy's copy is one memcpy per run.
        """
        return self.tensor[:, :, block_id].view(torch.uint8).numpy()

    def block_checksum(self, block_id: int) -> bytes:
        """``checksum(export_block(b).data)``, on host memory without the copy: the block's
        contiguous (layer, k/v) pieces are summed in the export's order (through one numpy view
        of the pool: a torch view per piece costs more than summing it)."""
        if self.tensor.device.type != "cpu":
            return checksum(self.export_block(block_id).data)
        if self._pieces is None:
            layers, kv, blocks = self.tensor.shape[:3]
            self._pieces = self.tensor.view(torch.uint8).numpy().reshape(layers * kv, blocks, -1)
        crc = Crc32()
        for piece in self._pieces[:, block_id]:
            crc.update(piece)
        return crc.digest()

    def export_block(self, block_id: int) -> BlockPayload:
        if self.tensor.device.type == "cpu":
            data = self._host_bytes_view(block_id).tobytes()
        else:
            data = self.tensor[:, :, block_id].contiguous().view(torch.uint8).cpu().numpy().tobytes()
        return BlockPayload(self.block_shape, dtype_name(self.dtype), data)

    def import_block(self, block_id: int, payload: BlockPayload) -> None:
        if tuple(payload.shape) != self.block_shape or parse_dtype(payload.dtype) != self.dtype:
            raise InvalidArgument(
                f"KV block layout mismatch: got {tuple(payload.shape)} {payload.dtype}, "
                f"this cache holds {self.block_shape} {dtype_name(self.dtype)}"
            )
        if len(payload.data) != self.block_nbytes:
            raise InvalidArgument(f"KV block has {len(payload.data)} bytes, expected {self.block_nbytes}")
        if self.tensor.device.type == "cpu":
            dst = self._host_bytes_view(block_id)
            dst[...] = numpy.frombuffer(payload.data, dtype=numpy.uint8).reshape(dst.shape)
        else:
            raw = torch.frombuffer(bytearray(payload.data), dtype=torch.uint8)
            block = raw.view(self.dtype).view(self.block_shape)
            self.tensor[:, :, block_id].copy_(block.to(self.tensor.device))
