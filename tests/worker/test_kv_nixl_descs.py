"""The descriptors a NIXL transfer names: runs of blocks consecutive on both sides, one per plane."""

from __future__ import annotations

import numpy
import torch

from kvmesh.worker.nixl_layout import PoolRegion, block_runs


def test_runs_break_where_either_side_stops_being_consecutive():
    src, dst, lengths = block_runs([4, 5, 6, 9, 10, 11, 12], [0, 1, 2, 3, 4, 7, 8])
    assert src.tolist() == [4, 9, 11] and dst.tolist() == [0, 3, 7] and lengths.tolist() == [3, 2, 2]


def test_a_run_descriptor_covers_exactly_its_blocks_pieces_in_each_plane():
    pool = torch.arange(3 * 2 * 10 * 4 * 2 * 8, dtype=torch.float32).view(3, 2, 10, 4, 2, 8)
    region = PoolRegion.of(pool)
    descs = region.run_descs(numpy.array([2, 7]), numpy.array([3, 1]))
    assert len(descs) == 2 * region.pieces_per_block  # run-major, then (layer, k/v)
    flat = pool.view(torch.uint8).numpy().reshape(-1)
    for i, (first, n) in enumerate([(2, 3), (7, 1)]):
        for plane in range(region.pieces_per_block):
            addr, length, device = descs[i * region.pieces_per_block + plane].tolist()
            offset = addr - region.base_address
            layer, kv = divmod(plane, 2)
            want = pool[layer, kv, first : first + n].contiguous().view(torch.uint8).numpy().reshape(-1)
            assert (length, device) == (n * region.piece_bytes, 0)
            assert numpy.array_equal(flat[offset : offset + length], want)
