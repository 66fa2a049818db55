"""KV heads read through a staging area between two NIXL agents of this process: in rounds where the area is
smaller than the hand-off, each head into its place, and nothing else of the pool touched."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvmesh.errors import NotFound
from kvmesh.worker import kv_staging
from kvmesh.worker.kv_nixl import NixlEndpoint, load_nixl
from kvmesh.worker.kv_staging import StagedRead, Staging
from kvmesh.worker.nixl_layout import HeadSpan

pytestmark = pytest.mark.skipif(load_nixl() is None, reason="NIXL not installed")


def _pool(heads: int, blocks: int = 12, fill: bool = False) -> torch.Tensor:
    shape = (2, 2, blocks, 4, heads, 8)  # [layers, k/v, blocks, block_size, heads, head_dim]
    return torch.randn(shape) if fill else torch.zeros(shape)


@pytest.fixture
def agents():
    holder, reader = _pool(4, fill=True), _pool(2)
    ends = [NixlEndpoint(load_nixl(), t, role) for t, role in ((holder, "prefill"), (reader, "decode"))]
    ends[1].add_peer(ends[0].metadata(), ends[0].region)
    yield holder, reader, ends[0], ends[1]
    for end in ends:
        end.close()


def test_heads_land_in_place_round_by_round(agents, monkeypatch):
    holder, reader, theirs, mine = agents
    # Three blocks of the holder's a round: seven blocks take three rounds.
    monkeypatch.setattr(kv_staging, "STAGING_BYTES", 3 * holder[:, :, 0].numel() * 4)
    src, dst = [9, 2, 3, 4, 11, 0, 5], [1, 2, 3, 7, 8, 10, 0]
    span = HeadSpan(remote_first=2, local_first=0, count=2)  # the holder's heads 2 and 3 are all of ours
    staging = Staging(mine, reader)
    read = StagedRead(staging, mine, theirs.name, mine.peer_region(theirs.name), src, dst, span, reader)
    asyncio.run(read.run(10.0))
    assert torch.equal(reader[:, :, dst], holder[:, :, src, :, 2:4])
    untouched = [b for b in range(12) if b not in dst]
    assert not reader[:, :, untouched].any()
    assert staging.area(4)[1].num_blocks == 3  # the area, kept for the next READ


def test_a_read_that_fails_leaves_the_pool_alone_and_the_area_free(agents):
    holder, reader, theirs, mine = agents
    span = HeadSpan(remote_first=0, local_first=0, count=2)
    staging, region = Staging(mine, reader), mine.peer_region(theirs.name)

    async def twice() -> None:
        mine.forget_peer(theirs.name)  # the holder went away between the handshake and the READ
        with pytest.raises(NotFound):
            await StagedRead(staging, mine, theirs.name, region, [0], [0], span, reader).run(10.0)
        assert not reader.any()
        mine.add_peer(theirs.metadata(), theirs.region)  # it came back: the next READ gets the area
        await StagedRead(staging, mine, theirs.name, region, [0], [0], span, reader).run(10.0)

    asyncio.run(twice())
    assert torch.equal(reader[:, :, 0], holder[:, :, 0, :, 0:2])
