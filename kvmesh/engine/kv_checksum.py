"""A block's checksum from pieces held by different ranks, without moving the KV to one place.

A block's checksum (``kvmesh.checksum``) is the CRC-32 of its bytes in the wire layout, every KV head. On a
tensor-parallel worker each rank holds some of the heads. CRC-32 is affine over GF(2) for a fixed length:
crc(a xor b) = crc(a) xor crc(b) xor crc(zeros). A rank sums the whole block with every head it does not
own zeroed (``partial_block_checksums``); the block's checksum is the xor of the ranks' sums, and of
crc(zeros) once more where they are an even number (``combine_block_checksums``). Each head counts once: a
head that ranks replicate is counted from the first rank holding it only. What moves is 4 bytes a block a
rank, not the block.
"""

from __future__ import annotations

import functools

import numpy
import torch

from kvmesh.checksum import CHECKSUM_BYTES, zlib


@functools.lru_cache(maxsize=8)
def _zeros_checksum(nbytes: int) -> int:
    return zlib.crc32(bytes(nbytes))


def partial_block_checksums(pool: torch.Tensor, block_ids: list[int], first_head: int, total_heads: int) -> list[int]:
    """Per block of ``pool`` ([layers, 2, blocks, block_size, its KV heads, head_dim], heads ``first_head``
    onwards of ``total_heads``): the CRC-32 of the whole block with every other head zeroed."""
    layers, kv, _, block_size, heads, head_dim = pool.shape
    whole = numpy.zeros((layers, kv, block_size, total_heads, head_dim * pool.element_size()), dtype=numpy.uint8)
    mine = whole[:, :, :, first_head : first_head + heads]
    out = []
    for block_id in block_ids:
        block = pool[:, :, block_id]
        mine[...] = (block if block.device.type == "cpu" else block.cpu()).view(torch.uint8).numpy()
        out.append(zlib.crc32(whole))
    return out


def combine_block_checksums(parts: list[list[int]], block_nbytes: int) -> list[bytes]:
    """The blocks' checksums from each owning rank's ``partial_block_checksums`` (one list a rank, aligned)."""
    pad = _zeros_checksum(block_nbytes) if len(parts) % 2 == 0 else 0
    out = []
    for sums in zip(*parts, strict=True):
        value = pad
        for s in sums:
            value ^= s
        out.append(value.to_bytes(CHECKSUM_BYTES, "little"))
    return out
