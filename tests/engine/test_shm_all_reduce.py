"""The shared-memory all-reduce of tensor-parallel ranks, two ranks as two threads of this process: sums
in rank order (the same bits on both), tensors larger than a slot in pieces, calls back to back, and a
rank that never arrives given up on with RankGone, not waited for forever."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvmesh.engine import shm_all_reduce
from kvmesh.engine.shm_all_reduce import RankGone, ShmAllReduce, create_memory


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setattr(shm_all_reduce, "SLOT_BYTES", 1024)  # 256 float32s: bigger tensors go in pieces
    memory = create_memory(2)
    first, second = (ShmAllReduce(memory, rank, 2, timeout_s=30) for rank in (0, 1))
    os.close(memory)
    yield first, second
    second.close()
    first.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_ranks_get_the_same_sum_of_every_call(pair, dtype) -> None:
    torch.manual_seed(0)
    calls = [(torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)) for n in (5, 256, 700, 3)]
    results: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def run(rank: int) -> None:
        for pair_of in calls:
            t = pair_of[rank].clone()
            pair[rank](t)
            results[rank].append(t)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for (a, b), mine, theirs in zip(calls, results[0], results[1]):
        assert torch.equal(mine, theirs)
        assert torch.equal(mine, (a.float() + b.float()).to(dtype))


def test_a_rank_that_never_arrives_is_given_up_on() -> None:
    memory = create_memory(2)
    lonely = ShmAllReduce(memory, 0, 2, timeout_s=0.2)
    os.close(memory)
    try:
        with pytest.raises(RankGone, match=r"ranks \[1\] did not reach all-reduce 1"):
            lonely(torch.ones(4))
        lonely.watch(lambda: False)  # known dead: no waiting for the timeout
        with pytest.raises(RankGone):
            lonely(torch.ones(4))
    finally:
        lonely.close()
