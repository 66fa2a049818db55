"""A block's checksum combined from ranks' parts is the checksum of the whole block's bytes."""

from __future__ import annotations

import pytest
import torch

from kvmesh.checksum import checksum
from kvmesh.engine.kv_checksum import combine_block_checksums, partial_block_checksums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads_per_rank", [[4], [2, 2], [1, 1, 1, 1], [1, 3]])
def test_the_ranks_parts_combine_to_the_whole_block_s_checksum(dtype, heads_per_rank) -> None:
    torch.manual_seed(0)
    whole = torch.randn(3, 2, 5, 8, sum(heads_per_rank), 16).to(dtype)  # [layers, 2, blocks, tokens, heads, dim]
    blocks = [4, 0, 2]
    parts, first = [], 0
    for heads in heads_per_rank:
        pool = whole[..., first : first + heads, :].clone()
        parts.append(partial_block_checksums(pool, blocks, first, whole.shape[4]))
        first += heads
    nbytes = whole[:, :, 0].numel() * whole.element_size()
    expected = [checksum(whole[:, :, b].contiguous().view(torch.uint8).numpy().tobytes()) for b in blocks]
    assert combine_block_checksums(parts, nbytes) == expected
    # A part missing, or one byte of one rank's heads changed, and the sums disagree.
    assert combine_block_checksums(parts[:-1], nbytes) != expected or len(parts) == 1
    pool = whole[..., : heads_per_rank[0], :].clone()
    pool.view(torch.uint8)[1, 0, 2, 3, 0, 5] ^= 1
    changed = [partial_block_checksums(pool, blocks, 0, whole.shape[4]), *parts[1:]]
    got = combine_block_checksums(changed, nbytes)
    assert got[0] == expected[0] and got[1] == expected[1] and got[2] != expected[2]
