"""Where each rank of a reader takes each of its KV heads from a holder's ranks (pure: no NIXL)."""

from __future__ import annotations

import pytest

from kvmesh.errors import FailedPrecondition
from kvmesh.worker.nixl_layout import HeadSpan, PoolRegion
from kvmesh.worker.rank_nixl import RankPool, first_holders, head_spans


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
