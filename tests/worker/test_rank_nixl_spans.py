"""Where each rank of a reader takes each of its KV heads from a holder's ranks, and how the ranks' parts of
a READ's checksums combine (pure: no NIXL)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.engine.kv_checksum import combine_block_checksums
from kvmesh.errors import FailedPrecondition, InvalidArgument
from kvmesh.worker.nixl_layout import HeadSpan, PoolRegion
from kvmesh.worker.rank_nixl import RankPool, ShardedRead, first_holders, head_spans


def _pools(*ranges: tuple[int, int]) -> list[RankPool]:
    """A holder's ranks, each holding ``count`` heads from ``first``."""
    out = []
    for r, (first, count) in enumerate(ranges):
        region = PoolRegion(0, 8, 2, 0, 0, 0, 16 * count * 64, "DRAM", 0, 16, count)
        out.append(RankPool(f"rank{r}", b"", region, first))
    return out


def _spans(mine, holder) -> list[tuple[str, HeadSpan]]:
    return [(pool.agent_name, span) for pool, span in head_spans(mine, first_holders(holder))]


def test_one_reader_rank_takes_each_holder_rank_s_heads_into_its_place():
    assert _spans((0, 4), _pools((0, 2), (2, 2))) == [("rank0", HeadSpan(0, 0, 2)), ("rank1", HeadSpan(0, 2, 2))]


def test_a_reader_rank_takes_its_range_out_of_a_holder_that_has_every_head():
    assert _spans((2, 2), _pools((0, 4))) == [("rank0", HeadSpan(2, 0, 2))]


def test_ranks_of_the_same_heads_read_whole_blocks():
    span = _spans((2, 2), _pools((0, 2), (2, 2)))
    assert span == [("rank1", HeadSpan(0, 0, 2))]
    assert span[0][1].whole(_pools((2, 2))[0].region, _pools((2, 2))[0].region)


def test_a_head_replicated_over_holder_ranks_is_read_from_the_first_of_them():
    holder = _pools((0, 1), (0, 1), (1, 1), (1, 1))  # 4 ranks over 2 KV heads
    assert [p.agent_name for p in first_holders(holder)] == ["rank0", "rank2"]
    assert _spans((0, 2), holder) == [("rank0", HeadSpan(0, 0, 1)), ("rank2", HeadSpan(0, 1, 1))]
    assert _spans((1, 1), _pools((0, 1), (1, 1))) == [("rank1", HeadSpan(0, 0, 1))]  # a replicating reader rank


def test_a_holder_without_some_head_is_refused():
    with pytest.raises(FailedPrecondition, match="no copy of KV head 2"):
        head_spans((0, 4), first_holders(_pools((0, 2))))


class _Landed:
    """Rank 0's READ, landed: its part of the checksums."""

    def __init__(self, part: list[int]) -> None:
        self.part = part

    async def run(self, timeout_s: float) -> list[int]:
        return self.part

    async def settle(self, timeout_s: float) -> bool:
        return True


def _answer(part: list[int]):
    async def call() -> tuple:
        return ("ok", part)

    return call


def test_replicating_ranks_parts_must_equal_their_owner_s_and_count_once():
    """Four ranks over two KV heads: ranks 0 and 2 own them, 1 and 3 hold copies. The copies' parts are checked
    against their owners' and left out of the sum; a copy that landed differently fails the READ."""
    parts = [[11, 12], [11, 12], [21, 22], [21, 22]]
    owner_of = [0, 0, 2, 2]

    def run(parts: list[list[int]]) -> list[bytes]:
        read = ShardedRead(_Landed(parts[0]), [_answer(p) for p in parts[1:]], owner_of, 64, 0, 1.0)
        return asyncio.run(read.run())

    assert run(parts) == combine_block_checksums([parts[0], parts[2]], 64)
    with pytest.raises(InvalidArgument, match="rank 3's copy of replicated KV heads"):
        run([*parts[:3], [21, 99]])
