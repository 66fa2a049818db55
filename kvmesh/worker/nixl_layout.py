"""Where a worker's KV blocks sit in its NIXL-registered pool, as a peer addresses them.

``PoolRegion`` is the pool's registered memory and its shape (what a peer needs to name any block in it),
``NixlBlocks`` the blocks of one hand-off in it, ``block_runs`` the runs of blocks consecutive on both sides
of a READ (one descriptor per (layer, k/v) plane per run), ``HeadSpan`` the KV heads one tensor-parallel
rank's pool takes from another's, ``layout_mismatch`` why two pools cannot exchange blocks. Pure: no NIXL
calls (``kv_nixl`` makes them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy

from kvmesh.api.common.v1 import kv_pb2
from kvmesh.checksum import CHECKSUM_BYTES
from kvmesh.errors import InvalidArgument

if TYPE_CHECKING:
    import torch


def layout_mismatch(mine: kv_pb2.KVLayout, theirs: kv_pb2.KVLayout) -> str:
    """How two workers' KV layouts differ ("" when blocks can move between them as bytes)."""
    diffs = [
        f"{f.name} {getattr(theirs, f.name)!r} vs ours {getattr(mine, f.name)!r}"
        for f in kv_pb2.KVLayout.DESCRIPTOR.fields
        if getattr(mine, f.name) != getattr(theirs, f.name)
    ]
    return "; ".join(diffs)


@dataclass(frozen=True)
class PoolRegion:
    """Where a pool lies in memory, so a peer can address each block's pieces."""

    base_address: int
    num_blocks: int
    num_layers: int
    layer_stride: int
    kv_stride: int
    block_stride: int
    piece_bytes: int
    mem_type: str
    device_id: int
    block_tokens: int
    num_kv_heads: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> PoolRegion:
        num_layers, _, num_blocks, block_tokens, num_kv_heads = tensor.shape[:5]
        elt = tensor.element_size()
        layer_stride, kv_stride, block_stride = (s * elt for s in tensor.stride()[:3])
        on_device = tensor.device.type != "cpu"
        return cls(
            base_address=tensor.data_ptr(),
            num_blocks=num_blocks,
            num_layers=num_layers,
            layer_stride=layer_stride,
            kv_stride=kv_stride,
            block_stride=block_stride,
            piece_bytes=tensor[0, 0, 0].numel() * elt,
            mem_type="VRAM" if on_device else "DRAM",
            device_id=tensor.device.index or 0,
            block_tokens=block_tokens,
            num_kv_heads=num_kv_heads,
        )

    def check_blocks(self, block_ids: list[int], whose: str) -> None:
        """InvalidArgument unless every id names a block of this pool: ids come from the network, and a
        descriptor built from one past the pool would address memory that is not KV."""
        bad = next((b for b in block_ids if not 0 <= b < self.num_blocks), None)
        if bad is not None:
            raise InvalidArgument(f"block id {bad} is outside {whose} pool of {self.num_blocks} blocks")

    @classmethod
    def from_pb(cls, pb: kv_pb2.NixlPoolRegion) -> PoolRegion:
        return cls(
            pb.base_address,
            pb.num_blocks,
            pb.num_layers,
            pb.layer_stride,
            pb.kv_stride,
            pb.block_stride,
            pb.piece_bytes,
            pb.mem_type,
            pb.device_id,
            pb.block_tokens,
            pb.num_kv_heads,
        )

    def to_pb(self) -> kv_pb2.NixlPoolRegion:
        return kv_pb2.NixlPoolRegion(**self.__dict__)

    @property
    def planes(self) -> int:
        """A layer's planes: K and V (2), or MLA's latent (1). A pool is one contiguous tensor, so a layer is
        that many plane strides (derived, not sent: the wire's region predates latent pools)."""
        return self.layer_stride // self.kv_stride

    @property
    def pieces_per_block(self) -> int:
        return self.planes * self.num_layers

    def run_descs(self, first_blocks: numpy.ndarray, run_lengths: numpy.ndarray) -> numpy.ndarray:
        """(address, length, device) per (run, layer, plane), run-major: run ``i`` is blocks
        ``first_blocks[i] .. + run_lengths[i]``, contiguous within each plane."""
        planes = (
            numpy.arange(self.num_layers, dtype=numpy.uint64)[:, None] * self.layer_stride
            + numpy.arange(self.planes, dtype=numpy.uint64)[None, :] * self.kv_stride
        ).ravel()
        starts = self.base_address + first_blocks.astype(numpy.uint64) * self.block_stride
        out = numpy.empty((len(starts) * len(planes), 3), dtype=numpy.uint64)
        out[:, 0] = (starts[:, None] + planes[None, :]).ravel()
        out[:, 1] = numpy.repeat(run_lengths.astype(numpy.uint64) * self.piece_bytes, len(planes))
        out[:, 2] = self.device_id
        return out

    @property
    def block_nbytes(self) -> int:
        return self.pieces_per_block * self.piece_bytes


@dataclass(frozen=True)
class HeadSpan:
    """KV heads read from a peer's pool into ours: ``count`` heads from the peer's ``remote_first``-th (of the
    heads its pool holds) into ours from our ``local_first``-th."""

    remote_first: int
    local_first: int
    count: int

    def whole(self, remote: PoolRegion, local: PoolRegion) -> bool:
        """Every head of both pools: whole blocks, read in runs."""
        return self.remote_first == self.local_first == 0 and self.count == remote.num_kv_heads == local.num_kv_heads


@dataclass(frozen=True)
class NixlBlocks:
    """A lease's blocks as a NIXL reader finds them (``kv_pb2.NixlBlocks``): aligned with the
    hand-off's block hashes."""

    agent_name: str
    block_ids: list[int]
    checksums: list[bytes]

    @classmethod
    def from_pb(cls, pb: kv_pb2.NixlBlocks) -> NixlBlocks:
        n = CHECKSUM_BYTES
        sums = [pb.checksums[i : i + n] for i in range(0, len(pb.checksums), n)]
        return cls(pb.agent_name, list(pb.block_ids), sums)

    def to_pb(self) -> kv_pb2.NixlBlocks:
        return kv_pb2.NixlBlocks(
            agent_name=self.agent_name, block_ids=self.block_ids, checksums=b"".join(self.checksums)
        )


def block_runs(src: list[int], dst: list[int]) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
    """Runs of blocks consecutive on both sides: (first src block, first dst block, length) each."""
    a, b = numpy.asarray(src, dtype=numpy.int64), numpy.asarray(dst, dtype=numpy.int64)
    breaks = numpy.flatnonzero((numpy.diff(a) != 1) | (numpy.diff(b) != 1)) + 1
    firsts = numpy.concatenate(([0], breaks))
    lengths = numpy.diff(numpy.concatenate((firsts, [len(a)])))
    return a[firsts], b[firsts], lengths
