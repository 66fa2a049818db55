"""The paged KV pool of one device, and the export/import of single blocks as bytes.

One tensor holds every layer's K and V:
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (for Multi-head Latent Attention,
one latent row a token: ``[num_layers, 1, num_blocks, block_size, 1, latent width]``).
A block exported to the wire is the slice ``[:, :, block_id]`` — shape
``[num_layers, 2, block_size, num_kv_heads, head_dim]`` (``KV_LAYOUT``) — as
raw little-endian bytes of the pool's dtype. This is the one tensor wire
format: the kvstore keeps these bytes, prefill ships them, decode imports them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy
import torch

from kvmesh.checksum import Crc32, checksum
from kvmesh.engine.config import dtype_name, parse_dtype
from kvmesh.errors import InvalidArgument

KV_LAYOUT = "layers,kv,block_tokens,kv_heads,head_dim"
# Multi-head Latent Attention's blocks: one latent row a token and layer (``[layers, 1, block_tokens, 1,
# latent width]``). Workers compare layouts before moving blocks, so a latent block never reaches a
# per-head pool, nor the reverse, and the refusal names both.
LATENT_KV_LAYOUT = "layers,latent,block_tokens,1,latent_width"


def layout_name(components: int) -> str:
    """The layout of a pool holding ``components`` rows a token (``ModelConfig.kv_components``)."""
    return LATENT_KV_LAYOUT if components == 1 else KV_LAYOUT


_MADV_HUGEPAGE = 14  # linux/mman.h
_HUGE_PAGE_BYTES = 2 << 20


def host_zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor whose pages are transparent huge pages where the kernel allows
    (``madvise`` mode; a no-op elsewhere).

    For a KV pool this is what a copy by another process costs: a NIXL READ over shared memory
    (CMA) pins each source and destination page, and with 4 KiB pages that capped a 96 MiB READ
    at ~2 GB/s here; on 2 MiB pages the same READ ran at ~6.5 GB/s (memcpy speed). The advice
    must come before the first touch, so the tensor is zeroed after it.
    """
    tensor = torch.empty(shape, dtype=dtype)
    addr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    start = -(-addr // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    length = (addr + nbytes - start) // _HUGE_PAGE_BYTES * _HUGE_PAGE_BYTES
    if length > 0:
        try:
            ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE)
        except (OSError, AttributeError):  # not Linux/glibc: ordinary pages
            pass
    return tensor.zero_()


@dataclass(frozen=True)
class BlockPayload:
    """One block's KV as bytes, with what is needed to check and rebuild it."""

    shape: tuple[int, ...]
    dtype: str
    data: bytes


def check_payload(payload: BlockPayload, block_shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> None:
    """InvalidArgument unless ``payload`` is a block of this layout: its shape, dtype and size."""
    if tuple(payload.shape) != block_shape or parse_dtype(payload.dtype) != dtype:
        theirs = layout_name(payload.shape[1]) if len(payload.shape) == 5 else "unknown"
        raise InvalidArgument(
            f"KV block layout mismatch: got {tuple(payload.shape)} {payload.dtype} ({theirs}), "
            f"this cache holds {block_shape} {dtype_name(dtype)} ({layout_name(block_shape[1])})"
        )
    if len(payload.data) != nbytes:
        raise InvalidArgument(f"KV block has {len(payload.data)} bytes, expected {nbytes}")


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
        components: int = 2,
    ) -> None:
        """``components``: K and V (2), or MLA's latent alone (1; ``ModelConfig.kv_components``)."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        shape = (num_layers, components, num_blocks, block_size, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            self.tensor = host_zeros_on_huge_pages(shape, dtype)
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.block_shape = (num_layers, components, block_size, num_kv_heads, head_dim)
        self._pieces: numpy.ndarray | None = None  # [layers * 2, blocks, piece bytes] view, made on first use

    @property
    def block_nbytes(self) -> int:
        return self.tensor[:, :, 0].numel() * self.tensor.element_size()

    def _host_bytes_view(self, block_id: int) -> numpy.ndarray:
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

    def block_checksums(self, block_ids: list[int]) -> list[bytes]:
        return [self.block_checksum(b) for b in block_ids]

    def export_block(self, block_id: int) -> BlockPayload:
        if self.tensor.device.type == "cpu":
            data = self._host_bytes_view(block_id).tobytes()
        else:
            data = self.tensor[:, :, block_id].contiguous().view(torch.uint8).cpu().numpy().tobytes()
        return BlockPayload(self.block_shape, dtype_name(self.dtype), data)

    def export_blocks(self, block_ids: list[int]) -> list[BlockPayload]:
        """``export_block`` of each, in order (a sharded pool gathers them from its ranks at once)."""
        return [self.export_block(b) for b in block_ids]

    def import_blocks(self, block_ids: list[int], payloads: list[BlockPayload]) -> None:
        """``import_block`` of each pair, in order (a sharded pool scatters them to its ranks at once)."""
        for b, p in zip(block_ids, payloads, strict=True):
            self.import_block(b, p)

    def import_block(self, block_id: int, payload: BlockPayload) -> None:
        check_payload(payload, self.block_shape, self.dtype, self.block_nbytes)
        if self.tensor.device.type == "cpu":
            dst = self._host_bytes_view(block_id)
            dst[...] = numpy.frombuffer(payload.data, dtype=numpy.uint8).reshape(dst.shape)
        else:
            raw = torch.frombuffer(bytearray(payload.data), dtype=torch.uint8)
            block = raw.view(self.dtype).view(self.block_shape)
            self.tensor[:, :, block_id].copy_(block.to(self.tensor.device))
